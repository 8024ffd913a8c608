"""FlashBoB: exact backward-over-backward of softmax attention (bob-math.md).

Given cotangents U_Q, U_K, U_V of (dQ, dK, dV), with per tile

    P = exp(S − L)   dP = dO Vᵀ   G = τ (U_Q Kᵀ + Q U_Kᵀ)   B = dO U_Vᵀ
    α = rowsum(P∘G)  E = rowsum(P∘G∘dP) − 2αD + rowsum(P∘B)
    R = P∘((G−α)∘(dP−D) + B − (E+αD))   H = P∘(G−α)
    Q̄ = τ (dS U_K + R K)   K̄ = τ (dSᵀ U_Q + Rᵀ Q)   V̄ = Hᵀ dO   dŌ = H V + P U_V

One kernel per pass, sharing the per-tile helpers below:

- ``_bob_stats_kernel`` (one program per query tile): the row statistics α, E + αD and the
  row-sum correction ρ (below), no tile accumulators;
- ``_bob_direct_kernel`` (per query tile, α and E known): Q̄ and dŌ with R and H formed per
  tile. For short key sequences the same program first runs the statistics sweep itself
  (``STATS_FIRST``: one launch less);
- ``_bob_col_kernel`` (one program per key tile and key head, looping over query tiles and
  the g query heads of the group): K̄ and V̄ from α, E + αD, ρ;
- ``_bob_fused_kernel`` (per key tile, after the statistics pass): K̄ and V̄ in registers and
  the Q̄ / dŌ contributions of the tile added to float32 row buffers with atomics: one
  recomputation of the tile products fewer than direct + column (34·d flops per pair
  instead of 44·d), results not bitwise reproducible;
- ``_bob_affine_kernel`` (``precise=False``): the two-pass affine form of bob-math.md, six
  α-free accumulators, α and E formed at the end of the row.

Row-sum correction ρ: P is recomputed from the forward's L, which float32 holds to
|L|·2⁻²⁴; at large logits the recomputed rows then sum to 1 + O(|L|·ε), and the BoB multiplies
that by logit-sized terms (H = P∘(G−α) no longer sums to 0 over a row). The statistics pass
measures each row's sum of the recomputed P and every pass uses P·ρ, ρ = 1 / rowsum(P): the
row passes scale their accumulators by ρ at the end, the key-tile passes scale P per tile.

On sm_90 the statistics, direct and column passes run as Gluon kernels where
``configs.use_gluon`` selects them (gluon_bob_row.py, gluon_bob_col.py: same inputs and
outputs); the Triton kernels here are the portable path.

No N×N tensor touches HBM; the extra memory is the row vectors α, E + αD, ρ. A missing
cotangent removes its products at compile time (constexpr flags), and the key-tile pass is
skipped when neither K̄ nor V̄ is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    LOG2E,
    _NO_SPECIALIZE,
    _dot_acc,
    _key_tile_range,
    _kt_dot,
    _kt_probs,
    _kt_q,
    _load_rowvec,
    _load_tile,
    _lse_log2,
    _query_tile_range,
    _row_tile_id,
    _rows,
    _seq_info,
    _store_tile,
    _visible,
    block_d,
    cu_or_dummy,
    dot_precision,
    layout,
    long_rows,
    new_empty,
    new_rowvec,
    on_input_device,
    prep,
    rowvec_strides,
    strides,
)
from .configs import ROWSUM_CORRECTION, fuse_row_sweeps, get_config, use_atomics, use_gluon


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


# --------------------------------------------------------------------------- key-tile passes


@triton.jit
def _bob_kt_tile(k, v, uk, uv, q_base, do_base, uq_base, l_base, d_base, a_base, e_base,
                 r_base, stride_qn, stride_dn, stride_uqn, offs_m, offs_n, offs_d, start_m,
                 mid_lo, mid_hi, n_q, n_k, shift, window, scale, qk_scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 EVEN_D: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
                 HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
                 HAS_G: tl.constexpr, NEED_R: tl.constexpr, ROWSUM: tl.constexpr,
                 QMAJOR: tl.constexpr):
    """Query tile ``offs_m`` of a key-tile program (orientation ``QMAJOR``, common.py
    ``_kt_*``): loads Q, dO (U_Q) and the row vectors, returns (q, do, uq, p, h, r, dpc):
    P·ρ, H = P·ρ∘(G−α) (HAS_G), and with NEED_R R = P·ρ∘((G−α)∘(dP−D) + B − (E+αD)) and
    dP − D. Absent values are placeholders."""
    m_ok = offs_m < n_q
    rows = _rows(offs_m, LONG)
    q = _load_tile(q_base, rows, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(do_base, rows, stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse2 = _lse_log2(_load_rowvec(l_base, offs_m, m_ok, True))
    p = _kt_probs(k, q, lse2, offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                  window, qk_scale, PREC, CAUSAL, WINDOW, QMAJOR)
    if ROWSUM:
        p = p * _kt_q(_load_rowvec(r_base, offs_m, m_ok, True), QMAJOR)
    uq = q
    if HAS_UQ:
        uq = _load_tile(uq_base, rows, stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    g = p
    h = p
    if HAS_G:
        al = _load_rowvec(a_base, offs_m, m_ok, True)
        if HAS_UQ:
            g = _kt_dot(k, uq, None, PREC, QMAJOR)
            if HAS_UK:
                g = _kt_dot(uk, q, g, PREC, QMAJOR)
        else:
            g = _kt_dot(uk, q, None, PREC, QMAJOR)
        g = g * scale - _kt_q(al, QMAJOR)  # G − α
        h = p * g
    r = p
    dpc = p
    if NEED_R:
        ee = _load_rowvec(e_base, offs_m, m_ok, True)
        di = _load_rowvec(d_base, offs_m, m_ok, True)
        dpc = _kt_dot(v, do, None, PREC, QMAJOR) - _kt_q(di, QMAJOR)
        if HAS_G:
            r = g * dpc
            if HAS_UV:
                r += _kt_dot(uv, do, None, PREC, QMAJOR)
        else:
            r = _kt_dot(uv, do, None, PREC, QMAJOR)
        r = p * (r - _kt_q(ee, QMAJOR))
    return q, do, uq, p, h, r, dpc


@triton.jit
def _kt_program(CU_Q, CU_K, N_Q, N_K, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Key tile, key head and sequence of a key-tile program: (n0, n_q, n_k, b64, hk64,
    q_start64, k_start64); the caller returns when n0 >= n_k."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU_Q, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU_K, b, N_K, IS_VARLEN)
    return (pid_n * BLOCK_N, n_q, n_k, b.to(tl.int64), hk.to(tl.int64), q_start.to(tl.int64),
            k_start.to(tl.int64))


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_col_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RHO, KB, VB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_uqb, stride_uqh, stride_uqn,
    stride_ukb, stride_ukh, stride_ukn,
    stride_uvb, stride_uvh, stride_uvn,
    stride_kbb, stride_kbh, stride_kbn,
    stride_vbb, stride_vbh, stride_vbn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_KB: tl.constexpr, NEED_VB: tl.constexpr, SPLIT: tl.constexpr, ROWSUM: tl.constexpr,
    QMAJOR: tl.constexpr,
):
    """Column pass: K̄ = τ (dSᵀ U_Q + Rᵀ Q) and V̄ = Hᵀ dO of one key tile, summed over the
    query tiles and the query heads of its group."""
    n0, n_q, n_k, b64, hk64, q_start64, k_start64 = _kt_program(CU_Q, CU_K, N_Q, N_K, BLOCK_N,
                                                                 IS_VARLEN)
    if n0 >= n_k:
        return
    shift = n_k - n_q
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < n_k
    rows_n = _rows(offs_n, LONG)
    k = _load_tile(K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn, rows_n,
                   stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    v = _load_tile(V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn, rows_n,
                   stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uk = k
    if HAS_UK:
        uk = _load_tile(UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn,
                        rows_n, stride_ukn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uv = v
    if HAS_UV:
        uv = _load_tile(UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn,
                        rows_n, stride_uvn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    kb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    vb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    for grp in range(0, GROUPS):
        h64 = hk64 * GROUPS + grp
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn
        do_base = DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn
        uq_base = UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn
        row_off = b64 * stride_lb + h64 * stride_lh + q_start64
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q, do, uq, p, h, r, dpc = _bob_kt_tile(
                k, v, uk, uv, q_base, do_base, uq_base, LSE + row_off, DELTA + row_off,
                ALPHA + row_off, EE + row_off, RHO + row_off, stride_qn, stride_dn, stride_uqn,
                offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, scale,
                qk_scale, HEAD_DIM, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK, HAS_UV,
                HAS_G, NEED_KB, ROWSUM, QMAJOR)
            if NEED_VB:
                vb = _dot_acc(h, do, vb, PREC, SPLIT, QMAJOR)
            if NEED_KB:
                kb = _dot_acc(r, q, kb, PREC, SPLIT, QMAJOR)
                if HAS_UQ:
                    kb = _dot_acc(p * dpc, uq, kb, PREC, False, QMAJOR)
    if NEED_KB:
        kb = kb * scale
        _store_tile(KB + b64 * stride_kbb + hk64 * stride_kbh + k_start64 * stride_kbn, rows_n,
                    stride_kbn, kb.to(KB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_VB:
        _store_tile(VB + b64 * stride_vbb + hk64 * stride_vbh + k_start64 * stride_vbn, rows_n,
                    stride_vbn, vb.to(VB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_fused_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, RHO, KB, VB, QB, DOB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_uqb, stride_uqh, stride_uqn,
    stride_ukb, stride_ukh, stride_ukn,
    stride_uvb, stride_uvh, stride_uvn,
    stride_kbb, stride_kbh, stride_kbn,
    stride_vbb, stride_vbh, stride_vbn,
    stride_qbb, stride_qbh, stride_qbn,
    stride_dobb, stride_dobh, stride_dobn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_QB: tl.constexpr, NEED_KB: tl.constexpr, NEED_VB: tl.constexpr, NEED_DOB: tl.constexpr,
    SPLIT_ROW: tl.constexpr, SPLIT_COL: tl.constexpr, ROWSUM: tl.constexpr,
    QMAJOR: tl.constexpr,
):
    """Fused key-tile pass (after the statistics pass): K̄, V̄ of one key tile as in the
    column pass, and each tile pair's contributions τ (dS U_K + R K) to Q̄ and H V + P U_V to
    dŌ added to the float32 buffers QB, DOB (zeroed by the caller) with atomics."""
    n0, n_q, n_k, b64, hk64, q_start64, k_start64 = _kt_program(CU_Q, CU_K, N_Q, N_K, BLOCK_N,
                                                                 IS_VARLEN)
    if n0 >= n_k:
        return
    shift = n_k - n_q
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < n_k
    rows_n = _rows(offs_n, LONG)
    k = _load_tile(K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn, rows_n,
                   stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    v = _load_tile(V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn, rows_n,
                   stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uk = k
    if HAS_UK:
        uk = _load_tile(UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn,
                        rows_n, stride_ukn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    uv = v
    if HAS_UV:
        uv = _load_tile(UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn,
                        rows_n, stride_uvn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    kb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    vb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    d_ok = offs_d[None, :] < HEAD_DIM
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    for grp in range(0, GROUPS):
        h64 = hk64 * GROUPS + grp
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn
        do_base = DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn
        uq_base = UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn
        qb_base = QB + b64 * stride_qbb + h64 * stride_qbh + q_start64 * stride_qbn
        dob_base = DOB + b64 * stride_dobb + h64 * stride_dobh + q_start64 * stride_dobn
        row_off = b64 * stride_lb + h64 * stride_lh + q_start64
        n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        for i in range(0, n_tiles):
            # start at a program-dependent tile: neighbouring programs add to different rows
            start_m = lo + ((i + n0 // BLOCK_N) % n_tiles) * BLOCK_M
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q, do, uq, p, h, r, dpc = _bob_kt_tile(
                k, v, uk, uv, q_base, do_base, uq_base, LSE + row_off, DELTA + row_off,
                ALPHA + row_off, EE + row_off, RHO + row_off, stride_qn, stride_dn, stride_uqn,
                offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, scale,
                qk_scale, HEAD_DIM, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK, HAS_UV,
                HAS_G, NEED_KB or NEED_QB, ROWSUM, QMAJOR)
            rows_m = _rows(offs_m, LONG)
            m_ok = (offs_m < n_q)[:, None] & d_ok
            ds = p * dpc
            if NEED_VB:
                vb = _dot_acc(h, do, vb, PREC, SPLIT_COL, QMAJOR)
            if NEED_KB:
                kb = _dot_acc(r, q, kb, PREC, SPLIT_COL, QMAJOR)
                if HAS_UQ:
                    kb = _dot_acc(ds, uq, kb, PREC, False, QMAJOR)
            if NEED_QB:
                qbt = _dot_acc(r, k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), PREC,
                               SPLIT_ROW, not QMAJOR)
                if HAS_UK:
                    qbt = _dot_acc(ds, uk, qbt, PREC, False, not QMAJOR)
                tl.atomic_add(qb_base + rows_m[:, None] * stride_qbn + offs_d[None, :],
                              qbt * scale, mask=m_ok)
            if NEED_DOB:
                dobt = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                if HAS_G:
                    dobt = _dot_acc(h, v, dobt, PREC, SPLIT_ROW, not QMAJOR)
                if HAS_UV:
                    dobt = _dot_acc(p, uv, dobt, PREC, False, not QMAJOR)
                tl.atomic_add(dob_base + rows_m[:, None] * stride_dobn + offs_d[None, :], dobt,
                              mask=m_ok)
    if NEED_KB:
        kb = kb * scale
        _store_tile(KB + b64 * stride_kbb + hk64 * stride_kbh + k_start64 * stride_kbn, rows_n,
                    stride_kbn, kb.to(KB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_VB:
        _store_tile(VB + b64 * stride_vbb + hk64 * stride_vbh + k_start64 * stride_vbn, rows_n,
                    stride_vbn, vb.to(VB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)


# --------------------------------------------------------------------------- launcher


@on_input_device
def attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, *, scale, causal, window,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             needs=(True, True, True, True), precise=True, deterministic=False,
             split_row=False, split_col=False, stats=None):
    """BoB composer (contract: docs/architecture.md). Returns (qb, kb, vb, dob).

    ``uq``, ``uk``, ``uv`` are the cotangents of (dq, dk, dv), any of them None (zero,
    its work skipped at compile time). ``needs`` selects which of (qb, kb, vb, dob) are
    computed; the others come back as None. All cotangents None: every result is None.

    ``precise`` (default, as ``flash_attention(precise_bob=True)``): a statistics pass
    computes α, E first and the later passes form R and H per tile. False: the affine
    two-pass form of bob-math.md, which loses accuracy where attention is peaked (its
    α (P∘dP) K and E (P K) terms cancel: emulated bf16 relative L2 error of Q̄ / dŌ at peaked
    attention (mean max P 0.64, N=512, d=64) 1.0e-2 / 5.8e-3 affine, 5.6e-3 / 1.8e-3 precise).

    ``deterministic`` (precise only): True takes the atomic-free passes (direct row pass, then
    the column pass): bitwise reproducible. False lets the tile table (``configs.use_atomics``)
    choose the fused key-tile pass, whose Q̄ / dŌ are sums of float32 atomics.

    ``split_row`` / ``split_col`` (16-bit inputs, precise only): the direct row pass / the
    column pass enter R and H as hi + lo pairs of 16-bit tiles (two more tile products per
    tile): bf16 errors ~2.4e-3 -> ~1.9e-3 (docs/benchmarks.md).

    ``stats`` (precise only): None, or ``(alpha, ee, rho)``, float32 row vectors in ``lse``'s
    layout known to the caller: α = rowsum(P∘G), E + αD and ρ = 1 / rowsum(exp(S − L)) (None
    where unknown). The statistics pass is then skipped (where the row-sum correction is on,
    only if ``rho`` is given). With U = the tangent ẋ of a jvp they are the tangent forward's
    L̇, rowsum(dO∘Ȯ) and ρ (docs/forward-mode.md; ``attn_tangent``).
    """
    if uq is None and uk is None and uv is None:
        return None, None, None, None
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v, o, do = prep(q), prep(k), prep(v), prep(o), prep(do)
    uq, uk, uv = prep(uq), prep(uk), prep(uv)
    lse, delta = lse.contiguous(), delta.contiguous()
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    need_qb, need_kb, need_vb, need_dob = (bool(x) for x in needs)
    has_g = uq is not None or uk is not None
    col_kb, col_vb = need_kb, need_vb and has_g  # V̄ = Hᵀ dO vanishes without G
    run_col = col_kb or col_vb

    qb = new_empty(q.shape, q.dtype, q.device) if need_qb else None
    dob = new_empty(do.shape, do.dtype, do.device) if need_dob else None
    kb = new_empty(k.shape, k.dtype, k.device) if col_kb else None
    if need_vb:
        vb = new_empty(v.shape, v.dtype, v.device) if col_vb else torch.zeros(
            v.shape, dtype=v.dtype, device=v.device)
    else:
        vb = None
    precise = bool(precise)
    half = q.dtype != torch.float32
    rowsum = ROWSUM_CORRECTION[q.dtype]
    with_stats = run_col or precise  # α, E go through HBM
    given = (precise and stats is not None and stats[0] is not None and stats[1] is not None
             and (not rowsum or stats[2] is not None))  # the statistics pass is skipped
    if given:
        alpha, ee = stats[0].contiguous(), stats[1].contiguous()
        rho = stats[2].contiguous() if rowsum else lse
    else:
        alpha = new_rowvec(lay, q.device) if with_stats else lse
        ee = new_rowvec(lay, q.device) if with_stats else lse
        rho = new_rowvec(lay, q.device) if with_stats and rowsum else lse

    bd = block_d(lay.head_dim)
    varlen = lay.varlen
    cu_q, cu_k = cu_or_dummy(cu_seqlens_q, q), cu_or_dummy(cu_seqlens_k, q)
    flags = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                 CAUSAL=bool(causal), WINDOW=bool(causal) and window is not None,
                 IS_VARLEN=varlen, PREC=dot_precision(q.dtype),
                 HAS_UQ=uq is not None, HAS_UK=uk is not None, HAS_UV=uv is not None,
                 HAS_G=has_g, ROWSUM=rowsum,
                 LONG=long_rows(lay, q, k, v, o, do, uq, uk, uv, qb, kb, vb, dob))
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    need_e = need_qb or col_kb  # E is needed (by Q̄ or K̄)

    def st(x, like):
        return strides(x if x is not None else like, varlen)

    def ptr(x, like):
        return x if x is not None else like

    def row_grid(cfg):
        return (triton.cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)

    all_u = uq is not None and uk is not None and uv is not None

    def stats_pass():
        gcfg = use_gluon("bob_stats", lay, q.dtype, q.device, window=flags["WINDOW"],
                         rowsum=rowsum, tensors=(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee),
                         complete=precise and all_u)
        if gcfg is not None:  # sm_90: the Gluon pass (configs.use_gluon, gluon_bob_row.py)
            from . import gluon_bob_row

            gluon_bob_row.gluon_bob_stats(
                q, k, v, do, uq, uk, uv, lse, delta, scale=scale, causal=causal,
                block_n=gcfg.block_n, block_m=gcfg.block_m, num_warps=gcfg.num_warps,
                stages=gcfg.stages, warp_specialize=gcfg.warp_specialize,
                maxnreg=gcfg.maxnreg, out=(alpha, ee))
            return
        cfg = get_config("bob_stats", bd, q.dtype, q.device)
        _bob_stats_kernel[row_grid(cfg)](
            q, k, v, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee, rho,
            cu_q, cu_k, *st(q, q), *st(k, k), *st(v, v), *st(do, do), *st(uq, q), *st(uk, k),
            *st(uv, v), *rowvec_strides(lay), *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            NEED_E=need_e, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

    def direct_pass(stats_first):
        gcfg = use_gluon("bob_direct", lay, q.dtype, q.device, window=flags["WINDOW"],
                         rowsum=rowsum,
                         tensors=(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, qb, dob),
                         complete=(precise and all_u and need_qb and need_dob
                                   and not (half and split_row)))
        if gcfg is not None:  # sm_90: the Gluon pass (configs.use_gluon, gluon_bob_row.py)
            from . import gluon_bob_row

            if stats_first:  # the Gluon direct pass reads α, E + αD from HBM
                stats_pass()
            gluon_bob_row.gluon_bob_direct(
                q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, scale=scale, causal=causal,
                block_n=gcfg.block_n, block_m=gcfg.block_m, num_warps=gcfg.num_warps,
                stages=gcfg.stages, warp_specialize=gcfg.warp_specialize,
                maxnreg=gcfg.maxnreg, out=(qb, dob))
            return
        cfg = get_config("bob_direct", bd, q.dtype, q.device)
        _bob_direct_kernel[row_grid(cfg)](
            q, k, v, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee, rho,
            ptr(qb, q), ptr(dob, do), cu_q, cu_k,
            *st(q, q), *st(k, k), *st(v, v), *st(do, do), *st(uq, q), *st(uk, k), *st(uv, v),
            *st(qb, q), *st(dob, do), *rowvec_strides(lay), *args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_QB=need_qb, NEED_DOB=need_dob,
            SPLIT=half and split_row, STATS_FIRST=stats_first,
            WRITE_STATS=stats_first and run_col, NEED_E=need_e,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

    def affine_pass():
        cfg = get_config("bob_row", bd, q.dtype, q.device)
        _bob_affine_kernel[row_grid(cfg)](
            q, k, v, o, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee, rho,
            ptr(qb, q), ptr(dob, do), cu_q, cu_k,
            *st(q, q), *st(k, k), *st(v, v), *st(o, o), *st(do, do), *st(uq, q), *st(uk, k),
            *st(uv, v), *st(qb, q), *st(dob, do), *rowvec_strides(lay), *args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_QB=need_qb, NEED_DOB=need_dob,
            NEED_E=need_qb or col_kb, WRITE_STATS=run_col,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

    def col_pass():
        gcfg = use_gluon("bob_col", lay, q.dtype, q.device, window=flags["WINDOW"], rowsum=rowsum,
                         tensors=(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, kb, vb),
                         complete=precise and col_kb and col_vb and not (half and split_col))
        if gcfg is not None:  # sm_90: the Gluon pass (configs.use_gluon, gluon_bob_col.py)
            from . import gluon_bob_col

            gluon_bob_col.gluon_bob_col(
                q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, None, scale=scale,
                causal=causal, block_n=gcfg.block_n, block_m=gcfg.block_m,
                num_warps=gcfg.num_warps, stages=gcfg.stages,
                warp_specialize=gcfg.warp_specialize, maxnreg=gcfg.maxnreg, out=(kb, vb))
            return
        cfg = get_config("bob_col", bd, q.dtype, q.device)
        _bob_col_kernel[(triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)](
            q, k, v, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee, rho,
            ptr(kb, k), ptr(vb if col_vb else None, v), cu_q, cu_k,
            *st(q, q), *st(k, k), *st(v, v), *st(do, do),
            *st(uq, q), *st(uk, k), *st(uv, v), *st(kb, k), *st(vb if col_vb else None, v),
            *rowvec_strides(lay), *args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_KB=col_kb, NEED_VB=col_vb,
            SPLIT=half and split_col, QMAJOR=cfg.qmajor,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

    def fused_pass():
        f32 = torch.float32
        qb_acc = (qb.zero_() if not half else torch.zeros(q.shape, dtype=f32, device=q.device)
                  ) if need_qb else None
        dob_acc = (dob.zero_() if not half else torch.zeros(do.shape, dtype=f32, device=q.device)
                   ) if need_dob else None
        if k.numel() > 0 and lay.n_k > 0:
            cfg = get_config("bob_fused", bd, q.dtype, q.device)
            _bob_fused_kernel[(triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)](
                q, k, v, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee, rho,
                ptr(kb, k), ptr(vb if col_vb else None, v), ptr(qb_acc, q), ptr(dob_acc, do),
                cu_q, cu_k,
                *st(q, q), *st(k, k), *st(v, v), *st(do, do),
                *st(uq, q), *st(uk, k), *st(uv, v), *st(kb, k), *st(vb if col_vb else None, v),
                *st(qb_acc, q), *st(dob_acc, do), *rowvec_strides(lay), *args,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_QB=need_qb, NEED_KB=col_kb,
                NEED_VB=col_vb, NEED_DOB=need_dob, SPLIT_ROW=half and split_row,
                SPLIT_COL=half and split_col, QMAJOR=cfg.qmajor,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
        if half and need_qb:
            qb.copy_(qb_acc)
        if half and need_dob:
            dob.copy_(dob_acc)

    rows_work = q.numel() > 0 and lay.n_q > 0
    cols_work = run_col and k.numel() > 0 and lay.n_k > 0
    if not precise:
        if rows_work and (need_qb or need_dob or run_col):
            affine_pass()
        if cols_work:
            col_pass()
        return qb, kb, vb, dob
    direct = need_qb or need_dob
    if direct and not deterministic and use_atomics("bob", lay.n_k, q.dtype, q.device):
        if rows_work and not given:
            stats_pass()
        fused_pass()
        return qb, kb, vb, dob
    if given:
        if rows_work and direct:
            direct_pass(stats_first=False)
    elif rows_work and (direct or run_col):
        if direct and fuse_row_sweeps(lay.n_k, bd, q.dtype, q.device):
            direct_pass(stats_first=True)  # one launch: statistics sweep, then direct sweep
        else:
            stats_pass()
            if direct:
                direct_pass(stats_first=False)
    if cols_work:
        col_pass()
    return qb, kb, vb, dob
