"""BoB key-tile pass: one program per (key tile, key head, batch), looping over the query
tiles (and, for GQA, the query heads of the group) that see the keys.

From the row statistics α, E + αD (and ρ) of the statistics pass, per tile (bob-math.md)

    K̄ = τ (dSᵀ U_Q + Rᵀ Q)   V̄ = Hᵀ dO

with R and H as in bob_rows.py and P scaled by ρ per tile. Score-shaped tiles are
(keys x queries) or, with ``QMAJOR``, (queries x keys) (common.py, ``_kt_*``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _NO_SPECIALIZE,
    _dot_acc,
    _kt_dot,
    _kt_probs,
    _kt_q,
    _load_rowvec,
    _load_tile,
    _lse_log2,
    _query_tile_range,
    _rows,
    _seq_info,
    _store_tile,
)


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
