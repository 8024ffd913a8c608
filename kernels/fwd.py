"""Forward: O = softmax(τ Q Kᵀ) V and the row log-sum-exp L (float32), FlashAttention-style.

One program per (query tile, query head, batch) loops over the key tiles its rows can
see (online softmax in log2 units). Dense and varlen layouts share the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (_key_tile, _row_scores, LOG2E, _NO_SPECIALIZE, _key_tile_range, _load_tile,
                     _online_softmax_step, _row_base, _row_program, _store_tile, _tile_base,
                     _tile_offsets)
from .host import (block_d, call_cache, cdiv, cu_seqlens, dot_precision, layout, long_rows,
                   new_like, new_rowvec, on_input_device, prep, remember, rowvec_strides, view)
from . import configs
from . import plan as _plan
from .launch import launch


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                    lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                    PREC: tl.constexpr, NAT: tl.constexpr):
    """Online-softmax accumulation over key tiles [lo, hi); only tiles outside
    [mid_lo, mid_hi) (band edges, ragged tail) are masked. Scores and the running max are in
    log2 units, or with NAT (float32) in natural units (``qk_scale`` = τ), converted only after
    the subtraction (common.py, ``_nat_probs``)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, rows, k = _key_tile(k_base, stride_kn, start_n, n_k, offs_d, HEAD_DIM,
                                      BLOCK_N, EVEN_D, LONG)
        s = _row_scores(q, k, offs_m, offs_n, start_n, mid_lo, mid_hi, n_q, n_k, shift, window,
                        qk_scale, PREC, CAUSAL, WINDOW)
        p, corr, m_new = _online_softmax_step(s, m_i, NAT)
        l_i = l_i * corr + tl.sum(p, 1)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        acc = acc * corr[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_fwd_kernel(
    Q, K, V, O, LSE, RS, CU, N_Q, N_K, GROUPS, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr, NAT: tl.constexpr,
):
    """O and L of one query tile. Q, K, V, O: views (common.py); LSE: a row vector with
    strides RS; CU: (cu_seqlens_q, cu_seqlens_k); ``qk_scale``: τ·log2 e, or τ with NAT."""
    m0, n_q, n_k, b64, h64, hk64, q_start64, k_start64 = _row_program(
        CU, N_Q, N_K, GROUPS, BLOCK_M, CAUSAL, IS_VARLEN)
    if m0 >= n_q:
        return
    shift = n_k - n_q
    # int64 bases of this (batch, head, sequence); tiles add int32 in-sequence offsets
    q_base = _tile_base(Q, b64, h64, q_start64)
    o_base = _tile_base(O, b64, h64, q_start64)
    l_base = _row_base(LSE, RS, b64, h64, q_start64)
    k_base = _tile_base(K, b64, hk64, k_start64)
    v_base = _tile_base(V, b64, hk64, k_start64)
    stride_qn, stride_kn, stride_vn, stride_on = Q[3], K[3], V[3], O[3]

    offs_m, offs_d, m_ok, rows_m = _tile_offsets(m0, n_q, BLOCK_M, BLOCK_D, LONG)
    q = _load_tile(q_base, rows_m, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift,
                                    window, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D,
                                    LONG, PREC, NAT)

    # rows that saw no key: l = 0 -> O = 0, L = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NAT:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe) * 0.6931471805599453)
    else:
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    _store_tile(o_base, rows_m, stride_on, o.to(O[0].dtype.element_ty), m_ok, offs_d, HEAD_DIM,
                EVEN_D)
    tl.store(l_base + offs_m, lse, mask=m_ok)


_CALLS = call_cache()  # dense calls: key -> (lay, plan, grid, nat, launch keywords)


def _fwd_call(q, k, v, o, lay, causal_, use_window):
    """What a forward call's launch is, apart from its tensors and scalars: (lay, plan, grid,
    nat, launch keywords); the grid and keywords None for a Gluon plan."""
    p = _plan.fwd(lay, q.dtype, q.device, window=use_window,
                  contiguous=q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    if p.gluon:
        return lay, p, None, None, None
    cfg = p.tiles
    bd = block_d(lay.head_dim)
    grid = (cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
    nat = q.element_size() == 4  # float32: scores in natural units (_attn_fwd_inner)
    meta = dict(
        HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd,
        EVEN_D=bd == lay.head_dim, CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
        LONG=long_rows(lay, q, k, v, o), PREC=dot_precision(q.dtype), NAT=nat,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return lay, p, grid, nat, meta


@on_input_device
def attn_fwd(q, k, v, *, scale, causal, window, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """Forward composer (contract: docs/architecture.md). Returns (o, lse).

    ``o`` is contiguous in the input dtype; ``lse`` float32, (B, H_q, N_q) dense or
    (H_q, T_q) varlen, -inf for rows that see no key. float32 inputs use IEEE float32 dots.
    The plan (``plan.fwd``) runs the sm_90 Gluon forward (``gluon/fwd.py``) where its scope
    allows, the Triton kernel below everywhere else. A dense call's launch is cached per call
    shape (``host.call_cache``).
    """
    q, k, v = prep(q), prep(k), prep(v)
    causal_ = bool(causal)
    use_window = causal_ and window is not None
    key = call = None
    if cu_seqlens_q is None:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
               causal_, use_window, configs.generation())
        call = _CALLS.get(key)
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) if call is None else call[0]
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    o = new_like(q)
    lse = new_rowvec(lay, q.device)
    if o.numel() == 0 or lay.n_q == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
        return o.zero_(), lse
    if call is None:
        call = _fwd_call(q, k, v, o, lay, causal_, use_window)
        if key is not None:
            remember(_CALLS, key, call)
    _, p, grid, nat, meta = call
    if p.gluon:
        from .gluon import fwd as _gluon_fwd  # imported where it runs: sm_90

        cfg = p.tiles
        _gluon_fwd.launch_fwd(q, k, v, scale=scale, causal=causal_, block_n=cfg.block_n,
                              block_m=cfg.block_m, num_warps=cfg.num_warps, stages=cfg.stages,
                              warp_specialize=cfg.warp_specialize, consumers=cfg.consumers,
                              pingpong=cfg.pingpong, maxnreg=cfg.maxnreg, out=(o, lse))
        return o, lse
    varlen = lay.varlen
    launch(
        _attn_fwd_kernel, grid,
        view(q, varlen), view(k, varlen), view(v, varlen), view(o, varlen),
        lse, rowvec_strides(lay), cu_seqlens(cu_seqlens_q, cu_seqlens_k, q),
        lay.n_q, lay.n_k, lay.groups, scale if nat else scale * LOG2E, int(window or 0),
        **meta,
    )
    return o, lse
