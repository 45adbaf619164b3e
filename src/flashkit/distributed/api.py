"""The public ring attention functions: check the call on every rank, plan the ring, run it.

Both are collectives over `group` (default: the whole world): every rank calls with its own
shard of the same sequences, laid out as `layout` says (see `flashkit.distributed.layout`), and
gets the attention output of its shard's queries over ALL the keys; the backward pass is a
collective too. Masks (causal, window_size) and ALiBi distances refer to global positions,
bottom-right aligned on the global lengths, exactly as flash_attn_func would see the unsharded
tensors; a sink enters each row's softmax once.
"""

from __future__ import annotations

import torch

from flashkit import checks
from flashkit.distributed import layout as layouts
from flashkit.distributed.checks import agree, resolve_group
from flashkit.distributed.engine import RingAttention, RingProblem
from flashkit.distributed.plan import ring_plans
from flashkit.distributed.ring import Ring
from flashkit.ops.params import AttentionParams

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func"]

_DENSE = {"q": "(batch, seqlen_q, nheads, headdim)", "k": "(batch, seqlen_k, nheads_k, headdim)",
          "v": "(batch, seqlen_k, nheads_k, headdim_v)"}
_VARLEN = {"q": "(total_q, nheads, headdim)", "k": "(total_k, nheads_k, headdim)",
           "v": "(total_k, nheads_k, headdim_v)"}
# The checked settings every rank must share, with the arguments they come from.
_SETTINGS = {"softmax_scale": "softmax_scale", "softcap": "softcap",
             "window_left": "window_size[0] (left)", "window_right": "causal / window_size[1]",
             "dtype": "dtype of q, k, v", "batch": "number of sequences (cu_seqlens)",
             "layout": "layout", "backend": "backend",
             "alibi_dims": "alibi_slopes (dims; -1 = None)", "sink_dims": "sink (dims; -1 = None)"}


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, layout="contiguous",
                         return_lse=False, backend=None, *, alibi_slopes=None, sink=None):
    """Sequence-parallel attention: this rank's queries over the keys of every rank of the group.

    q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d), v (batch, seqlen_k,
    nheads_k, d_v): this rank's shards (dim 1), equal on every rank; with layout="zigzag" each
    shard is two chunks, so seqlen_q and seqlen_k must be even. The global problem is
    flash_attn_func on the unsharded tensors (global seqlen = world * local seqlen): causal and
    window_size=(left, right) (-1 = unbounded) are bottom-right aligned on the global lengths;
    nheads_k divides nheads (GQA); softcap > 0 applies cap * tanh(s / cap); alibi_slopes
    float32 (nheads,) or (batch, nheads) subtract slope * |global distance|; sink (nheads,) adds
    one value-less logit to every row's softmax. alibi_slopes and sink are the same on every
    rank (float32 inputs with ALiBi round less well than single-device: see `plan`). backend:
    None picks "triton" for CUDA tensors and "torch" (tiled) otherwise.

    Returns out (batch, seqlen_q, nheads, d_v), this rank's shard of the global output, or
    (out, lse (batch, nheads, seqlen_q) float32) with return_lse. Differentiable in q, k, v and
    the sink; the sink's gradient is the part from this rank's queries (sum it over the group,
    as for any replicated parameter). The gradients of the ring's steps are summed in float32
    (float64 for float64 inputs) and rounded to the inputs' dtype once.
    """
    group = resolve_group(group)
    try:
        checks.dense_qkv(q, k, v)
        call = _settings(q, causal, softmax_scale, window_size, softcap, layout, backend)
        _check_extras(call, alibi_slopes, sink, q.shape[0], q.shape[2], q.device)
        error = None
    except (TypeError, ValueError) as e:
        call, error = None, e
    agree(group, _device(q), _signature({"q": q, "k": k, "v": v}, _DENSE, call), error)
    _agree_values(group, q, {"alibi_slopes": alibi_slopes, "sink": sink})
    for name, t in (("q", q), ("k", k)):
        _check_splits(f"{name}: seqlen_{name} (dim 1)", [t.shape[1]], call["layout"])
    out, lse = _run(q, k, v, [q.shape[1]], [k.shape[1]], group, call, alibi_slopes, sink)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                group=None, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0, layout="contiguous",
                                return_lse=False, backend=None, *, alibi_slopes=None,
                                sink=None):
    """ring_flash_attn_func for sequences packed without padding.

    q (total_q, nheads, d), k/v (total_k, nheads_k, d[_v]) are this rank's packed tokens; local
    cu_seqlens_q/k (int32, batch + 1) and max_seqlen_q/k describe them. Every sequence is sharded
    across the group with `layout` (flashkit.distributed.shard_varlen does it), so all ranks hold
    the same local lengths: sequence b has global length world * (its local length), and masks
    align per sequence on the global lengths; alibi_slopes (batch, nheads) give one row per
    sequence. Returns out (total_q, nheads, d_v), or (out, lse (nheads, total_q)) with
    return_lse. Each sequence is its own dense block call at every ring step (simple and exact;
    many short sequences mean many small kernel launches).
    """
    group = resolve_group(group)
    try:
        batch = checks.varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k)
        call = _settings(q, causal, softmax_scale, window_size, softcap, layout, backend)
        _check_extras(call, alibi_slopes, sink, batch, q.shape[1], q.device)
        call["batch"], error = batch, None
    except (TypeError, ValueError) as e:
        call, error = None, e
    agree(group, _device(q), _signature({"q": q, "k": k, "v": v}, _VARLEN, call), error)
    # Now the number of sequences agrees: compare the lengths themselves.
    cu = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    _agree_values(group, q, {**cu, "alibi_slopes": alibi_slopes, "sink": sink})
    lens = {name: [b - a for a, b in zip(c.tolist(), c.tolist()[1:], strict=False)]
            for name, c in cu.items()}
    for name, n in lens.items():
        _check_splits(f"{name}: local sequence lengths", n, call["layout"])
    out, lse = _run(q[None], k[None], v[None], lens["cu_seqlens_q"], lens["cu_seqlens_k"],
                    group, call, alibi_slopes, sink, varlen=True)
    return (out[0], lse[0]) if return_lse else out[0]


def _settings(q, causal, softmax_scale, window_size, softcap, layout, backend) -> dict:
    """The checked scalar arguments (raises naming the bad one)."""
    window_left, window_right = checks.window_size(window_size, causal)
    name = checks.backend(backend, q.device)
    if name == "reference":
        raise ValueError("backend: ring attention runs a block kernel, 'torch' or 'triton' "
                         "(None picks one); 'reference' materialises the whole matrix")
    return {"softmax_scale": checks.softmax_scale(softmax_scale, q.shape[-1]),
            "softcap": checks.softcap(softcap), "window_left": window_left,
            "window_right": window_right, "layout": layouts.check_layout(layout),
            "backend": name, "dtype": checks.DTYPES.index(q.dtype)}


def _check_extras(call: dict, alibi_slopes, sink, batch: int, nheads: int, device) -> None:
    """Check the ALiBi slopes and the sink; note their dims (-1 = None) for the signature."""
    checks.alibi_slopes(alibi_slopes, batch, nheads, device)
    checks.sink(sink, nheads, device)
    call["alibi_dims"] = -1 if alibi_slopes is None else alibi_slopes.dim()
    call["sink_dims"] = -1 if sink is None else sink.dim()


def _agree_values(group, q, tensors: dict) -> None:
    """Every rank holds the same values in these small tensors (None ones skipped; their
    shapes already agree, so every rank sends the same number of fields)."""
    fields = [(f"{name}{'.flatten()' if t.dim() > 1 else ''}[{n}]", x)
              for name, t in tensors.items() if t is not None
              for n, x in enumerate(t.detach().flatten().tolist())]
    if fields:
        agree(group, _device(q), fields, None)


def _signature(tensors: dict, dims: dict, call: dict | None) -> list[tuple[str, object]]:
    """What must agree across ranks; placeholders (-1) when this rank's checks failed."""
    fields = []
    for name, t in tensors.items():
        for i, label in enumerate(dims[name].strip("()").split(", ")):
            fields.append((f"{name}: {label} (dim {i})", -1 if call is None else t.shape[i]))
    if call is not None:
        call = {**call, "layout": layouts.LAYOUTS.index(call["layout"]),
                "backend": checks.BACKEND_NAMES.index(call["backend"])}
    for key, name in _SETTINGS.items():
        fields.append((name, -1 if call is None else call.get(key, 0)))
    return fields


def _check_splits(what: str, lengths: list[int], layout: str) -> None:
    if layout == "zigzag" and any(n % 2 for n in lengths):
        raise ValueError(f"{what} must be even with layout='zigzag' (each rank's shard is two "
                         f"chunks, r and 2 * world - 1 - r); got {lengths}")


def _device(q) -> torch.device:
    return q.device if isinstance(q, torch.Tensor) else torch.device("cpu")


def _run(q, k, v, q_lens, k_lens, group, call, alibi_slopes, sink, varlen=False):
    """Plan the ring for this rank and run it: (out, lse) on batch-first dense tensors."""
    ring = Ring(group)
    plans = ring_plans(call["layout"], ring.rank, ring.world, q_lens, k_lens,
                       call["window_left"], call["window_right"], alibi_slopes is not None)
    params = AttentionParams(softmax_scale=call["softmax_scale"], softcap=call["softcap"],
                             alibi_slopes=alibi_slopes)
    problem = RingProblem(ring, plans, params, call["backend"], varlen)
    return RingAttention.apply(q, k.contiguous(), v.contiguous(), sink, problem)
