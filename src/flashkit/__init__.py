"""flashkit: exact, memory-efficient attention (FlashAttention) for Python.

    import flashkit
    out = flashkit.flash_attn_func(q, k, v, causal=True)   # q, k, v: (batch, seqlen, nheads, d)

`flashkit.reference` is the materialised oracle every backend is tested against; the teaching
tools live in `flashkit.algorithms` and `flashkit.sim`; the JAX port in `flashkit.jax`.
"""

from flashkit import reference
from flashkit.api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)
from flashkit.kvcache import flash_attn_with_kvcache
from flashkit.sdpa import scaled_dot_product_attention
from flashkit.variants import BlockMask, MaskMod, ScoreMod, create_block_mask

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "reference",
    "ScoreMod",
    "MaskMod",
    "BlockMask",
    "create_block_mask",
]
