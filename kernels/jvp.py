"""Tangent forward: O, L and their tangents Ȯ, L̇ in one pass (forward-mode AD of attention).

With the tangent (Q̇, K̇, V̇) of the inputs (docs/forward-mode.md):

    Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ)      L̇ = rowsum(P∘Ṡ)      Ȯ = (P∘Ṡ) V − L̇ ∘ O + P V̇

One program per (query tile, query head, batch) loops over the key tiles its rows can see,
like the forward, with online softmax: besides the forward's accumulator of P V it keeps a
second tile × d accumulator of (P∘Ṡ) V + P V̇ and the row sum of P∘Ṡ, rescaled together.
A missing tangent (None) removes its products (constexpr flags).

Rounding: Ȯ subtracts L̇ O from (P∘Ṡ) V, which cancels where Ṡ has a large per-row offset
(a K̇ shared by every key moves every score of a row by the same amount and changes nothing).
The kernel subtracts a per-row reference c from Ṡ before rounding P∘(Ṡ − c) to the input
dtype, (P∘(Ṡ − c)) V − (L̇ − c) O being the same Ȯ; c is the P-weighted mean of Ṡ over the
first key tile where the row has mass (before it every accumulator is 0, so fixing c then
needs no correction).

Per (query, key) pair: 2d flops for S, 2d per present Q̇ / K̇ for Ṡ, 2d each for P V,
(P∘Ṡ) V and P V̇: 12d with every tangent (the forward alone: 4d).

Tiles: the ``jvp`` kind of configs.py (both kernels), through ``plan.tiles``; an override
``configs.tile_overrides({"jvp": ...})`` wins, as for every kind.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_key_tile, _row_probs, _row_scores, _NO_SPECIALIZE, _key_tile_range,
                     _load_rowvec, _load_tile, _load_view, _online_softmax_step, _lse_log2,
                     _row_off, _row_program, _store_tile, _tile_base, _tile_offsets, _tile_base_or)
from .host import (block_d, cdiv, cu_seqlens, dot_precision, layout, long_rows, new_like,
                   new_rowvec, on_input_device, prep, rowvec_strides, view)
from . import plan as _plan
from .launch import launch

__all__ = ["attn_jvp", "attn_tangent"]


@triton.jit
def _tangent_prologue(Q, K, V, QD, KD, VD, O, OD, RS, b64, h64, hk64, q_start64, k_start64,
                      m0, n_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                      HAS_QD: tl.constexpr, HAS_KD: tl.constexpr, HAS_VD: tl.constexpr):
    """What both tangent programs set up first: the bases of O, Ȯ, the row vectors and the
    key side (K̇, V̇ with their token strides; K's and V's for an absent tangent, never read
    then), the query tile's offsets, and its Q (and Q̇; q itself without HAS_QD)."""
    q_base = _tile_base(Q, b64, h64, q_start64)
    o_base = _tile_base(O, b64, h64, q_start64)
    od_base = _tile_base(OD, b64, h64, q_start64)
    l_off = _row_off(RS, b64, h64, q_start64)
    k_base = _tile_base(K, b64, hk64, k_start64)
    v_base = _tile_base(V, b64, hk64, k_start64)
    kd_base, stride_kdn = _tile_base_or(KD, b64, hk64, k_start64, k_base, K[3], HAS_KD)
    vd_base, stride_vdn = _tile_base_or(VD, b64, hk64, k_start64, v_base, V[3], HAS_VD)
    offs_m, offs_d, m_ok, rows_m = _tile_offsets(m0, n_q, BLOCK_M, BLOCK_D, LONG)
    q = _load_tile(q_base, rows_m, Q[3], m_ok, offs_d, HEAD_DIM, True, EVEN_D)
    qd = q
    if HAS_QD:
        qd = _load_view(QD, b64, h64, q_start64, rows_m, m_ok, offs_d, HEAD_DIM, EVEN_D)
    return (o_base, od_base, l_off, k_base, v_base, kd_base, vd_base, stride_kdn, stride_vdn,
            offs_m, offs_d, m_ok, rows_m, q, qd)


@triton.jit
def _tangent_psd(q, qd, k, p, p_sum, ref, has_ref, kd_base, rows, stride_kdn, n_ok, offs_d, scale,
                 HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
                 HAS_QD: tl.constexpr, HAS_KD: tl.constexpr):
    """P∘(Ṡ − c) of one key tile, Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ), with the row reference c fixed at the
    first tile where the row has mass: (P∘(Ṡ − c), c, 1 where c is fixed)."""
    if HAS_QD:
        sd = tl.dot(qd, tl.trans(k), input_precision=PREC)
        if HAS_KD:
            kd = _load_tile(kd_base, rows, stride_kdn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
            sd = tl.dot(q, tl.trans(kd), sd, input_precision=PREC)
    else:
        kd = _load_tile(kd_base, rows, stride_kdn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        sd = tl.dot(q, tl.trans(kd), input_precision=PREC)
    psd = p * (sd * scale)
    first = (has_ref == 0.0) & (p_sum > 0.0)
    ref = tl.where(first, tl.sum(psd, 1) / tl.where(first, p_sum, 1.0), ref)
    has_ref = tl.where(first, 1.0, has_ref)
    psd = psd - p * ref[:, None]
    return psd, ref, has_ref


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_jvp_kernel(
    Q, K, V, QD, KD, VD, O, OD, LSE, LSED, RS, CU, N_Q, N_K, GROUPS, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_QD: tl.constexpr, HAS_KD: tl.constexpr, HAS_VD: tl.constexpr,
):
    """O, L, Ȯ, L̇ of one query tile. Tiles: views (common.py); LSE, LSED: row vectors with
    strides RS."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    (o_base, od_base, l_off, k_base, v_base, kd_base, vd_base, stride_kdn, stride_vdn, offs_m,
     offs_d, m_ok, rows_m, q, qd) = _tangent_prologue(
        Q, K, V, QD, KD, VD, O, OD, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, HEAD_DIM,
        BLOCK_M, BLOCK_D, EVEN_D, LONG, HAS_QD, HAS_KD, HAS_VD)
    stride_on, stride_odn = O[3], OD[3]
    stride_kn, stride_vn = K[3], V[3]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)    # Σ P V
    acc_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # Σ (P∘(Ṡ − c)) V + P V̇
    sbar = tl.zeros([BLOCK_M], dtype=tl.float32)            # Σ P∘(Ṡ − c)
    ref = tl.zeros([BLOCK_M], dtype=tl.float32)             # c (fixed at the first tile with mass)
    has_ref = tl.zeros([BLOCK_M], dtype=tl.float32)          # 1 once c is fixed
    qk_scale = scale * 1.4426950408889634

    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                      BLOCK_N, EVEN_D, LONG)
        s = _row_scores(q, k, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift, window,
                        qk_scale, PREC, CAUSAL, WINDOW)
        p, corr, m_new = _online_softmax_step(s, m_i)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        p_sum = tl.sum(p, 1)
        l_i = l_i * corr + p_sum
        acc = acc * corr[:, None]
        acc_t = acc_t * corr[:, None]
        sbar = sbar * corr
        if HAS_QD or HAS_KD:
            psd, ref, has_ref = _tangent_psd(q, qd, k, p, p_sum, ref, has_ref, kd_base, rows,
                                             stride_kdn, n_ok, offs_d, scale, HEAD_DIM, EVEN_D,
                                             PREC, HAS_QD, HAS_KD)
            sbar = sbar + tl.sum(psd, 1)
            acc_t = tl.dot(psd.to(v.dtype), v, acc_t, input_precision=PREC)
        p16 = p.to(v.dtype)
        acc = tl.dot(p16, v, acc, input_precision=PREC)
        if HAS_VD:
            vd = _load_tile(vd_base, rows, stride_vdn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
            acc_t = tl.dot(p16, vd, acc_t, input_precision=PREC)
        m_i = m_new

    # rows that saw no key: l = 0 -> O = Ȯ = 0, L = -inf, L̇ = 0
    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    o = acc * inv[:, None]
    sbar = sbar * inv
    od = acc_t * inv[:, None] - sbar[:, None] * o
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    lsed = tl.where(empty, 0.0, sbar + ref)
    _store_tile(o_base, rows_m, stride_on, o.to(O[0].dtype.element_ty), m_ok, offs_d, HEAD_DIM,
                EVEN_D)
    _store_tile(od_base, rows_m, stride_odn, od.to(OD[0].dtype.element_ty), m_ok, offs_d, HEAD_DIM,
                EVEN_D)
    tl.store(LSE + l_off + offs_m, lse, mask=m_ok)
    tl.store(LSED + l_off + offs_m, lsed, mask=m_ok)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_tangent_kernel(
    Q, K, V, QD, KD, VD, O, OD, LSE, LSED, RHO, RS, CU, N_Q, N_K, GROUPS, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
    HAS_QD: tl.constexpr, HAS_KD: tl.constexpr, HAS_VD: tl.constexpr,
):
    """Tangent of a computed forward: Ȯ, L̇ and ρ of one query tile from the forward's O and L.
    P = exp(S − L) needs no online softmax and no P V: one tile x d accumulator of
    (P∘(Ṡ − c)) V + P V̇, the row sums of P∘(Ṡ − c) and of P (ρ = 1 / rowsum(P) normalises the
    recomputed rows, as in the backward passes)."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    (o_base, od_base, l_off, k_base, v_base, kd_base, vd_base, stride_kdn, stride_vdn, offs_m,
     offs_d, m_ok, rows_m, q, qd) = _tangent_prologue(
        Q, K, V, QD, KD, VD, O, OD, RS, b64, h64, hk64, q_start64, k_start64, m0, n_q, HEAD_DIM,
        BLOCK_M, BLOCK_D, EVEN_D, LONG, HAS_QD, HAS_KD, HAS_VD)
    stride_on, stride_odn = O[3], OD[3]
    stride_kn, stride_vn = K[3], V[3]
    lse2 = _lse_log2(_load_rowvec(LSE + l_off, offs_m, m_ok, True))

    acc_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # Σ (P∘(Ṡ − c)) V + P V̇
    sbar = tl.zeros([BLOCK_M], dtype=tl.float32)            # Σ P∘(Ṡ − c)
    r_p = tl.zeros([BLOCK_M], dtype=tl.float32)             # Σ P
    ref = tl.zeros([BLOCK_M], dtype=tl.float32)             # c (fixed at the first tile with mass)
    has_ref = tl.zeros([BLOCK_M], dtype=tl.float32)          # 1 once c is fixed
    qk_scale = scale * 1.4426950408889634

    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                      BLOCK_N, EVEN_D, LONG)
        p = _row_probs(q, k, lse2, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift,
                       window, qk_scale, PREC, CAUSAL, WINDOW)
        p_sum = tl.sum(p, 1)
        r_p += p_sum
        if HAS_QD or HAS_KD:
            psd, ref, has_ref = _tangent_psd(q, qd, k, p, p_sum, ref, has_ref, kd_base, rows,
                                             stride_kdn, n_ok, offs_d, scale, HEAD_DIM, EVEN_D,
                                             PREC, HAS_QD, HAS_KD)
            sbar += tl.sum(psd, 1)
            v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
            acc_t = tl.dot(psd.to(v.dtype), v, acc_t, input_precision=PREC)
        if HAS_VD:
            vd = _load_tile(vd_base, rows, stride_vdn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
            acc_t = tl.dot(p.to(vd.dtype), vd, acc_t, input_precision=PREC)

    # rows that see no key: P = 0 -> Ȯ = 0, L̇ = 0, ρ = 1
    empty = r_p == 0.0
    rho = 1.0 / tl.where(empty, 1.0, r_p)
    sbar = sbar * rho
    o = _load_tile(o_base, rows_m, stride_on, m_ok, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    od = acc_t * rho[:, None] - sbar[:, None] * o
    lsed = tl.where(empty, 0.0, sbar + ref)
    _store_tile(od_base, rows_m, stride_odn, od.to(OD[0].dtype.element_ty), m_ok, offs_d, HEAD_DIM,
                EVEN_D)
    tl.store(LSED + l_off + offs_m, lsed, mask=m_ok)
    tl.store(RHO + l_off + offs_m, rho, mask=m_ok)


# --------------------------------------------------------------------------- launcher


@on_input_device
def attn_jvp(q, k, v, qd, kd, vd, *, scale, causal, window, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """Tangent-forward composer: returns ``(o, lse, od, lsed)``.

    ``qd``, ``kd``, ``vd``: tangents of q, k, v (their shapes and dtype), any of them None
    (a zero tangent: its products are skipped). ``o``, ``od`` contiguous in the input dtype;
    ``lse``, ``lsed`` float32 row vectors, (B, H_q, N_q) dense or (H_q, T_q) varlen; a row
    that sees no key has o = od = 0, lse = -inf, lsed = 0. Layouts, masks and GQA as
    :func:`attn_fwd` (docs/architecture.md).
    """
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = prep(q), prep(k), prep(v)
    qd, kd, vd = prep(qd), prep(kd), prep(vd)
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    causal_, use_window = bool(causal), bool(causal) and window is not None
    o = new_like(q)
    od = new_like(q)
    lse = new_rowvec(lay, q.device)
    lsed = new_rowvec(lay, q.device)
    if o.numel() == 0 or lay.n_q == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
            lsed.zero_()
        return o.zero_(), lse, od.zero_(), lsed
    bd = block_d(lay.head_dim)
    cfg = _plan.tiles("jvp", bd, q.dtype, q.device)
    grid = (cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
    launch(
        _attn_jvp_kernel, grid,
        *(view(x, lay.varlen) for x in (q, k, v, qd, kd, vd, o, od)),
        lse, lsed, rowvec_strides(lay),
        cu_seqlens(cu_seqlens_q, cu_seqlens_k, q),
        lay.n_q, lay.n_k, lay.groups, scale, int(window or 0),
        HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd,
        EVEN_D=bd == lay.head_dim, CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
        LONG=long_rows(lay, q, k, v, o, qd, kd, vd, od), PREC=dot_precision(q.dtype),
        HAS_QD=qd is not None, HAS_KD=kd is not None, HAS_VD=vd is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse, od, lsed


@on_input_device
def attn_tangent(q, k, v, o, lse, qd, kd, vd, *, scale, causal, window, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Tangent of a computed forward: returns ``(od, lsed, rho)`` from the forward's ``o`` and
    ``lse`` (as :func:`attn_fwd` returns them) in direction ``(qd, kd, vd)`` (any of them None).

    P = exp(S − L) is recomputed from ``lse``, so the pass has no online softmax and no P V:
    10·d flops per (query, key) pair with every tangent, against 12·d for :func:`attn_jvp`
    (which also forms O and L). ``od`` is contiguous in the input dtype; ``lsed`` and ``rho``
    = 1 / rowsum(exp(S − L)) (the row-sum correction of the backward passes, 1 on rows that
    see no key) are float32 row vectors in ``lse``'s layout. Rows that see no key get od = 0,
    lsed = 0.
    """
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v, o = prep(q), prep(k), prep(v), prep(o)
    qd, kd, vd = prep(qd), prep(kd), prep(vd)
    lse = lse.contiguous()
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    causal_, use_window = bool(causal), bool(causal) and window is not None
    od = new_like(q)
    lsed = new_rowvec(lay, q.device)
    rho = new_rowvec(lay, q.device)
    if od.numel() == 0 or lay.n_q == 0:
        if lsed.numel():
            lsed.zero_()
            rho.fill_(1.0)
        return od.zero_(), lsed, rho
    bd = block_d(lay.head_dim)
    cfg = _plan.tiles("jvp", bd, q.dtype, q.device)
    grid = (cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
    launch(
        _attn_tangent_kernel, grid,
        *(view(x, lay.varlen) for x in (q, k, v, qd, kd, vd, o, od)),
        lse, lsed, rho, rowvec_strides(lay),
        cu_seqlens(cu_seqlens_q, cu_seqlens_k, q),
        lay.n_q, lay.n_k, lay.groups, scale, int(window or 0),
        HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd,
        EVEN_D=bd == lay.head_dim, CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
        LONG=long_rows(lay, q, k, v, o, qd, kd, vd, od), PREC=dot_precision(q.dtype),
        HAS_QD=qd is not None, HAS_KD=kd is not None, HAS_VD=vd is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return od, lsed, rho
