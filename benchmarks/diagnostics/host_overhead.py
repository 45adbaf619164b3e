"""Host (CPU) time per call of the Gluon forward's paths, offline: sm90_probe's fake driver
compiles for sm_90 and every launch becomes a no-op, so what is timed is the Python work of a
call (arguments, checks, descriptors, Triton's binder or launch.py's key) without the driver's
launch, cuTensorMapEncode or CUDA allocations. CPU tensors stand in for CUDA ones (is_cuda and
the device queries are patched), so torch ops are CPU ones.

    PYTHONPATH=src python3 benchmarks/diagnostics/host_overhead.py [--calls 300] [--profile PATH]
        [--out x.json]

Shapes: bf16 d128, 32 query heads; dense 512 x 512 causal; the kvcache route 512 queries over a
contiguous 8k cache (7.7k filled, GQA 8:1), over its work threshold; a decoding step appends
one token to that cache (its lengths a tensor, or an int that changes every call); the
dropout forward draws with a new seed every call; varlen: the dense tokens as 4 causal
sequences of 128 (the same cu_seqlens every call), forward, step, and a forward with a causal
block mask over the packed tokens; transformers' decoding step through flash_attn_func (one
query over a DynamicCache's keys, heads-major, GQA 4:1), the same length every call and one
key longer every call, as a generated token makes it. The step is the dense call with grad, then
its backward: CPU tensors, so autograd runs the backward on the calling thread (on a GPU it
runs on autograd's device thread, which costs more: step_threads.py). The int decoding step
plans anew every call here and not on a GPU: CPU tensors take the host checks, whose
max_seqlen_k (part of the plan's key) follows the int; a CUDA call passes the capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import itertools
import json
import platform
import pstats
import sys
import time
import types

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import sm90_probe as probe  # noqa: E402


def _fake_cuda():
    probe.install_fake_driver()
    triton.runtime.driver.active.utils = _FakeUtils()
    compile_only = probe.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # a launch of the compiled kernel: a no-op
        kernel = compile_only(self, *args, grid=grid, warmup=warmup, **kwargs)
        kernel._run = _noop
        probe.COMPILED.clear()
        return kernel

    probe.JITFunction.run = run
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=132, major=9)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.Tensor.get_device = lambda self: 0
    import flashkit.api as api
    import flashkit.kvcache as kvcache
    api.require_available = kvcache.require_available = lambda name, device: None


class _Noop:
    def __call__(self, *args):
        return None


class _NoopLauncher(_Noop):
    """A CudaLauncher whose C entry launches nothing (launch.Prepared calls that entry)."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False
    launch = _Noop()


_noop = _NoopLauncher()


class _FakeUtils:
    @staticmethod
    def fill_tma_descriptor(*args):  # the encoded map's stand-in
        return args[0]


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", default=None, help="cProfile stats of each path to PATH.<name>")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _fake_cuda()
    from flashkit import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashkit.ops.params import AttentionParams
    from flashkit.ops.triton import dispatch  # the front door, with its launch plans

    bf = torch.bfloat16
    q, k, v = (torch.randn(1, 512, 32, 128, dtype=bf) for _ in range(3))
    kv_shape = (1, 8192, 8, 128)  # 512 x 8k: over the route's work threshold
    k_cache, v_cache = torch.zeros(kv_shape, dtype=bf), torch.zeros(kv_shape, dtype=bf)
    lens = torch.full((1,), 7680, dtype=torch.int32)
    params = AttentionParams(128 ** -0.5, None, 0)
    out, lse = torch.empty_like(q), torch.empty(1, 32, 512)

    seeds, steps = itertools.count(1), itertools.count()
    q1, k1, v1 = q[:, :1], k[:, :1, :8], v[:, :1, :8]

    def decode_step(int_lengths):  # one new token appended, then decoded
        lengths = 4096 + next(steps) % 2048 if int_lengths else lens
        return flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=lengths,
                                       causal=True, backend="triton")

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)

    def step():  # forward with grad + backward (autograd runs it on this thread: CPU tensors)
        return torch.autograd.grad(flash_attn_func(*leaves, causal=True, backend="triton"),
                                   leaves, dout)

    # varlen: the dense problem's 512 tokens as 4 causal sequences of 128
    cu = torch.arange(0, 513, 128, dtype=torch.int32)
    packed = [x.view(512, 32, 128) for x in (q, k, v)]
    packed_leaves = [x.detach().view(512, 32, 128).requires_grad_() for x in (q, k, v)]

    def varlen(tensors):
        return flash_attn_varlen_func(*tensors, cu, cu, 128, 128, causal=True, backend="triton")

    from flashkit import create_block_mask, variants
    packed_mask = create_block_mask(variants.causal_mask(), None, None, 512, 512, device="cpu",
                                    cu_seqlens_q=cu, cu_seqlens_k=cu)

    def varlen_block_mask():
        return flash_attn_varlen_func(*packed, cu, cu, 128, 128, block_mask=packed_mask,
                                      backend="triton")

    def varlen_step():
        return torch.autograd.grad(varlen(packed_leaves), packed_leaves, dout.view(512, 32, 128))

    # transformers' decoding through flash_attn_func: one query over a DynamicCache's keys,
    # (batch, heads_k, length, d) contiguous seen through transpose(1, 2); each step one longer
    q_step = torch.randn(1, 32, 1, 128, dtype=bf).transpose(1, 2)
    lengths = itertools.count(1024)
    # room for every call of the growing row: per_call_us makes 20 + 3 * calls, twice with
    # --profile
    cache = torch.randn(8 * (1024 + 2 * (20 + 3 * args.calls) + 100) * 128, dtype=bf)

    def cache_step(length):
        kv = cache[:8 * length * 128].view(1, 8, length, 128).transpose(1, 2)
        return flash_attn_func(q_step, kv, kv, causal=True, backend="triton")

    paths = {
        "dispatch.forward_call (the Gluon forward, planned)": lambda: dispatch.forward_call(
            q, k, v, params, out=out, lse=lse),
        "dispatch.forward_call, dropout (a new seed each call)": lambda: dispatch.forward_call(
            q, k, v, dataclasses.replace(params, dropout_p=0.1, dropout_seed=next(seeds)),
            out=out, lse=lse),
        "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True, backend="triton"),
        "flash_attn_with_kvcache, 512 queries (the prefill route)": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, causal=True, backend="triton"),
        "step (forward with grad + backward)": step,
        "flash_attn_varlen_func (4 sequences, the same cu_seqlens each call)":
            lambda: varlen(packed),
        "varlen step": varlen_step,
        "flash_attn_varlen_func, a block mask over the packed tokens": varlen_block_mask,
        "decode step (tensor cache_seqlens)": lambda: decode_step(False),
        "decode step (int cache_seqlens, a new one each call)": lambda: decode_step(True),
        "flash_attn_func, 1 query over a DynamicCache, the same 1024 keys each call":
            lambda: cache_step(1024),
        "flash_attn_func, 1 query over a DynamicCache, one key more each call":
            lambda: cache_step(next(lengths)),
    }
    import triton

    import flashkit
    result = {"env": {"device": "CPU (sm90_probe's fake driver: launches are no-ops)",
                      "cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "flashkit_path": flashkit.__file__}, "host_us": {}}
    for name, fn in paths.items():
        result["host_us"][name] = per_call_us(fn, args.calls)
        print(f"{name:55s} {result['host_us'][name]:7.1f} us per call", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(per_call_us, fn, args.calls)
            stats = pstats.Stats(prof)
            stats.dump_stats(f"{args.profile}.{len(result['host_us'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
