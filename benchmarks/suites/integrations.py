"""flashkit inside Hugging Face transformers on the GPU: a Llama-style model (hidden 2048, 16
query / 4 kv heads, 4 layers, bf16, random weights) with attn_implementation flashkit, sdpa and
eager, in one process.

- training step (forward + backward + AdamW step) on 2 x 4096 tokens: median ms;
- greedy decoding tokens/s at batch 1 and 16 (prompt 128 tokens, 128 new tokens, KV cache).

    PYTHONPATH=src python3 benchmarks/suites/integrations.py --out $OUT

Writes integrations.json and integrations.md to --out.
"""

import argparse
import json
import os
import pathlib
import platform
import time

import torch


def _model(impl):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_attn_implementation(impl)
    return model


def _median_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def train_step_ms(impl, batch=2, seqlen=4096, reps=5):
    model = _model(impl).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median_ms(step, reps), torch.cuda.max_memory_allocated() / 2**30


def decode_tokens_per_s(impl, batch, prompt=128, new=128):
    model = _model(impl).eval()
    ids = torch.randint(0, 32000, (batch, prompt), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, **kw)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return batch * new / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    import transformers

    from flashkit.integrations.transformers import register

    impls = [register(), "sdpa", "eager"]
    rows = []
    for impl in impls:
        row = {"attn_implementation": impl}
        try:
            torch.cuda.reset_peak_memory_stats()
            row["train_step_ms"], row["train_peak_gib"] = train_step_ms(impl)
            torch.cuda.empty_cache()  # the model and optimizer of the step are gone now
        except torch.OutOfMemoryError:
            row["train_step_ms"] = "out of memory"
            torch.cuda.empty_cache()
        for batch in (1, 16):
            row[f"decode_tok_s_b{batch}"] = decode_tokens_per_s(impl, batch)
        rows.append(row)
        print(row, flush=True)
    result = {
        "suite": "integrations", "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "config": "Llama-style, hidden 2048, 16 q / 4 kv heads, 4 layers, bf16, random weights; "
                  "train: 2 x 4096 tokens, AdamW step, median of 5; decode: prompt 128, "
                  "128 greedy tokens",
        "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrations.json").write_text(json.dumps(result, indent=1))
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| attn_implementation | train step ms | train peak GiB | decode tok/s b1 | "
             "decode tok/s b16 |", "|---|---|---|---|---|"]
    lines += [f"| {r['attn_implementation']} | {fmt(r['train_step_ms'])} | "
              f"{fmt(r.get('train_peak_gib', '-'))} | {fmt(r['decode_tok_s_b1'])} | "
              f"{fmt(r['decode_tok_s_b16'])} |" for r in rows]
    (out / "integrations.md").write_text(f"{result['config']}\n{result['device']}\n\n"
                                         + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
