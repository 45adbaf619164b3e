"""Hopper-only forward in Gluon (triton.experimental.gluon): explicit TMA, mbarriers and async
wgmma; forward.py dispatches here when `eligible` says so.

Notation as in common.py (whose mask predicate, tile ranges, scores and ALiBi helpers this file
calls: Gluon kernels can call those @triton.jit helpers). One consumer = one warpgroup owning
BLOCK_M = 64 query rows of one (batch, head); the accumulators live in the wgmma layout.

The pipeline (FA3's intra-warpgroup overlap, FA3 3.2): the wgmma of tile t's scores
S_t = Q K_t^T and of the previous tile's P_{t-1} V_{t-1} are issued back to back; the warps wait
for S_t alone and run its softmax while the tensor cores still work on P_{t-1} V_{t-1}, then O is
rescaled by tile t's alpha and P_t goes into the next step. After step t, O holds
sum_{i < t} P_i V_i in the scale of m_t, the running row max (log2 units) after tile t.
(In the sm_90 SASS of the d128 kernels ptxas issues the P V wait right after the S wait, so
within one consumer that overlap is lost there; two consumers taking turns still hide one's
softmax under the other's matmuls: benchmarks/NOTES_triton.md.)

K/V tiles come through TMA into a NUM_STAGES-deep ring of shared-memory buffers with a "ready"
mbarrier per buffer and tensor. Two ways to run it (SPECIALIZED, configs.gluon_forward_tile per
head dim, band and length):
  - not specialized: one consumer per program issues its own loads; a buffer is refilled after
    the consumer's wgmma that read it completed (wgmma wait, then a warpgroup barrier); two or
    three programs share an SM and drift apart, so one's softmax hides under another's matmuls.
  - specialized (gl.warp_specialize, FA3's layout): a producer warp issues every TMA load and
    CONSUMERS (1-3) warpgroups share each K/V tile (half the L2 -> shared-memory traffic per
    FLOP at two consumers); consumers release a buffer through "empty" mbarriers, so they drift
    freely.

Masking: every tile of the program's key range outside a consumer's fully visible middle
(common.key_tile_ranges) applies common.visible, which also drops keys >= seqlen_k. The
built-in features run the masked and the open tiles in loops of their own; a user's variant
runs every tile after the first in one loop that masks a tile or not as a runtime choice
(_consumer's COMPACT): two thirds of the code to compile, which a new variant's first call
waits for. TMA reads
2-D views (hopper_common.view_2d) of dense or packed varlen tokens, rows (tokens, heads * d) or
(batch * heads * seqlen, d), so a tile past a sequence's end reads the next sequence's (or
head's) rows (or zeros past the tensor): their scores are
masked to -inf, so P is 0 there, and with KEY_TAIL (varlen, or seqlen_k not a multiple of
BLOCK_N or of a block mask's blocks) the consumers zero V's rows past the end in a range's last
tile before their P V wgmma
(hopper_common.zero_tile_tail; consumers that share the tile each zero a share of its rows and
wait on the `tails` mbarrier for the others'), so NaN or inf there (0 * NaN) cannot reach the
output; query rows past seqlen_q are never stored.

Varlen (VARLEN): the grid covers the longest sequence; each program reads its sequence's first
rows and lengths (_sequence_rows) and returns past its end, so the per-sequence masks, band
alignment, ALiBi and dropout indices (sequence b as batch entry b, rows and columns within the
sequence, as forward.py's Triton varlen kernel) are the dense ones. A sequence's keys are a
(first row, length) pair, so SEQUSED_K (flash-attn's seqused_k) reads a contiguous KV cache;
PAGED reads a paged one (power-of-two pages) through its block table: each key tile's rows are
looked up per page and loaded in page-sized TMA pieces where pages are shorter than the tile
(hopper_common.kv_tile_rows, tma_load_tile). The producer looks tile t + 1's pages up while tile t
waits for its buffers, and with two consumers (SPLIT_LOADS) a second producer warp issues V's
loads: a tile of 16-key pages is 8 table loads and 32 TMA instructions (two per piece at d128),
~400 instructions per tile from one warp on a scheduler it shares with two consumer warps (d128
bf16 page 16, 2k x 18.4k: 0.94-0.96 ms, as a contiguous cache, against 1.01-1.04 with one producer
warp and no look-ahead; benchmarks/NOTES_triton.md).

Dropout draws dropout.py's keep-mask bit for bit (dropout_gluon.keep_words, through dropout.py's
own Philox core), so either backward regenerates what this forward dropped.

Eligible (see `eligible`): CUDA sm_90, fp16/bf16, head dim 64, 128 or 256 (q, k, v alike),
dense or varlen, any seqlen_q / seqlen_k, any window (causal included), softcap, ALiBi, sink,
GQA, dropout, a user's score_mod and mask_mod (flashkit.variants, called where the built-in
terms are: _softmax_step) and a dense call's block mask whose blocks hold whole tiles (the
producer and the consumers walk its lists: hopper_common.tile_start); not an SDPA bias;
q/k/v each contiguous, tokens a pitch apart (unbound from a packed qkv) or heads-major (SDPA's
memory seen through transpose(1, 2)): hopper_common.tma_layout.
Same outputs as forward.py: out in out's dtype, lse (batch, heads, seqlen_q) or varlen (heads,
total_q) float32 natural log, a row with no visible key (and no sink) gives out 0, lse -inf.
"""

from __future__ import annotations

import functools

import torch

from flashkit.ops.params import AttentionParams, lse_shape
from flashkit.ops.triton.common import (
    LOG2E,
    SOFTCAP_FAST,
    alibi_bias,
    cdiv,
    interpreting,
    key_tile_ranges,
    load_alibi_log2,
    scores,
    sequence,
    softmax_denominator,
    softmax_lse,
    softmax_start,
    variant_args,
)
from flashkit.ops.triton.configs import (
    GLUON_FORWARD,
    GLUON_FORWARD_BLOCK_MASK,
    gluon_forward_tile,
)
from flashkit.ops.triton.features import (
    SEED,
    cuts_left,
    dropout_seed,
    feature_tensors,
    kernel_features,
    tiles_in_bounds,
)
from flashkit.ops.triton.hopper_common import (
    flash_descriptor,
    modifier_tensors,
    tma_layout,
    view_geometry,
)
from flashkit.ops.triton.launch import (
    Prepared,
    device_properties,
    fold,
    planned,
    specialisation,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # a Triton without Gluon: the Triton kernel does everything
    gluon = None

BLOCK_M = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
PRODUCER_REGS = 24  # registers per thread of the producer warp (the least setmaxnreg allows)
HEAD_DIMS = (64, 128, 256)  # of every Gluon kernel
# SOFTCAP value of scores bounded tightly enough for a fixed row max (bounded_scores): no
# running max, no rescaling of O. Without a score_mod, a softcap with SOFTCAP_FAST's tanh;
# with one, the score_mod's own bound (ScoreMod.bound) and no built-in softcap.
SOFTCAP_BOUNDED = 3
# (how wide 2 B log2(e) may be for scores in [-B, B], the fixed max's offset below B log2(e))
# per P dtype; see bounded_scores.
BOUNDED_RANGE = {torch.bfloat16: (100.0, 0.0), torch.float16: (15.0, 15.0)}


if gluon is not None:
    from flashkit.ops.triton.dropout_gluon import keep_words
    from flashkit.ops.triton.hopper_common import (
        block_listing,
        bounds_flags,
        issue_kv_load,
        kv_tile_rows,
        tile_start,
        tma_load_tile,
        user_scores,
        view_origin,
        visible_with_mod,
        zero_tile_tail,
    )

    LOG2E_GL = gl.constexpr(LOG2E)
    LN2_GL = gl.constexpr(1.0 / LOG2E)
    BM = gl.constexpr(BLOCK_M)
    PRODUCER = gl.constexpr(-1)  # _partition's role of the producer warp
    PRODUCER_QK = gl.constexpr(-2)  # SPLIT_LOADS: a producer warp for Q and K
    PRODUCER_V = gl.constexpr(-3)  # and one for V
    PRODUCER_REGS_GL = gl.constexpr(PRODUCER_REGS)
    SOFTCAP_FAST_GL = gl.constexpr(SOFTCAP_FAST)
    SOFTCAP_BOUNDED_GL = gl.constexpr(SOFTCAP_BOUNDED)
    # PTX of 2^x for FMA_EXP2_EVERY registers ($4 .. $7 into $0 .. $3): the first by a degree-3
    # polynomial on the FMA pipe (x = j + f, j = round(x) by the 1.5 * 2^23 shifter, 2^f on
    # [-0.5, 0.5] with relative error 7.5e-5, j added to the exponent), the others on MUFU.
    FMA_EXP2_EVERY = gl.constexpr(4)
    FMA_EXP2_ASM = gl.constexpr(
        "{ .reg .f32 j, f, p; .reg .b32 jb, pb; "
        "add.rn.f32 j, $4, 0f4B400000; sub.rn.f32 f, j, 0f4B400000; sub.rn.f32 f, $4, f; "
        "fma.rn.f32 p, f, 0f3D61FB53, 0f3E786EE6; fma.rn.f32 p, p, f, 0f3F31798D; "
        "fma.rn.f32 p, p, f, 0f3F7FFB4A; "
        "mov.b32 jb, j; shl.b32 jb, jb, 23; mov.b32 pb, p; add.s32 $0, pb, jb; } "
        "ex2.approx.ftz.f32 $1, $5; ex2.approx.ftz.f32 $2, $6; ex2.approx.ftz.f32 $3, $7;")

    @gluon.jit
    def _exp2_fma_share(x):
        """2^x for x in [-126, 127] (no -inf: unmasked tiles only) with every 4th register on
        the FMA pipe (FA4's trick; FMA_EXP2_ASM): MUFU is what bounds a bounded softcap's
        step (64 tanh and 64 exp2 per thread at BLOCK_N 128). Every 4th measured 1.5-3%
        faster, every 2nd slower (benchmarks/NOTES_triton.md)."""
        return gl.inline_asm_elementwise(FMA_EXP2_ASM, "=r,=r,=r,=r,r,r,r,r", [x],
                                         dtype=gl.float32, is_pure=True, pack=FMA_EXP2_EVERY)

    @gluon.jit
    def _p_operand(p, kept, dtype: gl.constexpr, s_layout: gl.constexpr,
                   DROPOUT: gl.constexpr):
        """P [BLOCK_M, BLOCK_N] float32 in dtype (fp16/bf16) as the P V wgmma's A operand, and
        with DROPOUT zero where the keep-mask drops (kept: dropout_gluon.keep_words' (ge,
        byte), drawn for this tile). The two scores of a register pair (columns 2c, 2c + 1:
        the same byte of two Philox calls, the wgmma layout's first register basis) are
        converted into one 32-bit register and masked with one PRMT and one AND: PRMT's
        sign-replicating selector copies bit 8 (byte % 4) + 7 of each call's ge word into its
        half (0xFFFF or 0), so the mask costs one instruction per score, the conversion
        none more."""
        if DROPOUT:
            ge, byte = kept
            BLOCK_N: gl.constexpr = p.shape[1]
            # selector nibbles 8 | c, 8 | c (ge_lo's byte c), 8 | 4 + c twice (ge_hi's)
            ge, sel = gl.broadcast(ge, (0xCC88 + 0x1111 * (byte % 4)).to(gl.uint32))
            ge = gl.convert_layout(gl.reshape(ge, [BM, BLOCK_N]), s_layout)
            sel = gl.convert_layout(gl.reshape(sel, [BM, BLOCK_N]), s_layout)
            CVT: gl.constexpr = "cvt.rn.bf16x2.f32" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32"
            op = gl.inline_asm_elementwise(
                "{ .reg .b32 m, t; prmt.b32 m, $3, $4, $5; " + CVT
                + " t, $2, $1; and.b32 $0, t, m; }",
                "=r,r,r,r,r,r,r", [p, ge, sel], dtype=dtype.value, is_pure=True, pack=2)
        else:
            op = p.to(dtype)
        return op

    @gluon.jit
    def _softmax_step(qk, m_i, l_i, rows, cols, col0, geo, alibi, user, MASK: gl.constexpr,
                      masked_now, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, ALIBI_SIDE: gl.constexpr,
                      SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, P_DTYPE: gl.constexpr):
        """Online softmax of raw scores qk [BLOCK_M, BLOCK_N] for query rows `rows` [BLOCK_M, 1]
        and key columns `cols` = col0 + [0, BLOCK_N) as [1, BLOCK_N]. Plain scores take the row
        max on qk and scale it after (qk_scale > 0), so s - m is one FMA per element; softcap
        (without ALiBi) the same on tanh(scale qk / c), so qk_scale joins that FMA instead of
        a multiply per element. MASK applies the band predicate; a row that has seen only -inf
        then subtracts 0, not -inf. masked_now: () for MASK as it stands, or (flag,) to apply
        the predicate only where the runtime flag is set (_steps' open_tiles).

        ALiBi (alibi = (slope * log2 e, slope * log2 e * [0, BLOCK_N) as [1, BLOCK_N])): with
        ALIBI_SIDE 0 the bias is slope |i + shift - j| per element. On a tile that lies wholly
        on one side of every row's diagonal (ALIBI_SIDE +1: j <= i + shift, -1: j >= i + shift)
        it is side * slope ((i + shift - col0) - (j - col0)): a row term, which joins the row
        max after the reduction and the exp2's subtrahend, and a column term that is the same
        for every tile (alibi[1]), so the tile costs one add per element more than plain.

        SOFTCAP_BOUNDED: m_i is a fixed bound of the row's scores (_consumer, bounded_scores),
        so there is no row max and alpha is 1 (the caller skips rescaling O); the bound is the
        fast softcap's, or with SCORE_MOD the score_mod's (no built-in softcap then). No term
        of a row is then exactly 1 (a running max makes the largest one 1), so P V weighs a
        row's keys with P rounded to P_DTYPE while l sums P unrounded: a row of few keys (one:
        its v) would be off by up to a rounding of P (2^-8 in bf16). Rows of few keys lie
        in masked tiles (the mask's edges: causal rows, windows, short sequences, key tails),
        so a masked tile rounds P to P_DTYPE before l sums it, and those rows come out as
        exact as under the running max. Open tiles skip it (on every tile it measured 23%
        slower), and so do a user's variant's tiles after its first, masked or not as a
        runtime choice (masked_now; the runtime branch measured 26-28% slower): a row whose few
        keys lie there (a narrow window or mask_mod) or where one key outweighs the others by
        far keeps that key's rounding (up to one ulp of out).

        A user's modifiers (flashkit.variants; user = (off_b, off_h, score_args, mask_args,
        packing)):
        SCORE_MOD takes the whole score in natural units after the built-in terms (so no ALiBi
        side split: the caller passes ALIBI_SIDE 0), MASK_MOD joins the band predicate (the
        caller masks every tile), both as the portable kernels call them
        (hopper_common.user_scores, visible_with_mod)."""
        seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale = geo
        alibi_log2, alibi_cols = alibi
        row_bias = gl.zeros_like(m_i)  # subtracted from each row after the max (side tiles)
        BOUNDED: gl.constexpr = SOFTCAP == SOFTCAP_BOUNDED_GL
        TANH: gl.constexpr = ((0 if SCORE_MOD is not None else SOFTCAP_FAST_GL) if BOUNDED
                              else SOFTCAP)
        if TANH and not ALIBI:  # tanh(scale qk / c), scaled by qk_scale as plain qk
            s = scores(qk, 1.0, softcap_scale, TANH)
            scale = qk_scale
        elif ALIBI:
            s = scores(qk, qk_scale, softcap_scale, SOFTCAP)
            if ALIBI_SIDE == 0:
                s = s - alibi_bias(rows, cols, seqlen_q, seqlen_k, alibi_log2)
            else:
                s = s + ALIBI_SIDE * alibi_cols
                row_bias = gl.sum(rows + (seqlen_k - seqlen_q - col0), 1).to(gl.float32) * (
                    ALIBI_SIDE * alibi_log2)
            scale = 1.0
        else:
            s = qk
            scale = qk_scale
        if SCORE_MOD is not None:  # natural units in and out; log2(e) joins exp2's FMA
            s, _ = user_scores(s * (scale * LN2_GL), rows, cols, seqlen_q, seqlen_k, user,
                               SCORE_MOD, None, True)
            scale = LOG2E_GL
        if MASK:
            if len(masked_now) > 0:
                if masked_now[0]:
                    s = _masked(s, rows, cols, geo, user, HAS_LEFT, HAS_RIGHT, MASK_MOD)
            else:
                s = _masked(s, rows, cols, geo, user, HAS_LEFT, HAS_RIGHT, MASK_MOD)
        if BOUNDED:
            m_new = m_i
            alpha = gl.full_like(m_i, 1.0)
            x = s * scale - gl.expand_dims(m_i, 1)
            if MASK or SCORE_MOD is not None:  # -inf, or anything a score_mod returns
                p = gl.exp2(x)
            else:  # x in [-100, 15] (bounded_scores)
                p = _exp2_fma_share(x)
            if MASK and len(masked_now) == 0:  # the weights P V multiplies sum to exactly l
                p = p.to(P_DTYPE).to(gl.float32)
            l_new = l_i + gl.sum(p, 1)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * scale - row_bias)
            m_use = m_new
            if MASK:
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * scale - gl.expand_dims(m_use + row_bias, 1))
            alpha = gl.exp2(m_i - m_use)
            l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _masked(s, rows, cols, geo, user, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                MASK_MOD: gl.constexpr):
        """Scores s [BLOCK_M, BLOCK_N] with the pairs the band and a user's mask_mod hide at
        -inf (hopper_common.visible_with_mod)."""
        seqlen_q, seqlen_k, window_left, window_right, _, _ = geo
        keep = visible_with_mod(rows, cols, seqlen_q, seqlen_k, window_left, window_right, user,
                                HAS_LEFT, HAS_RIGHT, MASK_MOD)
        return gl.where(keep, s, float("-inf"))

    @gluon.jit
    def _release_k(k_empty, stage, SPECIALIZED: gl.constexpr):
        """This consumer's wgmma that read K buffer `stage` completed: hand it to the producer
        (the unspecialized consumer refills K and V together in _release_v)."""
        if SPECIALIZED:
            mbarrier.arrive(k_empty.index(stage), count=1)

    @gluon.jit
    def _take_turn(turns, step, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong (FA3 3.1): the consumers issue their wgmmas in turns (0, 1, .., 0, ...), so
        one's softmax runs while another's matmuls do. Consumer 0 goes first: a fresh mbarrier
        passes a wait on phase 1. Every consumer takes n_tiles + 1 turns (prologue, steps,
        epilogue)."""
        if PINGPONG:
            mbarrier.wait(turns.index(CONSUMER), (step & 1) ^ (1 if CONSUMER == 0 else 0))

    @gluon.jit
    def _pass_turn(turns, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr,
                   PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index((CONSUMER + 1) % CONSUMERS), count=1)

    @gluon.jit
    def _release_v(descs, smem, bars, tile, ring, n_tiles, key0, kv_col, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, SPECIALIZED: gl.constexpr):
        """This consumer's P V wgmma of tile `tile` (ring position ring + tile) completed: hand
        V's buffer to the producer, or (unspecialized, ring 0) refill the buffer with tile +
        NUM_STAGES after every warp is done."""
        k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails = bars
        stage = (ring + tile) % NUM_STAGES
        if SPECIALIZED:
            mbarrier.arrive(v_empty.index(stage), count=1)
        else:
            gl.thread_barrier()
            issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, tile + NUM_STAGES,
                          n_tiles, key0, (), kv_col, BLOCK_N, NUM_STAGES)

    @gluon.jit
    def _pipelined_step(ctx, state, tile, masked_now, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, SPECIALIZED: gl.constexpr,
                        CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr,
                        PINGPONG: gl.constexpr, MASK: gl.constexpr,
                        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, ALIBI_SIDE: gl.constexpr,
                        DROPOUT: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                        s_layout: gl.constexpr, o_layout: gl.constexpr,
                        p_layout: gl.constexpr):
        """S_tile and P_{tile-1} V_{tile-1} in flight together, softmax of S_tile meant to run
        under the second (see the wait below); state (acc, P, m, l) -> (acc rescaled to
        m_tile, P_tile as the next A operand, m, l). ctx: see _consumer. DROPOUT zeroes
        dropped P after l summed it (lse and l stay pre-dropout)."""
        (descs, smem, bars, q_tile, row0, rows, n_tiles, key0, key_start, listing, kv_col, geo,
         alibi, user, drop, ring, turn0) = ctx
        acc, p_op, m_i, l_i = state
        q_smem, k_smem, v_smem = smem
        q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails = bars
        stage = (ring + tile) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), ((ring + tile) // NUM_STAGES) & 1)
        prev = (ring + tile - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(prev), ((ring + tile - 1) // NUM_STAGES) & 1)
        _take_turn(turns, turn0 + tile, CONSUMER, PINGPONG)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                              gl.zeros([BM, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
        # [BLOCK_M, D] += [BLOCK_M, BLOCK_N] @ [BLOCK_N, D]
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turns, CONSUMER, CONSUMERS, PINGPONG)
        col0 = tile_start(listing, key_start, tile, BLOCK_N)
        kept = None
        if DROPOUT:  # independent of the scores; ptxas schedules it among the softmax anyway
            kept = keep_words(drop, row0, col0, BLOCK_N)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        _release_k(k_empty, stage, SPECIALIZED)
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, gl.expand_dims(cols, 0), col0,
                                           geo, alibi, user, MASK, masked_now, HAS_LEFT,
                                           HAS_RIGHT, SOFTCAP, ALIBI, ALIBI_SIDE, SCORE_MOD,
                                           MASK_MOD, q_tile.dtype)
        p_next = gl.convert_layout(_p_operand(p, kept, q_tile.dtype, s_layout, DROPOUT),
                                   p_layout)
        # The softmax results pass through the wait so that the compiler cannot sink the softmax
        # below it in the PTX. ptxas still hoists the wait's DEPBAR above most of the softmax
        # (p_next gets p_op's registers, which the P V wgmma reads until it completes), so the
        # overlap comes from the other consumer (benchmarks/NOTES_triton.md: the P V wait).
        if SOFTCAP == SOFTCAP_BOUNDED_GL:  # a fixed row max: O keeps its scale
            acc, p_op, p_next, l_i = warpgroup_mma_wait(num_outstanding=0,
                                                        deps=(o_tok, p_op, p_next, l_i))
        else:
            acc, p_op, p_next, alpha, l_i = warpgroup_mma_wait(
                num_outstanding=0, deps=(o_tok, p_op, p_next, alpha, l_i))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        _release_v((descs[1], descs[2]), smem, bars, tile - 1, ring, n_tiles, key0, kv_col,
                   BLOCK_N, NUM_STAGES, SPECIALIZED)
        return acc, p_next, m_i, l_i

    @gluon.jit
    def _steps(ctx, state, start, end, open_tiles, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, SPECIALIZED: gl.constexpr, CONSUMER: gl.constexpr,
               CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, MASK: gl.constexpr,
               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
               ALIBI: gl.constexpr, ALIBI_SIDE: gl.constexpr, DROPOUT: gl.constexpr,
               SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, s_layout: gl.constexpr,
               o_layout: gl.constexpr, p_layout: gl.constexpr):
        """_pipelined_step over tiles [start, end), one variant of masking and ALiBi side.
        open_tiles = (lo, hi): MASK only the tiles outside [lo, hi), a runtime choice per tile,
        so one copy of the step serves masked and open tiles (_consumer's COMPACT); (): MASK
        every tile or none."""
        for tile in range(start, end):
            masked_now = ()
            if len(open_tiles) > 0:
                masked_now = ((tile < open_tiles[0]) | (tile >= open_tiles[1]), )
            state = _pipelined_step(ctx, state, tile, masked_now, BLOCK_N, NUM_STAGES,
                                    SPECIALIZED, CONSUMER, CONSUMERS, PINGPONG, MASK, HAS_LEFT,
                                    HAS_RIGHT, SOFTCAP, ALIBI, ALIBI_SIDE, DROPOUT, SCORE_MOD,
                                    MASK_MOD, s_layout, o_layout, p_layout)
        return state

    @gluon.jit
    def _consumer(descs, smem, bars, scalars, ring, items, CONSUMER: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr, SPECIALIZED: gl.constexpr, PINGPONG: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                  ALIBI: gl.constexpr, SINK: gl.constexpr, DROPOUT: gl.constexpr,
                  KEY_TAIL: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr):
        """One warpgroup: query rows start_m + CONSUMER * BLOCK_M ... over the work item's key
        tiles [lo, lo + n_tiles * BLOCK_N), then out and lse of its rows. ring: the K/V tiles
        the program consumed before this item (ring buffer positions continue across a
        persistent program's items), items: its earlier items with tiles (Q's phase; each took
        n_tiles + 1 turns, so this item's turns start at ring + items). With a user's modifier
        (COMPACT) the tiles after the first run in one loop that masks a tile or not as a
        runtime choice: a MASK_MOD masks every tile; a SCORE_MOD alone leaves the visible middle
        open; under a block mask (listing, hopper_common.tile_start) the item's tiles are its
        partial blocks' (masked, MASK_MOD too), then its full blocks' (open)."""
        (out_base, lse_base, Alibi, Sink, stride_os, stride_ab, stride_ah, off_b, off_h, start_m,
         lo, n_tiles, key0, kv_col, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
         softcap_scale, row_max, seed_lo, seed_hi, dropout_threshold, dropout_scale, score_args,
         mask_args, packing, listing) = scalars
        geo = (seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale)
        SPARSE: gl.constexpr = len(listing) > 0  # a block mask's tiles (tile_start)
        # without a key tail every key column lies in the sequence: the modifiers' key
        # positions need no clamp (common.mod_positions)
        user = (off_b, off_h, score_args, mask_args, packing,
                bounds_flags(False, not KEY_TAIL))
        drop = (seed_lo, seed_hi, dropout_threshold, off_b, off_h)
        # A user's variant runs its tiles after the first in one loop, masking as a runtime
        # choice per tile: one copy of the softmax step where the built-in features' separate
        # masked and open loops take two or three. The forward's compile is a new variant's
        # critical path to its first call, and its time follows those copies.
        COMPACT: gl.constexpr = SCORE_MOD is not None or MASK_MOD is not None or SPARSE
        ALIBI_SIDES: gl.constexpr = ALIBI and not COMPACT
        q_smem, k_smem, v_smem = smem
        q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails = bars
        dtype: gl.constexpr = q_smem.dtype

        # Accumulators in the wgmma layout: warps stacked along the rows, 16 rows per warp.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        row0 = start_m + CONSUMER * BM
        rows_1d = row0 + gl.arange(0, BM, layout=row_layout)
        rows = gl.expand_dims(rows_1d, 1)
        alibi_log2 = load_alibi_log2(Alibi, off_b, off_h, stride_ab, stride_ah, ALIBI)
        alibi_cols = gl.expand_dims(
            gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)).to(gl.float32), 0
        ) * alibi_log2
        alibi = (alibi_log2, alibi_cols)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_layout)
        if SOFTCAP == SOFTCAP_BOUNDED_GL:  # the fixed row max (bounded_scores)
            m_i = gl.full([BM], 0.0, gl.float32, row_layout) + row_max
        l_i = gl.zeros([BM], gl.float32, row_layout)
        if SINK:  # the sink logit joins every row's denominator
            m_i, l_i = softmax_start(m_i, l_i, gl.load(Sink + off_h) * LOG2E_GL)
        acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)

        # Tiles [t_lo, t_hi) are fully visible from this warpgroup's rows (no mask).
        _, mid_lo, mid_hi, _ = key_tile_ranges(row0, seqlen_q, seqlen_k, window_left,
                                               window_right, BM, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        t_lo = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(mid_lo - lo, 0), BLOCK_N), n_tiles), 1)
        t_hi = gl.maximum(gl.minimum(gl.maximum((mid_hi - lo) // BLOCK_N, t_lo), n_tiles), 1)
        q_tile = q_smem.index(CONSUMER)
        turn0 = ring + items
        ctx = (descs, smem, bars, q_tile, row0, rows, n_tiles, key0, lo, listing, kv_col, geo,
               alibi, user, drop, ring, turn0)
        if n_tiles > 0:
            # Tile 0 on its own: its scores, nothing to add to O yet (masked: exact anywhere).
            first = ring % NUM_STAGES
            mbarrier.wait(q_bars.index(CONSUMER), items & 1)
            mbarrier.wait(k_ready.index(first), (ring // NUM_STAGES) & 1)
            _take_turn(turns, turn0, CONSUMER, PINGPONG)
            s_tok = warpgroup_mma(q_tile, k_smem.index(first).permute((1, 0)),
                                  gl.zeros([BM, BLOCK_N], gl.float32, s_layout), use_acc=False,
                                  is_async=True)
            _pass_turn(turns, CONSUMER, CONSUMERS, PINGPONG)
            col0 = tile_start(listing, lo, 0, BLOCK_N)
            kept = None
            if DROPOUT:
                kept = keep_words(drop, row0, col0, BLOCK_N)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            _release_k(k_empty, first, SPECIALIZED)
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, gl.expand_dims(cols, 0), col0,
                                               geo, alibi, user, True, (), HAS_LEFT, HAS_RIGHT,
                                               SOFTCAP, ALIBI, 0, SCORE_MOD, MASK_MOD, dtype)
            state = (acc, gl.convert_layout(_p_operand(p, kept, dtype, s_layout, DROPOUT),
                                            p_layout), m_i, l_i)

            if COMPACT:
                if SPARSE:  # a block mask: its partial blocks' tiles masked, its full ones open
                    open_tiles = (listing[1], n_tiles)
                elif MASK_MOD is not None:  # every tile masked
                    open_tiles = (n_tiles, n_tiles)
                else:
                    open_tiles = (t_lo, t_hi)
                state = _steps(ctx, state, 1, n_tiles, open_tiles, BLOCK_N, NUM_STAGES,
                               SPECIALIZED, CONSUMER, CONSUMERS, PINGPONG, True, HAS_LEFT,
                               HAS_RIGHT, SOFTCAP, ALIBI, 0, DROPOUT, SCORE_MOD, MASK_MOD,
                               s_layout, o_layout, p_layout)
            else:
                if HAS_LEFT:  # masked tiles left of the visible middle
                    state = _steps(ctx, state, 1, t_lo, (), BLOCK_N, NUM_STAGES, SPECIALIZED,
                                   CONSUMER, CONSUMERS, PINGPONG, True, HAS_LEFT, HAS_RIGHT,
                                   SOFTCAP, ALIBI, 0, DROPOUT, SCORE_MOD, MASK_MOD, s_layout,
                                   o_layout, p_layout)
                if ALIBI_SIDES:  # the middle by the side of the diagonal it lies on
                    shift = seqlen_k - seqlen_q
                    left_end = gl.minimum(gl.maximum(
                        gl.maximum(row0 + shift - lo + 1, 0) // BLOCK_N, t_lo), t_hi)
                    right_start = gl.minimum(gl.maximum(
                        gl.cdiv(gl.maximum(row0 + BM - 1 + shift - lo, 0), BLOCK_N), left_end),
                        t_hi)
                    state = _steps(ctx, state, t_lo, left_end, (), BLOCK_N, NUM_STAGES,
                                   SPECIALIZED, CONSUMER, CONSUMERS, PINGPONG, False, HAS_LEFT,
                                   HAS_RIGHT, SOFTCAP, ALIBI, 1, DROPOUT, SCORE_MOD, MASK_MOD,
                                   s_layout, o_layout, p_layout)
                    state = _steps(ctx, state, left_end, right_start, (), BLOCK_N, NUM_STAGES,
                                   SPECIALIZED, CONSUMER, CONSUMERS, PINGPONG, False, HAS_LEFT,
                                   HAS_RIGHT, SOFTCAP, ALIBI, 0, DROPOUT, SCORE_MOD, MASK_MOD,
                                   s_layout, o_layout, p_layout)
                    state = _steps(ctx, state, right_start, t_hi, (), BLOCK_N, NUM_STAGES,
                                   SPECIALIZED, CONSUMER, CONSUMERS, PINGPONG, False, HAS_LEFT,
                                   HAS_RIGHT, SOFTCAP, ALIBI, -1, DROPOUT, SCORE_MOD, MASK_MOD,
                                   s_layout, o_layout, p_layout)
                else:
                    state = _steps(ctx, state, t_lo, t_hi, (), BLOCK_N, NUM_STAGES, SPECIALIZED,
                                   CONSUMER, CONSUMERS, PINGPONG, False, HAS_LEFT, HAS_RIGHT,
                                   SOFTCAP, ALIBI, 0, DROPOUT, SCORE_MOD, MASK_MOD, s_layout,
                                   o_layout, p_layout)
                # diagonal, right bound, last tile
                state = _steps(ctx, state, t_hi, n_tiles, (), BLOCK_N, NUM_STAGES, SPECIALIZED,
                               CONSUMER, CONSUMERS, PINGPONG, True, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                               ALIBI, 0, DROPOUT, SCORE_MOD, MASK_MOD, s_layout, o_layout,
                               p_layout)
            acc, p_op, m_i, l_i = state
            if SPECIALIZED:  # every S wgmma of this item completed: Q's buffer is free
                mbarrier.arrive(q_empty.index(CONSUMER), count=1)

            last = (ring + n_tiles - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(last), ((ring + n_tiles - 1) // NUM_STAGES) & 1)
            if KEY_TAIL and not SPARSE:  # only the last tile can reach past the keys (a
                # block mask's calls with a key tail are one sequence: TMA reads zeros there)
                zero_tile_tail(v_smem.index(last), seqlen_k - lo - (n_tiles - 1) * BLOCK_N,
                               BLOCK_N, HEAD_DIM, CONSUMER, CONSUMERS)
                if CONSUMERS > 1:  # the other consumers' shares are zero too (phase: items)
                    mbarrier.arrive(tails, count=1)
                    mbarrier.wait(tails, items & 1)
            _take_turn(turns, turn0 + n_tiles, CONSUMER, PINGPONG)
            o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            _pass_turn(turns, CONSUMER, CONSUMERS, PINGPONG)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
            if SPECIALIZED:  # the last V buffer too: a persistent program's next item needs it
                mbarrier.arrive(v_empty.index(last), count=1)

        # A row with no visible key (and no sink) has l = 0: out 0 (acc is 0), lse -inf.
        l_safe = softmax_denominator(l_i)
        if DROPOUT:
            l_safe = l_safe / dropout_scale  # kept P were not scaled by 1 / (1 - p) yet
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        rows_o = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (out_base + gl.expand_dims(rows_o, 1).to(gl.int64) * stride_os
                  + gl.expand_dims(cols_o, 0))
        gl.store(o_ptrs, out.to(out_base.dtype.element_ty),
                 mask=gl.expand_dims(rows_o, 1) < seqlen_q)
        lse = softmax_lse(m_i, l_i > 0.0, softmax_denominator(l_i))  # (before the dropout scale)
        gl.store(lse_base + rows_1d, lse, mask=rows_1d < seqlen_q)

    @gluon.jit
    def _producer(descs, smem, bars, n_tiles, keys, listing, kv_col, q_row, q_col, ring, items,
                  CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  ROLE: gl.constexpr):
        """The producer warp, one work item: Q of every consumer once that consumer's last S of
        the program's previous item completed, then K and V tiles into the ring (positions ring ..)
        as the consumers free its buffers (a fresh mbarrier passes a wait on phase 1, so the first
        item's Q and the first NUM_STAGES tiles pass). keys: see hopper_common.kv_tile_rows;
        listing: a block mask's tiles (hopper_common.block_listing), or (). ROLE PRODUCER_QK
        loads Q and K only, PRODUCER_V V only (SPLIT_LOADS)."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails = bars
        if ROLE != PRODUCER_V:
            for c in gl.static_range(CONSUMERS):
                mbarrier.wait(q_empty.index(c), (items & 1) ^ 1, pred=n_tiles > 0)
                mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes, pred=n_tiles > 0)
                tma.async_copy_global_to_shared(q_desc, [q_row + c * BM, q_col],
                                                q_bars.index(c), q_smem.index(c),
                                                pred=n_tiles > 0)
        ROWS: gl.constexpr = k_desc.block_type.shape[0]
        if isinstance(keys, gl.tuple):  # paged: tile t + 1's block_table loads fly while tile
            rows = kv_tile_rows(keys, 0, BLOCK_N, ROWS)  # t waits for its buffers
            for tile in range(n_tiles):
                next_rows = kv_tile_rows(keys, tile + 1, BLOCK_N, ROWS)
                _produce_tile(descs, smem, bars, ring + tile, rows, kv_col, NUM_STAGES, ROLE)
                rows = next_rows
        elif len(listing) > 0:  # a block mask: tile t + 1's list entry loads while tile t waits
            key = tile_start(listing, 0, 0, BLOCK_N)
            for tile in range(n_tiles):
                next_key = tile_start(listing, 0, gl.minimum(tile + 1, n_tiles - 1), BLOCK_N)
                _produce_tile(descs, smem, bars, ring + tile,
                              kv_tile_rows(keys + key, 0, BLOCK_N, ROWS), kv_col, NUM_STAGES,
                              ROLE)
                key = next_key
        else:  # contiguous rows are arithmetic: nothing to fetch ahead
            for tile in range(n_tiles):
                _produce_tile(descs, smem, bars, ring + tile,
                              kv_tile_rows(keys, tile, BLOCK_N, ROWS), kv_col, NUM_STAGES, ROLE)

    @gluon.jit
    def _produce_tile(descs, smem, bars, position, rows, kv_col, NUM_STAGES: gl.constexpr,
                      ROLE: gl.constexpr):
        """The producer's K and V loads of ring position `position` (pieces at rows), each once
        the consumers freed its buffer (PRODUCER_QK: K only, PRODUCER_V: V only)."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails = bars
        stage = position % NUM_STAGES
        phase = (position // NUM_STAGES) & 1
        if ROLE != PRODUCER_V:
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            tma_load_tile(k_desc, k_ready.index(stage), k_smem.index(stage), rows, kv_col, True)
        if ROLE != PRODUCER_QK:
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            tma_load_tile(v_desc, v_ready.index(stage), v_smem.index(stage), rows, kv_col, True)

    @gluon.jit
    def _sequence_rows(off_b, off_h, off_hk, seqlen_q, seqlen_k, Cu_q, Cu_k, Used_k, q_geo,
                       kv_geo, VARLEN: gl.constexpr, SEQUSED_K: gl.constexpr):
        """(q_start, q_row, q_col, k_row, kv_col, seqlen_q, seqlen_k) of batch entry off_b,
        query head off_h, kv head off_hk: its first query row in out/lse's sequence dimension
        (varlen: cu_seqlens_q[b], dense: 0), the (row, column) of its first query and first key
        in the 2-D TMA views (hopper_common.view_origin; q_geo and kv_geo their
        view_geometry), and its lengths. A sequence's keys are (first row, length): varlen
        rows cu_seqlens_k[b] .. + (cu_seqlens_k[b + 1] - cu_seqlens_k[b]), or with SEQUSED_K
        + Used_k[b] (flash-attn's seqused_k: a contiguous cache (batch, capacity) flattened,
        cu_seqlens_k = b * capacity)."""
        q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                        VARLEN)
        if VARLEN and SEQUSED_K:
            seqlen_k = gl.load(Used_k + off_b)
        q_row, q_col = view_origin(q_geo, off_b, off_h, q_start, VARLEN)
        k_row, kv_col = view_origin(kv_geo, off_b, off_hk, k_start, VARLEN)
        return q_start, q_row, q_col, k_row, kv_col, seqlen_q, seqlen_k

    @gluon.jit
    def _work_item(pid_m, pid_bh, problem, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                   BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   VARLEN: gl.constexpr, SEQUSED_K: gl.constexpr):
        """Query tile pid_m (BLOCK_Q rows) of (batch, head) pid_bh: _consumer's scalars, the
        producer's loads (n_tiles, key0, kv_col, q_row, q_col) and whether the tile starts
        inside its sequence (VARLEN: no tiles past the sequence's end). key0 (kv_tile_rows' keys):
        the first key row in the 2-D view, or with paging = (Table, stride_table, page_shift)
        (a paged cache; else ()) the tuple (first key index, block_table row, key count,
        log2 page_size). blocks: a block mask's (lists, stride_b, stride_h, query rows per
        block) (else ()), lists as hopper_common.block_listing takes them: the item's tiles are
        then its mask row's listed blocks (listing, hopper_common.tile_start), not the band's."""
        (Out, Lse, Alibi, Sink, Cu_q, Cu_k, Used_k, stride_ob, stride_os, stride_oh, stride_lb,
         stride_lh, stride_ab, stride_ah, nheads, group, seqlen_q, seqlen_k, window_left,
         window_right, qk_scale, softcap_scale, row_max, seed_lo, seed_hi, dropout_threshold,
         dropout_scale, paging, score_args, mask_args, packing, blocks, q_geo, kv_geo) = problem
        off_b = pid_bh // nheads
        off_h = pid_bh % nheads
        start_m = pid_m * BLOCK_Q
        q_start, q_row0, q_col, k_row0, kv_col, seqlen_q, seqlen_k = _sequence_rows(
            off_b, off_h, off_h // group, seqlen_q, seqlen_k, Cu_q, Cu_k, Used_k, q_geo, kv_geo,
            VARLEN, SEQUSED_K)
        lo, _, _, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                       BLOCK_Q, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        listing = ()
        if len(blocks) > 0:  # the mask's row of this query tile (its blocks hold whole tiles)
            lists, stride_sb, stride_sh, block_q = blocks
            listing, n_tiles = block_listing(
                lists, off_b * stride_sb + off_h * stride_sh + start_m // block_q)
        in_sequence = start_m < seqlen_q
        if VARLEN:
            n_tiles = gl.where(in_sequence, n_tiles, 0)
        key0 = k_row0 + lo  # the item's first key row in the 2-D view
        if len(paging) > 0:
            table, stride_table, page_shift = paging
            key0 = (lo, table + off_b * stride_table, seqlen_k, page_shift)
        # row 0 of this (sequence, head) in out (.., seqlen, heads, d) and lse (.., heads, seqlen)
        out_base = Out + off_b.to(gl.int64) * stride_ob + off_h * stride_oh + q_start * stride_os
        lse_base = Lse + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + q_start
        scalars = (out_base, lse_base, Alibi, Sink, stride_os, stride_ab, stride_ah, off_b, off_h,
                   start_m, lo, n_tiles, key0, kv_col, seqlen_q, seqlen_k, window_left,
                   window_right, qk_scale, softcap_scale, row_max, seed_lo, seed_hi,
                   dropout_threshold, dropout_scale, score_args, mask_args, packing, listing)
        return scalars, (n_tiles, key0, listing, kv_col, q_row0 + start_m, q_col), in_sequence

    @gluon.jit
    def _item_tile(item, n_m, n_items, LONGEST_FIRST: gl.constexpr):
        """(query tile, batch * heads index) of a persistent program's item. Items are dealt
        round-robin (program p takes p, p + programs, ...), so their order is the schedule:
        (batch, head) after (batch, head), each's query tiles heaviest first (neighbouring
        programs share K/V in L2), or LONGEST_FIRST (a right bound: a query tile's work grows
        with its index) every head's last query tile, then every head's one before, ..., so
        the round-robin deals each program about the same work."""
        if LONGEST_FIRST:
            n_bh = n_items // n_m
            pid_m = n_m - 1 - item // n_bh
            pid_bh = item % n_bh
        else:
            pid_m = n_m - 1 - item % n_m
            pid_bh = item // n_m
        return pid_m, pid_bh

    @gluon.jit
    def _partition(descs, smem, bars, work, ROLE: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                   PINGPONG: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINK: gl.constexpr,
                   DROPOUT: gl.constexpr, KEY_TAIL: gl.constexpr, VARLEN: gl.constexpr,
                   SEQUSED_K: gl.constexpr, PERSISTENT: gl.constexpr, SCORE_MOD: gl.constexpr,
                   MASK_MOD: gl.constexpr):
        """One partition of a specialized program, consumer ROLE (0 ..) or the producer warp
        (ROLE == PRODUCER), over the program's one item (work = (scalars, loads) of
        _work_item) or, PERSISTENT, items program_id, + num_programs, ... < n_items (work =
        (problem, n_m, n_items)), with the K/V ring positions and Q phases carried over."""
        if PERSISTENT:
            problem, n_m, n_items = work
            ring = gl.to_tensor(0)
            items = gl.to_tensor(0)
            for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
                pid_m, pid_bh = _item_tile(item, n_m, n_items, HAS_RIGHT)
                scalars, loads, _ = _work_item(pid_m, pid_bh, problem, HEAD_DIM, CONSUMERS * BM,
                                               BLOCK_N, HAS_LEFT, HAS_RIGHT, VARLEN, SEQUSED_K)
                _item_partition(descs, smem, bars, scalars, loads, ring, items, ROLE, HEAD_DIM,
                                BLOCK_N, NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, SCORE_MOD, MASK_MOD)
                n_tiles = loads[0]
                ring += n_tiles
                items += (n_tiles > 0).to(gl.int32)
        else:
            scalars, loads = work
            _item_partition(descs, smem, bars, scalars, loads, 0, 0, ROLE, HEAD_DIM, BLOCK_N,
                            NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                            ALIBI, SINK, DROPOUT, KEY_TAIL, SCORE_MOD, MASK_MOD)

    @gluon.jit
    def _item_partition(descs, smem, bars, scalars, loads, ring, items, ROLE: gl.constexpr,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                        PINGPONG: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINK: gl.constexpr,
                        DROPOUT: gl.constexpr, KEY_TAIL: gl.constexpr, SCORE_MOD: gl.constexpr,
                        MASK_MOD: gl.constexpr):
        """_partition's work on one item: the producer's loads or a consumer's rows."""
        if ROLE < 0:
            n_tiles, key0, listing, kv_col, q_row, q_col = loads
            _producer(descs, smem, bars, n_tiles, key0, listing, kv_col, q_row, q_col, ring,
                      items, CONSUMERS, BLOCK_N, NUM_STAGES, ROLE)
        else:
            _consumer(descs, smem, bars, scalars, ring, items, ROLE, HEAD_DIM, BLOCK_N,
                      NUM_STAGES, CONSUMERS, True, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                      ALIBI, SINK, DROPOUT, KEY_TAIL, SCORE_MOD, MASK_MOD)

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi", "dropout_threshold", "n_items"])
    def _fwd_hopper_kernel(q_desc, k_desc, v_desc, Out, Lse, Alibi, Sink, Cu_q, Cu_k, Used_k,
                           Table, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                           stride_ab, stride_ah, nheads, group, seqlen_q, seqlen_k, window_left,
                           window_right, qk_scale, softcap_scale, row_max, seed_lo, seed_hi,
                           dropout_threshold, dropout_scale, n_items, stride_table, page_shift,
                           q_geo, kv_geo, score_args, mask_args, packing, blocks,
                           HEAD_DIM: gl.constexpr,
                           BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                           SPECIALIZED: gl.constexpr, PINGPONG: gl.constexpr,
                           PERSISTENT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINK: gl.constexpr,
                           DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
                           SEQUSED_K: gl.constexpr, KEY_TAIL: gl.constexpr,
                           PAGED: gl.constexpr, SPLIT_LOADS: gl.constexpr,
                           SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                           num_warps: gl.constexpr):
        """Work items (_work_item) of CONSUMERS * 64 query rows of one (batch, head), n_items =
        n_m * batch * heads with n_m = cdiv(seqlen_q, CONSUMERS * 64). One program per item
        (grid (n_m, batch * heads)), or PERSISTENT (specialized): about one program per SM, each
        taking items program_id, + num_programs, ..., so its producer loads the next item's Q
        and first K/V tiles while the consumers finish the last one (FA3's persistent kernel).
        q_desc/k_desc/v_desc: TMA descriptors over the 2-D views (hopper_common.view_2d: the
        flash layout's (tokens, heads * HEAD_DIM), rows a pitch apart, or a heads-major
        tensor's (batch * heads * seqlen, HEAD_DIM)), q_geo and kv_geo their view_geometry.
        VARLEN: n_m covers the longest sequence; items past a sequence's end do nothing (a
        program of one returns at once). PAGED (VARLEN with SEQUSED_K): k_desc/v_desc view a
        paged cache (num_blocks * page_size, hk * HEAD_DIM) in [min(page_size, BLOCK_N),
        HEAD_DIM] boxes, sequence b's key j in page Table[b * stride_table + (j >> page_shift)]
        (kv_tile_rows); Cu_k is not read for rows then. SPLIT_LOADS (PAGED, two consumers): two
        producer warps, one loading Q and K, one V. SCORE_MOD / MASK_MOD: a user's modifiers
        (flashkit.variants: their @triton.jit functions, captured values in score_args /
        mask_args), as _softmax_step applies them; packing: a block mask over varlen's packed
        tokens, which this call runs as one sequence ((SeqQ, Cu_q, Cu_k): the modifiers see
        each token's sequence and positions in it, hopper_common.user_scores), or (); blocks: a
        block mask's lists (_work_item; specialized programs only), or ()."""
        BLOCK_Q: gl.constexpr = CONSUMERS * BM
        paging = ()
        if PAGED:
            paging = (Table, stride_table, page_shift)
        problem = (Out, Lse, Alibi, Sink, Cu_q, Cu_k, Used_k, stride_ob, stride_os, stride_oh,
                   stride_lb, stride_lh, stride_ab, stride_ah, nheads, group, seqlen_q,
                   seqlen_k, window_left, window_right, qk_scale, softcap_scale, row_max,
                   seed_lo, seed_hi, dropout_threshold, dropout_scale, paging, score_args,
                   mask_args, packing, blocks, q_geo, kv_geo)
        if PERSISTENT:
            work = (problem, gl.cdiv(seqlen_q, BLOCK_Q), n_items)
        else:  # heaviest causal rows first
            scalars, loads, in_sequence = _work_item(
                gl.num_programs(0) - 1 - gl.program_id(0),
                gl.program_id(1) + gl.program_id(2) * gl.num_programs(1), problem, HEAD_DIM,
                BLOCK_Q, BLOCK_N, HAS_LEFT, HAS_RIGHT, VARLEN, SEQUSED_K)
            if VARLEN:  # a tile past its sequence's end has nothing to do
                if not in_sequence:
                    return
            work = (scalars, loads)
        dtype: gl.constexpr = q_desc.dtype

        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BM, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        # KEY_TAIL with several consumers: each zeroes its share of the last V tile's tail, and
        # all wait here for every share before their P V wgmma (_consumer)
        tails = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(tails, count=CONSUMERS)
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(c), count=1)
            mbarrier.init(q_empty.index(c), count=1)
            mbarrier.init(turns.index(c), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrive per consumer
            mbarrier.init(v_empty.index(i), count=CONSUMERS)

        smem = (q_smem, k_smem, v_smem)
        bars = (q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tails)
        descs = (q_desc, k_desc, v_desc)
        if SPECIALIZED:  # consumer 0 is the default partition, the others workers of 4 warps
            # (written out per count: Triton 3.6 takes no constexpr tuple in a worker's args)
            if CONSUMERS == 1:
                gl.warp_specialize([
                    (_partition, (descs, smem, bars, work, 0, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, PRODUCER, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD))],
                    [1], [PRODUCER_REGS_GL])
            elif CONSUMERS == 2 and not SPLIT_LOADS:
                gl.warp_specialize([
                    (_partition, (descs, smem, bars, work, 0, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, PRODUCER, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, 1, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD))],
                    [1, 4], [PRODUCER_REGS_GL, CONSUMER_REGS])
            else:  # three consumers, or two with SPLIT_LOADS: V's producer warp, then consumer 1
                ROLE_1: gl.constexpr = PRODUCER_QK if SPLIT_LOADS else PRODUCER
                ROLE_2: gl.constexpr = PRODUCER_V if SPLIT_LOADS else 1
                ROLE_3: gl.constexpr = 1 if SPLIT_LOADS else 2
                gl.warp_specialize([
                    (_partition, (descs, smem, bars, work, 0, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, ROLE_1, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, ROLE_2, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD)),
                    (_partition, (descs, smem, bars, work, ROLE_3, HEAD_DIM, BLOCK_N,
                                        NUM_STAGES, CONSUMERS, PINGPONG, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, ALIBI, SINK, DROPOUT, KEY_TAIL, VARLEN,
                                        SEQUSED_K, PERSISTENT, SCORE_MOD, MASK_MOD))],
                    [1, 1 if SPLIT_LOADS else 4, 4],
                    [PRODUCER_REGS_GL, PRODUCER_REGS_GL if SPLIT_LOADS else CONSUMER_REGS,
                     CONSUMER_REGS])
        else:
            scalars, loads = work  # (no block mask here: attention_forward's tile)
            n_tiles, key0, _, kv_col, q_row, q_col = loads
            mbarrier.expect(q_bars.index(0), q_desc.block_type.nbytes, pred=n_tiles > 0)
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bars.index(0),
                                            q_smem.index(0), pred=n_tiles > 0)
            for i in gl.static_range(NUM_STAGES):
                issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, i, n_tiles,
                              key0, (), kv_col, BLOCK_N, NUM_STAGES)
            _consumer(descs, smem, bars, scalars, 0, 0, 0, HEAD_DIM, BLOCK_N, NUM_STAGES,
                      CONSUMERS, SPECIALIZED, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, SINK,
                      DROPOUT, KEY_TAIL, SCORE_MOD, MASK_MOD)

        mbarrier.invalidate(tails)
        for c in gl.static_range(CONSUMERS):
            mbarrier.invalidate(q_bars.index(c))
            mbarrier.invalidate(q_empty.index(c))
            mbarrier.invalidate(turns.index(c))
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_empty.index(i))


def gluon_declines(q, k, v, params: AttentionParams, varlen: bool = False,
                   copies: bool = False) -> str | None:
    """Why the Gluon kernels (this forward, backward_hopper's backward) cannot take a call, or
    None: they need Gluon on an sm_90 GPU, non-empty fp16/bf16 q/k/v of one head dim in
    HEAD_DIMS, each read in place through a 2-D view (hopper_common.tma_layout), no bias, a
    positive scale; dense, or varlen too where the caller says it takes it (varlen=True).
    copies=True: whether they take the call with q, k and v copied into the flash layout
    (contiguous), their own layout aside. Each kernel's `declines` adds its own conditions (a
    user's modifiers among them)."""
    if gluon is None or interpreting():
        return "no Gluon (the interpreter, or a Triton without it)"
    if params.is_varlen and not varlen:
        return "varlen"
    if params.attn_bias is not None or not params.softmax_scale > 0:
        return "an attention bias or a scale <= 0"
    if not (q.is_cuda and device_properties(q.device).major == 9):
        return "not an sm_90 GPU"
    head_dim = q.shape[-1]
    if not (head_dim in HEAD_DIMS and head_dim == v.shape[-1] == k.shape[-1]):
        return f"head dims {k.shape[-1]}/{v.shape[-1]} (takes {HEAD_DIMS}, q/k/v alike)"
    if not (q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype}"
    tokens = 0 if params.is_varlen else 1  # varlen (total, h, d), dense (b, seqlen, h, d)
    if min(q.shape[tokens], k.shape[tokens]) == 0:
        return "no query or key token"
    if not copies and not all(tma_layout(x) for x in (q, k, v)):
        return ("q, k or v not readable in place (contiguous, tokens a pitch apart or "
                "heads-major, 16-byte aligned)")
    return None


def declines(q, k, v, params: AttentionParams, out, lse, tile,
             copies: bool = False) -> str | None:
    """Why this kernel does not compute the call (forward.py's kernel does), or None. It takes
    a user's score_mod, mask_mod and block mask (block_mask_declines). copies=True: the call
    with q, k and v copied into the flash layout (gluon_declines)."""
    if not GLUON_FORWARD:
        return "switched off (configs.GLUON_FORWARD)"
    if tile is not None:
        return "a Triton tile was asked for"
    why = gluon_declines(q, k, v, params, varlen=True, copies=copies)
    if why is None and not ((out is None or out.stride(-1) == 1)
                            and (lse is None or lse.stride(-1) == 1)):
        why = "out or lse has a strided last dim"
    if why is None and params.variant is not None and params.variant.block_mask is not None:
        why = block_mask_declines(q, k, params)
    return why


def block_mask_declines(q, k, params: AttentionParams) -> str | None:
    """Why this kernel does not take the call's block mask, or None: dense calls (a mask over
    varlen's packed tokens runs as one), whose mask blocks hold whole tiles
    (configs.GLUON_FORWARD_BLOCK_MASK), and whose keys fill whole key tiles unless the batch
    is one sequence: a tile past its keys then reads zeros (TMA's out-of-bounds fill), and
    the mask's partial tiles mask those keys, so no tail needs zeroing (_prepare's
    KEY_TAIL)."""
    variant = params.variant
    if params.is_varlen:
        return "a block mask with varlen's own sequences"
    block_n, _, consumers = GLUON_FORWARD_BLOCK_MASK[q.shape[-1]][:3]
    block_q, block_kv = variant.block_mask.BLOCK_SIZE
    if block_q % (BLOCK_M * consumers) or block_kv % block_n:
        return (f"block mask blocks {block_q} x {block_kv} (takes multiples of "
                f"{BLOCK_M * consumers} x {block_n} at head dim {q.shape[-1]})")
    if k.shape[1] % block_n and k.shape[0] > 1:
        return f"a block mask with seqlen_k off the {block_n}-key tiles and batch > 1"
    return None


def eligible(q, k, v, params: AttentionParams, out, lse, tile) -> bool:
    """Whether the Gluon kernel computes this call (else forward.py's kernel does)."""
    return declines(q, k, v, params, out, lse, tile) is None


def bounded_scores(params: AttentionParams, dtype, qk_scale, softcap) -> tuple[int, float]:
    """(SOFTCAP flag, row_max): SOFTCAP_BOUNDED and the fixed row max m = B - offset
    (BOUNDED_RANGE) for scores s in [-B, B] (log2 units) that fit P's dtype under it, else
    (softcap, 0.0): the running max. Without ALiBi or a sink, B is c log2(e) of a SOFTCAP_FAST
    softcap (qk_scale) with no score_mod, or bound log2(e) of a score_mod that declares a bound
    (ScoreMod.bound) with no built-in softcap; any other score_mod may move the scores
    anywhere. P = 2^(s - m): bf16 (offset 0) keeps P <= 1 like the running max and needs
    2 B <= 100 (c <= 34.6), so a row's largest P is >= 2^-100 and whatever fp32's flush to
    zero below 2^-126 drops is < 2^-26 of it; fp16 (offset 15) keeps P <= 2^15 (< 65504) and
    a row's largest P >= 1, as the running max's, with 2 B <= 15 (c <= 5.2)."""
    width, offset = BOUNDED_RANGE.get(dtype, (0.0, 0.0))
    if params.alibi_slopes is not None or params.sink is not None:
        return softcap, 0.0
    score_mod = None if params.variant is None else params.variant.score_mod
    if score_mod is None:
        bound = qk_scale if softcap == SOFTCAP_FAST else None
    else:
        bound = score_mod.bound * LOG2E if score_mod.bound is not None and not softcap else None
    if bound is None or 2 * bound > width:
        return softcap, 0.0
    return SOFTCAP_BOUNDED, bound - offset


def launch_config(tile) -> dict:
    """num_warps, maxnreg and the consumer workers' registers of a tile (BLOCK_N, NUM_STAGES,
    CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT). Specialized programs have CONSUMERS + 1
    warpgroups (the producer warp pads to one); one consumer aims at two programs per SM, more
    at one."""
    consumers, specialized = tile[2:4]
    if not specialized:
        return dict(num_warps=4, CONSUMER_REGS=0)
    warpgroups, programs = consumers + 1, (2 if consumers == 1 else 1)
    maxnreg = min(65536 // (128 * warpgroups * programs) // 8 * 8, 256)
    consumer_regs = min((maxnreg * warpgroups - PRODUCER_REGS) // consumers // 8 * 8, 240)
    return dict(num_warps=4, maxnreg=maxnreg, CONSUMER_REGS=consumer_regs)


@functools.cache
def programs_per_device(device, consumers) -> int:
    """A persistent grid: one specialized program per SM (two at one consumer)."""
    programs = 2 if consumers == 1 else 1
    return programs * device_properties(device).multi_processor_count


def attention_forward(q, k, v, params: AttentionParams, out=None, lse=None, tile=None,
                      seqused_k=None, block_table=None, plan: dict | None = None,
                      any_length: bool = False):
    """(out, lse) of an eligible call; tile overrides configs.gluon_forward_tile (the bench).
    plan: the dispatch plan's dict of prepared launches for this call's key (launch.planned).
    any_length: the plan runs dense calls of every key length (dispatch.AnyLengthForward: a
    decoding step over a cache one key longer each call); seqlen_k and kv_geo are then passed
    per call, with one prepared launch per their specialisation (launch.specialisation) and
    whether a window's left edge cuts the keys (features.cuts_left), and the k and v
    descriptors take their rows from the call's k and v.

    Varlen (params.cu_seqlens_q set): q (total_q, h, d), k/v (total_k, hk, d), out like q, lse
    (h, total_q). seqused_k (int32 (batch,), varlen only; flash-attn's name): sequence b's keys
    are rows cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b] - 1 of k/v instead of up to
    cu_seqlens_k[b + 1], e.g. a contiguous cache (batch, capacity, hk, d) passed as
    k_cache.view(-1, hk, d) with cu_seqlens_k = capacity * arange(batch + 1) (only the starts
    are read, so they may be in any order). Slots past a sequence's keys are read by TMA and
    weigh exactly 0 whatever they hold (NaN, inf: see hopper_common.zero_tile_tail).

    block_table (int32 (batch, max_blocks), with seqused_k): k/v are a paged cache (num_blocks,
    page_size, hk, d) with page_size a power of two >= 16: key j of sequence b
    is slot j % page_size of page block_table[b, j // page_size]; cu_seqlens_k is not read
    (any int32 (batch + 1,), e.g. cu_seqlens_q). Only the table entries of pages below
    seqused_k[b] are read.

    A user's modifiers (params.variant) are passed to the launch as the call's own tensors
    (their captured values, a block mask's lists: modifier_tensors), like q and k; the plan's
    key fixes their layout and the functions."""
    if out is None:  # empty_like: a third of torch.empty's host time for the same tensor
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = q.new_empty(lse_shape(q, params), dtype=torch.float32)
    varying = dropout_seed(params)
    name = "forward"
    if any_length:  # what depends on the key length: (seqlen_k, kv_geo) passed, the left
        # edge's flag compiled in
        keys = (k.shape[1], view_geometry(k))
        varying, name = (*varying, *keys), (*specialisation(keys), cuts_left(params, keys[0]))
    prepared = planned(plan, name, lambda: _prepare(q, k, v, params, out, lse, tile,
                                                    seqused_k, block_table, any_length))
    (alibi,), sink, cu_q, cu_k = feature_tensors(params, lse)
    prepared(q, k, v, out, lse, alibi, sink, cu_q, cu_k, lse if seqused_k is None else seqused_k,
             lse if block_table is None else block_table,
             *modifier_tensors(params, lse, prepared.constexprs["BLOCK_N"]), varying=varying)
    return out, lse


# The kernel's tensor parameters (descriptors, pointers and the modifiers' bundles), for
# launch's argument order
_TENSORS = ("q_desc", "k_desc", "v_desc", "Out", "Lse", "Alibi", "Sink", "Cu_q", "Cu_k", "Used_k",
            "Table", "score_args", "mask_args", "packing", "blocks")
# the scalar parameters that depend on the key length, which a plan for every key length
# passes per call (attention_forward's any_length)
_KEY_LENGTH = ("seqlen_k", "kv_geo")


def _prepare(q, k, v, params: AttentionParams, out, lse, tile, seqused_k, block_table,
             any_length: bool = False):
    """The call's launch (launch.Prepared), from what a dispatch plan's key fixes: the shapes,
    strides and dtypes of q, k, v, out and lse, params' values (its tensors' layouts, not their
    contents), the tile, and whether seqused_k and block_table are given (the table's stride).
    Its tensors: q, k, v (the descriptors' bases), out, lse, the feature tensors, seqused_k and
    block_table (lse standing in for those absent) and the modifiers' bundles
    (modifier_tensors); each call passes its dropout seed. any_length (attention_forward):
    each call passes seqlen_k and kv_geo too, the k and v descriptors are sized by the call's
    k and v, and KEY_TAIL is on (a key count that fills its last tile zeroes nothing)."""
    paged = block_table is not None
    if paged:  # (num_blocks, page_size, hk, d) -> rows (num_blocks * page_size, hk, d)
        page_size = k.shape[1]
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    f = kernel_features(params, q, v, lse, q.dtype)
    head_dim = f.head_dim
    mask = None if params.variant is None else params.variant.block_mask
    if mask is not None:
        tile = tile or GLUON_FORWARD_BLOCK_MASK[head_dim]
    tile = tile or gluon_forward_tile(head_dim, f.seqlen_q, params.window_right is not None)
    block_n, num_stages, consumers, specialized, pingpong, persistent = tile
    persistent = persistent and specialized

    # the score modifiers unbundled: _softmax_step specialises on each (a new one joins here)
    qk_scale, softcap_scale, stride_ab, stride_ah = f.score_values
    softcap, alibi = f.flags["SCORES"]
    softcap, row_max = bounded_scores(params, q.dtype, qk_scale, softcap)
    flags = dict(HAS_LEFT=f.flags["HAS_LEFT"], HAS_RIGHT=f.flags["HAS_RIGHT"],
                 SOFTCAP=softcap, ALIBI=alibi,
                 SINK=f.flags["SINK"], DROPOUT=f.flags["DROPOUT"], VARLEN=f.flags["VARLEN"])
    n_m = cdiv(f.seqlen_q, BLOCK_M * consumers)
    n_items = n_m * f.batch * f.nheads
    grid = (min(n_items, programs_per_device(q.device, consumers)), ) if persistent else (
        n_m, *fold(f.batch * f.nheads))
    box_rows, paging = None, (0, 0)
    if paged:
        box_rows = min(page_size, block_n)
        paging = (block_table.stride(0), page_size.bit_length() - 1)
    config = launch_config(tile)
    # KEY_TAIL: a key tile may reach past the keys (tiles_in_bounds); the consumers then zero
    # the tail of a range's last V tile (a block mask's tiles are listed, not a range, and its
    # calls off the key tiles are one sequence, whose tail TMA reads as zeros) and clamp the
    # key positions a modifier sees
    descriptors = {0: flash_descriptor(q, BLOCK_M), 1: flash_descriptor(k, block_n, box_rows),
                   2: flash_descriptor(v, block_n, box_rows)}
    variant = variant_args(params)[3]
    if mask is not None and (not specialized or mask.BLOCK_SIZE[1] % block_n):
        raise ValueError(f"a block mask needs a specialized tile of whole blocks, not {tile}")
    return Prepared(_fwd_hopper_kernel, grid, (
        *f.strides(out)[:3], *f.strides(lse)[:2], stride_ab, stride_ah, f.nheads,
        f.nheads // f.nheads_k, *f.band, qk_scale, softcap_scale, row_max, *f.dropout, n_items,
        *paging, view_geometry(q), view_geometry(k)), dict(
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_STAGES=num_stages, CONSUMERS=consumers,
        SPECIALIZED=specialized, PINGPONG=pingpong and consumers >= 2, PERSISTENT=persistent,
        CONSUMER_REGS=config.pop("CONSUMER_REGS"), **flags, SEQUSED_K=seqused_k is not None,
        KEY_TAIL=any_length or not tiles_in_bounds(f, params, BLOCK_M, block_n)[1],
        PAGED=paged, SPLIT_LOADS=paged and specialized and consumers == 2,
        SCORE_MOD=variant["SCORE_MOD"], MASK_MOD=variant["MASK_MOD"],
        num_warps=config.pop("num_warps")),
        _TENSORS, descriptors, SEED + (_KEY_LENGTH if any_length else ()),
        keyed=_KEY_LENGTH if any_length else (), sized=(1, 2) if any_length else (), **config)
