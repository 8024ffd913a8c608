"""First backward: dQ, D = rowsum(dO∘O) and ρ by query-tile programs, then dK/dV by key-tile
programs.

    P = exp(S − L)·ρ,  dP = dO Vᵀ,  dS = P∘(dP − D)
    dQ = τ dS K,   dK = τ dSᵀ Q,   dV = Pᵀ dO

Float32 inputs (``configs.ROWSUM_CORRECTION``; bob-math.md, "Row sums of the recomputed P"):
P is recomputed in natural units, ρ = 1 / rowsum(exp(S − L)) corrects its rows to sum to 1,
and dP − D is formed as (dP − c) − (D − c), c = dP at the row's dominant key j* (where
P ≈ 1, dP − D cancels to a small rest). The dQ programs sweep whole rows twice (scores only,
for ρ and j*; then dQ and D − c) and pass ρ, j*, c, D − c to the dK/dV programs. 16-bit
inputs compile none of this.

A dK/dV program owns one key tile of one key head and loops over the query tiles (and, for
GQA, the g query heads) that can see it: no atomics, bitwise reproducible. On sm_90 the dK/dV
pass runs as the Gluon kernel where the plan selects it (plan.py, gluon/dkdv.py), and so does the
dQ pass (gluon/dq.py: dQ and D, without ρ).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _key_tile,
    _row_probs,
    LOG2E,
    _NO_SPECIALIZE,
    _dot_acc,
    _key_tile_range,
    _kt_dot,
    _kt_probs,
    _kt_program,
    _kt_prologue,
    _kt_k,
    _kt_q,
    _load_rowvec,
    _load_tile,
    _load_view,
    _load_index,
    _lse_log2,
    _lse_nat,
    _nat_probs,
    _visible,
    _store_index,
    _query_tile_range,
    _row_off,
    _row_program,
    _rows,
    _store_view,
    _tile_base,
)
from .host import (
    block_d,
    cu_or_dummy,
    dot_precision,
    layout,
    long_rows,
    new_empty,
    new_rowvec,
    new_rowvecs,
    on_input_device,
    prep,
    rowvec_strides,
    view,
)
from . import plan as _plan


@triton.jit
def _attn_bwd_kt_tile(k, v, q_base, do_base, l_base, d_base, r_base, j_base, c_base, stride_qn,
                      stride_dn, offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift,
                      window, qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                      PREC: tl.constexpr, ROWSUM: tl.constexpr, QMAJOR: tl.constexpr):
    """Query tile ``offs_m`` of a key-tile program, in (keys x queries) tiles or (QMAJOR)
    (queries x keys) tiles (common.py, ``_kt_*``): returns (q, do, p, ds). With ROWSUM, P is
    scaled by ρ and dP − D is formed as (dP − c) − (D − c) around the dominant key j*
    (``d_base`` then holds D − c, ``c_base`` c, ``j_base`` j*)."""
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
        p = p * _kt_q(_load_rowvec(r_base, offs_m, m_ok, True), QMAJOR)
        dom = _kt_q(_load_index(j_base, offs_m, m_ok), QMAJOR) == _kt_k(offs_n, QMAJOR)
        dp = tl.where(dom, 0.0, dp - _kt_q(_load_rowvec(c_base, offs_m, m_ok, True), QMAJOR))
    ds = p * (dp - _kt_q(delta, QMAJOR))
    return q, do, p, ds


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, r_base, j_base, c_base,
                         stride_qn, stride_dn, offs_n, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k,
                         shift, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                         LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr,
                         QMAJOR: tl.constexpr):
    """Accumulate dK (unscaled), dV of one key tile over query tiles [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, p, ds = _attn_bwd_kt_tile(
            k, v, q_base, do_base, l_base, d_base, r_base, j_base, c_base, stride_qn, stride_dn,
            offs_m, offs_n, offs_d, start_m, mid_lo, mid_hi, n_q, n_k, shift, window, qk_scale,
            HEAD_DIM, CAUSAL, WINDOW, EVEN_D, LONG, PREC, ROWSUM, QMAJOR)
        dv = _dot_acc(p, do, dv, PREC, False, QMAJOR)
        dk = _dot_acc(ds, q, dk, PREC, False, QMAJOR)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, RHO, SH, RS, CU, N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, QMAJOR: tl.constexpr,
    ROWSUM: tl.constexpr,
):
    """dK, dV of one key tile (summed over the query heads of its group). Tiles: views
    (common.py); LSE, DELTA, RHO and SH = (j*, c): row vectors with strides RS (with ROWSUM,
    DELTA holds D − c; SH is read only then)."""
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
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, _tile_base(Q, b64, h64, q_start64), _tile_base(DO, b64, h64, q_start64),
            LSE + row_off, DELTA + row_off, RHO + row_off, SH[0] + row_off, SH[1] + row_off, Q[3],
            DO[3], offs_n, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, p_scale,
            HEAD_DIM, BLOCK_M, CAUSAL, WINDOW, EVEN_D, LONG, PREC, ROWSUM, QMAJOR)
    dk = dk * scale
    _store_view(DK, b64, hk64, k_start64, rows_n, dk, n_ok, offs_d, HEAD_DIM, EVEN_D)
    _store_view(DV, b64, hk64, k_start64, rows_n, dv, n_ok, offs_d, HEAD_DIM, EVEN_D)


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
    Q, K, V, O, DO, DQ, LSE, DELTA, RHO, SH, RS, CU, N_Q, N_K, GROUPS, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, ROWSUM: tl.constexpr,
):
    """dQ of one query tile; it also forms D = rowsum(dO∘O) of its rows and writes it (the
    BoB reads it). With ROWSUM (float32) a first sweep finds ρ = 1 / rowsum(P), the dominant
    key j* of each row, c = dP there and D − c, and the dQ sweep forms dP − D as
    (dP − c) − (D − c) (bob-math.md, "Row sums of the recomputed P"); ρ and SH = (j*, c,
    D − c) are written for the dK/dV launch that follows."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
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
        tl.store(RHO + row_off + offs_m, rho, mask=m_ok)
        _store_index(SH[0] + row_off, offs_m, jstar, m_ok)
        tl.store(SH[1] + row_off + offs_m, cref, mask=m_ok)
        tl.store(SH[2] + row_off + offs_m, dtil, mask=m_ok)
    else:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, offs_m, delta, k_base, v_base, K[3],
                                V[3], offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift,
                                window, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D, LONG,
                                PREC, False)
        dq = dq * scale
    _store_view(DQ, b64, h64, q_start64, rows_m, dq, m_ok, offs_d, HEAD_DIM, EVEN_D)


@on_input_device
def attn_bwd(q, k, v, o, lse, do, *, scale, causal, window, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """First-backward composer (contract: docs/architecture.md). Returns (dq, dk, dv, delta).

    ``dk``/``dv`` are summed over the query heads of each key head (GQA). ``delta`` is the
    float32 row vector rowsum(dO ∘ O), in the layout of ``lse``. ``deterministic`` is
    accepted for the contract: both passes are atomic-free, so results are bitwise
    reproducible run to run whatever its value.
    """
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v, o, do = prep(q), prep(k), prep(v), prep(o), prep(do)
    lse = lse.contiguous()
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    use_window = bool(causal) and window is not None
    p = _plan.bwd(lay, q.dtype, q.device, window=use_window,
                  contiguous=q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
                  and do.is_contiguous(), o_contiguous=o.is_contiguous())
    dq = new_empty(q.shape, q.dtype, q.device)
    dk = new_empty(k.shape, k.dtype, k.device)
    dv = new_empty(v.shape, v.dtype, v.device)
    bd = block_d(lay.head_dim)
    cu = (cu_or_dummy(cu_seqlens_q, q), cu_or_dummy(cu_seqlens_k, q))
    common = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                  CAUSAL=bool(causal), WINDOW=use_window, IS_VARLEN=lay.varlen,
                  PREC=dot_precision(q.dtype), LONG=long_rows(lay, q, k, v, o, do, dq, dk, dv))
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    if p.rowsum:  # float32: ρ, j*, c and D − c for the dK/dV pass (attn_bwd_dq_kernel)
        delta, rho, jstar, cref, dtil = new_rowvecs(lay, q.device, 5)
    else:
        delta = rho = jstar = cref = dtil = new_rowvec(lay, q.device)
    if dq.numel() and lay.n_q > 0 and p.dq.gluon:
        # dQ first: its programs also form D = rowsum(dO∘O), which dK/dV read (never ρ:
        # the plan takes the Gluon pass only without the row-sum correction)
        from .gluon import dq as _gluon_dq  # imported where it runs: sm_90

        cfg = p.dq.tiles
        _gluon_dq.launch_dq(q, k, v, o, do, lse, scale=scale, causal=causal,
                            block_n=cfg.block_n, block_m=cfg.block_m, num_warps=cfg.num_warps,
                            stages=cfg.stages, warp_specialize=cfg.warp_specialize,
                            consumers=cfg.consumers, maxnreg=cfg.maxnreg, out=(dq, delta))
    elif dq.numel() and lay.n_q > 0:
        # dQ first: its programs also form D = rowsum(dO∘O) and ρ, which dK/dV read
        cfg = p.dq.tiles
        grid = (triton.cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
        _attn_bwd_dq_kernel[grid](
            *(view(x, lay.varlen) for x in (q, k, v, o, do, dq)), lse, delta, rho,
            (jstar, cref, dtil), rowvec_strides(lay), cu, *args, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, ROWSUM=p.rowsum, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common,
        )
    elif dq.numel():
        dq.zero_()
        delta.zero_()
    if dk.numel():
        cfg = p.dkdv.tiles
        if p.dkdv.gluon:
            from .gluon import dkdv as _gluon_dkdv  # imported where it runs: sm_90

            _gluon_dkdv.launch_dkdv(q, k, v, do, lse, delta, scale=scale, causal=causal,
                                    block_n=cfg.block_n, block_m=cfg.block_m,
                                    num_warps=cfg.num_warps, consumers=cfg.consumers,
                                    stages=cfg.stages, maxnreg=cfg.maxnreg, out=(dk, dv))
        elif lay.n_k > 0:
            grid = (triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
            _attn_bwd_dkdv_kernel[grid](
                *(view(x, lay.varlen) for x in (q, k, v, do, dk, dv)), lse,
                dtil if p.rowsum else delta, rho, (jstar, cref), rowvec_strides(lay), cu, *args,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, QMAJOR=cfg.qmajor, ROWSUM=p.rowsum, **common,
            )
        else:
            dk.zero_()
            dv.zero_()
    return dq, dk, dv, delta
