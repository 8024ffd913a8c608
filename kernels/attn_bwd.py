"""First backward: dQ, D = rowsum(dO∘O) and ρ by query-tile programs, then dK/dV by key-tile
programs; or (``deterministic=False``) D first, then one key-tile pass that also adds dQ.

    P = exp(S − L)·ρ,  dP = dO Vᵀ,  dS = P∘(dP − D)
    dQ = τ dS K,   dK = τ dSᵀ Q,   dV = Pᵀ dO

ρ = 1 / rowsum(exp(S − L)) corrects the recomputed rows to sum to 1 (float32 holds L to
|L|·2⁻²⁴; bob.py): the dQ programs sweep whole rows, measure it, and pass it to the dK/dV
programs (``configs.ROWSUM_CORRECTION``).

Atomic-free path: a dK/dV program owns one key tile of one key head and loops over the query
tiles (and, for GQA, the g query heads) that can see it; bitwise reproducible. Atomic path
(``_attn_bwd_fused_kernel``): the same programs add τ dS K of each tile pair to a float32 dQ
buffer, which saves the dQ pass's recomputation of S, P and dP (10·d instead of 14·d flops
per (query, key) pair); float32 atomics make dQ run-to-run non-bitwise-identical, and it has
no row sweep, hence no ρ (16-bit inputs only).
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
    _rows,
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
from .configs import ROWSUM_CORRECTION, get_config, use_atomics, use_gluon


@triton.jit
def _attn_bwd_kt_tile(k, v, q_base, do_base, l_base, d_base, r_base, stride_qn, stride_dn,
                      offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window,
                      qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                      PREC: tl.constexpr, ROWSUM: tl.constexpr, QMAJOR: tl.constexpr):
    """Query tile ``offs_m`` of a key-tile program, in (keys x queries) tiles or (QMAJOR)
    (queries x keys) tiles (common.py, ``_kt_*``): returns (q, do, p, ds), P scaled by ρ
    (ROWSUM)."""
    m_ok = offs_m < n_q
    rows = _rows(offs_m, LONG)
    q = _load_tile(q_base, rows, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(do_base, rows, stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    lse2 = _lse_log2(_load_rowvec(l_base, offs_m, m_ok, True))
    di = _load_rowvec(d_base, offs_m, m_ok, True)
    p = _kt_probs(k, q, lse2, offs_m, offs_n, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                  window, qk_scale, PREC, CAUSAL, WINDOW, QMAJOR)
    if ROWSUM:
        p = p * _kt_q(_load_rowvec(r_base, offs_m, m_ok, True), QMAJOR)
    dp = _kt_dot(v, do, None, PREC, QMAJOR)
    ds = p * (dp - _kt_q(di, QMAJOR))
    return q, do, p, ds


@triton.jit
def _attn_bwd_dkdv_step(dk, dv, k, v, q_base, do_base, l_base, d_base, r_base, dq_base,
                        stride_qn, stride_dn, stride_dqn, offs_n, offs_d, start_m, mid_lo, mid_hi,
                        n_q, n_k, shift, window, scale, qk_scale, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                        WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                        PREC: tl.constexpr, ROWSUM: tl.constexpr, QMAJOR: tl.constexpr,
                        ATOMIC_DQ: tl.constexpr):
    """One query tile of a dK/dV program; with ATOMIC_DQ also add its τ dS K to the float32
    rows at ``dq_base``."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q, do, p, ds = _attn_bwd_kt_tile(
        k, v, q_base, do_base, l_base, d_base, r_base, stride_qn, stride_dn, offs_m, offs_n,
        offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, qk_scale, HEAD_DIM,
        CAUSAL, WINDOW, EVEN_D, LONG, PREC, ROWSUM, QMAJOR)
    dv = _dot_acc(p, do, dv, PREC, False, QMAJOR)
    dk = _dot_acc(ds, q, dk, PREC, False, QMAJOR)
    if ATOMIC_DQ:
        dq = _dot_acc(ds, k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), PREC, False,
                      not QMAJOR)
        ptrs = dq_base + _rows(offs_m, LONG)[:, None] * stride_dqn + offs_d[None, :]
        tl.atomic_add(ptrs, dq * scale, mask=(offs_m < n_q)[:, None] & (offs_d[None, :] < HEAD_DIM))
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, r_base, dq_base,
                         stride_qn, stride_dn, stride_dqn, offs_n, offs_d, lo, mid_lo, mid_hi,
                         hi, rot, n_q, n_k, shift, window, scale, qk_scale, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                         WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                         PREC: tl.constexpr, ROWSUM: tl.constexpr, QMAJOR: tl.constexpr,
                         ATOMIC_DQ: tl.constexpr):
    """Accumulate dK (unscaled), dV of one key tile over query tiles [lo, hi). With
    ATOMIC_DQ the sweep starts at tile ``rot`` (mod the count) so that neighbouring programs
    add to different dQ rows at a time."""
    if ATOMIC_DQ:
        n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        for i in range(0, n_tiles):
            start_m = lo + ((i + rot) % n_tiles) * BLOCK_M
            dk, dv = _attn_bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, l_base, d_base, r_base, dq_base, stride_qn,
                stride_dn, stride_dqn, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
                LONG, PREC, ROWSUM, QMAJOR, ATOMIC_DQ)
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, l_base, d_base, r_base, dq_base, stride_qn,
                stride_dn, stride_dqn, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
                LONG, PREC, ROWSUM, QMAJOR, ATOMIC_DQ)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, RHO, DK, DV, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, QMAJOR: tl.constexpr,
    ROWSUM: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """dK, dV of one key tile (summed over the query heads of its group); with ATOMIC_DQ
    the same sweep adds dQ into the float32 buffer DQ (zeroed by the caller)."""
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
    q_start64 = q_start.to(tl.int64)
    k_start64 = k_start.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < n_k
    rows_n = _rows(offs_n, LONG)
    k = _load_tile(K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn, rows_n,
                   stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    v = _load_tile(V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn, rows_n,
                   stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_tile_range(n0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW)
    for g in range(0, GROUPS):
        h64 = hk64 * GROUPS + g
        row_off = b64 * stride_lb + h64 * stride_lh + q_start64
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn,
            DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, LSE + row_off,
            DELTA + row_off, RHO + row_off,
            DQ + b64 * stride_dqb + h64 * stride_dqh + q_start64 * stride_dqn,
            stride_qn, stride_dn, stride_dqn, offs_n, offs_d, lo, mid_lo, mid_hi, hi, pid_n, n_q,
            n_k, shift, window, scale, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, CAUSAL, WINDOW, EVEN_D,
            LONG, PREC, ROWSUM, QMAJOR, ATOMIC_DQ)
    dk = dk * scale
    _store_tile(DK + b64 * stride_dkb + hk64 * stride_dkh + k_start64 * stride_dkn, rows_n,
                stride_dkn, dk.to(DK.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)
    _store_tile(DV + b64 * stride_dvb + hk64 * stride_dvh + k_start64 * stride_dvn, rows_n,
                stride_dvn, dv.to(DV.dtype.element_ty), n_ok, offs_d, HEAD_DIM, EVEN_D)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_delta_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_oh, stride_on,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_VARLEN: tl.constexpr, LONG: tl.constexpr,
):
    """D = rowsum(dO∘O) of one query tile (the atomic path has no dQ pass to form it)."""
    pid_m = tl.program_id(0)
    h64 = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_start, n_q = _seq_info(CU_Q, b, N_Q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    b64 = b.to(tl.int64)
    q_start64 = q_start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    o = _load_tile(O + b64 * stride_ob + h64 * stride_oh + q_start64 * stride_on, rows_m,
                   stride_on, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    di = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b64 * stride_lb + h64 * stride_lh + q_start64 + offs_m, di, mask=m_ok)


@triton.jit
def _attn_bwd_dq_inner(dq, r_p, q, do, lse2, di, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                       LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr):
    """Accumulate dQ (unscaled, uncorrected) and rowsum(P) (ROWSUM) of one query tile over
    key tiles [lo, hi)."""
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
        if ROWSUM:
            r_p += tl.sum(p, 1)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - di[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq, r_p


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, RHO, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_db, stride_dh, stride_dn,
    stride_dqb, stride_dqh, stride_dqn,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr,
):
    """dQ of one query tile; it also forms D = rowsum(dO∘O) and (ROWSUM) ρ = 1 / rowsum(P)
    of its rows and writes them for the dK/dV launch that follows."""
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
    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn, rows_m,
                   stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    do = _load_tile(DO + b64 * stride_db + h64 * stride_dh + q_start64 * stride_dn, rows_m,
                    stride_dn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    row_off = b64 * stride_lb + h64 * stride_lh + q_start64
    lse2 = _lse_log2(_load_rowvec(LSE + row_off, offs_m, m_ok, True))
    o = _load_tile(O + b64 * stride_ob + h64 * stride_oh + q_start64 * stride_on, rows_m,
                   stride_on, m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    di = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + row_off + offs_m, di, mask=m_ok)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    dq, r_p = _attn_bwd_dq_inner(dq, r_p, q, do, lse2, di, k_base, v_base, stride_kn, stride_vn,
                                 offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window,
                                 qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG, PREC,
                                 ROWSUM)
    if ROWSUM:
        rho = 1.0 / tl.where(r_p > 0.0, r_p, 1.0)
        tl.store(RHO + row_off + offs_m, rho, mask=m_ok)
        dq = dq * (rho * scale)[:, None]
    else:
        dq = dq * scale
    _store_tile(DQ + b64 * stride_dqb + h64 * stride_dqh + q_start64 * stride_dqn, rows_m,
                stride_dqn, dq.to(DQ.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)


@on_input_device
def attn_bwd(q, k, v, o, lse, do, *, scale, causal, window, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """First-backward composer (contract: docs/architecture.md). Returns (dq, dk, dv, delta).

    ``dk``/``dv`` are summed over the query heads of each key head (GQA). ``delta`` is the
    float32 row vector rowsum(dO ∘ O), in the layout of ``lse``. ``deterministic=False`` lets
    the table (``configs.use_atomics``) choose the atomic path: dQ added by the dK/dV
    programs (float32 atomics, not bitwise reproducible).
    """
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v, o, do = prep(q), prep(k), prep(v), prep(o), prep(do)
    lse = lse.contiguous()
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    use_window = bool(causal) and window is not None
    atomic = not deterministic and use_atomics("bwd", lay.n_k, q.dtype, q.device)
    rowsum = ROWSUM_CORRECTION[q.dtype] and not atomic
    dq = new_empty(q.shape, q.dtype, q.device)
    dk = new_empty(k.shape, k.dtype, k.device)
    dv = new_empty(v.shape, v.dtype, v.device)
    bd = block_d(lay.head_dim)
    prec = dot_precision(q.dtype)
    cu_q, cu_k = cu_or_dummy(cu_seqlens_q, q), cu_or_dummy(cu_seqlens_k, q)
    common = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                  CAUSAL=bool(causal), WINDOW=use_window, IS_VARLEN=lay.varlen, PREC=prec,
                  LONG=long_rows(lay, q, k, v, o, do, dq, dk, dv))
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    delta = new_rowvec(lay, q.device)
    rho = new_rowvec(lay, q.device) if rowsum else delta
    dq_acc = dq
    rows_work = dq.numel() and lay.n_q > 0
    if atomic:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if rows_work:
            bm = 64
            _attn_bwd_delta_kernel[(triton.cdiv(lay.n_q, bm), lay.h_q, lay.batch)](
                o, do, delta, cu_q, *strides(o, lay.varlen), *strides(do, lay.varlen),
                *rowvec_strides(lay), lay.n_q, HEAD_DIM=lay.head_dim, BLOCK_M=bm, BLOCK_D=bd,
                EVEN_D=bd == lay.head_dim, IS_VARLEN=lay.varlen, LONG=common["LONG"])
    elif rows_work:
        # dQ first: its programs also form D = rowsum(dO∘O) and ρ, which dK/dV read
        cfg = get_config("bwd_dq", bd, q.dtype, q.device)
        grid = (triton.cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
        _attn_bwd_dq_kernel[grid](
            q, k, v, o, do, lse, delta, rho, dq, cu_q, cu_k,
            *strides(q, lay.varlen), *strides(k, lay.varlen), *strides(v, lay.varlen),
            *strides(o, lay.varlen), *strides(do, lay.varlen), *strides(dq, lay.varlen),
            *rowvec_strides(lay), *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            ROWSUM=rowsum, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )
    elif dq.numel():
        dq.zero_()
        delta.zero_()
    if dk.numel():
        gcfg = use_gluon("bwd_dkdv", lay, q.dtype, q.device, window=use_window, rowsum=rowsum,
                         tensors=(q, k, v, do, lse, delta, dk, dv), complete=not atomic)
        if gcfg is not None:  # sm_90: the Gluon pass (configs.use_gluon, gluon_dkdv.py)
            from . import gluon_dkdv

            gluon_dkdv.gluon_dkdv(q, k, v, do, lse, delta, scale=scale, causal=causal,
                                  block_n=gcfg.block_n, block_m=gcfg.block_m,
                                  num_warps=gcfg.num_warps, maxnreg=gcfg.maxnreg, out=(dk, dv))
        elif lay.n_k > 0:
            cfg = get_config("bwd_fused" if atomic else "bwd_dkdv", bd, q.dtype, q.device)
            grid = (triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
            _attn_bwd_dkdv_kernel[grid](
                q, k, v, do, lse, delta, rho, dk, dv, dq_acc, cu_q, cu_k,
                *strides(q, lay.varlen), *strides(k, lay.varlen), *strides(v, lay.varlen),
                *strides(do, lay.varlen), *strides(dk, lay.varlen), *strides(dv, lay.varlen),
                *strides(dq_acc, lay.varlen), *rowvec_strides(lay), *args,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, QMAJOR=cfg.qmajor, ROWSUM=rowsum, ATOMIC_DQ=atomic,
                **common,
            )
        else:
            dk.zero_()
            dv.zero_()
    if atomic and dq.numel():
        dq.copy_(dq_acc)
    return dq, dk, dv, delta
