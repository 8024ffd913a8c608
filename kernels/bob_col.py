"""BoB key-tile pass: one program per (key tile, key head, batch), looping over the query
tiles (and, for GQA, the query heads of the group) that see the keys.

From the row statistics α, E + αD (and ρ) of the statistics pass, per tile (bob-math.md)

    K̄ = τ (dSᵀ U_Q + Rᵀ Q)   V̄ = Hᵀ dO

with R and H as in bob_row.py and P scaled by ρ per tile. Score-shaped tiles are
(keys x queries) or, with ``QMAJOR``, (queries x keys) (common.py, ``_kt_*``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_NO_SPECIALIZE, _bob_r, _dot_acc, _kt_dot, _kt_probs, _kt_program,
                     _kt_prologue, _kt_k, _kt_q, _load_index, _load_rowvec, _load_tile, _load_view,
                     _lse_log2, _lse_nat, _query_tile_range, _row_off, _rows, _store_view,
                     _tile_base)


# --------------------------------------------------------------------------- key-tile passes


@triton.jit
def _bob_kt_tile(k, v, uk, uv, q_base, do_base, uq_base, l_base, d_base, a_base, e_base,
                 r_base, sh_rows, stride_qn, stride_dn, stride_uqn, offs_m, offs_n, offs_d,
                 start_m, mid_lo, mid_hi, n_q, n_k, shift, window, scale, qk_scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 EVEN_D: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
                 HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr,
                 HAS_G: tl.constexpr, NEED_R: tl.constexpr, ROWSUM: tl.constexpr,
                 SHIFT: tl.constexpr, QMAJOR: tl.constexpr):
    """Query tile ``offs_m`` of a key-tile program (orientation ``QMAJOR``, common.py
    ``_kt_*``): loads Q, dO (U_Q) and the row vectors, returns (q, do, uq, p, h, r, dp_d):
    P·ρ, H = P·ρ∘(G−α) (HAS_G), and with NEED_R R = P·ρ∘((G−α)∘(dP−D) + B − (E+αD)) and
    dP − D. ROWSUM (float32): P in natural units, scaled by ρ; SHIFT (and the statistics pass
    ran): dP, G, B are shifted by c, g, b at each row's dominant key j* and α, E + αD, D are
    read as α − g, F, D − c (bob_row.py, ``_bob_stats_shift_sweep``): ``sh_rows`` = the rows'
    (j*, c, g, b, D − c), None without SHIFT (``d_base``, D, is None with it; ``r_base``, ρ,
    None without ROWSUM). Absent values are placeholders."""
    m_ok = offs_m < n_q
    rows = _rows(offs_m, LONG)
    q = _load_tile(q_base, rows, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(do_base, rows, stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse = _load_rowvec(l_base, offs_m, m_ok, True)
    if ROWSUM:  # natural units (common.py, _nat_probs)
        p = _kt_probs(k, q, _lse_nat(lse), offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k,
                      shift, window, scale, PREC, CAUSAL, WINDOW, QMAJOR, True)
    else:
        p = _kt_probs(k, q, _lse_log2(lse), offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k,
                      shift, window, qk_scale, PREC, CAUSAL, WINDOW, QMAJOR)
    dom = p
    if ROWSUM:
        p = p * _kt_q(_load_rowvec(r_base, offs_m, m_ok, True), QMAJOR)
    if SHIFT:
        dom = _kt_q(_load_index(sh_rows[0], offs_m, m_ok), QMAJOR) == _kt_k(offs_n, QMAJOR)
    uq = q
    if HAS_UQ:
        uq = _load_tile(uq_base, rows, stride_uqn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    g = p
    h = p
    if HAS_G:
        alpha = _load_rowvec(a_base, offs_m, m_ok, True)
        if HAS_UQ:
            g = _kt_dot(k, uq, None, PREC, QMAJOR)
            if HAS_UK:
                g = _kt_dot(uk, q, g, PREC, QMAJOR)
        else:
            g = _kt_dot(uk, q, None, PREC, QMAJOR)
        if SHIFT:
            g = tl.where(dom, 0.0, g * scale - _kt_q(_load_rowvec(sh_rows[2], offs_m, m_ok, True),
                                                     QMAJOR)) - _kt_q(alpha, QMAJOR)
        else:
            g = g * scale - _kt_q(alpha, QMAJOR)  # G − α
        h = p * g
    r = p
    dp_d = p
    if NEED_R:
        e_ad = _load_rowvec(e_base, offs_m, m_ok, True)
        if SHIFT:
            dp_d = tl.where(dom, 0.0, _kt_dot(v, do, None, PREC, QMAJOR)
                            - _kt_q(_load_rowvec(sh_rows[1], offs_m, m_ok, True), QMAJOR))
            dp_d = dp_d - _kt_q(_load_rowvec(sh_rows[4], offs_m, m_ok, True), QMAJOR)
            b_tile = dp_d
            if HAS_UV:
                b_tile = tl.where(dom, 0.0, _kt_dot(uv, do, None, PREC, QMAJOR)
                                  - _kt_q(_load_rowvec(sh_rows[3], offs_m, m_ok, True), QMAJOR))
        else:
            delta = _load_rowvec(d_base, offs_m, m_ok, True)
            dp_d = _kt_dot(v, do, None, PREC, QMAJOR) - _kt_q(delta, QMAJOR)
            b_tile = dp_d
            if HAS_UV:
                b_tile = _kt_dot(uv, do, None, PREC, QMAJOR)
        r = _bob_r(p, g, dp_d, b_tile, _kt_q(e_ad, QMAJOR), HAS_G, HAS_UV)
    return q, do, uq, p, h, r, dp_d


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bob_col_kernel(
    Q, K, V, DO, UQ, UK, UV, KB, VB, LSE, DELTA, ALPHA, EE, RHO, SH, RS, CU,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_UQ: tl.constexpr, HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr,
    NEED_KB: tl.constexpr, NEED_VB: tl.constexpr, SPLIT: tl.constexpr, ROWSUM: tl.constexpr,
    SHIFT: tl.constexpr, QMAJOR: tl.constexpr,
):
    """Column pass: K̄ = τ (dSᵀ U_Q + Rᵀ Q) and V̄ = Hᵀ dO of one key tile, summed over the
    query tiles and the query heads of its group. Tiles: views (common.py); row vectors with
    strides RS: LSE, ALPHA, EE, and without SHIFT DELTA (and with ROWSUM RHO), with SHIFT (the
    precise float32 path) SH = (ρ, j*, c, g, b, D − c); the others are None."""
    n0, n_q, n_k, b64, hk64, q_start64, k_start64 = _kt_program(CU, N_Q, N_K, BLOCK_N,
                                                                 IS_VARLEN)
    if n0 >= n_k:
        return
    shift = n_k - n_q
    offs_n, offs_d, n_ok, rows_n, k, v = _kt_prologue(K, V, b64, hk64, k_start64, n0, n_k,
                                                      HEAD_DIM, BLOCK_N, BLOCK_D, EVEN_D, LONG)
    uk = k
    if HAS_UK:
        uk = _load_view(UK, b64, hk64, k_start64, rows_n, n_ok, offs_d, HEAD_DIM, EVEN_D)
    uv = v
    if HAS_UV:
        uv = _load_view(UV, b64, hk64, k_start64, rows_n, n_ok, offs_d, HEAD_DIM, EVEN_D)
    kb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    vb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    stride_uqn = None
    if HAS_UQ:
        stride_uqn = UQ[3]
    for grp in range(0, GROUPS):
        h64 = hk64 * GROUPS + grp
        q_base = _tile_base(Q, b64, h64, q_start64)
        do_base = _tile_base(DO, b64, h64, q_start64)
        uq_base = None
        if HAS_UQ:
            uq_base = _tile_base(UQ, b64, h64, q_start64)
        row_off = _row_off(RS, b64, h64, q_start64)
        d_rows = None
        r_rows = None
        sh_rows = None
        if SHIFT:
            r_rows = SH[0] + row_off
            sh_rows = (SH[1] + row_off, SH[2] + row_off, SH[3] + row_off, SH[4] + row_off,
                       SH[5] + row_off)
        else:
            d_rows = DELTA + row_off
            if ROWSUM:
                r_rows = RHO + row_off
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q, do, uq, p, h, r, dp_d = _bob_kt_tile(
                k, v, uk, uv, q_base, do_base, uq_base, LSE + row_off, d_rows, ALPHA + row_off,
                EE + row_off, r_rows, sh_rows, Q[3], DO[3], stride_uqn,
                offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, scale,
                qk_scale, HEAD_DIM, CAUSAL, WINDOW, EVEN_D, LONG, PREC, HAS_UQ, HAS_UK, HAS_UV,
                HAS_G, NEED_KB, ROWSUM, SHIFT, QMAJOR)
            if NEED_VB:
                vb = _dot_acc(h, do, vb, PREC, SPLIT, QMAJOR)
            if NEED_KB:
                kb = _dot_acc(r, q, kb, PREC, SPLIT, QMAJOR)
                if HAS_UQ:
                    kb = _dot_acc(p * dp_d, uq, kb, PREC, False, QMAJOR)
    if NEED_KB:
        kb = kb * scale
        _store_view(KB, b64, hk64, k_start64, rows_n, kb, n_ok, offs_d, HEAD_DIM, EVEN_D)
    if NEED_VB:
        _store_view(VB, b64, hk64, k_start64, rows_n, vb, n_ok, offs_d, HEAD_DIM, EVEN_D)
