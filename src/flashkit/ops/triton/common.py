"""Shared @triton.jit helpers: mask predicate, tile ranges, scores, online-softmax update.

Notation (every kernel file of this backend uses it):
    i, j          query row, key column (0-based, within one sequence)
    shift         seqlen_k - seqlen_q: query i's diagonal is key column i + shift
    band          key j is visible from query i iff
                      i + shift - window_left <= j <= i + shift + window_right
                  HAS_LEFT / HAS_RIGHT say whether each side is bounded (causal: right = 0)
    s             scores in log2 units: s = (scale * log2(e)) * q . k, so exp(x) = exp2(x log2 e);
                  SOFTCAP: log2(e) c tanh(scale q . k / c); ALIBI: minus log2(e) slope |i+shift-j|.
                  fp32 inputs keep s in natural units (NATURAL: no log2(e) in the scale, sink or
                  slope; exp2((s - m) log2 e), one multiply more per score): the saved natural
                  lse then matches s as the forward rounded it, where a log2-unit lse would
                  round twice more on its way through natural units (at sharp softmax 4-7x the
                  torch backend's error in P and dV). Host: features.kernel_features; kernels:
                  NATURAL = (the q tile's dtype is fp32).
    features      compile-time flags (HAS_LEFT/HAS_RIGHT for the band, SCORES = (SOFTCAP,
                  ALIBI), SINK, DROPOUT, VARLEN: features.FLAGS, the host's one source of
                  them): a kernel compiled without one is the same code as before the feature
                  existed
    varlen        sequence b of packed tokens spans rows [cu_seqlens[b], cu_seqlens[b + 1]);
                  kernels see it as batch entry b with batch stride 0, its first row (q_start,
                  k_start) added to the base pointers and its own seqlen_q / seqlen_k
    m, l          running row max and row sum of exp2(s - m) (online softmax)
    lse           natural-log log-sum-exp as stored; lse2 = lse * log2(e) inside kernels
    *_tile        a block of a tensor in registers; *_ptrs a block of pointers; offs_* index vectors
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host side: qk_scale = softmax_scale * LOG2E
LOG2E_JIT = tl.constexpr(LOG2E)  # the same constants as kernels can read them
LN2_JIT = tl.constexpr(0.6931471805599453)
# Every tl.dot: fp32 inputs get IEEE fp32 products (exact to fp32, no tf32); bf16/fp16 dots
# ignore the setting and accumulate in fp32.
DOT_PRECISION = "ieee"


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter): launchers pick the test tiles."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """triton.cdiv of host ints (Triton 3.6's is a constexpr_function: ~1.9 us a call on the
    host, against ~0.03)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 of a host int >= 0 (0 stays 0, as Triton's), without its
    constexpr_function call (~1.9 us)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


SOFTCAP_EXACT, SOFTCAP_FAST = 1, 2  # values of the SOFTCAP flag (0: no softcap)
SOFTCAP_EXACT_JIT = tl.constexpr(SOFTCAP_EXACT)
SOFTCAP_FAST_JIT = tl.constexpr(SOFTCAP_FAST)


@triton.jit
def sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k, VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k) of batch entry off_b: with VARLEN the first rows
    of sequence off_b in the packed tokens (int64) and its lengths, else (0, 0) and the dense
    lengths as given."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(Cu_q + off_b).to(tl.int64)
        k_start = tl.load(Cu_k + off_b).to(tl.int64)
        seqlen_q = (tl.load(Cu_q + off_b + 1) - q_start).to(tl.int32)
        seqlen_k = (tl.load(Cu_k + off_b + 1) - k_start).to(tl.int32)
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def head_ptr(X, off_b, off_h, start, stride_b, stride_h, stride_s):
    """Pointer to row `start` of (batch off_b, head off_h) of X (start: a varlen sequence's
    first row, else 0)."""
    return X + off_b * stride_b + off_h * stride_h + start * stride_s


@triton.jit
def tile_ptrs(base, rows, cols, stride_r, stride_c):
    """[R, C] pointers base + rows * stride_r + cols * stride_c. The row offsets are int64: a
    row index times its stride passes 2^31 in a long sequence (2^24 rows of 8 heads x 16 dims),
    and sign-extended int32 factors make it one wide multiply, as the int32 product was."""
    return base + rows[:, None].to(tl.int64) * stride_r + cols[None, :] * stride_c


@triton.jit
def visible(i, j, seqlen_q, seqlen_k, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The mask predicate, once for every kernel: key j is in bounds and inside query i's band.

    i and j broadcast against each other ([M, 1] and [1, N], or [1, M] and [N, 1]).
    """
    diag = i + (seqlen_k - seqlen_q)
    keep = j < seqlen_k
    if HAS_LEFT:
        keep = keep & (j >= diag - window_left)
    if HAS_RIGHT:
        keep = keep & (j <= diag + window_right)
    return keep


@triton.jit
def gradient_pairs(keep, i, seqlen_q, seqlen_k, window_left, window_right,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ONE_KEY_ZERO: tl.constexpr):
    """Where a masked tile's dS may be nonzero: keep (the visible pairs, as `visible` gives
    them), less, with ONE_KEY_ZERO (no sink and no gradient on lse, either of which makes a
    row's result depend on its one score), the rows that see exactly one key. Such a row's
    softmax is the constant 1, so its scores get no gradient at all; computed, dS = P (dP - D)
    leaves the rounding of two dot products of different order (dP = dO . v_j, D = dO . O with
    O = v_j) in dq and dk. Selecting on keep also keeps a NaN dP from a value the row cannot
    see out of dS. Unmasked tiles need neither: there every row sees every key of the tile
    (>= 16). i: the rows, broadcasting like `visible`'s."""
    if not ONE_KEY_ZERO:
        pairs = keep
    else:
        diag = i + (seqlen_k - seqlen_q)
        first = i * 0  # (not zeros_like: Gluon's needs a layout; this serves both)
        last = first + (seqlen_k - 1)
        if HAS_LEFT:
            first = tl.maximum(diag - window_left, 0)
        if HAS_RIGHT:
            last = tl.minimum(diag + window_right, seqlen_k - 1)
        pairs = keep & (first != last)
    return pairs


@triton.jit
def key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left, window_right,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles seen by query rows [start_m, start_m + BLOCK_M), in three consecutive pieces.

    Returns (lo, mid_lo, mid_hi, hi), lo <= mid_lo <= mid_hi <= hi, each a multiple of BLOCK_N
    or equal to hi: tiles starting in [lo, mid_lo) and [mid_hi, hi) need the mask; tiles in
    [mid_lo, mid_hi) are in bounds and fully visible from every row of the block, so they skip
    it (FA2's off-diagonal tiles). Negative intermediate values truncate to 0 under Triton's
    C-style division, which the clamps make harmless.
    """
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(start_m + shift - window_left, 0)
        full_lo = start_m + BLOCK_M - 1 + shift - window_left
    if HAS_RIGHT:
        hi = tl.minimum(start_m + BLOCK_M + shift + window_right, seqlen_k)
        full_hi = start_m + shift + window_right + 1
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(lo, hi) // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.cdiv(tl.maximum(full_lo, lo), BLOCK_N) * BLOCK_N, hi)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi) // BLOCK_N * BLOCK_N, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def query_tile_ranges(start_n, seqlen_q, seqlen_k, window_left, window_right,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles that see key columns [start_n, start_n + BLOCK_N), as key_tile_ranges.

    Visible iff j - shift - right <= i <= j - shift + left; the unmasked middle holds the
    row tiles in bounds that see every column of the block.
    """
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(start_n - shift - window_right, 0)
        full_lo = start_n + BLOCK_N - 1 - shift - window_right
    if HAS_LEFT:
        hi = tl.minimum(start_n + BLOCK_N - shift + window_left, seqlen_q)
        full_hi = start_n - shift + window_left + 1
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(lo, hi) // BLOCK_M * BLOCK_M
    mid_lo = tl.minimum(tl.cdiv(tl.maximum(full_lo, lo), BLOCK_M) * BLOCK_M, hi)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi) // BLOCK_M * BLOCK_M, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def exp_units(x, NATURAL: tl.constexpr):
    """exp of a score difference x: exp2(x) in log2 units, exp2(x log2 e) with NATURAL."""
    if NATURAL:
        x = x * LOG2E_JIT
    return tl.math.exp2(x)


@triton.jit
def row_lse(m_i, l_safe, NATURAL: tl.constexpr):
    """The natural log-sum-exp m + log l of the running state, in either unit of m."""
    if NATURAL:
        lse = m_i + tl.math.log2(l_safe) * LN2_JIT
    else:
        lse = (m_i + tl.math.log2(l_safe)) * LN2_JIT
    return lse


@triton.jit
def online_softmax_update(m_i, l_i, s, MASKED: tl.constexpr, NATURAL: tl.constexpr = False):
    """One step of the online softmax over a [..., BLOCK_M, BLOCK_N] score tile s (log2 units)
    along its last axis; m_i, l_i: [..., BLOCK_M].

    Returns (p, alpha, m_new, l_new): p = exp2(s - m_new) and alpha = exp2(m_i - m_new), the
    factor that rescales what was accumulated before. With MASKED a row may have seen only -inf
    so far; it then subtracts 0 instead of -inf so p = 0 and nothing becomes NaN.
    """
    axis: tl.constexpr = len(s.shape) - 1
    m_new = tl.maximum(m_i, tl.max(s, axis))
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp_units(s - tl.expand_dims(m_use, axis), NATURAL)
    alpha = exp_units(m_i - m_use, NATURAL)
    l_new = l_i * alpha + tl.sum(p, axis)
    return p, alpha, m_new, l_new


@triton.jit
def masked_values_product(acc, p, s, v_tile, PRECISION: tl.constexpr):
    """acc + p @ v_tile for a masked tile ([.., BLOCK_M, BLOCK_N] @ [.., BLOCK_N, BLOCK_DV]) in
    which a key a row cannot see (s = -inf, p = 0) adds nothing even if its value is NaN or inf
    (0 * NaN would reach every row of the tile). A row that sees a non-finite value gets NaN in
    that column, as the math gives NaN or inf there. Finite tiles pay one compare and a
    reduction; unmasked tiles need none of this (every row sees every key)."""
    bad = ~(tl.abs(v_tile.to(tl.float32)) < float("inf"))  # NaN compares false
    if tl.max(bad.to(tl.int32)) > 0:
        seen = tl.where(s > float("-inf"), 1.0, 0.0).to(v_tile.dtype)
        # [.., BLOCK_M, BLOCK_DV]: how many visible keys of the row hold a non-finite value
        hits = tl.dot(seen, bad.to(v_tile.dtype), input_precision=PRECISION)
        clean = tl.where(bad, 0.0, v_tile).to(v_tile.dtype)
        acc = tl.dot(p.to(v_tile.dtype), clean, acc, input_precision=PRECISION)
        acc = tl.where(hits > 0, float("nan"), acc)
    else:
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=PRECISION)
    return acc


@triton.jit
def tanh_exact(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both tails (exp2 -> inf gives 1, -> 0 gives
    -1); exp(2x) as 2^(2 log2(e) x), one multiply before the hardware's exp2."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def tanh_hardware(x):
    """The GPU's tanh (PTX tanh.approx.f32, relative error about 2^-11): one MUFU instruction
    where tanh_exact takes an exp2 and a division. A GPU only (the interpreter runs no PTX)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def scores(qk, qk_scale, softcap_scale, SOFTCAP: tl.constexpr):
    """Scores in log2 units from raw q . k, once for every kernel.

    Plain: s = qk_scale * qk with qk_scale = scale * log2(e). SOFTCAP (softcap c > 0):
    s = qk_scale * tanh(softcap_scale * qk) with softcap_scale = scale / c and qk_scale =
    c * log2(e), i.e. log2(e) * c * tanh(scale * qk / c); tanh by the hardware's approximation
    when SOFTCAP == SOFTCAP_FAST (see features.kernel_features).
    """
    if SOFTCAP:
        x = qk * softcap_scale
        if SOFTCAP == SOFTCAP_FAST_JIT:
            t = tanh_hardware(x)
        else:
            t = tanh_exact(x)
        s = qk_scale * t
    else:
        s = qk * qk_scale
    return s


@triton.jit
def mod_indices(off_b, i, j, seqlen_q, seqlen_k, packing, PACKED: tl.constexpr):
    """(b, q_idx, kv_idx, seqlen_q, seqlen_k, same) as a modifier sees the pairs of a tile (i
    and j broadcast, [M, 1] and [1, N] or the transpose). Plain: as given. PACKED (a block mask
    over varlen's packed tokens; the kernel runs the tokens as one sequence): packing = (SeqQ,
    Cu_q, Cu_k) with SeqQ[t] the sequence of packed query t; b is the query's sequence, the
    indices and lengths are within it, the key index clamped into it (in bounds for the
    modifier's reads) and same says which keys are really in it."""
    b = off_b
    same = i == i
    if PACKED:
        SeqQ, Cu_q, Cu_k = packing
        b = tl.load(SeqQ + tl.minimum(i, seqlen_q - 1))
        q_start = tl.load(Cu_q + b)
        k_start = tl.load(Cu_k + b)
        seqlen_q = tl.load(Cu_q + b + 1) - q_start
        seqlen_k = tl.load(Cu_k + b + 1) - k_start
        same = (j >= k_start) & (j < k_start + seqlen_k)
        i = i - q_start
        j = tl.minimum(tl.maximum(j - k_start, 0), tl.maximum(seqlen_k - 1, 0))
        seqlen_k = tl.maximum(seqlen_k, 1)
    return b, i, j, seqlen_q, seqlen_k, same


@triton.jit
def mod_positions(i, j, seqlen_q, seqlen_k, QUERIES_IN: tl.constexpr, KEYS_IN: tl.constexpr):
    """The query and key positions a user modifier sees: i and j (broadcasting, [M, 1] and
    [1, N] or the transpose) clamped into the sequence, so a modifier's table reads stay in
    bounds on the padding rows and columns (which the mask drops). QUERIES_IN (KEYS_IN): the
    caller's query (key) tiles end within seqlen_q (seqlen_k), so i (j) needs no clamp, and
    consecutive positions along a tile's columns stay consecutive to the compiler (a
    modifier's reads there then load several at once)."""
    i_in = i
    j_in = j
    if not QUERIES_IN:
        i_in = tl.minimum(i, seqlen_q - 1)
    if not KEYS_IN:
        j_in = tl.minimum(j, seqlen_k - 1)
    return i_in, j_in


@triton.jit
def user_score(s, off_b, off_h, i, j, seqlen_q, seqlen_k, SCORE_MOD: tl.constexpr, score_args,
               NATURAL: tl.constexpr = False, QUERIES_IN: tl.constexpr = False,
               KEYS_IN: tl.constexpr = False):
    """A user score_mod (flashkit.variants) on log2-unit scores s (natural with NATURAL): it
    sees and returns the natural scaled score, as FlexAttention's, at the positions
    mod_positions gives."""
    i_in, j_in = mod_positions(i, j, seqlen_q, seqlen_k, QUERIES_IN, KEYS_IN)
    if NATURAL:
        s = SCORE_MOD(s, off_b, off_h, i_in, j_in, *score_args)
    else:
        s = SCORE_MOD(s * LN2_JIT, off_b, off_h, i_in, j_in, *score_args) * LOG2E_JIT
    return s


@triton.jit
def user_score_grad(s, off_b, off_h, i, j, seqlen_q, seqlen_k, SCORE_GRAD: tl.constexpr,
                    score_args, NATURAL: tl.constexpr = False,
                    QUERIES_IN: tl.constexpr = False, KEYS_IN: tl.constexpr = False):
    """d score_mod / d score at the scores s (before score_mod), units and positions as
    user_score."""
    i_in, j_in = mod_positions(i, j, seqlen_q, seqlen_k, QUERIES_IN, KEYS_IN)
    if not NATURAL:
        s = s * LN2_JIT
    return SCORE_GRAD(s, off_b, off_h, i_in, j_in, *score_args)


@triton.jit
def user_captured_grad(ds, s, off_b, off_h, i, j, seqlen_q, seqlen_k,
                       CAPTURED_GRAD: tl.constexpr, score_args, grad_args,
                       NATURAL: tl.constexpr = False, QUERIES_IN: tl.constexpr = False,
                       KEYS_IN: tl.constexpr = False):
    """A score_mod's rule for its captured tensors' gradients: CAPTURED_GRAD(ds, score, b, h,
    q_idx, kv_idx, *captured, *grads) adds into grads (float32 buffers, None for a captured
    value without one). ds [M, N] = dL / d score_mod(score) (natural units, 0 where masked),
    s the score before score_mod, units and positions as user_score."""
    i_in, j_in = mod_positions(i, j, seqlen_q, seqlen_k, QUERIES_IN, KEYS_IN)
    if not NATURAL:
        s = s * LN2_JIT
    CAPTURED_GRAD(ds, s, off_b, off_h, i_in, j_in, *score_args, *grad_args)


@triton.jit
def user_visible(off_b, off_h, i, j, seqlen_q, seqlen_k, MASK_MOD: tl.constexpr, mask_args,
                 QUERIES_IN: tl.constexpr = False, KEYS_IN: tl.constexpr = False):
    """A user mask_mod's verdict (True = visible) at the positions mod_positions gives."""
    i_in, j_in = mod_positions(i, j, seqlen_q, seqlen_k, QUERIES_IN, KEYS_IN)
    return MASK_MOD(off_b, off_h, i_in, j_in, *mask_args)


def variant_args(params):
    """(score_args, mask_args, packing, {SCORE_MOD, SCORE_GRAD, MASK_MOD, PACKED}): a user
    modifier's captured values (tuples, tensors passed as pointers), its @triton.jit functions,
    compile-time arguments (None without one), and the packing of a block mask over varlen's
    packed tokens (mod_indices; () and PACKED=False without one)."""
    variant = params.variant
    if variant is None:
        return (), (), (), dict(SCORE_MOD=None, SCORE_GRAD=None, MASK_MOD=None, PACKED=False)
    args = variant.triton_args()
    packing = args.pop("packing")
    return (args.pop("score_args"), args.pop("mask_args"), packing,
            dict(args, PACKED=bool(packing)))


def captured_grad_args(params):
    """(grad_args, {CAPTURED_GRAD}) of the backward: one float32 buffer per score_mod captured
    value whose gradient is wanted (None for the others), and the score_mod's captured_grad rule
    (None when no gradient is wanted: the rule is not compiled in)."""
    variant = params.variant
    grads = None if variant is None else variant.captured_grads
    if not grads or all(g is None for g in grads):
        return (), dict(CAPTURED_GRAD=None)
    return tuple(grads), dict(CAPTURED_GRAD=variant.score_mod.jit_captured_grad())


def block_args(params, placeholder, transposed: bool = False, mask=None):
    """(Num, Idx, FullNum, FullIdx, stride_b, stride_h, n_blocks) of the block mask (the call's,
    or `mask`, one of its BlockMasks), rows per query block (transposed: per key block, for
    dK/dV), and (SPARSE, SPARSE_Q, SPARSE_KV); without one, placeholders and SPARSE=False."""
    if mask is None:
        mask = None if params.variant is None else params.variant.block_mask
    if mask is None:
        return (placeholder,) * 4 + (0, 0, 0), dict(SPARSE=False, SPARSE_Q=1, SPARSE_KV=1)
    lists = ((mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
             if transposed else
             (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
              mask.full_kv_indices))
    num = lists[0]
    b, h, rows = num.shape
    strides = (0 if b == 1 else h * rows, 0 if h == 1 else rows)
    return (*lists, *strides, lists[1].shape[-1]), dict(
        SPARSE=True, SPARSE_Q=mask.BLOCK_SIZE[0], SPARSE_KV=mask.BLOCK_SIZE[1])


@triton.jit
def alibi_bias(i, j, seqlen_q, seqlen_k, alibi_log2):
    """What ALiBi subtracts from the log2 scores: slope * log2(e) * |i + shift - j|.

    i and j broadcast against each other ([M, 1] and [1, N], or the transpose): converted to
    float32 on their own (a vector each), their difference is one float subtract per element
    and exact (integers below 2^24), so the bias is bit for bit the integer form's with two
    operations per element fewer (no integer subtract, absolute value and conversion)."""
    diag = (i + (seqlen_k - seqlen_q)).to(tl.float32)
    return alibi_log2 * tl.abs(diag - j.to(tl.float32))


SCORE_GRAD_NONE, SCORE_GRAD_FROM_S, SCORE_GRAD_FROM_TANH = 0, 1, 2  # values of score_mod's DCAP
SCORE_GRAD_FROM_S_JIT = tl.constexpr(SCORE_GRAD_FROM_S)
SCORE_GRAD_FROM_TANH_JIT = tl.constexpr(SCORE_GRAD_FROM_TANH)


@triton.jit
def load_score_mods(ScoreTensors, score_values, off_b, heads, SCORES: tl.constexpr,
                    NATURAL: tl.constexpr = False, heads_ok=None):
    """The built-in score modifiers of one program, as score_mod takes them: mods = (qk_scale,
    softcap_scale, alibi_log2). The kernels take the modifiers as three bundles and hand them
    here unopened (features.KernelFeatures): SCORES = (SOFTCAP, ALIBI), the flags;
    score_values = (qk_scale, softcap_scale, stride_ab, stride_ah), their runtime values;
    ScoreTensors = (Alibi,), their tensors. heads: the query head of batch entry off_b, or a
    tensor of them (the decode kernel's rows, one head each, shaped as its scores' rows), in
    which case heads_ok masks the rows past the last head. A new modifier adds its values to
    the bundles (features.py), its load here and its term in score_mod."""
    qk_scale, softcap_scale, stride_ab, stride_ah = score_values
    (Alibi,) = ScoreTensors
    ALIBI: tl.constexpr = SCORES[1]
    alibi_log2 = load_alibi_log2(Alibi, off_b, heads, stride_ab, stride_ah, ALIBI, NATURAL,
                                 heads_ok)
    return qk_scale, softcap_scale, alibi_log2


@triton.jit
def score_mod(qk, i, j, band, mods, SCORES: tl.constexpr, DCAP: tl.constexpr = 0):
    """The score modification, once for every kernel: raw q . k -> log2-unit scores, in the
    order scale -> softcap -> ALiBi (the mask predicate `visible` comes after, applied by each
    kernel in its own way: -inf on s forward, 0 on P backward). Returns (s, dcap).

    band = (seqlen_q, seqlen_k, window_left, window_right) as features.KernelFeatures.band
    gives it, mods = (qk_scale, softcap_scale, alibi_log2) as load_score_mods gives them and
    SCORES = (SOFTCAP, ALIBI) the flags. i and j broadcast against each other as in `visible`.
    dcap, d(softcapped score) / d(scale * qk) for the backward (score_grad), is 1.0 unless
    SOFTCAP and DCAP: SCORE_GRAD_FROM_S takes it from s (softcap_grad: fp16 for SOFTCAP_FAST,
    fewer registers across the portable backward's matmuls), SCORE_GRAD_FROM_TANH from the
    tanh itself in fp32, with s = qk_scale * tanh left to fuse into exp2's subtraction (the
    Gluon backward: there an fp16 dcap saves no spills and costs instructions)."""
    qk_scale, softcap_scale, alibi_log2 = mods
    SOFTCAP: tl.constexpr = SCORES[0]
    ALIBI: tl.constexpr = SCORES[1]
    dcap = 1.0
    if SOFTCAP and DCAP == SCORE_GRAD_FROM_S_JIT:
        s = scores(qk, qk_scale, softcap_scale, SOFTCAP)
        dcap = softcap_grad(s, qk_scale, SOFTCAP)
    elif SOFTCAP and DCAP:
        t = scores(qk, 1.0, softcap_scale, SOFTCAP)
        s = t * qk_scale
        dcap = softcap_grad(t, 1.0)  # SOFTCAP_EXACT's fp32 (no fp16 round trip)
    else:
        s = scores(qk, qk_scale, softcap_scale, SOFTCAP)
    if ALIBI:
        seqlen_q, seqlen_k, _, _ = band
        s = s - alibi_bias(i, j, seqlen_q, seqlen_k, alibi_log2)
    return s, dcap


@triton.jit
def score_grad(ds, dcap, SCORES: tl.constexpr):
    """dL / d(scale * q . k) from ds = dL / d(modified score): times dcap (score_mod's) where
    a modifier depends on the score (SOFTCAP), else ds itself (ALiBi's term is additive)."""
    if SCORES[0]:
        ds = ds * dcap
    return ds


@triton.jit
def descaled_mods(mods, factor, SCORES: tl.constexpr):
    """mods for q . k scaled by `factor` (the FP8 forward's q_descale * k_descale), folded into
    the one multiplier score_mod applies to the raw q . k: softcap_scale under a softcap (the
    tanh's argument), else qk_scale."""
    qk_scale, softcap_scale, alibi_log2 = mods
    if SCORES[0]:
        softcap_scale = softcap_scale * factor
    else:
        qk_scale = qk_scale * factor
    return qk_scale, softcap_scale, alibi_log2


@triton.jit
def softmax_start(m_i, l_i, sink_log2):
    """The online softmax's start state with a sink (a logit per query head that joins every
    row's denominator, in log2 units): (m, l) = (sink, 1) instead of (-inf, 0). m_i, l_i: the
    empty state. m is l_i + sink (l_i is 0 there) rather than max(m_i, sink): the hardware's
    max drops a NaN operand, and a NaN sink must reach its head's rows as the math says."""
    return l_i + sink_log2, l_i + 1.0


@triton.jit
def softmax_denominator(l_i):
    """What the final online-softmax state's accumulator is divided by: out = acc / l_safe. A
    row with no mass (no visible key and no sink: l = 0) divides by 1, so its out is 0 (acc is
    0), never NaN."""
    return tl.where(l_i > 0.0, l_i, 1.0)


@triton.jit
def softmax_lse(m_i, has_mass, l_safe, NATURAL: tl.constexpr = False):
    """The natural-log log-sum-exp of the final state (m_i in log2 units, natural with NATURAL;
    has_mass = l > 0, l_safe from softmax_denominator); -inf for a row with no mass. Kernels
    compute has_mass before the output and this after it: in other orders (or with has_mass
    computed in here) the sm_90 schedules of the forward and decode kernels change."""
    if NATURAL:
        lse = m_i + tl.math.log2(l_safe) * LN2_JIT
    else:
        lse = (m_i + tl.math.log2(l_safe)) * LN2_JIT
    return tl.where(has_mass, lse, float("-inf"))


@triton.jit
def load_alibi_log2(Alibi, off_b, off_h, stride_ab, stride_ah, ALIBI: tl.constexpr,
                    NATURAL: tl.constexpr = False, heads_ok=None):
    """slope * log2(e) of (batch, head) when ALIBI (the slope itself with NATURAL), else 0
    (unused). off_h: a head, or a tensor of heads with heads_ok masking those past the last
    (their slope reads as 0)."""
    alibi_log2 = 0.0
    if ALIBI:
        if heads_ok is None:
            alibi_log2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah)
        else:
            alibi_log2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah, mask=heads_ok,
                                 other=0.0)
        if not NATURAL:
            alibi_log2 = alibi_log2 * LOG2E_JIT
    return alibi_log2


@triton.jit
def softcap_grad(s, qk_scale, SOFTCAP: tl.constexpr = SOFTCAP_EXACT_JIT):
    """d(softcapped score) / d(scale * qk) = 1 - tanh^2, from the log2 scores s of `scores`.
    SOFTCAP_FAST (fp16/bf16 inputs) returns it in fp16: it waits in registers across two
    matmuls (half the registers: measured 99 -> 75 spill loads in the d128 dK/dV kernel), and
    in [0, 1] fp16's 2^-11 relative rounding is finer than the tanh those dtypes compute."""
    t = s * (1.0 / qk_scale)
    dcap = 1.0 - t * t
    if SOFTCAP == SOFTCAP_FAST_JIT:
        dcap = dcap.to(tl.float16)
    return dcap


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr,
              CHECK_COLS: tl.constexpr):
    """Load a [..., R, C] tile (rows [..., R], cols [C]), masking rows >= n_rows and columns >=
    n_cols only where asked."""
    if CHECK_ROWS:
        row_ok = tl.expand_dims(rows, len(rows.shape)) < n_rows
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=row_ok & (cols[None, :] < n_cols), other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr,
               CHECK_COLS: tl.constexpr):
    """Store a [R, C] tile with the same masking rule as load_tile."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=cols[None, :] < n_cols)
        else:
            tl.store(ptrs, tile)
