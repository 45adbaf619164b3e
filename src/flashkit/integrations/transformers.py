"""flashkit as an attention implementation for Hugging Face transformers.

    from flashkit.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=register())

register() adds flashkit to transformers' AttentionInterface and AttentionMaskInterface under
the name NAME and returns it (also for `model.set_attn_implementation(NAME)`). The name avoids
"flash": transformers treats any implementation whose name contains it as one of its own flash
attention packages and refuses it when that package is missing.

Padding never becomes a mask: the mask interface is transformers' own flash-attention one, which
hands the attention a (batch, seqlen_k) padding mask only when some token is padding (else
None). The padded tokens are then removed, the sequences packed and run through
flashkit.flash_attn_varlen_func, and the output put back in place, zero at padded query
positions (as transformers' flash-attention path does). Finding the padded tokens reads the
mask on the host (two device syncs); the layers of one forward share its mask tensor, so only
the first layer does it, and the others reuse what it found. Causal masks are bottom-right
aligned, so a decoding step's query rows are the last positions of their sequence. Sliding windows
(Mistral), softcapping (Gemma 2), GQA, attention sinks (s_aux), dropout, sequences already
packed through cu_seq_lens_q/k, `generate` with a KV cache, and training are covered.

Supported: transformers 4.53 and later (the first releases with AttentionMaskInterface), tested
with 5.17 and 5.24.
"""

from __future__ import annotations

import flashkit
from flashkit import kept
from flashkit.flash_attn.bert_padding import index_first_axis, pad_input, unpad_indices

__all__ = ["NAME", "register", "attention_forward"]

NAME = "fk_attention"


def register() -> str:
    """Register flashkit with transformers; returns the name for attn_implementation=."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("flashkit.integrations.transformers needs transformers >= 4.53 "
                          "(AttentionInterface and AttentionMaskInterface)") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query (batch, nheads, seqlen_q, d), key/value
    (batch, nheads_k, seqlen_k, d) (GQA: nheads_k divides nheads), attention_mask None or the
    (batch, seqlen_k) padding mask (nonzero = token). Returns (out (batch, seqlen_q, nheads, d),
    None): no attention weights are materialised."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, d)
    batch, seqlen_q = q.shape[:2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        # transformers' window counts the query's own token: sliding_window - 1 keys back
        window = (sliding_window - 1, sliding_window - 1)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=bool(causal),
                   window_size=window, softcap=softcap or 0.0, sink=s_aux)
    packed = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                      "max_length_k")]
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, options), None
    if all(x is not None for x in packed):  # sequences packed along one batch row
        cu_q, cu_k, max_q, max_k = packed
        out = flashkit.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q.int(), cu_k.int(),
            int(max_q), int(max_k), **options)
        return out.unflatten(0, (batch, seqlen_q)), None
    return flashkit.flash_attn_func(q, k, v, **options), None


def _padded(q, k, v, attention_mask, options):
    """Attention of a padded batch through the varlen kernels: unpad, attend, pad back."""
    batch, seqlen_q = q.shape[:2]
    (indices_k, cu_k, max_k), (indices_q, cu_q, max_q) = _unpadding(attention_mask, seqlen_q)
    seqlen_k = attention_mask.shape[1]
    k, v = k[:, :seqlen_k], v[:, :seqlen_k]  # a static cache may be longer
    k_packed, v_packed, q_packed = (index_first_axis(x.flatten(0, 1), indices)
                                    for x, indices in ((k, indices_k), (v, indices_k),
                                                       (q, indices_q)))
    out = flashkit.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q,
                                          max_k, **options)
    return pad_input(out, indices_q, batch, seqlen_q)


# The unpadding of the last padding mask seen, with what it was made for: (the mask's
# kept.tensor_states, seqlen_q, the unpadding). Every layer of a model's forward passes the same
# mask tensor, and unpadding it reads the mask on the host (two device syncs per mask it
# unpads), so the layers after the first reuse the first one's. An in-place change of the mask
# bumps its version; the weak reference keeps no mask alive.
_last_unpadding: tuple = (None, None, None)


def _unpadding(attention_mask, seqlen_q: int) -> tuple:
    """((indices, cu_seqlens, max_seqlen) of the keys, the same of the queries), the queries
    being the last seqlen_q positions of the (batch, seqlen_k) padding mask."""
    global _last_unpadding
    states, rows, unpadding = _last_unpadding  # one read: another thread may replace it
    if rows == seqlen_q and kept.same_tensors(states, (attention_mask,)):
        return unpadding
    keys = unpad_indices(attention_mask)[:3]
    queries = keys if seqlen_q == attention_mask.shape[1] else \
        unpad_indices(attention_mask[:, -seqlen_q:])[:3]
    unpadding = (keys, queries)
    states = kept.tensor_states(attention_mask)
    if states is not None:  # (none for an inference tensor, or under torch.compile)
        _last_unpadding = (states, seqlen_q, unpadding)
    return unpadding
