"""BoB row passes: one program per (query tile, query head, batch), looping over key tiles.

With the cotangents U_Q, U_K, U_V of (dQ, dK, dV), per tile (bob-math.md)

    P = exp(S − L)   dP = dO Vᵀ   G = τ (U_Q Kᵀ + Q U_Kᵀ)   B = dO U_Vᵀ
    α = rowsum(P∘G)  E = rowsum(P∘G∘dP) − 2αD + rowsum(P∘B)
    R = P∘((G−α)∘(dP−D) + B − (E+αD))   H = P∘(G−α)
    Q̄ = τ (dS U_K + R K)   dŌ = H V + P U_V

- ``_bob_stats_kernel``: the row statistics α, E + αD, no tile accumulators;
- ``_bob_direct_kernel`` (α and E + αD known): Q̄ and dŌ with R and H formed per tile; with
  ``STATS_FIRST`` the same program first runs the statistics sweep itself (one launch less).

Float32 inputs without the caller's statistics run the shifted pair ``_bob_stats_shift_kernel``
/ ``_bob_direct_shift_kernel``: P is recomputed in natural units and corrected by
ρ = 1 / rowsum(exp(S − L)), and dP, G, B are shifted by their values at each row's dominant key
(``_bob_stats_shift_sweep``; bob-math.md, "Row sums of the recomputed P"). The row passes
scale their accumulators by ρ at the end. The affine form (``precise=False``) is bob_affine.py.
A missing cotangent removes its products at compile time (constexpr flags).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_key_tile, _row_probs, _NO_SPECIALIZE, _bob_load_shift, _bob_r,
                     _bob_shift_tile, _bob_store_shift, _dot_acc, _key_tile_range, _load_rowvec,
                     _load_tile, _load_view, _lse_log2, _lse_nat, _row_off, _row_program,
                     _store_view, _tile_base, _tile_offsets, _tile_base_or)


# --------------------------------------------------------------------------- row-program helpers


@triton.jit
def _bob_row_setup(Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0,
                   n_q, n_k, window, scale, qk_scale, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                   LONG: tl.constexpr, HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr,
                   HAS_UV: tl.constexpr, ROWSUM: tl.constexpr):
    """What every row program sets up first: (offs_m, offs_d, m_ok, rows_m, row_off, lo, hi,
    row). ``row`` is the tuple :func:`_bob_row_tile` reads: (q, do, uq, lse2, k_base, v_base,
    uk_base, uv_base, stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d, mid_lo,
    mid_hi, n_q, n_k, shift, window, scale, qk_scale): the query tile's Q, dO (and U_Q; q
    itself without HAS_UQ, never read then), L in log2 units or with ROWSUM in natural units
    (common.py, ``_nat_probs``), the key-side bases (K, V, U_K, U_V of its kv head and
    sequence, with their token strides; K's and V's for an absent cotangent, never read then)
    and the unmasked key tiles [mid_lo, mid_hi) of the key tiles [lo, hi) it visits."""
    shift = n_k - n_q
    offs_m, offs_d, m_ok, rows_m = _tile_offsets(m0, n_q, BLOCK_M, BLOCK_D, LONG)
    row_off = _row_off(RS, b64, h64, q_start64)
    q = _load_view(Q, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    do = _load_view(DO, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    uq = q
    if HAS_UQ:
        uq = _load_view(UQ, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    if ROWSUM:
        lse2 = _lse_nat(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    else:
        lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    k_base = _tile_base(K, b64, hk64, k_start64)
    v_base = _tile_base(V, b64, hk64, k_start64)
    uk_base, stride_ukn = _tile_base_or(UK, b64, hk64, k_start64, k_base, K[3], HAS_UK)
    uv_base, stride_uvn = _tile_base_or(UV, b64, hk64, k_start64, v_base, V[3], HAS_UV)
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    row = (q, do, uq, lse2, k_base, v_base, uk_base, uv_base, K[3], V[3], stride_ukn,
           stride_uvn, offs_m, offs_d, mid_lo, mid_hi, n_q, n_k, shift, window, scale, qk_scale)
    return offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row


@triton.jit
def _bob_row_tile(row, start_n, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                  LONG: tl.constexpr, PREC: tl.constexpr, HAS_UQ: tl.constexpr,
                  HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
                  NEED_DP: tl.constexpr, ROWSUM: tl.constexpr):
    """Key tile [start_n, start_n + BLOCK_N) of a row program (``row``: what
    :func:`_bob_row_setup` set up): loads K, V (U_K, U_V) and returns
    (k, v, uk, uv, p, dp, g, b_tile), (queries x keys): P (masked outside [mid_lo, mid_hi);
    with ROWSUM from L in natural units), dP and B when NEED_DP, G (scaled by τ) when HAS_G.
    Absent values are placeholders (never read)."""
    (q, do, uq, lse2, k_base, v_base, uk_base, uv_base, stride_kn, stride_vn, stride_ukn,
     stride_uvn, offs_m, offs_d, mid_lo, mid_hi, n_q, n_k, shift, window, scale, qk_scale) = row
    offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                  BLOCK_N, EVEN_D, LONG)
    v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    if ROWSUM:
        p = _row_probs(q, k, lse2, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift,
                       window, scale, PREC, CAUSAL, WINDOW, True)
    else:
        p = _row_probs(q, k, lse2, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift,
                       window, qk_scale, PREC, CAUSAL, WINDOW)
    dp = p
    b_tile = p
    g = p
    uk = k
    uv = v
    if NEED_DP:
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    if HAS_UK:
        uk = _load_tile(uk_base, rows, stride_ukn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    if HAS_UV:
        uv = _load_tile(uv_base, rows, stride_uvn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        if NEED_DP:
            b_tile = tl.dot(do, tl.trans(uv), input_precision=PREC)
    if HAS_G:
        if HAS_UK:
            g = tl.dot(q, tl.trans(uk), input_precision=PREC)
            if HAS_UQ:
                g = tl.dot(uq, tl.trans(k), g, input_precision=PREC)
        else:
            g = tl.dot(uq, tl.trans(k), input_precision=PREC)
        g = g * scale
    return k, v, uk, uv, p, dp, g, b_tile



@triton.jit
def _bob_row_sums(p, g, dp, b_tile, r_alpha, r_e, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
                  NEED_E: tl.constexpr):
    """The statistics sweeps' row sums of one key tile: (r_alpha + rowsum(P∘G), r_e +
    rowsum(P∘(G∘dP + B))), the terms present (HAS_G, HAS_UV; E only with NEED_E). The shifted
    sweep passes G − g, dP − c, B − b."""
    if HAS_G:
        r_alpha += tl.sum(p * g, 1)
        if NEED_E:
            if HAS_UV:
                r_e += tl.sum(p * (g * dp + b_tile), 1)
            else:
                r_e += tl.sum(p * (g * dp), 1)
    elif NEED_E:
        r_e += tl.sum(p * b_tile, 1)
    return r_alpha, r_e


@triton.jit
def _bob_stats_shift_sweep(row, lo, hi, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                           EVEN_D: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
                           HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
                           HAS_G: tl.constexpr, NEED_E: tl.constexpr):
    """The float32 row statistics of one query tile (``row``, :func:`_bob_row_setup`) over key
    tiles [lo, hi) (bob-math.md, "Row sums of the recomputed P"), P̂ = exp(S − L)
    uncorrected: with j* the key of largest P̂, c, g, b = dP, G, B there and x = dP − c,
    y = G − g, z = B − b (0 at j*), it forms ρ = 1 / rowsum(P̂),
    D − c = rowsum(P x), α − g = rowsum(P y) and F = rowsum(P (y x + z)) − (α − g)(D − c), so
    that R = P∘((y − (α − g))∘(x − (D − c)) + z − F) and H = P∘(y − (α − g)) lose nothing to
    cancellation where one key dominates. j*, c, g, b are those of the keys seen so far; when
    they move, the sums so far are re-shifted exactly (the old j*'s x, y, z become the old
    minus the new c, g, b), a small correction where it matters: the keys before a dominant
    one carry little P̂. Returns (α − g, F, ρ, j*, c, g, b, D − c)."""
    m = tl.full([BLOCK_M], -1.0, dtype=tl.float32)
    jstar = tl.zeros([BLOCK_M], dtype=tl.int32)
    cref = tl.zeros([BLOCK_M], dtype=tl.float32)
    gref = tl.zeros([BLOCK_M], dtype=tl.float32)
    bref = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_y = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_x = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_e = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, b_tile = _bob_row_tile(
            row, start_n, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK,
            HAS_UV, HAS_G, NEED_E, True)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        t_max = tl.max(p, 1)
        t_arg = start_n + tl.argmax(p, 1).to(tl.int32)
        better = t_max > m
        at = offs_n[None, :] == t_arg[:, None]
        # move j* (and c, g, b) to this tile's largest P̂ where it beats the old one
        d_c = tl.zeros([BLOCK_M], dtype=tl.float32)
        d_g = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NEED_E:
            d_c = tl.where(better, tl.sum(tl.where(at, dp, 0.0), 1) - cref, 0.0)
            if HAS_UV:
                d_b = tl.where(better, tl.sum(tl.where(at, b_tile, 0.0), 1) - bref, 0.0)
                r_e -= d_b * r_p
                bref += d_b
        if HAS_G:
            d_g = tl.where(better, tl.sum(tl.where(at, g, 0.0), 1) - gref, 0.0)
            gref += d_g
        r_e += d_g * d_c * r_p - d_g * r_x - d_c * r_y
        r_x -= d_c * r_p
        r_y -= d_g * r_p
        cref += d_c
        jstar = tl.where(better, t_arg, jstar)
        m = tl.maximum(m, t_max)
        dom = offs_n[None, :] == jstar[:, None]
        x, y, z = _bob_shift_tile(dp, g, b_tile, dom, cref, gref, bref, HAS_UV, HAS_G, NEED_E)
        r_y, r_e = _bob_row_sums(p, y, x, z, r_y, r_e, HAS_UV, HAS_G, NEED_E)
        if NEED_E:
            r_x += tl.sum(p * x, 1)
        r_p += tl.sum(p, 1)
    rho = 1.0 / tl.where(r_p > 0.0, r_p, 1.0)
    alpha = r_y * rho
    dtil = r_x * rho
    f = r_e * rho - alpha * dtil
    return alpha, f, rho, jstar, cref, gref, bref, dtil


@triton.jit
def _bob_stats_sweep(row, lo, hi, delta, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                     EVEN_D: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
                     HAS_UQ: tl.constexpr,
                     HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
                     NEED_E: tl.constexpr):
    """Row statistics of one query tile (``row``, :func:`_bob_row_setup`) over key tiles
    [lo, hi), 16-bit inputs: (α, E + αD). Without NEED_E (neither Q̄ nor K̄ wanted) E is not
    formed."""
    r_alpha = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_e = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, b_tile = _bob_row_tile(
            row, start_n, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK,
            HAS_UV, HAS_G, NEED_E, False)
        r_alpha, r_e = _bob_row_sums(p, g, dp, b_tile, r_alpha, r_e, HAS_UV, HAS_G, NEED_E)
    e_ad = r_e - r_alpha * delta  # E + αD = rowsum(P∘(G∘dP + B)) − αD
    return r_alpha, e_ad


@triton.jit
def _bob_direct_sweep(row, lo, hi, delta, alpha, e_ad, ref, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                      LONG: tl.constexpr, PREC: tl.constexpr, HAS_UQ: tl.constexpr,
                      HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
                      NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, SPLIT: tl.constexpr,
                      ROWSUM: tl.constexpr, SHIFT: tl.constexpr):
    """Unscaled Q̄/τ and dŌ of one query tile (``row``, :func:`_bob_row_setup`) over key
    tiles [lo, hi), with α = ``alpha`` and E + αD = ``e_ad`` known: dS U_K + R K and
    H V + P U_V, R and H formed per tile (multiply by ρ for the corrected P). ROWSUM: P in
    natural units. SHIFT: dP, G, B are shifted by c, g, b at j* (``_bob_shift_tile``; ``ref``
    = (j*, c, g, b), None without SHIFT) and ``delta``, ``alpha``, ``e_ad`` are D − c, α − g
    and F (``_bob_stats_shift_sweep``)."""
    a_qb = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_dob = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, b_tile = _bob_row_tile(
            row, start_n, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK,
            HAS_UV, HAS_G, NEED_QB, ROWSUM)
        if SHIFT:
            dom = (start_n + tl.arange(0, BLOCK_N))[None, :] == ref[0][:, None]
            dp, g, b_tile = _bob_shift_tile(dp, g, b_tile, dom, ref[1], ref[2], ref[3], HAS_UV,
                                            HAS_G, NEED_QB)
        if HAS_G:
            g = g - alpha[:, None]  # G − α
        if NEED_DOB:
            if HAS_G:
                a_dob = _dot_acc(p * g, v, a_dob, PREC, SPLIT)
            if HAS_UV:
                a_dob = tl.dot(p.to(uv.dtype), uv, a_dob, input_precision=PREC)
        if NEED_QB:
            dp_d = dp - delta[:, None]
            r = _bob_r(p, g, dp_d, b_tile, e_ad[:, None], HAS_G, HAS_UV)
            a_qb = _dot_acc(r, k, a_qb, PREC, SPLIT)
            if HAS_UK:
                a_qb = tl.dot((p * dp_d).to(uk.dtype), uk, a_qb, input_precision=PREC)
    return a_qb, a_dob



# --------------------------------------------------------------------------- row kernels


@triton.jit
def _bob_store_stats(ALPHA, EE, row_off, offs_m, m_ok, alpha, e_ad):
    """Write α and E + αD (with the shift: α − g and F) for the passes that follow."""
    tl.store(ALPHA + row_off + offs_m, alpha, mask=m_ok)
    tl.store(EE + row_off + offs_m, e_ad, mask=m_ok)


@triton.jit
def _bob_direct_store(QB, DOB, b64, h64, q_start64, rows_m, m_ok, offs_d, a_qb, a_dob, rho, scale,
                      HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, NEED_QB: tl.constexpr,
                      NEED_DOB: tl.constexpr):
    """Q̄ = τ ρ a_qb and dŌ = ρ a_dob of one query tile, stored where wanted."""
    if NEED_QB:
        qb = a_qb * (rho * scale)[:, None]
        _store_view(QB, b64, h64, q_start64, rows_m, qb, m_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_DOB:
        dob = a_dob * rho[:, None]
        _store_view(DOB, b64, h64, q_start64, rows_m, dob, m_ok, offs_d, HEAD_DIM, EVEN_D)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_stats_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_E: tl.constexpr,
):
    """Statistics pass: writes α, E + αD of one query tile (``_bob_stats_sweep``). Tiles:
    views (common.py); LSE, DELTA, ALPHA, EE: row vectors with strides RS."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row = _bob_row_setup(
        Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, n_k,
        window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
        LONG, HAS_UQ, HAS_UK, HAS_UV, False)
    delta = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    alpha, e_ad = _bob_stats_sweep(
        row, lo, hi, delta, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
        HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E)
    _bob_store_stats(ALPHA, EE, row_off, offs_m, m_ok, alpha, e_ad)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_stats_shift_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, ALPHA, EE, SH, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_E: tl.constexpr,
):
    """Statistics pass with the float32 shift (``_bob_stats_shift_sweep``): writes α − g, F
    and SH = (ρ, j*, c, g, b, D − c) of one query tile. Tiles: views (common.py); LSE, ALPHA,
    EE and SH: row vectors with strides RS."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row = _bob_row_setup(
        Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, n_k,
        window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
        LONG, HAS_UQ, HAS_UK, HAS_UV, True)
    alpha, e_ad, rho, jstar, cref, gref, bref, dtil = _bob_stats_shift_sweep(
        row, lo, hi, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ,
        HAS_UK, HAS_UV, HAS_G, NEED_E)
    _bob_store_stats(ALPHA, EE, row_off, offs_m, m_ok, alpha, e_ad)
    _bob_store_shift(SH, row_off, offs_m, m_ok, rho, jstar, cref, gref, bref, dtil)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_direct_kernel(
    Q, K, V, DO, UQ, UK, UV, QB, DOB, LSE, DELTA, ALPHA, EE, RHO, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, SPLIT: tl.constexpr, ROWSUM: tl.constexpr,
    STATS_FIRST: tl.constexpr, WRITE_STATS: tl.constexpr, NEED_E: tl.constexpr,
):
    """Direct row pass: Q̄ and dŌ of one query tile, R and H formed per tile. α, E + αD come
    from the statistics pass or the caller (with ROWSUM, float32, ρ too: RHO, None otherwise),
    or (STATS_FIRST, without ROWSUM) from this program's own statistics sweep over the same
    keys, then written to ALPHA, EE when WRITE_STATS (a key-tile pass follows; None
    otherwise)."""
    tl.static_assert(not (STATS_FIRST and ROWSUM), "float32 statistics sweeps are shifted")
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row = _bob_row_setup(
        Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, n_k,
        window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
        LONG, HAS_UQ, HAS_UK, HAS_UV, ROWSUM)
    delta = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    if STATS_FIRST:
        alpha, e_ad = _bob_stats_sweep(
            row, lo, hi, delta, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E)
        if WRITE_STATS:
            _bob_store_stats(ALPHA, EE, row_off, offs_m, m_ok, alpha, e_ad)
    else:
        alpha = _load_rowvec(ALPHA + row_off, offs_m, m_ok, True)
        e_ad = _load_rowvec(EE + row_off, offs_m, m_ok, True)
    if ROWSUM:
        rho = _load_rowvec(RHO + row_off, offs_m, m_ok, True)
    else:
        rho = tl.full([BLOCK_M], 1.0, tl.float32)
    a_qb, a_dob = _bob_direct_sweep(
        row, lo, hi, delta, alpha, e_ad, None, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL,
        WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_QB, NEED_DOB, SPLIT,
        ROWSUM, False)
    _bob_direct_store(QB, DOB, b64, h64, q_start64, rows_m, m_ok, offs_d, a_qb, a_dob, rho, scale,
                      HEAD_DIM, EVEN_D, NEED_QB, NEED_DOB)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_direct_shift_kernel(
    Q, K, V, DO, UQ, UK, UV, QB, DOB, LSE, ALPHA, EE, SH, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, SPLIT: tl.constexpr,
    STATS_FIRST: tl.constexpr, WRITE_STATS: tl.constexpr, NEED_E: tl.constexpr,
):
    """Direct row pass with the float32 shift: Q̄ and dŌ of one query tile from α − g, F and
    SH = (ρ, j*, c, g, b, D − c) (row vectors with strides RS) of the shifted statistics pass,
    or (STATS_FIRST) of this program's own shifted statistics sweep, then written when
    WRITE_STATS (a key-tile pass follows)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    offs_m, offs_d, m_ok, rows_m, row_off, lo, hi, row = _bob_row_setup(
        Q, K, V, DO, UQ, UK, UV, LSE, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, n_k,
        window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
        LONG, HAS_UQ, HAS_UK, HAS_UV, True)
    if STATS_FIRST:
        alpha, e_ad, rho, jstar, cref, gref, bref, dtil = _bob_stats_shift_sweep(
            row, lo, hi, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ,
            HAS_UK, HAS_UV, HAS_G, NEED_E)
        if WRITE_STATS:
            _bob_store_stats(ALPHA, EE, row_off, offs_m, m_ok, alpha, e_ad)
            _bob_store_shift(SH, row_off, offs_m, m_ok, rho, jstar, cref, gref, bref, dtil)
    else:
        alpha = _load_rowvec(ALPHA + row_off, offs_m, m_ok, True)
        e_ad = _load_rowvec(EE + row_off, offs_m, m_ok, True)
        rho, jstar, cref, gref, bref, dtil = _bob_load_shift(SH, row_off, offs_m, m_ok)
    a_qb, a_dob = _bob_direct_sweep(
        row, lo, hi, dtil, alpha, e_ad, (jstar, cref, gref, bref), HEAD_DIM, BLOCK_M, BLOCK_N,
        BLOCK_D, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_QB,
        NEED_DOB, SPLIT, True, True)
    _bob_direct_store(QB, DOB, b64, h64, q_start64, rows_m, m_ok, offs_d, a_qb, a_dob, rho, scale,
                      HEAD_DIM, EVEN_D, NEED_QB, NEED_DOB)
