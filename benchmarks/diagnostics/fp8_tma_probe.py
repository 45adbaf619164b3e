"""What TMA loads and the tile would buy the FP8 forward: a feature-free FP8 forward (no mask,
no modifiers, unit descales, lengths multiples of the tile) that reads Q, K and V through TMA
descriptors, timed at several tiles against flashkit's FP8 and bf16 forwards in one process.
Needs a Hopper GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/fp8_tma_probe.py

e4m3 inputs, d128, 16 heads, 16k tokens per batch (4 x 4096 and 1 x 16384), not causal;
TFLOP/s from triton.testing.do_bench medians. The probe takes V key-major (the layout
fp8.quantize(v, key_major=True) writes); flashkit's FP8 call gets V in the flash-attn layout,
as most callers pass it, and copies it. A measurement, not a kernel flashkit runs.
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import flashkit
from flashkit import fp8
from flashkit.ops.triton.common import online_softmax_update

P_SCALE = tl.constexpr(256.0)  # P's lift to the top of e4m3 before its cast (as the FP8 kernel's)


@triton.jit
def _probe_forward(Out, desc_q, desc_k, desc_v, sm_scale, seqlen, NHEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). desc_q, desc_k over (batch *
    seqlen, nheads * d); desc_v over (batch * nheads * d, seqlen), keys contiguous."""
    off_b = tl.program_id(1) // NHEADS
    off_h = tl.program_id(1) % NHEADS
    q = desc_q.load([off_b * seqlen + tl.program_id(0) * BLOCK_M, off_h * HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2 units
    for start_n in tl.range(0, seqlen, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([off_b * seqlen + start_n, off_h * HEAD_DIM]).T  # [HEAD_DIM, BLOCK_N]
        # the FP8 kernel's own softmax step, so the loads and the tile are what differ
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, tl.dot(q, k) * qk_scale, False)
        # [BLOCK_N, HEAD_DIM] from V^T's [HEAD_DIM, BLOCK_N] tile: K-major for wgmma
        v = desc_v.load([(off_b * NHEADS + off_h) * HEAD_DIM, start_n]).T
        acc = tl.dot((p * P_SCALE).to(tl.float8e4nv), v, acc * alpha[:, None])
    acc = acc / (l_i[:, None] * P_SCALE)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    tl.store(Out + ((off_b * seqlen + rows[:, None]) * NHEADS + off_h) * HEAD_DIM + cols[None, :],
             acc.to(tl.bfloat16))


def probe(q8, k8, v8_key_major, tile):
    """A launch of the probe on (batch, seqlen, heads, d) inputs, and its output tensor."""
    batch, seqlen, nheads, head_dim = q8.shape
    block_m, block_n, num_warps, num_stages, warp_specialize = tile
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    desc_q = TensorDescriptor.from_tensor(q8.view(batch * seqlen, -1), [block_m, head_dim])
    desc_k = TensorDescriptor.from_tensor(k8.view(batch * seqlen, -1), [block_n, head_dim])
    # key_major's storage: (batch, heads, d, seqlen) with seqlen a multiple of 16 here
    v_store = v8_key_major.permute(0, 2, 3, 1)
    desc_v = TensorDescriptor.from_tensor(v_store.reshape(-1, seqlen), [head_dim, block_n])

    def run():
        _probe_forward[(seqlen // block_m, batch * nheads)](
            out, desc_q, desc_k, desc_v, head_dim ** -0.5, seqlen, nheads, head_dim, block_m,
            block_n, warp_specialize, num_warps=num_warps, num_stages=num_stages)
    return run, out


# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize)
TILES = [(128, 128, 8, 2, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False),
         (128, 128, 4, 2, False), (128, 128, 8, 4, False), (64, 128, 4, 3, False),
         (128, 128, 8, 2, True), (128, 128, 8, 3, True), (128, 64, 8, 3, False),
         (128, 256, 8, 2, False)]


def compare(seqlen: int, nheads: int = 16, head_dim: int = 128) -> None:
    """Print flashkit's bf16 and FP8 forwards and the probe at every tile, 16k tokens."""
    batch = 16384 // seqlen
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    v8_key_major = fp8.key_major_empty(v8.shape, v8.dtype, v8.device).copy_(v8)

    def tflops(ms):
        return 4 * batch * nheads * seqlen ** 2 * head_dim / ms / 1e9

    expected = flashkit.flash_attn_func(q8, k8, v8)
    bf16 = triton.testing.do_bench(lambda: flashkit.flash_attn_func(q, k, v), rep=200)
    ours = triton.testing.do_bench(lambda: flashkit.flash_attn_func(q8, k8, v8), rep=200)
    print(f"seqlen {seqlen}: flashkit bf16 {tflops(bf16):.0f}, flashkit fp8 "
          f"{tflops(ours):.0f} TFLOP/s", flush=True)
    for tile in TILES:
        try:
            run, out = probe(q8, k8, v8_key_major, tile)
            run()
            diff = (out.float() - expected.float()).abs().max().item()
            ms = triton.testing.do_bench(run, rep=200)
            print(f"  {tile}: {tflops(ms):.0f} TFLOP/s, {bf16 / ms:.2f}x bf16, max |diff| "
                  f"against flashkit fp8 {diff:.3f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a tile may not fit shared memory
            print(f"  {tile}: failed, {type(e).__name__}: {str(e)[:200]}", flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    for seqlen in (4096, 16384):
        compare(seqlen)


if __name__ == "__main__":
    main()
