"""flashkit inside Hugging Face transformers: a Llama-style model (hidden 2048, 16 query / 4 kv
heads, 4 layers, bf16, random weights) with attn_implementation flashkit, sdpa and eager, in
one process, the same weights, prompt and seed for all three.

- training step (forward + backward + AdamW step) on 2 x 4096 tokens: median ms of 12 timed
  steps per implementation (after 3 warm-up steps), and the forward + backward alone the same
  way; peak memory of the step;
- greedy decoding tokens/s at batch 1 and 16: prompt 128 tokens, exactly 128 new tokens (EOS
  disabled, min_new_tokens = max_new_tokens, checked on the output), KV cache; one full warm-up
  generate per implementation (so every kv length's compiles and cuDNN plans happen before
  timing), then the median of 3 timed generates, the implementations' order rotated per round.

    PYTHONPATH=src python3 benchmarks/suites/integrations.py --out $OUT          # GPU, ~2 min
    PYTHONPATH=src python3 benchmarks/suites/integrations.py --tiny --out /tmp/i # CPU smoke run

Writes integrations.json (date, device, versions, config, rows) and integrations.md to --out.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():  # before any kernel is decorated: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the model is built from a config in code: nothing is downloaded, and nothing may be tried
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import environment  # noqa: E402

FULL = dict(hidden=2048, intermediate=5632, layers=4, heads=16, kv_heads=4, vocab=32000,
            train_batch=2, train_seqlen=4096, prompt=128, new=128, batches=(1, 16),
            warm_steps=3, timed_steps=12, timed_generates=3, dtype=torch.bfloat16)
# CPU smoke run: the same code paths at toy sizes (the Triton interpreter is slow), float32.
TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=128,
            train_batch=1, train_seqlen=32, prompt=8, new=4, batches=(1, 2),
            warm_steps=1, timed_steps=2, timed_generates=1, dtype=torch.float32)


def build_model(size: dict, device: str):
    """The Llama-style model with random weights (seed 0), EOS disabled so generate always
    produces the asked number of tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], vocab_size=size["vocab"],
        max_position_embeddings=8192, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(device, size["dtype"])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds of fn(), the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def rotations(impls: list, rounds: int):
    """The implementations in a rotated order per round (none always first)."""
    for r in range(rounds):
        yield r, impls[r % len(impls):] + impls[:r % len(impls)]


def measure_training(impls, size, device) -> dict:
    """Per implementation: median ms of the full step and of forward + backward, peak GiB."""
    model = build_model(size, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["train_batch"], size["train_seqlen"]),
                        generator=gen).to(device)

    def fwd_bwd():
        model(input_ids=ids, labels=ids).loss.backward()

    def step():
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {impl: dict(step=[], fwd_bwd=[], peak=0.0) for impl in impls}
    for impl in impls:  # warm-up: first-call compiles and autotuning stay out of the timings
        model.set_attn_implementation(impl)
        for _ in range(size["warm_steps"]):
            step()
    rounds = 2
    per_round = max(1, size["timed_steps"] // rounds)
    for _, order in rotations(impls, rounds):
        for impl in order:
            model.set_attn_implementation(impl)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(per_round):
                out[impl]["step"].append(timed(step, device) * 1e3)
                out[impl]["fwd_bwd"].append(timed(fwd_bwd, device) * 1e3)
                opt.zero_grad(set_to_none=True)
            if device == "cuda":
                peak = torch.cuda.max_memory_allocated() / 2**30
                out[impl]["peak"] = max(out[impl]["peak"], peak)
    return {impl: dict(train_step_ms=statistics.median(r["step"]),
                       train_fwd_bwd_ms=statistics.median(r["fwd_bwd"]),
                       train_samples=len(r["step"]),
                       train_peak_gib=r["peak"] if device == "cuda" else None)
            for impl, r in out.items()}


def measure_decoding(impls, size, device) -> dict:
    """Per implementation and batch: median tokens/s of greedy generate with exactly `new`
    new tokens."""
    model = build_model(size, device).eval()
    out = {impl: {} for impl in impls}
    gen = torch.Generator(device="cpu").manual_seed(2)
    for batch in size["batches"]:
        ids = torch.randint(1, size["vocab"], (batch, size["prompt"]), generator=gen).to(device)
        mask = torch.ones_like(ids)
        kw = dict(max_new_tokens=size["new"], min_new_tokens=size["new"], do_sample=False,
                  pad_token_id=0, eos_token_id=None, attention_mask=mask)

        def generate(ids=ids, kw=kw, batch=batch):
            with torch.no_grad():
                tokens = model.generate(input_ids=ids, **kw)
            if tokens.shape != (batch, size["prompt"] + size["new"]):
                raise RuntimeError(f"generate returned shape {tuple(tokens.shape)}, not "
                                   f"{(batch, size['prompt'] + size['new'])}")
            return tokens

        first = {}
        for impl in impls:  # warm-up: the same generate, every kv length once
            model.set_attn_implementation(impl)
            first[impl] = generate()
        samples = {impl: [] for impl in impls}
        for _, order in rotations(impls, size["timed_generates"]):
            for impl in order:
                model.set_attn_implementation(impl)
                samples[impl].append(timed(generate, device))
        for impl in impls:
            seconds = statistics.median(samples[impl])
            out[impl][f"decode_tok_s_b{batch}"] = batch * size["new"] / seconds
            agree = (first[impl] == first[impls[-1]]).float().mean().item()
            out[impl][f"decode_tokens_agree_b{batch}"] = round(agree, 3)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true",
                        help="toy sizes on the CPU (a smoke run of the code paths)")
    args = parser.parse_args(argv)
    import transformers

    from flashkit.integrations.transformers import register

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        parser.error("no GPU: pass --tiny for the CPU smoke run")
    size = TINY if args.tiny else FULL
    impls = [register(), "sdpa", "eager"]
    start = time.perf_counter()
    try:
        train = measure_training(impls, size, device)
    except torch.OutOfMemoryError:
        train = {impl: dict(train_step_ms="out of memory") for impl in impls}
        torch.cuda.empty_cache()
    if device == "cuda":
        torch.cuda.empty_cache()  # the training model and optimizer are gone
    train_seconds = time.perf_counter() - start
    decode = measure_decoding(impls, size, device)
    seconds = {"train": round(train_seconds, 1),
               "decode": round(time.perf_counter() - start - train_seconds, 1)}
    rows = [{"attn_implementation": impl, **train[impl], **decode[impl]} for impl in impls]
    for row in rows:
        print(row, flush=True)
    config = (f"Llama-style, hidden {size['hidden']}, {size['heads']} q / {size['kv_heads']} kv "
              f"heads, {size['layers']} layers, {str(size['dtype']).replace('torch.', '')}, "
              f"random weights; train: {size['train_batch']} x {size['train_seqlen']} tokens, "
              f"AdamW step, median of {size['timed_steps']} after {size['warm_steps']} warm-up "
              f"steps; decode: prompt {size['prompt']}, exactly {size['new']} greedy tokens, "
              f"median of {size['timed_generates']} after a warm-up generate, order rotated")
    env = environment()
    env["transformers"] = transformers.__version__
    result = {"suite": "integrations", "env": env, "config": config, "seconds": seconds,
              "rows": rows}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrations.json").write_text(json.dumps(result, indent=1, default=str))
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else str(x)  # noqa: E731
    cols = ["train_step_ms", "train_fwd_bwd_ms", "train_peak_gib"]
    cols += [f"decode_tok_s_b{b}" for b in size["batches"]]
    lines = ["| attn_implementation | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {r['attn_implementation']} | " + " | ".join(fmt(r.get(c, "-")) for c in cols)
              + " |" for r in rows]
    (out / "integrations.md").write_text(
        f"{config}\n\n{env['device']}, {env['date']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, triton {env['triton']}; measuring took {seconds['train']} s "
        f"(training) and {seconds['decode']} s (decoding)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
