"""The GPT's two attention plugs give the same model: same loss at step 0, close curves after."""

import functools

import pytest
import torch

from flashkit.experiments import corpus, train
from flashkit.models.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def runs():
    text = corpus.load_text()
    tokenizer = corpus.CharTokenizer(text)
    tokens = tokenizer.encode(text)
    config = train.TrainConfig(steps=5, batch=4, seqlen=32, n_layer=2, n_head=2, n_embd=32,
                               lr=3e-3, device="cpu")
    return [train.train_once(a, config, tokens, tokenizer.vocab_size)
            for a in ("naive", "flashkit")]


def test_same_loss_at_step_zero(runs):
    naive, flash = runs
    assert naive.losses[0] == pytest.approx(flash.losses[0], abs=1e-6)


def test_loss_curves_stay_close_and_fall(runs):
    naive, flash = runs
    assert max(abs(a - b) for a, b in zip(naive.losses, flash.losses, strict=True)) < 1e-4
    assert naive.losses[-1] < naive.losses[0]


def test_attention_layer_steps_compose():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    x = model.embed(torch.randint(0, 11, (3, 5)))
    attn = model.blocks[0].attn
    q, k, v = attn.qkv(x)
    assert q.shape == k.shape == v.shape == (3, 5, 2, 4)
    assert torch.allclose(attn.project(model.attend(q, k, v)), attn(x, model.attend))


def test_embed_places_tokens_after_a_cache_and_checks_block_size():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    idx = torch.randint(0, 11, (1, 3))
    full = model.embed(torch.cat([idx, idx], 1))
    assert torch.allclose(model.embed(idx, start=3), full[:, 3:])
    with pytest.raises(ValueError, match="block_size"):
        model.embed(idx, start=6)


def test_tokenizer_round_trips_the_text():
    text = corpus.load_text()
    tokenizer = corpus.CharTokenizer(text)
    assert tokenizer.decode(tokenizer.encode(text[:500]).tolist()) == text[:500]
    assert len(text) > 90_000 and not text.startswith("#")


def test_train_table_adds_peak_memory_when_measured():
    comparison = {"seqlen": 16, "final_loss_naive": 2.0, "final_loss_flashkit": 2.0,
                  "max_delta": 0.0, "tokens_per_s_naive": 10.0, "tokens_per_s_flashkit": 20.0,
                  "speedup": 2.0, "peak_gib_naive": None, "peak_gib_flashkit": None}
    header, _ = train.table([comparison])
    assert header == train.HEADER
    header, (row,) = train.table([{**comparison, "peak_gib_naive": 3.0,
                                   "peak_gib_flashkit": 1.0}])
    assert header[-2:] == train.MEMORY_HEADER and row[-2:] == ["3.0", "1.0"]


def test_naive_running_out_of_memory_is_a_result_not_a_crash(monkeypatch):
    real = train.train_once

    def naive_ooms(attention, config, tokens, vocab_size):
        if attention == "naive":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(attention, config, tokens, vocab_size)
    monkeypatch.setattr(train, "train_once", naive_ooms)
    config = train.TrainConfig(steps=2, batch=1, seqlen=8, n_layer=1, n_head=1, n_embd=8,
                               lr=1e-3, device="cpu")
    tokens = torch.randint(0, 5, (100,))
    naive, flash = (train.train_or_oom(a, config, tokens, 5) for a in ("naive", "flashkit"))
    assert naive.oom.startswith("CUDA out of memory") and not naive.losses
    assert len(flash.losses) == 2
    comparison = train.compare(naive, flash, config, None)
    assert comparison["speedup"] is None and comparison["final_loss_flashkit"] is not None
    _, (row,) = train.table([comparison])
    assert row[1] == "OOM" and row[3] == "-" and row[6] == "-" and row[2] != "OOM"


def test_step_times_are_the_fastest_of_interleaved_repeats(monkeypatch):
    order = []
    real = train._step

    def recording(model, optimizer, x, y, config):
        order.append("flashkit" if isinstance(model.attend, functools.partial) else "naive")
        return real(model, optimizer, x, y, config)
    monkeypatch.setattr(train, "_step", recording)
    config = train.TrainConfig(steps=2, batch=1, seqlen=8, n_layer=1, n_head=1, n_embd=8,
                               lr=1e-3, device="cpu")
    fastest = train.fastest_steps(config, torch.randint(0, 5, (100,)), 5, repeats=2)
    assert set(fastest) == {"naive", "flashkit"} and min(fastest.values()) > 0
    # One warm-up round, then two timed rounds; the order alternates from round to round.
    assert order == ["flashkit", "naive", "naive", "flashkit", "flashkit", "naive"]


def test_configs_take_the_device_defaults_and_overrides():
    (cpu,) = train.configs("cpu")
    assert (cpu.steps, cpu.seqlen) == (train.CPU_DEFAULTS.steps, 64)
    one_k, four_k = train.configs("cuda", seed=3, steps=None, n_layer=2)
    assert (one_k.seqlen, four_k.seqlen, four_k.batch) == (1024, 4096, 4)
    assert one_k.steps == 200 and one_k.n_layer == 2 and one_k.seed == 3
