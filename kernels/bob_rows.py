"""BoB row passes: one program per (query tile, query head, batch), looping over key tiles.

With the cotangents U_Q, U_K, U_V of (dQ, dK, dV), per tile (bob-math.md)

    P = exp(S − L)   dP = dO Vᵀ   G = τ (U_Q Kᵀ + Q U_Kᵀ)   B = dO U_Vᵀ
    α = rowsum(P∘G)  E = rowsum(P∘G∘dP) − 2αD + rowsum(P∘B)
    R = P∘((G−α)∘(dP−D) + B − (E+αD))   H = P∘(G−α)
    Q̄ = τ (dS U_K + R K)   dŌ = H V + P U_V

- ``_bob_stats_kernel``: the row statistics α, E + αD and the row-sum correction ρ
  (bob-math.md, "Row sums of the recomputed P"), no tile accumulators;
- ``_bob_direct_kernel`` (α and E + αD known): Q̄ and dŌ with R and H formed per tile; with
  ``STATS_FIRST`` the same program first runs the statistics sweep itself (one launch less);
- ``_bob_affine_kernel`` (``precise=False``): the two-pass affine form of bob-math.md, six
  α-free accumulators, α and E formed at the end of the row.

The row passes scale their accumulators by ρ at the end. A missing cotangent removes its
products at compile time (constexpr flags).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _NO_SPECIALIZE,
    _dot_acc,
    _key_tile_range,
    _load_rowvec,
    _load_tile,
    _lse_log2,
    _row_tile_id,
    _rows,
    _seq_info,
    _store_tile,
    _visible,
)


# --------------------------------------------------------------------------- row-program helpers


@triton.jit
def _row_program(CU_Q, CU_K, N_Q, N_K, GROUPS, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """Query tile, head and sequence of a row program: (m0, n_q, n_k, b64, h64, hk64,
    q_start64, k_start64); the caller returns when m0 >= n_q."""
    pid_m = _row_tile_id(CAUSAL)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU_Q, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU_K, b, N_K, IS_VARLEN)
    return (pid_m * BLOCK_M, n_q, n_k, b.to(tl.int64), h.to(tl.int64),
            (h // GROUPS).to(tl.int64), q_start.to(tl.int64), k_start.to(tl.int64))


@triton.jit
def _bob_row_tile(q, do, uq, lse2, k_base, v_base, uk_base, uv_base,
                  stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d, start_n,
                  mid_lo, mid_hi, n_q, n_k, shift, window, scale, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                  PREC: tl.constexpr, HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr,
                  HAS_UV: tl.constexpr, HAS_G: tl.constexpr, NEED_DP: tl.constexpr):
    """Key tile [start_n, start_n + BLOCK_N) of a row program: loads K, V (U_K, U_V) and
    returns (k, v, uk, uv, p, dp, g, bm), (queries x keys): P (masked outside [mid_lo,
    mid_hi)), dP and B when NEED_DP, G (scaled by τ) when HAS_G. Absent values are
    placeholders (never read)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_k
    rows = _rows(offs_n, LONG)
    k = _load_tile(k_base, rows, stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if (start_n < mid_lo) | (start_n >= mid_hi):
        vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window, CAUSAL, WINDOW)
        p = tl.where(vis, p, 0.0)
    dp = p
    bm = p
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
            bm = tl.dot(do, tl.trans(uv), input_precision=PREC)
    if HAS_G:
        if HAS_UK:
            g = tl.dot(q, tl.trans(uk), input_precision=PREC)
            if HAS_UQ:
                g = tl.dot(uq, tl.trans(k), g, input_precision=PREC)
        else:
            g = tl.dot(uq, tl.trans(k), input_precision=PREC)
        g = g * scale
    return k, v, uk, uv, p, dp, g, bm


@triton.jit
def _rowsum_scale(r_p, ROWSUM: tl.constexpr):
    """ρ = 1 / rowsum(P) (1 for rows that see no key, or without ROWSUM)."""
    if ROWSUM:
        return 1.0 / tl.where(r_p > 0.0, r_p, 1.0)
    else:
        return tl.full(r_p.shape, 1.0, tl.float32)


@triton.jit
def _bob_stats_sweep(q, do, uq, lse2, di, k_base, v_base, uk_base, uv_base,
                     stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
                     lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                     LONG: tl.constexpr, PREC: tl.constexpr, HAS_UQ: tl.constexpr,
                     HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
                     NEED_E: tl.constexpr, ROWSUM: tl.constexpr):
    """Row statistics of one query tile over key tiles [lo, hi): (α, E + αD, ρ), all with the
    corrected P·ρ. Without NEED_E (neither Q̄ nor K̄ wanted) E is not formed."""
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_alpha = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_e = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, bm = _bob_row_tile(
            q, do, uq, lse2, k_base, v_base, uk_base, uv_base, stride_kn, stride_vn,
            stride_ukn, stride_uvn, offs_m, offs_d, start_n, mid_lo, mid_hi, n_q, n_k, shift,
            window, scale, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E)
        if ROWSUM:
            r_p += tl.sum(p, 1)
        if HAS_G:
            r_alpha += tl.sum(p * g, 1)
            if NEED_E:
                if HAS_UV:
                    r_e += tl.sum(p * (g * dp + bm), 1)
                else:
                    r_e += tl.sum(p * (g * dp), 1)
        elif NEED_E:
            r_e += tl.sum(p * bm, 1)
    rho = _rowsum_scale(r_p, ROWSUM)
    al = r_alpha * rho
    ee = r_e * rho - al * di  # E + αD = rowsum(P∘(G∘dP + B)) − αD
    return al, ee, rho


@triton.jit
def _bob_direct_sweep(q, do, uq, lse2, di, al, ee, k_base, v_base, uk_base, uv_base,
                      stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
                      lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                      EVEN_D: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
                      HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
                      HAS_G: tl.constexpr, NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr,
                      SPLIT: tl.constexpr):
    """Unscaled Q̄/τ and dŌ of one query tile over key tiles [lo, hi), with α = ``al`` and
    E + αD = ``ee`` known: dS U_K + R K and H V + P U_V, R and H formed per tile (multiply by
    ρ for the corrected P)."""
    a_qb = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_dob = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, bm = _bob_row_tile(
            q, do, uq, lse2, k_base, v_base, uk_base, uv_base, stride_kn, stride_vn,
            stride_ukn, stride_uvn, offs_m, offs_d, start_n, mid_lo, mid_hi, n_q, n_k, shift,
            window, scale, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_QB)
        if HAS_G:
            g = g - al[:, None]  # G − α
        if NEED_DOB:
            if HAS_G:
                a_dob = _dot_acc(p * g, v, a_dob, PREC, SPLIT)
            if HAS_UV:
                a_dob = tl.dot(p.to(uv.dtype), uv, a_dob, input_precision=PREC)
        if NEED_QB:
            dpc = dp - di[:, None]
            if HAS_G:
                r = g * dpc
                if HAS_UV:
                    r += bm
            else:
                r = bm
            r = p * (r - ee[:, None])
            a_qb = _dot_acc(r, k, a_qb, PREC, SPLIT)
            if HAS_UK:
                a_qb = tl.dot((p * dpc).to(uk.dtype), uk, a_qb, input_precision=PREC)
    return a_qb, a_dob


# --------------------------------------------------------------------------- row kernels


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_stats_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RHO, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_uqb, stride_uqh, stride_uqn,
    stride_ukb, stride_ukh, stride_ukn,
    stride_uvb, stride_uvh, stride_uvn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_E: tl.constexpr, ROWSUM: tl.constexpr,
):
    """Statistics pass: writes α, E + αD (and ρ with ROWSUM) of one query tile."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU_Q, CU_K, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    row_off = b64 * stride_lb + h64 * stride_lh + q_start64
    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn, rows_m,
                   stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uq = q
    if HAS_UQ:
        uq = _load_tile(UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn, rows_m,
                        stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    di = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    al, ee, rho = _bob_stats_sweep(
        q, do, uq, lse2, di,
        K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn,
        V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn,
        UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn,
        UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn,
        stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
        lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
        HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E, ROWSUM)
    tl.store(ALPHA + row_off + offs_m, al, mask=m_ok)
    tl.store(EE + row_off + offs_m, ee, mask=m_ok)
    if ROWSUM:
        tl.store(RHO + row_off + offs_m, rho, mask=m_ok)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_direct_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RHO, QB, DOB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_uqb, stride_uqh, stride_uqn,
    stride_ukb, stride_ukh, stride_ukn,
    stride_uvb, stride_uvh, stride_uvn,
    stride_qbb, stride_qbh, stride_qbn,
    stride_dobb, stride_dobh, stride_dobn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, SPLIT: tl.constexpr, ROWSUM: tl.constexpr,
    STATS_FIRST: tl.constexpr, WRITE_STATS: tl.constexpr, NEED_E: tl.constexpr,
):
    """Direct row pass: Q̄ and dŌ of one query tile, R and H formed per tile. α, E + αD, ρ
    come from the statistics pass, or (STATS_FIRST) from this program's own statistics sweep
    over the same keys, then written when WRITE_STATS (a key-tile pass follows)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU_Q, CU_K, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    row_off = b64 * stride_lb + h64 * stride_lh + q_start64
    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn, rows_m,
                   stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uq = q
    if HAS_UQ:
        uq = _load_tile(UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn, rows_m,
                        stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    di = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn
    uk_base = UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn
    uv_base = UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    if STATS_FIRST:
        al, ee, rho = _bob_stats_sweep(
            q, do, uq, lse2, di, k_base, v_base, uk_base, uv_base,
            stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
            lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E, ROWSUM)
        if WRITE_STATS:
            tl.store(ALPHA + row_off + offs_m, al, mask=m_ok)
            tl.store(EE + row_off + offs_m, ee, mask=m_ok)
            if ROWSUM:
                tl.store(RHO + row_off + offs_m, rho, mask=m_ok)
    else:
        al = _load_rowvec(ALPHA + row_off, offs_m, m_ok, True)
        ee = _load_rowvec(EE + row_off, offs_m, m_ok, True)
        if ROWSUM:
            rho = _load_rowvec(RHO + row_off, offs_m, m_ok, True)
        else:
            rho = tl.full([BLOCK_M], 1.0, tl.float32)
    a_qb, a_dob = _bob_direct_sweep(
        q, do, uq, lse2, di, al, ee, k_base, v_base, uk_base, uv_base,
        stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
        lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
        HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_QB, NEED_DOB, SPLIT)
    if NEED_QB:
        qb = a_qb * (rho * scale)[:, None]
        _store_tile(QB + b64 * stride_qbb + h64 * stride_qbh + q_start64 * stride_qbn, rows_m,
                    stride_qbn, qb.to(QB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_DOB:
        dob = a_dob * rho[:, None]
        _store_tile(DOB + b64 * stride_dobb + h64 * stride_dobh + q_start64 * stride_dobn, rows_m,
                    stride_dobn, dob.to(DOB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_affine_kernel(
    Q, K, V, O, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RHO, QB, DOB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_db, stride_dh, stride_dn,
    stride_uqb, stride_uqh, stride_uqn,
    stride_ukb, stride_ukh, stride_ukn,
    stride_uvb, stride_uvh, stride_uvn,
    stride_qbb, stride_qbh, stride_qbn,
    stride_dobb, stride_dobh, stride_dobn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, NEED_E: tl.constexpr,
    WRITE_STATS: tl.constexpr, ROWSUM: tl.constexpr,
):
    """Affine row pass (bob-math.md, "Why two passes suffice"): six α-free accumulators

        dS U_K,  (P∘(G∘(dP−D)+B)) K,  (P∘dP) K,  P K,  (P∘G) V,  P U_V

    and the row sums rowsum(P), α, rowsum(P∘G∘dP), rowsum(P∘B); at the end of the row
    Q̄ = τ [dS U_K + (P∘(G∘(dP−D)+B)) K − α (P∘dP) K − E (P K)], dŌ = (P∘G) V + P U_V − α O.
    Writes α, E + αD, ρ when WRITE_STATS (the column pass follows). NEED_E: dP and B are
    needed (for Q̄ or for E)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU_Q, CU_K, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    row_off = b64 * stride_lb + h64 * stride_lh + q_start64
    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn, rows_m,
                   stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uq = q
    if HAS_UQ:
        uq = _load_tile(UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn, rows_m,
                        stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    di = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn
    uk_base = UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn
    uv_base = UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    a_dsuk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_tk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pdpk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pgv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_puv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_alpha = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_gdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_b = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, uk, uv, p, dp, g, bm = _bob_row_tile(
            q, do, uq, lse2, k_base, v_base, uk_base, uv_base, stride_kn, stride_vn,
            stride_ukn, stride_uvn, offs_m, offs_d, start_n, mid_lo, mid_hi, n_q, n_k, shift,
            window, scale, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_E)
        if ROWSUM:
            r_p += tl.sum(p, 1)
        pg = p
        pb = p
        if HAS_G:
            pg = p * g
            r_alpha += tl.sum(pg, 1)
            if NEED_E:
                r_gdp += tl.sum(pg * dp, 1)
        if HAS_UV:
            if NEED_E:
                pb = p * bm
                r_b += tl.sum(pb, 1)
        if NEED_QB:
            if HAS_UK:
                ds = p * (dp - di[:, None])
                a_dsuk = tl.dot(ds.to(uk.dtype), uk, a_dsuk, input_precision=PREC)
            if HAS_G:
                t = pg * (dp - di[:, None])
                if HAS_UV:
                    t += pb
                a_pdpk = tl.dot((p * dp).to(k.dtype), k, a_pdpk, input_precision=PREC)
            else:
                t = pb
            a_tk = tl.dot(t.to(k.dtype), k, a_tk, input_precision=PREC)
            a_pk = tl.dot(p.to(k.dtype), k, a_pk, input_precision=PREC)
        if NEED_DOB:
            if HAS_G:
                a_pgv = tl.dot(pg.to(v.dtype), v, a_pgv, input_precision=PREC)
            if HAS_UV:
                a_puv = tl.dot(p.to(uv.dtype), uv, a_puv, input_precision=PREC)
    rho = _rowsum_scale(r_p, ROWSUM)
    alpha = r_alpha * rho
    ee = (r_gdp + r_b) * rho - 2.0 * alpha * di  # E
    if NEED_QB:
        qb = (a_dsuk + a_tk - alpha[:, None] * a_pdpk - ee[:, None] * a_pk) * (rho * scale)[:, None]
        _store_tile(QB + b64 * stride_qbb + h64 * stride_qbh + q_start64 * stride_qbn, rows_m,
                    stride_qbn, qb.to(QB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_DOB:
        dob = (a_pgv + a_puv) * rho[:, None]
        if HAS_G:
            o = _load_tile(O + b64 * stride_ob + h64 * stride_oh + q_start64 * stride_on,
                           rows_m, stride_on, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
            dob -= alpha[:, None] * o.to(tl.float32)
        _store_tile(DOB + b64 * stride_dobb + h64 * stride_dobh + q_start64 * stride_dobn, rows_m,
                    stride_dobn, dob.to(DOB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)
    if WRITE_STATS:
        tl.store(ALPHA + row_off + offs_m, alpha, mask=m_ok)
        tl.store(EE + row_off + offs_m, ee + alpha * di, mask=m_ok)  # E + αD
        if ROWSUM:
            tl.store(RHO + row_off + offs_m, rho, mask=m_ok)
