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

Three more slips the chapter warns of, each a switch of the same function:

    causal=True, mask_from_zero=True    the causal mask built from arange(0) inside every tile
                                        instead of the tile's global offsets: right on the
                                        diagonal tiles only; in a GPT it shows each token the
                                        next one, and the training loss falls below the intact
                                        run's for the wrong reason
    max_init=0                          the running max starts at 0, not -inf: exact until a
                                        whole tile's scores sit far below 0, then its weight
                                        exp(m_tile) underflows and rows turn 0 / 0 = NaN
    skip_masked_tiles=False             the chapter's causal loop as printed: a tile whose keys
                                        are all masked gives exp(-inf - (-inf)) = NaN

and break 2 inside the GPT's training run (--train-steps): does it converge worse?

The score scale decides break 1: unit-scale scores (std 1) survive even in fp16, scores of a
sharper head (std 4) overflow fp16, and very sharp ones (std 25) overflow fp32 too. Break 2 is
wrong at every scale. The function computes in the dtype of its inputs on purpose: the point is
to see what fp16 and fp32 do.

    flashkit break-it                       # three score scales, fp32 and fp16, then the GPT
                                            # trained with each causal break (a few minutes)
    flashkit break-it --train-steps 0       # the forward experiments only, seconds
    flashkit break-it --logit-stds 2,8 --seqlen 1024 --block 128
    flashkit break-it --device cuda         # the same on the GPU (its fp16 matmuls accumulate
                                            # in fp32, the overflow happens in exp all the same)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashkit.experiments import corpus, plotting, results, train
from flashkit.experiments.attention_methods import DTYPES
from flashkit.experiments.progress import track

VARIANTS = {  # name -> the switches of tiled_attention it turns
    "intact": {},
    "no max subtraction": {"subtract_max": False},
    "no rescaling": {"rescale": False},
}
CAUSAL_VARIANTS = {  # the same, for the causal mask (run with causal=True)
    "intact": {},
    "chapter's causal loop as printed": {"skip_masked_tiles": False},
    "mask from arange(0) in each tile": {"mask_from_zero": True},
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
                    trace: list[TileStats] | None = None, causal: bool = False,
                    mask_from_zero: bool = False, max_init: float = -math.inf,
                    skip_masked_tiles: bool = True):
    """Streaming-softmax attention of q, k, v (batch, nheads, seqlen, d).

    causal: key j visible to query i iff j <= i, the mask built from each tile's global offsets
    (i0 + r, j0 + c). mask_from_zero builds it from arange(0) inside every tile instead (the
    chapter's Step 6 bug). max_init is where the running max starts (-inf; 0 is the chapter's
    Step 4 bug). skip_masked_tiles leaves out a tile in which every score is masked, as
    FlashAttention's causal loop bound does; without it such a tile has m_tile = -inf and
    p = exp(-inf - (-inf)) = NaN, which is what the chapter's causal loop does as printed.
    With a trace list, trace[j] ends up holding TileStats of key/value tile j over all rows.
    """
    seqlen, scale = q.shape[-2], q.shape[-1] ** -0.5
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    for i in range(0, seqlen, block):
        q_tile = q[..., i:i + block, :]
        rows = q_tile.shape[:-1] + (1,)
        m = torch.full(rows, max_init, dtype=q.dtype, device=q.device)  # running max
        l = torch.zeros(rows, dtype=q.dtype, device=q.device)  # running sum of exp
        o = q.new_zeros(rows[:-1] + v.shape[-1:])  # running (unnormalised) output
        for j in range(0, seqlen, block):
            k_tile, v_tile = k[..., j:j + block, :], v[..., j:j + block, :]
            # [.., Bq, Bk] = [.., Bq, d] @ [.., d, Bk]
            s = (q_tile @ k_tile.transpose(-1, -2)) * scale
            if causal:
                hidden = _causal_hidden(i, j, s.shape[-2], s.shape[-1], mask_from_zero, q.device)
                if skip_masked_tiles and bool(hidden.all()):
                    continue
                s = s.masked_fill(hidden, -math.inf)
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


def _causal_hidden(i: int, j: int, rows: int, cols: int, from_zero: bool, device):
    """(rows, cols) bool, True where key j + c is in query i + r's future; from_zero forgets the
    tile's offsets (i, j) and compares c > r inside every tile."""
    row = torch.arange(rows, device=device)[:, None] + (0 if from_zero else i)
    col = torch.arange(cols, device=device)[None, :] + (0 if from_zero else j)
    return col > row


def _record(trace: list[TileStats], tile: int, s, p, l, o) -> None:
    broken = ~(torch.isfinite(l) & torch.isfinite(o).all(-1, keepdim=True))
    stats = TileStats(tile, s.max().item(), p.max().item(), l.max().item(), l.numel(),
                      int(broken.sum()))
    if tile < len(trace):
        trace[tile] = trace[tile].merge(stats)
    else:
        trace.append(stats)


def naive_attention(q, k, v, causal: bool = False):
    """The chapter's materialised reference: softmax over the whole score matrix, in float64."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1).to(s.device), -math.inf)
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
                 block=64, device: str = "cpu", variants=VARIANTS,
                 causal: bool = False) -> list[Outcome]:
    """Every variant in every dtype on the same (float64, CPU) inputs, run on device."""
    q, k, v = inputs
    expected = naive_attention(q, k, v, causal)
    outcomes = []
    for dtype in dtypes:
        qt, kt, vt = (t.to(device, DTYPES[dtype]) for t in (q, k, v))
        for name, switches in variants.items():
            trace: list[TileStats] = []
            out = tiled_attention(qt, kt, vt, block, trace=trace, causal=causal,
                                  **switches).cpu().double()
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


def shifted_inputs(inputs, shift: float):
    """q, k with one more dimension such that every score becomes s + shift (v unchanged).

    Softmax ignores a constant added to a row, so the answer is the same; only the size of the
    scores moves, which is what the running max's starting value is about.
    q' = [q sqrt((d+1)/d), shift sqrt(d+1)], k' = [k, 1]: q'.k' / sqrt(d+1) = q.k / sqrt(d) + shift.
    """
    q, k, v = inputs
    d = q.shape[-1]
    q = torch.cat([q * math.sqrt((d + 1) / d), torch.full_like(q[..., :1],
                                                               shift * math.sqrt(d + 1))], -1)
    return q, torch.cat([k, torch.ones_like(k[..., :1])], -1), v


@dataclass
class MaxInitPoint:
    shift: float
    dtype: str
    error_minus_inf: float  # max error vs naive with the running max starting at -inf
    error_zero: float  # ... starting at 0 (inf when the output has NaN or inf)


def max_init_sweep(inputs, shifts, dtypes=("float32", "float16"), block=64,
                   device: str = "cpu") -> list[MaxInitPoint]:
    """The running max started at -inf and at 0, for scores moved by each shift.

    Started at 0, the max never drops below 0, so a tile whose scores are all far below 0 is
    weighted by beta = exp(m_tile - 0), which loses digits and then underflows (fp32: subnormal
    below -87.3, zero below -103.3; fp16: zero below -16.6): l and o lose the tile, and once
    every tile is lost, o / l = 0 / 0 = NaN. At ordinary scores nothing changes.
    """
    points = []
    for shift in shifts:
        q, k, v = shifted_inputs(inputs, shift)
        expected = naive_attention(q, k, v)
        for dtype in dtypes:
            qt, kt, vt = (t.to(device, DTYPES[dtype]) for t in (q, k, v))
            errors = []
            for start in (-math.inf, 0.0):
                out = tiled_attention(qt, kt, vt, block, max_init=start).cpu().double()
                errors.append(math.inf if not torch.isfinite(out).all()
                              else (out - expected).abs().max().item())
            points.append(MaxInitPoint(shift, dtype, *errors))
    return points


def max_init_table(points: list[MaxInitPoint]) -> tuple[list[str], list[list]]:
    dtypes = list(dict.fromkeys(p.dtype for p in points))
    cells = {(p.shift, p.dtype): p for p in points}
    shifts = list(dict.fromkeys(p.shift for p in points))
    header = ["shift of s", *(f"{d}: m starts at {start}" for d in dtypes
                              for start in ("-inf", "0"))]
    return header, [[f"{shift:g}", *(f"{e:.3g}" for d in dtypes for e in
                                     (cells[shift, d].error_minus_inf, cells[shift, d].error_zero))]
                    for shift in shifts]


TRAIN_VARIANTS = {  # name -> switches, all causal; the GPT's attention is one of these
    "intact": {},
    "no rescaling": {"rescale": False},
    "mask from arange(0) in each tile": {"mask_from_zero": True},
}


def gpt_attention(block: int, **switches):
    """A causal tiled_attention on the GPT's (batch, seqlen, nheads, headdim) layout."""
    def attend(q, k, v):
        out = tiled_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block,
                              causal=True, **switches)
        return out.transpose(1, 2)
    return attend


def train_variants(config: train.TrainConfig) -> list[train.Run]:
    """The GPT trained once per TRAIN_VARIANTS entry, same seed and batches, four key tiles per
    row (block = seqlen / 4) so that every tile after the first is where the breaks act."""
    text = corpus.load_text()
    tokenizer = corpus.CharTokenizer(text)
    tokens = tokenizer.encode(text)
    block = max(1, config.seqlen // 4)
    return [train.train_once(name, config, tokens, tokenizer.vocab_size,
                             gpt_attention(block, **switches))
            for name, switches in TRAIN_VARIANTS.items()]


def plot(outcomes: list[Outcome], points: list[MaxInitPoint], path: Path) -> Path | None:
    """Left: max error of each variant against naive (inf drawn at the top); right: the
    running-max start against the score shift."""
    plt = plotting.pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{o.variant}\n{o.dtype}, std {o.logit_std:g}" for o in outcomes]
    finite = [o.max_error for o in outcomes if math.isfinite(o.max_error) and o.max_error > 0]
    top = 10 * max(finite, default=1.0)
    heights = [o.max_error if math.isfinite(o.max_error) else top for o in outcomes]
    colors = ["C3" if not math.isfinite(o.max_error) else f"C{list(VARIANTS).index(o.variant)}"
              if o.variant in VARIANTS else "C4" for o in outcomes]
    left.barh(range(len(outcomes)), [max(h, 1e-17) for h in heights], color=colors)
    left.set_yticks(range(len(outcomes)), labels, fontsize=6)
    left.set_xscale("log")
    left.set_xlabel("max |error| vs naive float64 (red: NaN/inf)")
    left.set_title("each break, each dtype and score scale", fontsize=9)
    for dtype in dict.fromkeys(p.dtype for p in points):
        mine = [p for p in points if p.dtype == dtype]
        for start, attr, style in (("-inf", "error_minus_inf", "-"), ("0", "error_zero", "--")):
            ys = [getattr(p, attr) for p in mine]
            right.plot([-p.shift for p in mine], [y if math.isfinite(y) else top for y in ys],
                       style, marker="o", label=f"{dtype}, m starts at {start}")
    right.set_xscale("symlog")
    right.set_yscale("log")
    right.set_xlabel("how far below 0 the scores sit (-shift)")
    right.set_ylabel("max |error| (NaN/inf drawn at the top)")
    right.set_title("running max initialised to 0 instead of -inf", fontsize=9)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    return plotting.save(fig, path)


def plot_training(runs: list[train.Run], config: train.TrainConfig, path: Path) -> Path | None:
    plt = plotting.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot(r.losses, label=f"{r.attention} (final {r.losses[-1]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT, seqlen {config.seqlen}, tiles of {max(1, config.seqlen // 4)}, "
                 f"{config.device}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return plotting.save(fig, path)


MAX_INIT_SHIFTS = (0.0, -5.0, -10.0, -20.0, -50.0, -90.0, -100.0, -120.0)


def run(out, logit_stds=(1.0, 4.0, 25.0), seqlen=512, nheads=2, headdim=64, block=64,
        device: str = "cpu", train_config: train.TrainConfig | None = None) -> dict:
    """Every variant at every score scale, the causal-mask breaks, the running max started at 0,
    and (with train_config) the GPT trained with the causal breaks; prints the lessons and writes
    break_it.json, break_it.png and break_it_train.png."""
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

    unit = make_inputs(1, nheads, seqlen, headdim, 1.0)
    causal = run_variants(unit, 1.0, block=block, device=device, variants=CAUSAL_VARIANTS,
                          causal=True)
    causal_header, causal_rows = table(causal)
    print(f"\nCausal, std(s) 1, tiles of {block}: the mask must use each tile's global offsets "
          "(row i0 + r, key j0 + c). Built from arange(0) inside every tile it is right only on "
          "the diagonal tiles: it hides half of every earlier tile and shows half of every later "
          "one (the future). The chapter's causal loop as printed also visits tiles in which "
          "every key is masked; there m_tile = -inf and exp(-inf - (-inf)) = NaN, so every row "
          "tile but the last comes out NaN. Skipping such tiles, as FlashAttention's causal loop "
          "bound does, fixes it:\n")
    print(results.text_table(causal_header, causal_rows))

    points = max_init_sweep(unit, MAX_INIT_SHIFTS, block=block, device=device)
    init_header, init_rows = max_init_table(points)
    print("\nThe running max started at 0 instead of -inf, scores moved by a constant (softmax "
          "does not change): exact while the scores are near 0; once a tile's scores all sit "
          "far below 0, its weight exp(m_tile - 0) underflows and the tile is lost (NaN/inf "
          "once every tile is):\n")
    print(results.text_table(init_header, init_rows))

    data = {"environment": results.environment(device),
            "config": {"logit_stds": list(logit_stds), "seqlen": seqlen, "nheads": nheads,
                       "headdim": headdim, "block": block},
            "outcomes": [asdict(o) for o in outcomes],
            "causal_outcomes": [asdict(o) for o in causal],
            "max_init": [asdict(p) for p in points]}
    pngs = [plot(outcomes + causal, points, out / "break_it.png")]
    if train_config is not None:
        runs = train_variants(train_config)
        print(f"\nThe GPT trained {train_config.steps} steps per variant, same seed and "
              f"batches, seqlen {train_config.seqlen}, tiles of "
              f"{max(1, train_config.seqlen // 4)}:\n")
        print(results.text_table(["attention", "first loss", "final loss", "lowest loss"],
                                 [[r.attention, f"{r.losses[0]:.4f}", f"{r.losses[-1]:.4f}",
                                   f"{min(r.losses):.4f}"] for r in runs]))
        print("A loss below the intact run's is no win: the mask built from arange(0) lets "
              "each query see later tokens, including the one it must predict.")
        data["training"] = {"config": asdict(train_config),
                            "runs": [asdict(r) for r in runs]}
        pngs.append(plot_training(runs, train_config, out / "break_it_train.png"))
    pngs = [p for p in pngs if p]
    path = results.write_json(out / "break_it.json", data)
    return {**data, "outcomes": outcomes, "files": [path, *pngs], "pngs": pngs,
            "lesson": lesson(outcomes), "markdown": results.markdown_table(header, rows)}
