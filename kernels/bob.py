"""FlashBoB: exact backward-over-backward of softmax attention in two passes (bob-math.md).

Given cotangents U_Q, U_K, U_V of (dQ, dK, dV), with per tile

    P = exp(S − L)   dP = dO Vᵀ   G = τ (U_Q Kᵀ + Q U_Kᵀ)   B = dO U_Vᵀ
    α = rowsum(P∘G)  E = rowsum(P∘G∘dP) − 2αD + rowsum(P∘B)

- the **row pass** (one program per query tile, looping over key tiles) keeps six α-free
  tile×d accumulators

      dS U_K,  (P∘(G∘(dP−D)+B)) K,  (P∘dP) K,  P K,  (P∘G) V,  P U_V

  and three row sums, then forms α, E and

      Q̄  = τ [dS U_K + (P∘(G∘(dP−D)+B)) K − α (P∘dP) K − E (P K)]
      dŌ = (P∘G) V + P U_V − α O

  writing Q̄, dŌ and the row vectors α, E;
- the **column pass** (one program per key tile and key head, looping over query tiles and
  the g query heads of the group) recomputes S, P, dP, G, B, reads L, D, α, E and
  accumulates

      K̄ = τ (dSᵀ U_Q + Rᵀ Q),   R = P∘(G∘(dP−D) − α dP + B − E)
      V̄ = Hᵀ dO,                 H = P∘(G − α)

No N×N tensor touches HBM; the extra memory is the two row vectors α, E. A missing
cotangent removes its products at compile time (constexpr flags), and the column pass is
skipped when neither K̄ nor V̄ is needed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import (
    LOG2E,
    _NO_SPECIALIZE,
    _key_tile_range,
    _kt_dot,
    _kt_probs,
    _kt_q,
    _load_rowvec,
    _load_tile,
    _rows,
    _dot_acc,
    _lse_log2,
    _query_tile_range,
    _row_tile_id,
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
from .configs import get_config


# --------------------------------------------------------------------------- row pass


@triton.jit
def _bob_row_inner(
    a_dsuk, a_tk, a_pdpk, a_pk, a_pgv, a_puv, r_alpha, r_gdp, r_b,
    q, do, uq, lse2, di, al, ee, k_base, v_base, uk_base, uv_base,
    stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
    lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
    PREC: tl.constexpr, HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
    HAS_G: tl.constexpr, NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, NEED_DP: tl.constexpr,
    DIRECT: tl.constexpr, SPLIT: tl.constexpr,
):
    """Row-pass accumulation of one query tile over key tiles [lo, hi); tiles outside
    [mid_lo, mid_hi) are masked. NEED_DP: dP and B are needed (for Q̄ or for E).

    Two-pass (affine) mode: the six α-free accumulators dS U_K, (P∘(G∘(dP−D)+B)) K,
    (P∘dP) K, P K, (P∘G) V, P U_V and the row sums α, rowsum(P∘G∘dP), rowsum(P∘B).
    DIRECT mode (α = ``al``, E = ``ee`` known from a stats pass): a_dsuk = dS U_K + R K and
    a_pgv = H V + P U_V, with R, H formed per tile (no cancellation between accumulators).
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_k
        rows = _rows(offs_n, LONG)
        k = _load_tile(k_base, rows, stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if (start_n < mid_lo) | (start_n >= mid_hi):
            vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window,
                           CAUSAL, WINDOW)
            p = tl.where(vis, p, 0.0)
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
            if DIRECT:
                g = g * scale - al[:, None]  # G − α
            else:
                g = g * scale
        if DIRECT:  # ee = E + αD; R = P∘((G−α)∘(dP−D) + B − ee), H = P∘(G−α)
            if NEED_DOB:
                if HAS_G:
                    a_pgv = _dot_acc(p * g, v, a_pgv, PREC, SPLIT)
                if HAS_UV:
                    a_pgv = tl.dot(p.to(uv.dtype), uv, a_pgv, input_precision=PREC)
            if NEED_QB:
                dpc = dp - di[:, None]
                if HAS_G:
                    r = g * dpc
                    if HAS_UV:
                        r += bm
                else:
                    r = bm
                r = p * (r - ee[:, None])
                a_dsuk = _dot_acc(r, k, a_dsuk, PREC, SPLIT)
                if HAS_UK:
                    a_dsuk = tl.dot((p * dpc).to(uk.dtype), uk, a_dsuk, input_precision=PREC)
        elif not (NEED_QB or NEED_DOB):  # statistics only: α and rowsum(P∘(G∘dP + B))
            if HAS_G:
                r_alpha += tl.sum(p * g, 1)
                if NEED_DP:
                    if HAS_UV:
                        r_gdp += tl.sum(p * (g * dp + bm), 1)
                    else:
                        r_gdp += tl.sum(p * (g * dp), 1)
            elif HAS_UV:
                if NEED_DP:
                    r_b += tl.sum(p * bm, 1)
        else:
            if HAS_G:
                pg = p * g
                r_alpha += tl.sum(pg, 1)
                if NEED_DP:
                    r_gdp += tl.sum(pg * dp, 1)
            if HAS_UV:
                if NEED_DP:
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
    return a_dsuk, a_tk, a_pdpk, a_pk, a_pgv, a_puv, r_alpha, r_gdp, r_b


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_row_kernel(
    Q, K, V, O, DO, UQ, UK, UV, LSE, DELTA, QB, DOB, ALPHA, EE, CU_Q, CU_K,
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
    NEED_QB: tl.constexpr, NEED_DOB: tl.constexpr, NEED_DP: tl.constexpr, WRITE_AE: tl.constexpr,
    DIRECT: tl.constexpr, SPLIT: tl.constexpr, STATS_FIRST: tl.constexpr = False,
    STATS_DP: tl.constexpr = False,
):
    pid_m = _row_tile_id(CAUSAL)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU_Q, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU_K, b, N_K, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    shift = n_k - n_q
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = (h // GROUPS).to(tl.int64)
    q_start64 = q_start.to(tl.int64)
    k_start64 = k_start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    row_off = b64 * stride_lb + h64 * stride_lh + q_start64

    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn, rows_m,
                   stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    if HAS_UQ:
        uq = _load_tile(UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn, rows_m,
                        stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    else:
        uq = q
    lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    di = _load_rowvec(DELTA + row_off, offs_m, m_ok, True)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn
    uk_base = UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn
    uv_base = UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    if STATS_FIRST:  # DIRECT with the statistics pass's sweep in this program (same rows)
        zt = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        zr = tl.zeros([BLOCK_M], dtype=tl.float32)
        _, _, _, _, _, _, al, r_gdp, r_b = _bob_row_inner(
            zt, zt, zt, zt, zt, zt, zr, zr, zr,
            q, do, uq, lse2, di, di, di, k_base, v_base, uk_base, uv_base,
            stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
            lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
            HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, False, False, STATS_DP, False, False)
        ee = r_gdp - al * di + r_b  # E + αD
        if WRITE_AE:
            tl.store(ALPHA + row_off + offs_m, al, mask=m_ok)
            tl.store(EE + row_off + offs_m, ee, mask=m_ok)
    elif DIRECT:  # α, E + αD from the stats pass
        al = _load_rowvec(ALPHA + row_off, offs_m, m_ok, True)
        ee = _load_rowvec(EE + row_off, offs_m, m_ok, True)
    else:
        al = di
        ee = di

    a_dsuk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_tk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pdpk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_pgv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a_puv = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    r_alpha = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_gdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_b = tl.zeros([BLOCK_M], dtype=tl.float32)

    a_dsuk, a_tk, a_pdpk, a_pk, a_pgv, a_puv, r_alpha, r_gdp, r_b = _bob_row_inner(
        a_dsuk, a_tk, a_pdpk, a_pk, a_pgv, a_puv, r_alpha, r_gdp, r_b,
        q, do, uq, lse2, di, al, ee, k_base, v_base, uk_base, uv_base,
        stride_kn, stride_vn, stride_ukn, stride_uvn, offs_m, offs_d,
        lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
        HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
        HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_QB, NEED_DOB, NEED_DP, DIRECT, SPLIT)

    if DIRECT:
        qb = a_dsuk * scale
        dob = a_pgv
    else:
        alpha = r_alpha
        ee = r_gdp - 2.0 * alpha * di + r_b
        qb = (a_dsuk + a_tk - alpha[:, None] * a_pdpk - ee[:, None] * a_pk) * scale
        dob = a_pgv + a_puv
        if HAS_G:
            if NEED_DOB:
                o = _load_tile(O + b64 * stride_ob + h64 * stride_oh + q_start64 * stride_on,
                               rows_m, stride_on, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
                dob -= alpha[:, None] * o.to(tl.float32)
        if WRITE_AE:
            tl.store(ALPHA + row_off + offs_m, alpha, mask=m_ok)
            tl.store(EE + row_off + offs_m, ee + alpha * di, mask=m_ok)  # E + αD
    if NEED_QB:
        _store_tile(QB + b64 * stride_qbb + h64 * stride_qbh + q_start64 * stride_qbn, rows_m,
                    stride_qbn, qb.to(QB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_DOB:
        _store_tile(DOB + b64 * stride_dobb + h64 * stride_dobh + q_start64 * stride_dobn, rows_m,
                    stride_dobn, dob.to(DOB.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)


# --------------------------------------------------------------------------- column pass


@triton.jit
def _bob_col_inner(
    kb, vb, k, v, uk, uv, q_base, do_base, uq_base, l_base, d_base, a_base, e_base,
    stride_qn, stride_dn, stride_uqn, offs_n, offs_d,
    lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
    PREC: tl.constexpr, HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
    HAS_G: tl.constexpr,
    NEED_KB: tl.constexpr, NEED_VB: tl.constexpr,
    SPLIT: tl.constexpr, QMAJOR: tl.constexpr,
):
    """Column-pass accumulation of one key tile over query tiles [lo, hi), in (keys x
    queries) tiles or (QMAJOR) (queries x keys) tiles (common.py, ``_kt_*``); query tiles
    outside [mid_lo, mid_hi) are masked. ``e_base`` holds E + αD."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_q
        rows = _rows(offs_m, LONG)
        q = _load_tile(q_base, rows, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
        do = _load_tile(do_base, rows, stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
        lse2 = _lse_log2(_load_rowvec(l_base, offs_m, m_ok, True))
        di = _load_rowvec(d_base, offs_m, m_ok, True)
        p = _kt_probs(k, q, lse2, offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                      window, qk_scale, PREC, CAUSAL, WINDOW, QMAJOR)
        dp = _kt_dot(v, do, None, PREC, QMAJOR)
        if HAS_G:
            al = _load_rowvec(a_base, offs_m, m_ok, True)
            if HAS_UQ:
                uq = _load_tile(uq_base, rows, stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
                g = _kt_dot(k, uq, None, PREC, QMAJOR)
                if HAS_UK:
                    g = _kt_dot(uk, q, g, PREC, QMAJOR)
            else:
                g = _kt_dot(uk, q, None, PREC, QMAJOR)
            g = g * scale - _kt_q(al, QMAJOR)  # G − α
            if NEED_VB:
                vb = _dot_acc(p * g, do, vb, PREC, SPLIT, QMAJOR)
        if NEED_KB:
            ee = _load_rowvec(e_base, offs_m, m_ok, True)
            dpc = dp - _kt_q(di, QMAJOR)
            if HAS_G:
                r = g * dpc
                if HAS_UV:
                    r += _kt_dot(uv, do, None, PREC, QMAJOR)
            else:
                r = _kt_dot(uv, do, None, PREC, QMAJOR)
            r = p * (r - _kt_q(ee, QMAJOR))
            kb = _dot_acc(r, q, kb, PREC, SPLIT, QMAJOR)
            if HAS_UQ:
                kb = _dot_acc(p * dpc, uq, kb, PREC, False, QMAJOR)
    return kb, vb


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_col_kernel(
    Q, K, V, DO, UQ, UK, UV, LSE, DELTA, ALPHA, EE, KB, VB, CU_Q, CU_K,
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
    NEED_KB: tl.constexpr, NEED_VB: tl.constexpr,
    SPLIT: tl.constexpr, QMAJOR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU_Q, b, N_Q, IS_VARLEN)
    k_start, n_k = _seq_info(CU_K, b, N_K, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= n_k:
        return
    shift = n_k - n_q
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < n_k
    k_start64 = k_start.to(tl.int64)
    rows_n = _rows(offs_n, LONG)
    k = _load_tile(K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn, rows_n,
                   stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    v = _load_tile(V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn, rows_n,
                   stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    if HAS_UK:
        uk = _load_tile(UK + b64 * stride_ukb + hk64 * stride_ukh + k_start64 * stride_ukn,
                        rows_n, stride_ukn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    else:
        uk = k
    if HAS_UV:
        uv = _load_tile(UV + b64 * stride_uvb + hk64 * stride_uvh + k_start64 * stride_uvn,
                        rows_n, stride_uvn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    else:
        uv = v
    kb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    vb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    q_start64 = q_start.to(tl.int64)
    for g in range(0, GROUPS):
        h64 = hk64 * GROUPS + g
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn
        do_base = DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn
        uq_base = UQ + b64 * stride_uqb + h64 * stride_uqh + q_start64 * stride_uqn
        row_off = b64 * stride_lb + h64 * stride_lh + q_start64
        kb, vb = _bob_col_inner(
            kb, vb, k, v, uk, uv, q_base, do_base, uq_base, LSE + row_off, DELTA + row_off,
            ALPHA + row_off, EE + row_off, stride_qn, stride_dn, stride_uqn, offs_n, offs_d,
            lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale, qk_scale,
            HEAD_DIM, BLOCK_M, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
            HAS_UQ, HAS_UK, HAS_UV, HAS_G, NEED_KB, NEED_VB, SPLIT, QMAJOR)
    if NEED_KB:
        kb = kb * scale
        _store_tile(KB + b64 * stride_kbb + hk64 * stride_kbh + k_start64 * stride_kbn, rows_n,
                    stride_kbn, kb.to(KB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_VB:
        _store_tile(VB + b64 * stride_vbb + hk64 * stride_vbh + k_start64 * stride_vbn, rows_n,
                    stride_vbn, vb.to(VB.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)


# --------------------------------------------------------------------------- launcher

#: Whether the column pass enters R and H as hi + lo 16-bit pairs when ``precise`` (two more
#: tile products per tile, ~13% of the BoB time at N=16,384): bf16 K̄ / V̄ relative error
#: 2.35e-3 -> 1.85e-3 / 1.66e-3 (N=1,024, GPT-2 shape). Off by default;
#: ``TTT_FLASH_BOB_COL_SPLIT=1`` (read at import) turns it on.
COL_SPLIT = os.environ.get("TTT_FLASH_BOB_COL_SPLIT", "0") == "1"
#: The same for the direct row pass (R K and H V): Q̄ / dŌ 2.37e-3 / 2.34e-3 -> 1.86e-3 /
#: 1.91e-3. ``TTT_FLASH_BOB_ROW_SPLIT=1`` turns it on.
ROW_SPLIT = os.environ.get("TTT_FLASH_BOB_ROW_SPLIT", "0") == "1"
#: Longest key sequence for which the statistics and direct row sweeps run in one launch (when
#: their tiles agree). Short sequences are host-bound, so a launch less counts (H200, N=1,024:
#: chain 2.26 -> 1.89 ms with D also formed in the dQ launch). At N=65,536 the chain measured
#: 425.5 ms with one launch against 420.9 / 421.5 ms with two in earlier runs of the same day
#: (not one A/B run), so long sequences keep one launch per sweep.
FUSED_ROW_MAX_KEYS = 8192


@on_input_device
def attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, *, scale, causal, window,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             needs=(True, True, True, True), allow_tf32=False, precise=False):
    """BoB composer (contract: docs/architecture.md). Returns (qb, kb, vb, dob).

    ``uq``, ``uk``, ``uv`` are the cotangents of (dq, dk, dv), any of them None (zero,
    its work skipped at compile time). ``needs`` selects which of (qb, kb, vb, dob) are
    computed; the others come back as None. All cotangents None: every result is None.

    ``precise``: a third, cheap pass first computes the row statistics α, E (five
    score-shaped products per tile, no accumulators); the row pass then forms R and H per
    tile (Q̄ = τ(dS U_K + R K), dŌ = H V + P U_V) instead of the affine α/E decomposition.
    The affine two-pass form loses accuracy where attention is peaked (its α (P∘dP) K and
    E (P K) terms cancel): emulated bf16 relative L2 error of Q̄ / dŌ at peaked attention
    (mean max P 0.64, N=512, d=64) 1.0e-2 / 5.8e-3 affine, 5.6e-3 / 1.8e-3 precise (with the
    split below). On the H200 the precise form is also the faster one. ``COL_SPLIT`` /
    ``ROW_SPLIT`` (environment ``TTT_FLASH_BOB_COL_SPLIT=1``, ``TTT_FLASH_BOB_ROW_SPLIT=1``)
    enter R and H as hi + lo pairs of 16-bit tiles: bf16 errors ~2.4e-3 -> ~1.9e-3, at two
    more tile products per tile in each pass.
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
    direct = precise and (need_qb or need_dob)  # row pass with α, E known
    with_stats = run_col or direct  # α, E go through HBM
    alpha = new_rowvec(lay, q.device) if with_stats else lse
    ee = new_rowvec(lay, q.device) if with_stats else lse

    bd = block_d(lay.head_dim)
    varlen = lay.varlen
    cu_q, cu_k = cu_or_dummy(cu_seqlens_q, q), cu_or_dummy(cu_seqlens_k, q)
    flags = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                 CAUSAL=bool(causal), WINDOW=bool(causal) and window is not None,
                 IS_VARLEN=varlen, PREC=dot_precision(q.dtype, allow_tf32),
                 HAS_UQ=uq is not None, HAS_UK=uk is not None, HAS_UV=uv is not None,
                 HAS_G=has_g, SPLIT=precise and q.dtype != torch.float32,
                 LONG=long_rows(lay, q, k, v, o, do, uq, uk, uv, qb, kb, vb, dob))
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))

    def st(x, like):
        return strides(x if x is not None else like, varlen)

    def ptr(x, like):
        return x if x is not None else like

    def row_pass(kind, **mode):
        cfg = get_config(kind, bd, q.dtype, q.device)
        grid = (triton.cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
        _bob_row_kernel[grid](
            q, k, v, o, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta,
            ptr(qb, q), ptr(dob, do), alpha, ee, cu_q, cu_k,
            *st(q, q), *st(k, k), *st(v, v), *st(o, o), *st(do, do),
            *st(uq, q), *st(uk, k), *st(uv, v), *st(qb, q), *st(dob, do),
            *rowvec_strides(lay), *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dict(flags, **mode),
        )

    if q.numel() > 0 and lay.n_q > 0:
        stats_dp = need_qb or col_kb  # E is needed (by Q̄ or K̄)
        if (precise and direct and lay.n_k <= FUSED_ROW_MAX_KEYS
                and get_config("bob_stats", bd, q.dtype, q.device)
                == get_config("bob_direct", bd, q.dtype, q.device)):
            # same tiles, short keys: one program sweeps its keys twice (statistics, then
            # direct), one launch less
            row_pass("bob_direct", NEED_QB=need_qb, NEED_DOB=need_dob, NEED_DP=need_qb,
                     WRITE_AE=run_col, DIRECT=True, SPLIT=flags["SPLIT"] and ROW_SPLIT,
                     STATS_FIRST=True, STATS_DP=stats_dp)
        elif precise:
            if with_stats:  # stats pass: α (and E when Q̄ or K̄ needs it)
                row_pass("bob_stats", NEED_QB=False, NEED_DOB=False, NEED_DP=stats_dp,
                         WRITE_AE=True, DIRECT=False)
            if direct:
                row_pass("bob_direct", NEED_QB=need_qb, NEED_DOB=need_dob, NEED_DP=need_qb,
                         WRITE_AE=False, DIRECT=True,
                         SPLIT=flags["SPLIT"] and ROW_SPLIT)
        elif need_qb or need_dob or run_col:
            row_pass("bob_row", NEED_QB=need_qb, NEED_DOB=need_dob, NEED_DP=need_qb or col_kb,
                     WRITE_AE=run_col, DIRECT=False)
    if run_col and k.numel() > 0 and lay.n_k > 0:
        cfg = get_config("bob_col", bd, q.dtype, q.device)
        grid = (triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
        _bob_col_kernel[grid](
            q, k, v, do, ptr(uq, q), ptr(uk, k), ptr(uv, v), lse, delta, alpha, ee,
            ptr(kb, k), ptr(vb if col_vb else None, v), cu_q, cu_k,
            *st(q, q), *st(k, k), *st(v, v), *st(do, do),
            *st(uq, q), *st(uk, k), *st(uv, v), *st(kb, k), *st(vb if col_vb else None, v),
            *rowvec_strides(lay), *args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_KB=col_kb, NEED_VB=col_vb,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            QMAJOR=cfg.qmajor, **dict(flags, SPLIT=flags["SPLIT"] and COL_SPLIT),
        )
    return qb, kb, vb, dob
