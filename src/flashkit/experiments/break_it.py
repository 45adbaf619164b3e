"""BREAK IT: remove one of the two moves that keep the streaming softmax alive, and watch.

`tiled_attention` below is the chapter's tiled forward (query-row tiles outer, key/value
tiles inner, a running max m, sum l and output o per row), written once, with two switches:

    subtract_max=True,  rescale=True    intact: exactly softmax(q k^T / sqrt(d)) v
    subtract_max=False                  break 1: p = exp(s) with no shift, so exp overflows
                                        (fp16 above s = 11.1, fp32 above s = 88.7), l and o
                                        become inf, and o / l becomes NaN
    subtract_max=True,  rescale=False   break 2: each tile is shifted by its own max but the old
                                        (l, o) are never rescaled to the new max, so tiles are
                                        added on different scales: finite and wrong

The score scale decides break 1: unit-scale scores (std 1) survive even in fp16, scores of a
sharper head (std 4) overflow fp16, and very sharp ones (std 25) overflow fp32 too. Break 2 is
wrong at every scale. The function computes in the dtype of its inputs on purpose: the point is
to see what fp16 and fp32 do.

    flashkit break-it                       # three score scales, fp32 and fp16, seconds
    flashkit break-it --logit-stds 2,8 --seqlen 1024 --block 128
    flashkit break-it --device cuda         # the same on the GPU (its fp16 matmuls accumulate
                                            # in fp32, the overflow happens in exp all the same)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from flashkit.experiments import results
from flashkit.experiments.attention_methods import DTYPES
from flashkit.experiments.progress import track

VARIANTS = {  # name -> (subtract_max, rescale)
    "intact": (True, True),
    "no max subtraction": (False, True),
    "no rescaling": (True, False),
}


@dataclass
class TileStats:
    """What key/value tile `tile` did to the running state, over every query row."""
    tile: int
    max_s: float
    max_p: float
    max_l: float
    rows: int
    broken_rows: int  # rows whose l or o is no longer finite after this tile

    def merge(self, other: TileStats) -> TileStats:
        """Combine the stats of the same tile seen from two query-row tiles."""
        return TileStats(self.tile, _max(self.max_s, other.max_s), _max(self.max_p, other.max_p),
                         _max(self.max_l, other.max_l), self.rows + other.rows,
                         self.broken_rows + other.broken_rows)


def _max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def tiled_attention(q, k, v, block: int = 64, subtract_max: bool = True, rescale: bool = True,
                    trace: list[TileStats] | None = None):
    """Streaming-softmax attention of q, k, v (batch, nheads, seqlen, d), non-causal.

    With a trace list, trace[j] ends up holding TileStats of key/value tile j over all rows.
    """
    seqlen, scale = q.shape[-2], q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(0, seqlen, block):
        q_tile = q[..., i:i + block, :]
        rows = q_tile.shape[:-1] + (1,)
        m = torch.full(rows, -math.inf, dtype=q.dtype, device=q.device)  # running max
        l = torch.zeros(rows, dtype=q.dtype, device=q.device)  # running sum of exp
        o = torch.zeros_like(q_tile)  # running (unnormalised) output
        for j in range(0, seqlen, block):
            k_tile, v_tile = k[..., j:j + block, :], v[..., j:j + block, :]
            # [.., Bq, Bk] = [.., Bq, d] @ [.., d, Bk]
            s = (q_tile @ k_tile.transpose(-1, -2)) * scale
            # The stability shift: without it m_tile = 0 and p = exp(s) as it stands.
            m_tile = s.amax(-1, keepdim=True) if subtract_max else torch.zeros_like(m)
            p = torch.exp(s - m_tile)
            l_tile = p.sum(-1, keepdim=True)
            if rescale:  # bring the old state and this tile onto the common max m_new
                m_new = torch.maximum(m, m_tile)
                alpha, beta = torch.exp(m - m_new), torch.exp(m_tile - m_new)
            else:  # add on whatever scale each tile happened to use
                m_new, alpha, beta = m_tile, 1.0, 1.0
            l = alpha * l + beta * l_tile
            o = alpha * o + beta * (p @ v_tile)  # [.., Bq, d] = [.., Bq, Bk] @ [.., Bk, d]
            m = m_new
            if trace is not None:
                _record(trace, j // block, s, p, l, o)
        out[..., i:i + block, :] = o / l
    return out


def _record(trace: list[TileStats], tile: int, s, p, l, o) -> None:
    broken = ~(torch.isfinite(l) & torch.isfinite(o).all(-1, keepdim=True))
    stats = TileStats(tile, s.max().item(), p.max().item(), l.max().item(), l.numel(),
                      int(broken.sum()))
    if tile < len(trace):
        trace[tile] = trace[tile].merge(stats)
    else:
        trace.append(stats)


def naive_attention(q, k, v):
    """The chapter's materialised reference: softmax over the whole score matrix, in float64."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v.double()


def make_inputs(batch=1, nheads=2, seqlen=512, headdim=64, logit_std=1.0, seed=0):
    """float64 q, k, v whose scores s = q.k / sqrt(d) have standard deviation logit_std."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, nheads, seqlen, headdim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    return q, k * logit_std, v


@dataclass
class Outcome:
    logit_std: float
    variant: str
    dtype: str
    max_error: float  # against naive float64; inf when the output has NaN or inf
    nonfinite: int  # how many output elements are NaN or inf
    first_broken_tile: int | None  # first key/value tile after which some row's l or o was
    # not finite
    trace: list[TileStats]

    def cell(self) -> str:
        """The error, or how badly it broke: 'inf (18368 outputs NaN/inf from tile 0)'."""
        if self.nonfinite == 0:
            return f"{self.max_error:.3g}"
        return f"inf ({self.nonfinite} outputs NaN/inf from tile {self.first_broken_tile})"


def table(outcomes: list[Outcome]) -> tuple[list[str], list[list]]:
    """One row per (score scale, variant), one column per dtype: the max error against naive."""
    dtypes = list(dict.fromkeys(o.dtype for o in outcomes))
    cells = {(o.logit_std, o.variant, o.dtype): o.cell() for o in outcomes}
    keys = list(dict.fromkeys((o.logit_std, o.variant) for o in outcomes))
    header = ["std(s)", "variant", *(f"{d}: max error vs naive" for d in dtypes)]
    return header, [[f"{std:g}", variant, *(cells[std, variant, d] for d in dtypes)]
                    for std, variant in keys]


def run_variants(inputs, logit_std: float, dtypes=("float32", "float16"),
                 block=64, device: str = "cpu") -> list[Outcome]:
    """Every variant in every dtype on the same (float64, CPU) inputs, run on device."""
    q, k, v = inputs
    expected = naive_attention(q, k, v)
    outcomes = []
    for dtype in dtypes:
        qt, kt, vt = (t.to(device, DTYPES[dtype]) for t in (q, k, v))
        for name, (subtract_max, rescale) in VARIANTS.items():
            trace: list[TileStats] = []
            out = tiled_attention(qt, kt, vt, block, subtract_max, rescale, trace).cpu().double()
            bad = ~torch.isfinite(out)
            error = math.inf if bad.any() else (out - expected).abs().max().item()
            first = next((t.tile for t in trace if t.broken_rows), None)
            outcomes.append(Outcome(logit_std, name, dtype, error, int(bad.sum()), first, trace))
    return outcomes


def trace_table(outcome: Outcome, tiles: int) -> str:
    """Per key/value tile: max(s), max(p), max(l) over all rows and the share of broken rows."""
    rows = [[t.tile, f"{t.max_s:.1f}", f"{t.max_p:.3g}", f"{t.max_l:.3g}",
             f"{100 * t.broken_rows / t.rows:.1f}%"] for t in outcome.trace[:tiles]]
    return results.text_table(["tile", "max s", "max p", "max l", "rows with inf/NaN"], rows)


def lesson(outcomes: list[Outcome]) -> str:
    """Break 1 tile by tile, at every score scale above the smallest, in both dtypes."""
    smallest = min(o.logit_std for o in outcomes)
    parts = []
    for o in outcomes:
        if o.variant == "no max subtraction" and o.logit_std > smallest:
            limit = math.log(torch.finfo(DTYPES[o.dtype]).max)
            shown = 4 if o.first_broken_tile is None else o.first_broken_tile + 3
            parts.append(f"no max subtraction, {o.dtype}, std(s) {o.logit_std:g} "
                         f"(exp overflows above s = {limit:.1f}):\n" + trace_table(o, shown))
    return "\n\n".join(parts)


def run(out, logit_stds=(1.0, 4.0, 25.0), seqlen=512, nheads=2, headdim=64, block=64,
        device: str = "cpu") -> dict:
    """Every variant at every score scale; prints the lesson and writes break_it.json."""
    out = results.output_dir(out)
    outcomes = []
    for std in track(logit_stds, "break-it", lambda std: f"std(s)={std:g}"):
        outcomes += run_variants(make_inputs(1, nheads, seqlen, headdim, std), std, block=block,
                                 device=device)
    header, rows = table(outcomes)
    print(f"\nseqlen {seqlen}, {nheads} heads x {headdim}, tiles of {block}, on {device}; "
          "scores s = q.k/sqrt(d) drawn with the std shown; errors against naive float64:\n")
    print(results.text_table(header, rows))
    print("\n" + lesson(outcomes))
    data = {"environment": results.environment(device),
            "config": {"logit_stds": list(logit_stds), "seqlen": seqlen, "nheads": nheads,
                       "headdim": headdim, "block": block},
            "outcomes": [asdict(o) for o in outcomes]}
    path = results.write_json(out / "break_it.json", data)
    return {**data, "outcomes": outcomes, "files": [path], "lesson": lesson(outcomes),
            "markdown": results.markdown_table(header, rows)}
