"""`flashkit train`: the same GPT trained twice from the same seed, naive vs flashkit attention.

Exact attention means exactly that: with the same initial weights and the same batches, the two
loss curves must lie on top of each other (they differ only by floating-point rounding, which
grows slowly as the runs drift apart), while flashkit's steps are faster and lighter at long
sequence lengths because the (seqlen x seqlen) score matrix is never stored for backward.

Step times (tokens/s, speed-up) are measured after training, the two models taking turns for
TIMED_REPEATS steps each (after one warm-up step each), and each side's fastest step counts:
other processes on a shared machine can only add time, so the minimum of interleaved repeats is
the measurement they distort least.

    flashkit train                          # CPU: 40 steps at 64 tokens, under a minute
    flashkit train --device cuda            # GPU: 200 steps at 1k and at 4k tokens, bf16
    flashkit train --steps 100 --seqlens 128 --layers 4
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flashkit.experiments import corpus, plotting, results
from flashkit.experiments.memory import is_out_of_memory
from flashkit.experiments.progress import track
from flashkit.models.gpt import ATTENTION, GPT, Attend, GPTConfig, flashkit_attention


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch: int
    seqlen: int
    n_layer: int
    n_head: int
    n_embd: int
    lr: float
    device: str
    seed: int = 0
    backend: str | None = None  # flashkit's backend; None: Triton on CUDA, tiled elsewhere

    @property
    def autocast(self):
        """bfloat16 autocast on CUDA (the Triton kernels' dtype); float32 on the CPU."""
        if self.device.startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass(frozen=True)
class Defaults:
    """What `flashkit train` runs when a size is not given, per kind of device."""
    steps: int
    seqlens: tuple[int, ...]
    tokens: int  # per batch: batch = tokens // seqlen
    n_layer: int
    n_head: int
    n_embd: int
    lr: float


CPU_DEFAULTS = Defaults(40, (64,), 512, 2, 4, 64, 3e-3)
GPU_DEFAULTS = Defaults(200, (1024, 4096), 16384, 6, 8, 512, 1e-3)


def configs(device: str, seed: int = 0, backend: str | None = None,
            **sizes) -> list[TrainConfig]:
    """One TrainConfig per seqlen; sizes (the Defaults fields) left out or None take the
    device's defaults."""
    chosen = GPU_DEFAULTS if device.startswith("cuda") else CPU_DEFAULTS
    chosen = Defaults(**{**asdict(chosen), **{k: v for k, v in sizes.items() if v is not None}})
    return [TrainConfig(chosen.steps, max(1, chosen.tokens // n), n, chosen.n_layer,
                        chosen.n_head, chosen.n_embd, chosen.lr, device, seed, backend)
            for n in chosen.seqlens]


TIMED_REPEATS = 10  # interleaved timed steps per side, after training


@dataclass
class Run:
    attention: str
    seqlen: int
    losses: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    oom: str = ""  # the out-of-memory error, when this run could not train at all


def _model(attention: str, config: TrainConfig, vocab_size: int,
           attend: Attend | None = None):
    """A GPT initialised from config.seed with attention "naive" or "flashkit", or with `attend`
    (any causal attention on (batch, seqlen, nheads, headdim)), and its optimizer."""
    torch.manual_seed(config.seed)
    model_config = GPTConfig(vocab_size, config.seqlen, config.n_layer, config.n_head,
                             config.n_embd)
    if attend is None:
        attend = (ATTENTION[attention] if attention == "naive"
                  else functools.partial(flashkit_attention, backend=config.backend))
    model = GPT(model_config, attend).to(config.device)
    return model, torch.optim.AdamW(model.parameters(), lr=config.lr)


def _step(model, optimizer, x, y, config: TrainConfig) -> tuple[float, float]:
    """One optimizer step; returns (loss, seconds)."""
    start = time.perf_counter()
    with config.autocast:
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if config.device.startswith("cuda"):
        torch.cuda.synchronize(config.device)
    return loss.item(), time.perf_counter() - start


def train_once(attention: str, config: TrainConfig, tokens: torch.Tensor,
               vocab_size: int, attend: Attend | None = None) -> Run:
    """Train from config.seed with attention "naive" or "flashkit", or with `attend` (any causal
    attention on (batch, seqlen, nheads, headdim), `attention` then only names the run); batches
    come from a generator seeded the same way, so two calls differ only in the attention."""
    model, optimizer = _model(attention, config, vocab_size, attend)
    batches = torch.Generator().manual_seed(config.seed)
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(config.device)
    run = Run(attention, config.seqlen)
    for _ in track(range(config.steps), f"train {attention:>8} seqlen={config.seqlen}",
                   describe=lambda step: f"step {step}"):
        x, y = (t.to(config.device) for t in corpus.random_batch(tokens, config.batch,
                                                                  config.seqlen, batches))
        run.losses.append(_step(model, optimizer, x, y, config)[0])
    if cuda:
        run.peak_gib = torch.cuda.max_memory_allocated(config.device) / 2**30
    return run


def fastest_steps(config: TrainConfig, tokens: torch.Tensor, vocab_size: int,
                  repeats: int = TIMED_REPEATS) -> dict[str, float]:
    """Seconds of each side's fastest training step: both models built, one warm-up step each,
    then `repeats` steps each taking turns (the order alternating), on the same batch."""
    sides = {name: _model(name, config, vocab_size) for name in ("naive", "flashkit")}
    generator = torch.Generator().manual_seed(config.seed)
    x, y = (t.to(config.device) for t in corpus.random_batch(tokens, config.batch,
                                                              config.seqlen, generator))
    times = {name: [] for name in sides}
    for repeat in range(repeats + 1):
        for name in (sides if repeat % 2 else reversed(list(sides))):
            seconds = _step(*sides[name], x, y, config)[1]
            if repeat:  # the first round warms up
                times[name].append(seconds)
    return {name: min(values) for name, values in times.items()}


def fastest_steps_or_oom(config: TrainConfig, tokens: torch.Tensor,
                         vocab_size: int) -> dict[str, float] | None:
    """fastest_steps, or None when the two models do not fit side by side (no speed-up then)."""
    try:
        return fastest_steps(config, tokens, vocab_size)
    except Exception as error:  # noqa: BLE001 - only an OOM is caught; the rest re-raises
        if not is_out_of_memory(error):
            raise
    gc.collect()
    if config.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return None


def train_or_oom(attention: str, config: TrainConfig, tokens: torch.Tensor,
                 vocab_size: int) -> Run:
    """train_once, except that running out of memory is a result (naive attention at long
    sequences), reported as an empty Run with the error, not a crash."""
    try:
        return train_once(attention, config, tokens, vocab_size)
    except Exception as error:  # noqa: BLE001 - only an OOM is caught; the rest re-raises
        if not is_out_of_memory(error):
            raise
        note = str(error).splitlines()[0][:200]
    # Outside the except block, so the traceback's references to the model are gone.
    gc.collect()
    if config.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return Run(attention, config.seqlen, oom=note)


def compare(naive: Run, flash: Run, config: TrainConfig,
            fastest: dict[str, float] | None) -> dict:
    """Max |loss difference| (at step 0 and overall), tokens/s, and flashkit's speed-up from
    `fastest` (fastest_steps; None when either side ran out of memory): what a side that ran out
    of memory cannot give is None."""
    tokens_per_step = config.batch * config.seqlen
    both = not (naive.oom or flash.oom)
    deltas = [abs(a - b) for a, b in zip(naive.losses, flash.losses, strict=True)] if both else []
    side = lambda run, value: None if run.oom else value(run)
    rate = lambda name: tokens_per_step / fastest[name] if fastest else None
    return {"seqlen": config.seqlen, "step0_delta": deltas[0] if both else None,
            "max_delta": max(deltas) if both else None,
            "final_loss_naive": side(naive, lambda r: r.losses[-1]),
            "final_loss_flashkit": side(flash, lambda r: r.losses[-1]),
            "tokens_per_s_naive": rate("naive"), "tokens_per_s_flashkit": rate("flashkit"),
            "speedup": fastest["naive"] / fastest["flashkit"] if fastest else None,
            "peak_gib_naive": naive.peak_gib, "peak_gib_flashkit": flash.peak_gib,
            "oom_naive": naive.oom, "oom_flashkit": flash.oom}


HEADER = ["seqlen", "final loss naive", "final loss flashkit", "max loss difference",
          "tokens/s naive", "tokens/s flashkit", "speed-up"]
MEMORY_HEADER = ["peak GiB naive", "peak GiB flashkit"]


def table(comparisons: list[dict]) -> tuple[list[str], list[list]]:
    """(header, rows); the peak-memory columns appear when it was measured (CUDA). A side that
    ran out of memory reads OOM, and what needs both sides reads -."""
    with_memory = any(c["peak_gib_naive"] is not None or c["peak_gib_flashkit"] is not None
                      for c in comparisons)
    rows = []
    for c in comparisons:
        row = [c["seqlen"], _cell(c, "final_loss_naive", ".4f", "naive"),
               _cell(c, "final_loss_flashkit", ".4f", "flashkit"), _cell(c, "max_delta", ".2e"),
               _cell(c, "tokens_per_s_naive", ",.0f", "naive"),
               _cell(c, "tokens_per_s_flashkit", ",.0f", "flashkit"),
               _cell(c, "speedup", ".2f") + ("x" if c["speedup"] is not None else "")]
        if with_memory:
            row += [_cell(c, "peak_gib_naive", ".1f", "naive"),
                    _cell(c, "peak_gib_flashkit", ".1f", "flashkit")]
        rows.append(row)
    return HEADER + (MEMORY_HEADER if with_memory else []), rows


def _cell(comparison: dict, key: str, spec: str, side: str | None = None) -> str:
    """The value formatted, else OOM when that side ran out of memory, else -."""
    if comparison[key] is not None:
        return format(comparison[key], spec)
    return "OOM" if side and comparison.get(f"oom_{side}") else "-"


def plot(runs: list[tuple[Run, Run]], comparisons: list[dict], path: Path) -> Path | None:
    """One panel per seqlen: both loss curves, with max |delta| and the speed-up in the title."""
    plt = plotting.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (naive, flash), c in zip(axes[0], runs, comparisons, strict=True):
        ax.plot(naive.losses, label="naive (materialised)" + (": OOM" if naive.oom else ""),
                linewidth=3, alpha=0.5)
        ax.plot(flash.losses, label="flashkit" + (": OOM" if flash.oom else ""), linewidth=1.2,
                linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        title = f"seqlen {c['seqlen']}: "
        if c["speedup"] is None:
            title += "naive attention ran out of memory" if naive.oom else "out of memory"
        else:
            title += (f"max |delta loss| {c['max_delta']:.1e}, flashkit {c['speedup']:.2f}x "
                      "per step")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
    return plotting.save(fig, path)


def run(configs: list[TrainConfig], out: Path) -> dict:
    """Train naive and flashkit for each config (one per seqlen); print, write and plot."""
    out = results.output_dir(out)
    text = corpus.load_text()
    tokenizer = corpus.CharTokenizer(text)
    tokens = tokenizer.encode(text)
    pairs, comparisons = [], []
    for config in configs:
        naive = train_or_oom("naive", config, tokens, tokenizer.vocab_size)
        flash = train_or_oom("flashkit", config, tokens, tokenizer.vocab_size)
        pairs.append((naive, flash))
        fastest = (None if naive.oom or flash.oom
                   else fastest_steps_or_oom(config, tokens, tokenizer.vocab_size))
        comparisons.append(compare(naive, flash, config, fastest))
    header, rows = table(comparisons)
    print(f"\n{configs[0].steps} steps, same seed and batches; model {configs[0].n_layer} "
          f"layers x {configs[0].n_head} heads x {configs[0].n_embd}, {configs[0].device}:")
    print(results.text_table(header, rows))
    env = results.environment(configs[0].device)
    if results.busy_cpu_note(env) and not configs[0].device.startswith("cuda"):
        print(f"note: {results.busy_cpu_note(env)}")
    data = {"environment": env,
            "configs": [asdict(c) for c in configs], "comparisons": comparisons,
            "runs": [asdict(r) for pair in pairs for r in pair]}
    files = [results.write_json(out / "train.json", data)]
    png = plot(pairs, comparisons, out / "train.png")
    return {**data, "markdown": results.markdown_table(header, rows), "png": png,
            "files": files + ([png] if png else [])}
