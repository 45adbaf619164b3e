import pytest
import torch

from flashkit import reference
from flashkit.algorithms.online_attention import one_pass_attention, two_pass_attention

F64 = torch.float64
METHODS = [two_pass_attention, one_pass_attention]


@pytest.mark.parametrize("attend", METHODS)
def test_seed_worked_example(attend):
    # Scores x = [1..6] (q = [1], K[i] = [x_i], scale 1) and values v = [1..6]: o = 5.4329.
    x = torch.arange(1.0, 7.0, dtype=F64)
    o = attend(torch.ones(1, dtype=F64), x[:, None], x[:, None], scale=1.0)
    assert o.shape == (1,) and round(o.item(), 4) == 5.4329


@pytest.mark.parametrize("attend", METHODS)
@pytest.mark.parametrize("n", [1, 3, 17, 113])
@pytest.mark.parametrize("scale", [None, 3.0])  # 3.0: scores in the tens, exp would be huge
def test_matches_reference(attend, n, scale):
    gen = torch.Generator().manual_seed(n)
    d, dv = 16, 5
    q = torch.randn(d, dtype=F64, generator=gen)
    k = torch.randn(n, d, dtype=F64, generator=gen)
    v = torch.randn(n, dv, dtype=F64, generator=gen)
    expected, _ = reference.attention(q[None, None, None], k[None, :, None], v[None, :, None],
                                      softmax_scale=scale)
    torch.testing.assert_close(attend(q, k, v, scale=scale), expected[0, 0, 0],
                               rtol=1e-12, atol=1e-14)
