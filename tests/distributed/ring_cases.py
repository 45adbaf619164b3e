"""The ring attention cases and the worker that runs them all in one process group.

Spawning processes is slow (each imports torch), so one spawned group per world size runs every
case in turn; each rank checks its own shards against the float64 oracle of the whole problem
(computed on every rank from the same seed) and rank 0 writes {case name: failure or ""} to a
JSON file that the pytest tests read case by case.
"""

from __future__ import annotations

import gc
import itertools
import json
import traceback
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import flashkit.distributed as fd
from flashkit import reference
from flashkit.testing import assert_close_to_oracle, factor_for


@dataclass(frozen=True)
class Case:
    """One ring call. Shard lengths are per rank; varlen gives per-rank lengths per sequence."""

    name: str
    layout: str = "contiguous"
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    dtype: torch.dtype = torch.float32
    batch: int = 2
    shard_q: int = 6
    shard_k: int = 6
    nheads: int = 4
    nheads_k: int = 4
    headdim: int = 16
    headdim_v: int = 16
    varlen: tuple[int, ...] = ()  # local length of each packed sequence (q and k alike)
    lse_grad: bool = False  # return the lse and put a random gradient on it too
    alibi: str = ""  # "heads": slopes (nheads,); "batch": (batch or sequences, nheads)
    sink: bool = False  # a learnable sink (nheads,), its gradient checked too
    backend: str | None = None  # None: the device's default (tiled on the CPU)
    worlds: tuple[int, ...] = (1, 2, 4)  # the group sizes that run it


VALID = [
    Case("contiguous-full"),
    Case("zigzag-full", layout="zigzag", batch=1, shard_q=10, shard_k=10),
    Case("contiguous-causal", causal=True, nheads_k=1),
    Case("zigzag-causal-gqa4", layout="zigzag", causal=True, nheads=8, nheads_k=2, headdim=40,
         headdim_v=40),
    Case("zigzag-causal-float64", layout="zigzag", causal=True, dtype=torch.float64,
         shard_q=14, shard_k=14),
    Case("zigzag-causal-bf16", layout="zigzag", causal=True, dtype=torch.bfloat16),
    Case("contiguous-window-odd-shards", window=(3, 2), shard_q=7, shard_k=7),
    Case("contiguous-causal-seqlen1", causal=True, shard_q=1, shard_k=1),
    Case("zigzag-causal-chunks-of-1", layout="zigzag", causal=True, shard_q=2, shard_k=2),
    Case("zigzag-window", layout="zigzag", window=(3, 2), shard_q=10, shard_k=10,
         dtype=torch.float64),
    Case("zigzag-causal-window", layout="zigzag", causal=True, window=(7, -1), nheads_k=2),
    Case("contiguous-causal-window-softcap", causal=True, window=(4, -1), softcap=2.0),
    Case("zigzag-softcap-dv24", layout="zigzag", softcap=1.5, headdim_v=24),
    Case("contiguous-causal-q-longer", causal=True, shard_q=10, shard_k=4),  # empty rows
    Case("zigzag-causal-k-longer", layout="zigzag", causal=True, shard_q=4, shard_k=10),
    Case("contiguous-causal-lse-grad", causal=True, lse_grad=True),
    Case("zigzag-lse-grad-window", layout="zigzag", window=(5, 1), lse_grad=True),
    Case("varlen-contiguous-causal", causal=True, nheads_k=2, varlen=(7, 1, 0, 4)),
    Case("varlen-zigzag-causal", layout="zigzag", causal=True, varlen=(6, 0, 2, 10),
         dtype=torch.float64),
    Case("varlen-zigzag-window", layout="zigzag", window=(2, 3), varlen=(4, 8)),
    Case("contiguous-causal-alibi", causal=True, alibi="heads"),
    Case("zigzag-causal-alibi-gqa4", layout="zigzag", causal=True, alibi="heads", nheads=8,
         nheads_k=2, shard_q=10, shard_k=10, dtype=torch.float64),
    Case("contiguous-alibi-batch-q-longer", alibi="batch", shard_q=10, shard_k=4),
    Case("zigzag-alibi-window-softcap", layout="zigzag", window=(5, 3), softcap=2.0,
         alibi="heads", shard_q=10, shard_k=10),
    Case("zigzag-causal-sink", layout="zigzag", causal=True, sink=True, nheads_k=2),
    Case("zigzag-causal-sink-bf16", layout="zigzag", causal=True, sink=True,
         dtype=torch.bfloat16),
    Case("contiguous-alibi-sink-lse-grad", alibi="heads", sink=True, lse_grad=True,
         dtype=torch.float64),
    Case("varlen-zigzag-causal-alibi-sink", layout="zigzag", causal=True, alibi="batch",
         sink=True, varlen=(6, 0, 2, 10)),
    # The Triton kernels, interpreted on the CPU (slow: one small case on 2 ranks): slopes of
    # both signs (the block straddles the diagonal, keys longer than queries) and the sink.
    Case("triton-alibi-sink-k-longer", alibi="batch", sink=True, backend="triton", nheads=2,
         nheads_k=1, shard_q=4, shard_k=6, worlds=(2,)),
    # and in bf16, where summing the steps' gradients unrounded matters (engine.ring_backward)
    Case("triton-zigzag-causal-bf16", layout="zigzag", causal=True, dtype=torch.bfloat16,
         backend="triton", worlds=(2,)),
]


@dataclass(frozen=True)
class Reject:
    """A call every rank must reject: with `error` whose message contains `match` (rank 0's
    message contains `match_rank0` when given).

    `call` sets inputs (shard, headdim_k, lengths) and keyword arguments on every rank, `rank0`
    on rank 0 only (calls that differ across ranks). The group SUBGROUP_WITHOUT_RANK0 is made
    by a collective new_group when the case runs.
    """

    name: str
    error: type
    match: str
    call: dict = field(default_factory=dict)
    rank0: dict = field(default_factory=dict)
    varlen: bool = False
    match_rank0: str | None = None
    others_pass: bool = False  # only rank 0 must raise; the others' call must succeed


SUBGROUP_WITHOUT_RANK0 = "<new_group of ranks 1..W-1>"


REJECT = [
    Reject("unequal-shards", ValueError, "q: seqlen_q (dim 1) differs across the ranks",
           rank0={"shard": 4}),
    Reject("zigzag-odd-shard", ValueError, "q: seqlen_q (dim 1) must be even",
           call={"layout": "zigzag", "shard": 7}),
    Reject("one-rank-bad-input", ValueError, "rank(s) [0] of the group rejected their inputs",
           rank0={"headdim_k": 8}, match_rank0="k: head dim 8 differs from q's 16"),
    Reject("mixed-causal", ValueError, "causal / window_size[1] differs",
           rank0={"causal": True}),
    Reject("bad-group", TypeError, "group: expected a torch.distributed.ProcessGroup",
           call={"group": "world"}),
    Reject("not-a-member", ValueError, "group: this process is not a member of the group",
           call={"group": SUBGROUP_WITHOUT_RANK0}, others_pass=True),
    Reject("bad-layout", ValueError, "layout: expected one of", call={"layout": "spiral"}),
    Reject("reference-backend", ValueError, "backend: ring attention runs a block kernel",
           call={"backend": "reference"}),
    Reject("varlen-unequal-lengths", ValueError, "cu_seqlens_q[1] differs", varlen=True,
           rank0={"lengths": (6, 4)}),
    Reject("varlen-zigzag-odd", ValueError, "cu_seqlens_q: local sequence lengths must be even",
           call={"layout": "zigzag", "lengths": (4, 3)}, varlen=True),
    Reject("sink-differs", ValueError, "sink[1] differs across the ranks",
           call={"sink": (0.5, 0.25)}, rank0={"sink": (0.5, 0.75)}),
    Reject("alibi-differs", ValueError, "alibi_slopes[0] differs across the ranks",
           call={"alibi_slopes": (0.5, 0.25)}, rank0={"alibi_slopes": (0.125, 0.25)},
           varlen=True),
    Reject("alibi-one-rank-only", ValueError, "alibi_slopes (dims; -1 = None) differs",
           rank0={"alibi_slopes": (0.5, 0.25)}),
    Reject("alibi-bad-shape", ValueError, "alibi_slopes: expected shape (2,) or (1, 2)",
           call={"alibi_slopes": (0.5, 0.25, 0.125)}),
]


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _cu_seqlens(lengths, device=None) -> torch.Tensor:
    """int32 prefix sums (batch + 1,) of sequence lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


class _Shards:
    """This rank's view of global tensors under a case's layout (dense: dim 1; varlen: dim 0)."""

    def __init__(self, case: Case, rank: int, world: int):
        self.case, self.rank, self.world = case, rank, world
        self.cu = _cu_seqlens(case.varlen) * world if case.varlen else None  # global

    def __call__(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.cu is None:
            return fd.shard(x, dim, self.rank, self.world, self.case.layout)
        moved = x.movedim(dim, 0)
        local = fd.shard_varlen(moved, self.cu, self.rank, self.world, self.case.layout)[0]
        return local.movedim(0, dim)


def _extras(case: Case, gen: torch.Generator) -> dict:
    """The case's ALiBi slopes (float32, positive, from 0.1 to 1) and sink (float64, drawn)."""
    extras = {}
    if case.alibi:
        rows = len(case.varlen) if case.varlen else case.batch
        shape = (case.nheads,) if case.alibi == "heads" else (rows, case.nheads)
        extras["alibi_slopes"] = (0.1 + 0.9 * torch.rand(shape, generator=gen)).float()
    if case.sink:
        extras["sink"] = torch.randn(case.nheads, generator=gen, dtype=torch.float64)
    return extras


def _inputs(case: Case, world: int):
    """Global float64 q, k, v, dout, dlse from the case's seed (the same on every rank), and
    the slopes and sink."""
    gen = torch.Generator().manual_seed(_seed(case.name))
    if case.varlen:
        total = world * sum(case.varlen)
        lead_q, lead_k, lse_shape = (total,), (total,), (case.nheads, total)
    else:
        lead_q = (case.batch, world * case.shard_q)
        lead_k = (case.batch, world * case.shard_k)
        lse_shape = (case.batch, case.nheads, world * case.shard_q)
    shapes = [(*lead_q, case.nheads, case.headdim), (*lead_k, case.nheads_k, case.headdim),
              (*lead_k, case.nheads_k, case.headdim_v), (*lead_q, case.nheads, case.headdim_v),
              lse_shape]
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return tensors, _extras(case, gen)


def _attention(case: Case, q, k, v, extras: dict, shards: _Shards, oracle: bool, device):
    """(out, lse): the oracle on global tensors, or the ring on this rank's shards."""
    common = {"causal": case.causal, "window_size": case.window, "softcap": case.softcap,
              **extras}
    if oracle:
        return reference.attention(q, k, v, cu_seqlens_q=shards.cu, cu_seqlens_k=shards.cu,
                                   **common)
    q, k, v = (x.to(device) for x in (q, k, v))
    common = {name: x.to(device) if isinstance(x, torch.Tensor) else x
              for name, x in common.items()}
    if not case.varlen:
        return fd.ring_flash_attn_func(q, k, v, layout=case.layout, return_lse=True,
                                       backend=case.backend, **common)
    cu = _cu_seqlens(case.varlen, device)  # local: every rank holds the same lengths
    return fd.ring_flash_attn_varlen_func(q, k, v, cu, cu, max(case.varlen), max(case.varlen),
                                          layout=case.layout, return_lse=True,
                                          backend=case.backend, **common)


def _results(case: Case, q, k, v, dout, dlse, extras: dict, shards: _Shards, oracle: bool,
             device) -> dict:
    """Outputs and gradients of the oracle (global tensors) or of the ring (local shards); the
    ring's dsink is summed over the group (each rank's is the part from its own queries)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    extras = dict(extras)
    if "sink" in extras:  # the oracle's stays with its inputs, on the CPU
        extras["sink"] = extras["sink"].detach().to("cpu" if oracle else device).requires_grad_()
    out, lse = _attention(case, q, k, v, extras, shards, oracle, device)
    loss = (out * dout.to(out)).sum()
    if case.lse_grad:
        loss = loss + (lse * dlse.to(lse)).sum()
    loss.backward()
    results = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if "sink" in extras:
        results["dsink"] = extras["sink"].grad
        if not oracle:
            dist.all_reduce(results["dsink"])
    return results


def check_case(case: Case, rank: int, world: int, device) -> None:
    """Raise AssertionError unless this rank's ring results match the oracle's shards."""
    shards = _Shards(case, rank, world)
    seq_dim, lse_dim = (0, 1) if case.varlen else (1, 2)
    (q, k, v, dout, dlse), extras = _inputs(case, world)
    oracle = _results(case, q, k, v, dout, dlse, extras, shards, True, device)
    # The docs/design.md section 5 baseline: the same materialised computation in the case's dtype.
    cast = [x.to(case.dtype) for x in (q, k, v, dout, dlse)]
    extras = {name: x.to(case.dtype) if name == "sink" else x for name, x in extras.items()}
    baseline = _results(case, *cast, extras, shards, True, device)
    local = [shards(x, seq_dim) for x in cast[:4]] + [shards(cast[4], lse_dim)]
    ring = _results(case, *local, extras, shards, False, device)
    atol = 1e-12 if case.dtype == torch.float64 else 1e-5  # float64: exact up to rounding
    for name in ring:
        if name == "dsink":  # the whole (nheads,) gradient, summed over the group
            assert_close_to_oracle(name, ring[name], oracle[name], baseline[name], atol=atol,
                                   factor=factor_for(name))
            continue
        dim = lse_dim if name == "lse" else seq_dim
        assert_close_to_oracle(name, ring[name], shards(oracle[name], dim),
                               shards(baseline[name], dim), atol=atol, factor=factor_for(name))


def check_reject(r: Reject, rank: int, world: int, device) -> None:
    """Raise AssertionError unless this rank raised r.error with the expected message."""
    kwargs = {"shard": 6, "headdim_k": 16, "lengths": (4, 6), **r.call,
              **(r.rank0 if rank == 0 else {})}
    shard, headdim_k, lengths = (kwargs.pop(key) for key in ("shard", "headdim_k", "lengths"))
    if kwargs.get("group") == SUBGROUP_WITHOUT_RANK0:
        kwargs["group"] = dist.new_group(list(range(1, world)))
    for name in ("alibi_slopes", "sink"):  # given as tuples of floats
        if name in kwargs:
            kwargs[name] = torch.tensor(kwargs[name], dtype=torch.float32, device=device)
    lead = (sum(lengths),) if r.varlen else (1, shard)
    gen = torch.Generator().manual_seed(_seed(r.name))
    q, k, v = (torch.randn(*lead, 2, d, generator=gen).to(device) for d in (16, headdim_k, 16))
    match = r.match_rank0 if rank == 0 and r.match_rank0 else r.match
    if rank != 0 and r.others_pass:
        match = None
    try:
        if r.varlen:
            cu = _cu_seqlens(lengths, device)
            fd.ring_flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)
        else:
            fd.ring_flash_attn_func(q, k, v, **kwargs)
    except r.error as e:
        expected = "success" if match is None else f"{r.error.__name__} matching {match!r}"
        if match is None or match not in str(e):
            raise AssertionError(f"expected {expected}, got: {e}") from e
        return
    if match is not None:
        raise AssertionError(f"expected {r.error.__name__} matching {match!r}, nothing raised")


def run(rank: int, world: int, port: int, out_path: str, dist_backend: str = "gloo",
        names: tuple[str, ...] | None = None) -> None:
    """Worker: join the group, run the cases (all, or those named), rank 0 writes the results."""
    if world > 1:
        torch.set_num_threads(1)  # several ranks share the CI machine's cores
    device = torch.device("cpu")
    if dist_backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        results = {}
        todo = [(c.name, check_case, c) for c in VALID] + [(r.name, check_reject, r)
                                                             for r in REJECT]
        for name, check, case in todo:
            if names is not None and name not in names or world not in getattr(case, "worlds",
                                                                                  (world,)):
                continue
            try:
                check(case, rank, world, device)
                results[name] = ""
            except Exception as e:  # every failure is reported under its case's name
                detail = str(e) if isinstance(e, AssertionError) else traceback.format_exc()
                results[name] = f"rank {rank}: {detail}"
        everyone = [None] * world
        dist.all_gather_object(everyone, results)
        if rank == 0:
            merged = {n: "\n".join(r[n] for r in everyone if r[n]) for n in results}
            with open(out_path, "w") as f:
                json.dump(merged, f)
    finally:
        # Let every rank finish its last collective, and drop every handle on gloo's pending
        # work, before the group goes: otherwise a gloo thread may outlive the interpreter.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
