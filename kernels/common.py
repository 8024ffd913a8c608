"""Helpers shared by every kernel: program prologues, masks, sequence bounds, tile ranges,
tile loads.

A kernel takes each (batch, head, token, d) tensor as a *view*, the tuple (pointer, batch
stride, head stride, token stride) (:func:`view` on the host, :func:`_tile_base` in the
kernel), the float32 row vectors as pointers sharing one (batch stride, head stride) pair
(:func:`rowvec_strides`, :func:`_row_off`), and cu_seqlens as the pair ``CU`` = (CU_Q, CU_K);
:func:`_row_program` / :func:`_kt_program` give a query-tile / key-tile program its
coordinates.

One mask implementation (:func:`_visible`) serves the forward, the first backward and
both BoB passes. :func:`_key_tile_range` / :func:`_query_tile_range` give each program
its loop bounds: tiles entirely outside the causal band / window are never visited, and
inside the loop only boundary tiles (the diagonal, the window edge, the ragged tail: those
outside [mid_lo, mid_hi)) pay for the mask, through a runtime-uniform branch. One loop per
kernel keeps register pressure lower than separate masked/unmasked loops.

The host half (``host.py``) turns dense (B, H, N, D) and varlen (T, H, D) tensors into
views, so both layouts share the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Largest head dimension the kernels accept (BLOCK_D = next power of two >= max(16, D)).
MAX_HEAD_DIM = 256
#: Every head dimension 1..256 works (masked loads along d); 16, 32, 64, 128 and 256
#: waste nothing, other sizes pad to the next power of two.
SUPPORTED_HEAD_DIMS = range(1, MAX_HEAD_DIM + 1)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: Sequence lengths, group size and window are runtime values: not specialising on them
#: (divisibility by 16, == 1) keeps one compiled kernel per dtype/head dim/mask kind.
_NO_SPECIALIZE = ["N_Q", "N_K", "GROUPS", "window"]


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _tile_base(X, b64, h64, start64):
    """Pointer to token ``start64`` of (batch ``b64``, head ``h64``) of the view ``X`` =
    (pointer, batch stride, head stride, token stride)."""
    return X[0] + b64 * X[1] + h64 * X[2] + start64 * X[3]


@triton.jit
def _tile_base_or(X, b64, h64, start64, other_base, other_stride, HAS_X: tl.constexpr):
    """(:func:`_tile_base` of the optional view ``X``, its token stride) with HAS_X; else
    (``other_base``, ``other_stride``), a placeholder for a tensor that is never read."""
    if HAS_X:
        return _tile_base(X, b64, h64, start64), X[3]
    else:
        return other_base, other_stride


@triton.jit
def _row_base(R, RS, b64, h64, start64):
    """Pointer to token ``start64`` of (batch, head) of the row vector ``R`` with strides
    ``RS`` = (batch stride, head stride)."""
    return R + b64 * RS[0] + h64 * RS[1] + start64


@triton.jit
def _row_off(RS, b64, h64, start64):
    """Offset of token ``start64`` of (batch, head) in a row vector with strides ``RS`` =
    (batch stride, head stride)."""
    return b64 * RS[0] + h64 * RS[1] + start64


@triton.jit
def _seq_info(CU, side: tl.constexpr, b, n_dense, IS_VARLEN: tl.constexpr):
    """(start token, length) of sequence ``b``: from cu_seqlens ``CU[side]`` (0: queries, 1:
    keys; CU is None for dense calls), or (0, n_dense)."""
    if IS_VARLEN:
        start = tl.load(CU[side] + b)
        n = tl.load(CU[side] + b + 1) - start
    else:
        start = b * 0
        n = n_dense + b * 0
    return start, n


@triton.jit
def _row_tile_id(CAUSAL: tl.constexpr):
    """Query-tile index of a row program. Causal: last tiles (most keys) first, so the
    longest programs start early and the tail of the launch is short."""
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        return tl.program_id(0)


@triton.jit
def _row_program(CU, N_Q, N_K, GROUPS, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """Query tile, head and sequence of a query-tile program: (m0, n_q, n_k, b64, h64, hk64,
    q_start64, k_start64); the caller returns when m0 >= n_q."""
    pid_m = _row_tile_id(CAUSAL)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU, 0, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU, 1, b, N_K, IS_VARLEN)
    return (pid_m * BLOCK_M, n_q, n_k, b.to(tl.int64), h.to(tl.int64),
            (h // GROUPS).to(tl.int64), q_start.to(tl.int64), k_start.to(tl.int64))


@triton.jit
def _kt_program(CU, N_Q, N_K, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Key tile, key head and sequence of a key-tile program: (n0, n_q, n_k, b64, hk64,
    q_start64, k_start64); the caller returns when n0 >= n_k."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU, 0, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU, 1, b, N_K, IS_VARLEN)
    return (pid_n * BLOCK_N, n_q, n_k, b.to(tl.int64), hk.to(tl.int64), q_start.to(tl.int64),
            k_start.to(tl.int64))


@triton.jit
def _tile_offsets(start, n, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, LONG: tl.constexpr):
    """The tile [start, start + BLOCK) of a program's own tokens (n of them): (offs, offs_d,
    ok, rows), its token offsets, the d offsets, which tokens exist and the row offsets for
    pointers (:func:`_rows`)."""
    offs = start + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs < n
    rows = _rows(offs, LONG)
    return offs, offs_d, ok, rows


@triton.jit
def _kt_prologue(K, V, b64, hk64, k_start64, n0, n_k, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                 LONG: tl.constexpr):
    """What every key-tile program loads first: (offs_n, offs_d, n_ok, rows_n, k, v)."""
    offs_n, offs_d, n_ok, rows_n = _tile_offsets(n0, n_k, BLOCK_N, BLOCK_D, LONG)
    k = _load_view(K, b64, hk64, k_start64, rows_n, n_ok, offs_d, HEAD_DIM, EVEN_D)
    v = _load_view(V, b64, hk64, k_start64, rows_n, n_ok, offs_d, HEAD_DIM, EVEN_D)
    return offs_n, offs_d, n_ok, rows_n, k, v


@triton.jit
def _visible(rows, cols, n_q, n_k, shift, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """True where query ``rows`` may attend to key ``cols`` (broadcastable index tensors).

    Out-of-range rows/columns are invisible. Causal is bottom-right aligned: key j is
    visible to query i iff j <= i + shift, shift = n_k - n_q; a window w also requires
    j > i + shift - w.
    """
    ok = (rows < n_q) & (cols < n_k)
    if CAUSAL:
        ok = ok & (cols <= rows + shift)
        if WINDOW:
            ok = ok & (cols > rows + shift - window)
    return ok


@triton.jit
def _floor_to(x, BLOCK: tl.constexpr):
    """Largest multiple of BLOCK <= x, for x >= 0 (negative x gives 0)."""
    x = tl.maximum(x, 0)
    return (x // BLOCK) * BLOCK


@triton.jit
def _ceil_to(x, BLOCK: tl.constexpr):
    """Smallest multiple of BLOCK >= x, for x >= 0 (negative x gives 0)."""
    x = tl.maximum(x, 0)
    return ((x + BLOCK - 1) // BLOCK) * BLOCK


@triton.jit
def _clamp_tile_range(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi) from the visible span [lo, hi) and the span [full_lo,
    full_hi) seen whole: hi >= 0, lo <= hi, and the unmasked tiles (starting at multiples of
    BLOCK) [mid_lo, mid_hi) inside [lo, hi)."""
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(lo, hi)
    mid_lo = tl.minimum(tl.maximum(_ceil_to(full_lo, BLOCK), lo), hi)
    mid_hi = tl.maximum(_floor_to(full_hi, BLOCK), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Key tiles a query tile [m0, m0 + BLOCK_M) visits: (lo, mid_lo, mid_hi, hi).

    Tiles start at multiples of BLOCK_N. Keys outside [lo, hi) are invisible to every row
    of the tile (they are skipped); tiles starting in [mid_lo, mid_hi) are visible to every
    valid row (no mask needed); the others are boundary tiles.
    Rows >= n_q are ignored: in a row program they are never stored.
    """
    m_last = tl.minimum(m0 + BLOCK_M, n_q) - 1
    hi = n_k + m0 * 0
    full_hi = n_k + m0 * 0
    lo = m0 * 0
    full_lo = m0 * 0
    if CAUSAL:
        hi = tl.minimum(hi, m_last + shift + 1)
        full_hi = tl.minimum(full_hi, m0 + shift + 1)
        if WINDOW:
            lo = _floor_to(m0 + shift - window + 1, BLOCK_N)
            full_lo = m_last + shift - window + 1
    return _clamp_tile_range(lo, full_lo, full_hi, hi, BLOCK_N)


@triton.jit
def _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Query tiles a key tile [n0, n0 + BLOCK_N) visits: (lo, mid_lo, mid_hi, hi).

    Mirror of :func:`_key_tile_range` for column programs. Tiles start at multiples of
    BLOCK_M; [mid_lo, mid_hi) holds tiles whose valid rows all see every valid key of the
    tile (and lie entirely below n_q, since rows are summed over here).
    """
    n_last = tl.minimum(n0 + BLOCK_N, n_k) - 1
    lo = n0 * 0
    full_lo = n0 * 0
    hi = n_q + n0 * 0
    full_hi = n_q + n0 * 0
    if CAUSAL:
        lo = _floor_to(n0 - shift, BLOCK_M)
        full_lo = n_last - shift
        if WINDOW:
            hi = tl.minimum(hi, n_last - shift + window)
            full_hi = tl.minimum(full_hi, n0 - shift + window)
    return _clamp_tile_range(lo, full_lo, full_hi, hi, BLOCK_M)


@triton.jit
def _rows(offs, LONG: tl.constexpr):
    """Row offsets inside one sequence, widened to int64 only when row x stride may pass 2^31.

    Kept int32 otherwise: pointers built as ``base + rows * stride`` with int32 rows (not
    loop-carried pointers) keep Triton's alignment analysis, i.e. vectorised loads and no
    register spills.
    """
    if LONG:
        return offs.to(tl.int64)
    else:
        return offs


@triton.jit
def _load_tile(base, rows, stride_row, row_ok, offs_d, HEAD_DIM: tl.constexpr,
               MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile at ``base + rows * stride_row``; rows ``row_ok``-masked
    when MASK_ROWS, d masked to HEAD_DIM unless EVEN_D."""
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _load_view(X, b64, h64, start64, rows, row_ok, offs_d, HEAD_DIM: tl.constexpr,
               EVEN_D: tl.constexpr):
    """Load the (rows, BLOCK_D) tile ``rows`` (row-masked by ``row_ok``) of (batch, head,
    sequence start) of the view ``X``."""
    return _load_tile(_tile_base(X, b64, h64, start64), rows, X[3], row_ok, offs_d, HEAD_DIM,
                      True, EVEN_D)


@triton.jit
def _store_view(X, b64, h64, start64, rows, x, row_ok, offs_d, HEAD_DIM: tl.constexpr,
                EVEN_D: tl.constexpr):
    """Store the float32 tile ``x`` in X's dtype at ``rows`` of (batch, head, sequence start)
    of the view ``X`` (rows masked by ``row_ok``)."""
    _store_tile(_tile_base(X, b64, h64, start64), rows, X[3], x.to(X[0].dtype.element_ty),
                row_ok, offs_d, HEAD_DIM, EVEN_D)


@triton.jit
def _store_tile(base, rows, stride_row, x, row_ok, offs_d, HEAD_DIM: tl.constexpr,
                EVEN_D: tl.constexpr):
    """Store a (rows, BLOCK_D) tile at ``base + rows * stride_row``, rows masked by ``row_ok``."""
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if EVEN_D:
        tl.store(ptrs, x, mask=row_ok[:, None])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _load_rowvec(base, rows, row_ok, MASK_ROWS: tl.constexpr):
    """Load float32 row-vector entries ``base + rows``."""
    if MASK_ROWS:
        x = tl.load(base + rows, mask=row_ok, other=0.0)
    else:
        x = tl.load(base + rows)
    return x


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr, SPLIT: tl.constexpr,
             TRANS_A: tl.constexpr = False):
    """acc += A @ b, A the float32 tile ``a`` (transposed with TRANS_A) rounded to b's dtype;
    with SPLIT, ``a`` enters as hi + lo (two products), which removes most of the 16-bit
    rounding of ``a``."""
    hi = a.to(b.dtype)
    if TRANS_A:
        acc = tl.dot(tl.trans(hi), b, acc, input_precision=PREC)
    else:
        acc = tl.dot(hi, b, acc, input_precision=PREC)
    if SPLIT:
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        if TRANS_A:
            acc = tl.dot(tl.trans(lo), b, acc, input_precision=PREC)
        else:
            acc = tl.dot(lo, b, acc, input_precision=PREC)
    return acc


# Key-tile programs (dK/dV, BoB column pass) hold one key tile and loop over query tiles. They
# compute their score-shaped tiles either as (keys x queries), or (QMAJOR) as (queries x keys)
# with the key-side tiles as the products' B operands and the per-query vectors as row vectors;
# the helpers below hide the orientation.


@triton.jit
def _kt_dot(key_tile, query_tile, acc, PREC: tl.constexpr, QMAJOR: tl.constexpr):
    """A score-shaped product (plus ``acc``, or None) of a key-side and a query-side
    tile x d: query_tile @ key_tileᵀ when QMAJOR, key_tile @ query_tileᵀ otherwise."""
    if QMAJOR:
        return tl.dot(query_tile, tl.trans(key_tile), acc, input_precision=PREC)
    else:
        return tl.dot(key_tile, tl.trans(query_tile), acc, input_precision=PREC)


@triton.jit
def _kt_q(x, QMAJOR: tl.constexpr):
    """A per-query vector, broadcast over the keys of a score-shaped tile."""
    if QMAJOR:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _kt_k(x, QMAJOR: tl.constexpr):
    """A per-key vector, broadcast over the queries of a score-shaped tile."""
    if QMAJOR:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _kt_probs(k, q, lse2, offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k, shift, window,
              qk_scale, PREC: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              QMAJOR: tl.constexpr, NAT: tl.constexpr = False):
    """P of one (query tile, key tile) pair in a key-tile program; query tiles outside
    [mid_lo, mid_hi) are masked. NAT: ``lse2`` and ``qk_scale`` are L and τ in natural units
    (:func:`_nat_probs`)."""
    if NAT:
        p = _nat_probs(_kt_dot(k, q, None, PREC, QMAJOR), qk_scale, _kt_q(lse2, QMAJOR))
    else:
        s = _kt_dot(k, q, None, PREC, QMAJOR) * qk_scale
        p = tl.exp2(s - _kt_q(lse2, QMAJOR))
    if (start_m < mid_lo) | (start_m >= mid_hi):
        vis = _visible(_kt_q(offs_m, QMAJOR), _kt_k(offs_n, QMAJOR), n_q, n_k, shift, window,
                       CAUSAL, WINDOW)
        p = tl.where(vis, p, 0.0)
    return p


@triton.jit
def _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr):
    """Key tile [start_n, start_n + BLOCK_N) of a query-tile program: (offs_n, n_ok, rows, k)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_k
    rows = _rows(offs_n, LONG)
    k = _load_tile(k_base, rows, stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    return offs_n, n_ok, rows, k


@triton.jit
def _row_scores(q, k, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift, window,
                qk_scale, PREC: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """S·τ·log2e of one (query tile, key tile) pair, -inf where masked (key tiles outside
    [mid_lo, mid_hi) only): the online-softmax passes' scores."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if (start_n < mid_lo) | (start_n >= mid_hi):
        vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window, CAUSAL, WINDOW)
        s = tl.where(vis, s, float("-inf"))
    return s


@triton.jit
def _online_softmax_step(s, m_i, NAT: tl.constexpr = False):
    """One key tile of an online softmax: (p, corr, m_new) from the tile's scores ``s``
    (:func:`_row_scores`; log2 units, or with NAT natural units) and the running row max
    ``m_i``: P = exp(s − m_new) and the factor exp(m_i − m_new) that rescales what was summed
    so far (rows with no key yet, max -inf, subtract 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    if NAT:
        p = tl.exp2((s - m_use[:, None]) * 1.4426950408889634)
        corr = tl.exp2((m_i - m_use) * 1.4426950408889634)
    else:
        p = tl.exp2(s - m_use[:, None])
        corr = tl.exp2(m_i - m_use)
    return p, corr, m_new


@triton.jit
def _row_probs(q, k, lse2, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift, window,
               qk_scale, PREC: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               NAT: tl.constexpr = False):
    """P = exp(S − L) of one (query tile, key tile) pair in a query-tile program, (queries x
    keys); key tiles outside [mid_lo, mid_hi) are masked. NAT: ``lse2`` and ``qk_scale`` are L
    and τ in natural units (:func:`_nat_probs`)."""
    if NAT:
        p = _nat_probs(tl.dot(q, tl.trans(k), input_precision=PREC), qk_scale, lse2[:, None])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(s - lse2[:, None])
    if (start_n < mid_lo) | (start_n >= mid_hi):
        vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window, CAUSAL, WINDOW)
        p = tl.where(vis, p, 0.0)
    return p


@triton.jit
def _nat_probs(qk, scale, lse):
    """exp(S − L) with S = τ·qk and L subtracted in natural units, then converted: the float32
    passes' P, rounded like PyTorch's softmax (S − L is small where P matters; converting S
    and L to base 2 first would round each at |S| and double the error of P at large logits)."""
    return tl.exp2((qk * scale - lse) * 1.4426950408889634)


@triton.jit
def _lse_nat(lse):
    """The natural-log LSE as :func:`_nat_probs` takes it: rows that see no key (-inf)
    become +inf so P = 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _lse_log2(lse):
    """Natural-log LSE -> log2 units; rows that see no key (-inf) become +inf so P = 0."""
    lse2 = lse * 1.4426950408889634
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


# --------------------------------------------------------------------------- float32 shift
# Where one key dominates a row (P ≈ 1 there), dP − D, G − α and B − E cancel to a small rest;
# the float32 passes shift dP, G, B by their values c, g, b at the dominant key j* (0 there
# exactly) and carry the statistics as D − c, α − g (bob-math.md, "Row sums of the recomputed P").


@triton.jit
def _store_index(base, offs, idx, ok):
    """Store int32 row indices into a float32 row vector (bit pattern kept)."""
    tl.store(base + offs, idx.to(tl.float32, bitcast=True), mask=ok)


@triton.jit
def _load_index(base, offs, ok):
    """Load int32 row indices stored by :func:`_store_index` (0 where not ``ok``)."""
    return tl.load(base + offs, mask=ok, other=0.0).to(tl.int32, bitcast=True)


@triton.jit
def _bob_shift_tile(dp, g, b_tile, dom, cref, gref, bref, HAS_UV: tl.constexpr,
                    HAS_G: tl.constexpr, NEED_DP: tl.constexpr):
    """dP − c, G − g, B − b, each 0 at the dominant key (``dom``) of its row."""
    if HAS_G:
        g = tl.where(dom, 0.0, g - gref[:, None])
    if NEED_DP:
        dp = tl.where(dom, 0.0, dp - cref[:, None])
        if HAS_UV:
            b_tile = tl.where(dom, 0.0, b_tile - bref[:, None])
    return dp, g, b_tile


@triton.jit
def _bob_r(p, g, dp_d, b_tile, e_ad, HAS_G: tl.constexpr, HAS_UV: tl.constexpr):
    """R = P∘((G − α)∘(dP − D) + B − (E + αD)) of one score-shaped tile from ``g`` = G − α
    (read with HAS_G), ``dp_d`` = dP − D, ``b_tile`` = B (read with HAS_UV) and ``e_ad`` =
    E + αD broadcast over the tile (with the shift: the shifted forms, the same identity)."""
    if HAS_G:
        r = g * dp_d
        if HAS_UV:
            r += b_tile
    else:
        r = b_tile
    return p * (r - e_ad)


@triton.jit
def _bob_store_shift(SH, row_off, offs_m, m_ok, rho, jstar, cref, gref, bref, dtil):
    """Write the float32 statistics besides α − g and F into the row vectors ``SH`` =
    (ρ, j*, c, g, b, D − c)."""
    tl.store(SH[0] + row_off + offs_m, rho, mask=m_ok)
    _store_index(SH[1] + row_off, offs_m, jstar, m_ok)
    tl.store(SH[2] + row_off + offs_m, cref, mask=m_ok)
    tl.store(SH[3] + row_off + offs_m, gref, mask=m_ok)
    tl.store(SH[4] + row_off + offs_m, bref, mask=m_ok)
    tl.store(SH[5] + row_off + offs_m, dtil, mask=m_ok)


@triton.jit
def _bob_load_shift(SH, row_off, offs_m, m_ok):
    """Read back what :func:`_bob_store_shift` wrote: (ρ, j*, c, g, b, D − c)."""
    return (_load_rowvec(SH[0] + row_off, offs_m, m_ok, True),
            _load_index(SH[1] + row_off, offs_m, m_ok),
            _load_rowvec(SH[2] + row_off, offs_m, m_ok, True),
            _load_rowvec(SH[3] + row_off, offs_m, m_ok, True),
            _load_rowvec(SH[4] + row_off, offs_m, m_ok, True),
            _load_rowvec(SH[5] + row_off, offs_m, m_ok, True))
