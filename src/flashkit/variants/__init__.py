"""User-defined attention variants: score and mask modifiers and block sparsity, fused into the
kernels with no torch.compile.

    @triton.jit
    def bias(score, b, h, q_idx, kv_idx, table):
        return score + tl.load(table + h * 64 + tl.minimum(tl.abs(q_idx - kv_idx), 63))

    out = flashkit.flash_attn_func(q, k, v, score_mod=flashkit.ScoreMod(bias, table))
    mask = flashkit.create_block_mask(flashkit.variants.document_mask(doc_ids), None, None, L, L,
                                      device="cuda")
    out = flashkit.flash_attn_func(q, k, v, block_mask=mask)

See docs/variants.md. The built-in examples (`document_mask`, `prefix_lm`, `alibi`, `softcap`,
`relative_bias`, `token_bias`, `sliding_window_with_globals`, ...) live in
flashkit.variants.library and are imported here on first use (they need triton).
"""

from flashkit.variants.block_mask import BlockMask, create_block_mask
from flashkit.variants.mods import MaskMod, ScoreMod

_LIBRARY = ("tanh", "tanh_approx", "causal_mask", "document_mask", "prefix_lm",
            "sliding_window_with_globals", "causal_window", "alibi", "softcap", "relative_bias",
            "token_bias")

__all__ = ["ScoreMod", "MaskMod", "BlockMask", "create_block_mask", *_LIBRARY]


def __getattr__(name):
    if name in _LIBRARY:
        try:
            from flashkit.variants import library
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            raise ModuleNotFoundError(f"flashkit.variants.{name} is written in Triton: pip "
                                      "install 'flashkit-attn[gpu]' (triton installs on a CPU "
                                      "too)", name="triton") from error
        return getattr(library, name)
    raise AttributeError(f"module 'flashkit.variants' has no attribute {name!r}")
