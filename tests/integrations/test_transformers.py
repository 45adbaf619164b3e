"""flashkit inside Hugging Face transformers: tiny random models with left-padded batches.

The oracle of a padded batch is each sequence run alone, without padding, in float64 with
transformers' own attention ("sdpa", or "eager" for Gemma 2, whose softcap sdpa lacks); the
baseline is the same unpadded run in float32. flashkit runs the padded batch in float32, so the
comparison checks the unpad / varlen / pad-back path as well as the kernels, under the rule of
flashkit.testing (factor 2 for logits, 3 for gradients). Running each sequence alone also keeps
the oracle free of fully-masked padding rows, which transformers' eager attention turns into NaN
in float64.
"""

import pytest
import torch

from flashkit.testing import max_error

transformers = pytest.importorskip("transformers")
from flashkit.integrations.transformers import NAME, register  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
MODELS = {  # name: (config, oracle attention)
    "llama": (lambda: transformers.LlamaConfig(**TINY), "sdpa"),
    "qwen2": (lambda: transformers.Qwen2Config(**TINY), "sdpa"),
    "mistral_sliding": (lambda: transformers.MistralConfig(**TINY, sliding_window=4), "sdpa"),
    "gemma2_softcap": (lambda: transformers.Gemma2Config(
        **TINY, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=0.5,
        final_logit_softcapping=None, sliding_window=4), "eager"),
}
PAD = [3, 0, 5]  # left padding of each row
SEQLEN = 11


def _model(name, dtype, attn_implementation):
    """The tiny model `name` (the same weights every time) with the given attention, chosen at
    construction: the way every supported transformers version takes (set_attn_implementation
    on a loaded model arrived later)."""
    config, _ = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config(), attn_implementation=attn_implementation).to(dtype).eval()
    return model


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (len(PAD), SEQLEN))
    mask = torch.ones_like(ids)
    for b, p in enumerate(PAD):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _logits_and_grads(model, ids, mask, weights):
    """Logits at the valid tokens (concatenated) and the gradients of sum(weights * logits)
    with respect to every attention projection."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    valid = logits[mask.bool()]
    (valid * weights.to(valid.dtype)).sum().backward()
    grads = torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                       if "self_attn" in n and p.grad is not None])
    return valid.detach(), grads


def _alone(model, ids, mask, weights):
    """Each sequence run alone without its padding: the oracle's and the baseline's way."""
    logits, grads, start = [], 0, 0
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        n = int(keep.sum())
        l_b, g_b = _logits_and_grads(model, ids[b:b + 1, keep], mask[b:b + 1, keep],
                                     weights[start:start + n])
        logits.append(l_b)
        grads = grads + g_b
        start += n
    return torch.cat(logits), grads


def _assert_rule(what, actual, oracle, baseline, factor):
    err, base = max_error(actual, oracle), max_error(baseline, oracle)
    assert err <= factor * base + 1e-5, (
        f"{what}: max error {err:.3e} > {factor} x baseline {base:.3e} + 1e-5")


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_batch_logits_and_gradients_match_the_unpadded_oracle(name):
    oracle_impl = MODELS[name][1]
    ids, mask = _batch()
    weights = torch.randn(int(mask.sum()), 128, dtype=torch.float64)
    results = {}
    for label, dtype, impl in (("oracle", torch.float64, oracle_impl),
                               ("baseline", torch.float32, oracle_impl),
                               ("flashkit", torch.float32, register())):
        model = _model(name, dtype, impl)
        model.train()  # gradients; the tiny configs have no dropout
        run = _logits_and_grads if label == "flashkit" else _alone
        results[label] = run(model, ids, mask, weights)
    (lo, go), (lb, gb), (lf, gf) = results["oracle"], results["baseline"], results["flashkit"]
    assert torch.isfinite(lf).all() and torch.isfinite(gf).all()
    _assert_rule(f"{name} logits", lf, lo, lb, factor=2)
    _assert_rule(f"{name} attention gradients", gf, go, gb, factor=3)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generate_with_kv_cache_matches_each_sequence_alone(name):
    """float64 on both sides: a greedy token can only differ through a near tie, and float64
    leaves none at this size."""
    ids, mask = _batch()
    model = _model(name, torch.float64, MODELS[name][1])
    model.generation_config.pad_token_id = 0
    expected = []
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        out = model.generate(input_ids=ids[b:b + 1, keep], max_new_tokens=6, do_sample=False)
        expected.append(out[0, int(keep.sum()):].tolist())
    model = _model(name, torch.float64, register())
    model.generation_config.pad_token_id = 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out[:, SEQLEN:].tolist() == expected


def test_register_returns_a_name_transformers_accepts():
    name = register()
    assert name == NAME and "flash" not in name
    model = _model("llama", torch.float32, name)
    assert model.config._attn_implementation == name
    if hasattr(model, "set_attn_implementation"):  # newer transformers: a loaded model switches
        model.set_attn_implementation("sdpa")
        model.set_attn_implementation(name)
        assert model.config._attn_implementation == name
    ids, mask = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits[mask.bool()]).all()


def test_the_layers_of_a_forward_unpad_the_mask_once(monkeypatch):
    """Finding the padded tokens reads the mask on the host (a device sync on a GPU): a forward
    does it once for all its layers (they share its mask tensor), and the reuse stops when the
    mask changes in place, is another tensor or the query length differs."""
    from flashkit.integrations import transformers as integration
    found = []
    real = integration.unpad_indices
    monkeypatch.setattr(integration, "unpad_indices",
                        lambda mask: found.append(tuple(mask.shape)) or real(mask))
    ids, mask = _batch()
    model = _model("llama", torch.float32, register())
    assert model.config.num_hidden_layers == 2
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    assert found == [(3, SEQLEN)]

    found.clear()
    padding = mask.bool()
    first = integration._unpadding(padding, SEQLEN)
    assert integration._unpadding(padding, SEQLEN) is first and len(found) == 1
    decode = integration._unpadding(padding, 1)  # a decoding step's last query row
    assert found == [(3, SEQLEN), (3, SEQLEN), (3, 1)]
    assert decode[1][2] == 1 and torch.equal(decode[1][1], torch.tensor([0, 1, 2, 3]))
    padding[1, :2] = False  # in place: unpadded anew
    changed = integration._unpadding(padding, SEQLEN)
    assert len(found) == 4 and changed[0][2] == SEQLEN - 2 and changed is not first
    assert int(changed[0][1][2] - changed[0][1][1]) == SEQLEN - 2
    other = integration._unpadding(padding.clone(), SEQLEN)  # another tensor
    assert len(found) == 5 and torch.equal(other[0][0], changed[0][0])
