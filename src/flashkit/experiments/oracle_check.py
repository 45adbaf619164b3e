"""Run attention through every available backend and compare each with the float64 oracle.

The pass rule is docs/design.md section 5's (flashkit.testing): a backend computing in dtype t
passes when max|backend - oracle| <= 2 * max|naive_in_t - oracle| + 1e-5, where the oracle is
flashkit.reference in float64 and naive_in_t is the same materialised computation in dtype t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flashkit
from flashkit import reference
from flashkit.experiments.attention_methods import DTYPES
from flashkit.testing import max_error

ATOL = 1e-5


@dataclass
class Check:
    backend: str
    dtype: str
    error: float | None
    bound: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error is not None and self.error <= self.bound

    def row(self) -> list[str]:
        error = "-" if self.error is None else f"{self.error:.2e}"
        verdict = "PASS" if self.passed else ("not run" if self.error is None else "FAIL")
        return [self.backend, self.dtype, error, f"{self.bound:.2e}", verdict, self.note]


HEADER = ["backend", "dtype", "max error vs oracle", "bound", "verdict", "note"]


def backends(device: str) -> list[str]:
    """The backends that can run here: the Triton kernels only on CUDA."""
    return ["reference", "torch", "triton"] if device.startswith("cuda") else ["reference",
                                                                                "torch"]


def check_all(device: str, dtypes: list[str], batch=2, seqlen=203, nheads=4, headdim=64,
              causal=True) -> list[Check]:
    """One forward per (backend, dtype) on awkward-length random inputs, against the oracle."""
    torch.manual_seed(0)
    shape = (batch, seqlen, nheads, headdim)
    q64, k64, v64 = (torch.randn(shape, dtype=torch.float64, device=device) for _ in range(3))
    oracle = reference.attention(q64, k64, v64, causal=causal)[0]
    checks = []
    for dtype in dtypes:
        q, k, v = (t.to(DTYPES[dtype]) for t in (q64, k64, v64))
        baseline = reference.attention(q, k, v, causal=causal)[0]
        bound = 2 * max_error(baseline, oracle) + ATOL
        for backend in backends(device):
            try:
                out = flashkit.flash_attn_func(q, k, v, causal=causal, backend=backend)
                checks.append(Check(backend, dtype, max_error(out, oracle), bound))
            except Exception as error:  # noqa: BLE001 - a backend that cannot run is a result
                checks.append(Check(backend, dtype, None, bound,
                                    f"{type(error).__name__}: {error}"[:120]))
    return checks
