"""First backward, key-tile pass: dK, dV of one key tile, summed over the query tiles (and,
for GQA, the g query heads) that see it: no atomics, bitwise reproducible.

    P = exp(S − L)·ρ,  dP = dO Vᵀ,  dS = P∘(dP − D)
    dK = τ dSᵀ Q,   dV = Pᵀ dO

It reads D (and, with ROWSUM, ρ, j*, c and D − c) as the dQ pass (dq.py) wrote them. Score
tiles are (keys x queries) or, with ``QMAJOR``, (queries x keys) (common.py, ``_kt_*``). On
sm_90 the plan may run the Gluon version instead (gluon/dkdv.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_NO_SPECIALIZE, _dot_acc, _kt_dot, _kt_k, _kt_probs, _kt_program,
                     _kt_prologue, _kt_q, _load_index, _load_rowvec, _load_tile, _lse_log2,
                     _lse_nat, _query_tile_range, _row_off, _rows, _store_view, _tile_base)


@triton.jit
def _attn_bwd_kt_tile(k, v, q_base, do_base, l_base, d_base, sh_rows, stride_qn, stride_dn,
                      offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                      window, qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                      PREC: tl.constexpr, ROWSUM: tl.constexpr, QMAJOR: tl.constexpr):
    """Query tile ``offs_m`` of a key-tile program, in (keys x queries) tiles or (QMAJOR)
    (queries x keys) tiles (common.py, ``_kt_*``): returns (q, do, p, ds). With ROWSUM, P is
    scaled by ρ and dP − D is formed as (dP − c) − (D − c) around the dominant key j*
    (``d_base`` then holds D − c, ``sh_rows`` the rows' (ρ, j*, c); None without ROWSUM)."""
    m_ok = offs_m < n_q
    rows = _rows(offs_m, LONG)
    q = _load_tile(q_base, rows, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(do_base, rows, stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    if ROWSUM:  # natural units, qk_scale = τ (common.py, _nat_probs)
        lse2 = _lse_nat(_load_rowvec(l_base, offs_m, m_ok, True))
    else:
        lse2 = _lse_log2(_load_rowvec(l_base, offs_m, m_ok, True))
    delta = _load_rowvec(d_base, offs_m, m_ok, True)
    p = _kt_probs(k, q, lse2, offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                  window, qk_scale, PREC, CAUSAL, WINDOW, QMAJOR, ROWSUM)
    dp = _kt_dot(v, do, None, PREC, QMAJOR)
    if ROWSUM:
        p = p * _kt_q(_load_rowvec(sh_rows[0], offs_m, m_ok, True), QMAJOR)
        dom = _kt_q(_load_index(sh_rows[1], offs_m, m_ok), QMAJOR) == _kt_k(offs_n, QMAJOR)
        dp = tl.where(dom, 0.0, dp - _kt_q(_load_rowvec(sh_rows[2], offs_m, m_ok, True), QMAJOR))
    ds = p * (dp - _kt_q(delta, QMAJOR))
    return q, do, p, ds


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, sh_rows,
                         stride_qn, stride_dn, offs_n, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k,
                         shift, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                         LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr,
                         QMAJOR: tl.constexpr):
    """Accumulate dK (unscaled), dV of one key tile over query tiles [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, p, ds = _attn_bwd_kt_tile(
            k, v, q_base, do_base, l_base, d_base, sh_rows, stride_qn, stride_dn,
            offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, qk_scale,
            HEAD_DIM, CAUSAL, WINDOW, EVEN_D, LONG, PREC, ROWSUM, QMAJOR)
        dv = _dot_acc(p, do, dv, PREC, False, QMAJOR)
        dk = _dot_acc(ds, q, dk, PREC, False, QMAJOR)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, SH, RS, CU, N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, QMAJOR: tl.constexpr,
    ROWSUM: tl.constexpr,
):
    """dK, dV of one key tile (summed over the query heads of its group). Tiles: views
    (common.py); LSE, DELTA: row vectors with strides RS; with ROWSUM, DELTA holds D − c and
    SH = (ρ, j*, c) are row vectors with the same strides (None without ROWSUM)."""
    n0, n_q, n_k, b64, hk64, q_start64, k_start64 = _kt_program(CU, N_Q, N_K, BLOCK_N,
                                                                 IS_VARLEN)
    if n0 >= n_k:
        return
    shift = n_k - n_q
    offs_n, offs_d, n_ok, rows_n, k, v = _kt_prologue(K, V, b64, hk64, k_start64, n0, n_k,
                                                      HEAD_DIM, BLOCK_N, BLOCK_D, EVEN_D, LONG)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    p_scale = qk_scale
    if ROWSUM:
        p_scale = scale  # P in natural units (common.py, _nat_probs)
    for g in range(0, GROUPS):
        h64 = hk64 * GROUPS + g
        row_off = _row_off(RS, b64, h64, q_start64)
        sh_rows = None
        if ROWSUM:
            sh_rows = (SH[0] + row_off, SH[1] + row_off, SH[2] + row_off)
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, _tile_base(Q, b64, h64, q_start64), _tile_base(DO, b64, h64, q_start64),
            LSE + row_off, DELTA + row_off, sh_rows, Q[3], DO[3], offs_n, offs_d, lo, mid_lo,
            mid_hi, hi, n_q, n_k, shift, window, p_scale,
            HEAD_DIM, BLOCK_M, CAUSAL, WINDOW, EVEN_D, LONG, PREC, ROWSUM, QMAJOR)
    dk = dk * scale
    _store_view(DK, b64, hk64, k_start64, rows_n, dk, n_ok, offs_d, HEAD_DIM, EVEN_D)
    _store_view(DV, b64, hk64, k_start64, rows_n, dv, n_ok, offs_d, HEAD_DIM, EVEN_D)
