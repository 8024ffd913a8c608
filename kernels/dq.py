"""First backward, query-tile pass: dQ and D = rowsum(dO∘O) (and ρ) of one query tile.

    P = exp(S − L)·ρ,  dP = dO Vᵀ,  dS = P∘(dP − D),  dQ = τ dS K

Float32 inputs (``configs.ROWSUM_CORRECTION``; bob-math.md, "Row sums of the recomputed P"):
P is recomputed in natural units, ρ = 1 / rowsum(exp(S − L)) corrects its rows to sum to 1,
and dP − D is formed as (dP − c) − (D − c), c = dP at the row's dominant key j* (where
P ≈ 1, dP − D cancels to a small rest). The program then sweeps its row twice (scores only,
for ρ and j*; then dQ and D − c) and writes ρ, j*, c, D − c for the dK/dV pass (dkdv.py).
16-bit inputs compile none of this. On sm_90 the plan may run the Gluon version instead
(gluon/dq.py: dQ and D, without ρ).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_NO_SPECIALIZE, _key_tile, _key_tile_range, _load_rowvec, _load_tile,
                     _load_view, _lse_log2, _lse_nat, _nat_probs, _row_off, _row_probs,
                     _row_program, _store_index, _store_view, _tile_base, _tile_offsets, _visible)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, jstar, cref, k_base, v_base, stride_kn, stride_vn,
                       offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                       LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr):
    """Accumulate dQ (unscaled; with ROWSUM uncorrected, P in natural units and dP − D formed
    as (dP − c) − (D − c): ``delta`` holds D − c, 0 at the dominant key ``jstar``) of one query
    tile over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                      BLOCK_N, EVEN_D, LONG)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        p = _row_probs(q, k, lse2, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift,
                       window, qk_scale, PREC, CAUSAL, WINDOW, ROWSUM)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if ROWSUM:
            dp = tl.where(offs_n[None, :] == jstar[:, None], 0.0, dp - cref[:, None])
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq_stats(q, do, lse, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo,
                       mid_lo, mid_hi, hi, n_q, n_k, shift, window, scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                       LONG: tl.constexpr, PREC: tl.constexpr):
    """The float32 row statistics of one query tile over key tiles [lo, hi), P̂ = exp(S − L)
    uncorrected (natural units): (j*, c, rowsum(P̂), rowsum(P̂ x)) with j* the first key of
    largest S, c = dP there and x = dP − c (0 at j*). j* and c are those of the keys seen so
    far; when they move, the sum so far is re-shifted, rowsum(P̂ x) += (c_old − c_new)
    rowsum(P̂) (exact: the old j*'s x becomes c_old − c_new), a small term where it matters,
    since the keys before a dominant one carry little P̂."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    jstar = tl.zeros([BLOCK_M], dtype=tl.int32)
    cref = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_x = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                          BLOCK_N, EVEN_D, LONG)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = _nat_probs(qk, scale, lse[:, None])
        if (start_n < mid_lo) | (start_n >= mid_hi):
            vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window, CAUSAL,
                           WINDOW)
            p = tl.where(vis, p, 0.0)
            qk = tl.where(vis, qk, float("-inf"))
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        t_max = tl.max(qk, 1)
        t_arg = start_n + tl.argmax(qk, 1).to(tl.int32)
        better = t_max > m
        c_new = tl.where(better, tl.sum(tl.where(offs_n[None, :] == t_arg[:, None], dp, 0.0), 1),
                         cref)
        r_x += (cref - c_new) * r_p
        jstar = tl.where(better, t_arg, jstar)
        cref = c_new
        m = tl.maximum(m, t_max)
        r_x += tl.sum(p * tl.where(offs_n[None, :] == jstar[:, None], 0.0, dp - cref[:, None]), 1)
        r_p += tl.sum(p, 1)
    return jstar, cref, r_p, r_x


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, SH, RS, CU, N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr,
):
    """dQ of one query tile; it also forms D = rowsum(dO∘O) of its rows and writes it (the
    BoB reads it). With ROWSUM (float32) a first sweep finds ρ = 1 / rowsum(P), the dominant
    key j* of each row, c = dP there and D − c, and the dQ sweep forms dP − D as
    (dP − c) − (D − c) (bob-math.md, "Row sums of the recomputed P"), and SH = (ρ, j*, c,
    D − c), row vectors with the strides RS of LSE and DELTA, are written for the dK/dV launch
    that follows (SH is None without ROWSUM)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    offs_m, offs_d, m_ok, rows_m = _tile_offsets(m0, n_q, BLOCK_M, BLOCK_D, LONG)
    q = _load_view(Q, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    do = _load_view(DO, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    row_off = _row_off(RS, b64, h64, q_start64)
    if ROWSUM:  # natural units (common.py, _nat_probs)
        lse2 = _lse_nat(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    else:
        lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    o = _load_view(O, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + row_off + offs_m, delta, mask=m_ok)
    k_base = _tile_base(K, b64, hk64, k_start64)
    v_base = _tile_base(V, b64, hk64, k_start64)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    if ROWSUM:
        jstar, cref, r_p, r_x = _attn_bwd_dq_stats(
            q, do, lse2, k_base, v_base, K[3], V[3], offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q,
            n_k, shift, window, scale, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG,
            PREC)
        rho = 1.0 / tl.where(r_p > 0.0, r_p, 1.0)
        dtil = r_x * rho  # D − c
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, dtil, jstar, cref, k_base, v_base, K[3], V[3],
                                offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window,
                                scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
                                True)
        dq = dq * (rho * scale)[:, None]
        tl.store(SH[0] + row_off + offs_m, rho, mask=m_ok)
        _store_index(SH[1] + row_off, offs_m, jstar, m_ok)
        tl.store(SH[2] + row_off + offs_m, cref, mask=m_ok)
        tl.store(SH[3] + row_off + offs_m, dtil, mask=m_ok)
    else:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, None, None, k_base, v_base, K[3],
                                V[3], offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift,
                                window, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG,
                                PREC, False)
        dq = dq * scale
    _store_view(DQ, b64, h64, q_start64, rows_m, dq, m_ok, offs_d, HEAD_DIM, EVEN_D)
