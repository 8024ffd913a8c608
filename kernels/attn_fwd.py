"""Forward: O = softmax(τ Q Kᵀ) V and the row log-sum-exp L (float32), FlashAttention-style.

One program per (query tile, query head, batch) loops over the key tiles its rows can
see (online softmax in log2 units). Dense and varlen layouts share the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    _NO_SPECIALIZE,
    _key_tile_range,
    _load_tile,
    _rows,
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
from . import plan as _plan


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                    lo, mid_lo, mid_hi, hi, n_q, n_k, shift, window, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW: tl.constexpr, EVEN_D: tl.constexpr, LONG: tl.constexpr,
                    PREC: tl.constexpr):
    """Online-softmax accumulation over key tiles [lo, hi); only tiles outside
    [mid_lo, mid_hi) (band edges, ragged tail) are masked."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_k
        rows = _rows(offs_n, LONG)
        k = _load_tile(k_base, rows, stride_kn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if (start_n < mid_lo) | (start_n >= mid_hi):
            vis = _visible(offs_m[:, None], offs_n[None, :], n_q, n_k, shift, window,
                           CAUSAL, WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        corr = tl.exp2(m_i - m_use)
        l_i = l_i * corr + tl.sum(p, 1)
        v = _load_tile(v_base, rows, stride_vn, n_ok, offs_d, HEAD_DIM, True, EVEN_D)
        acc = acc * corr[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    N_Q, N_K, GROUPS, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr, LONG: tl.constexpr, PREC: tl.constexpr,
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
    # int64 bases of this (batch, head, sequence); tiles add int32 in-sequence offsets
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qn
    o_base = O + b64 * stride_ob + h64 * stride_oh + q_start64 * stride_on
    l_base = LSE + b64 * stride_lb + h64 * stride_lh + q_start64
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start64 * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start64 * stride_vn

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_q
    rows_m = _rows(offs_m, LONG)
    q = _load_tile(q_base, rows_m, stride_qn, m_ok, offs_d, HEAD_DIM, True, EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_tile_range(m0, n_q, n_k, shift, window, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, lo, mid_lo, mid_hi, hi, n_q, n_k, shift,
                                    window, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, EVEN_D,
                                    LONG, PREC)

    # rows that saw no key: l = 0 -> O = 0, L = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    _store_tile(o_base, rows_m, stride_on, o.to(O.dtype.element_ty), m_ok, offs_d, HEAD_DIM, EVEN_D)
    tl.store(l_base + offs_m, lse, mask=m_ok)


@on_input_device
def attn_fwd(q, k, v, *, scale, causal, window, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """Forward composer (contract: docs/architecture.md). Returns (o, lse).

    ``o`` is contiguous in the input dtype; ``lse`` float32, (B, H_q, N_q) dense or
    (H_q, T_q) varlen, -inf for rows that see no key. float32 inputs use IEEE float32 dots.
    """
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = prep(q), prep(k), prep(v)
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    causal_, use_window = bool(causal), bool(causal) and window is not None
    o = new_empty(q.shape, q.dtype, q.device)
    lse = new_rowvec(lay, q.device)
    if o.numel() == 0 or lay.n_q == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
        return o.zero_(), lse
    bd = block_d(lay.head_dim)
    cfg = _plan.tiles("fwd", bd, q.dtype, q.device)
    grid = (triton.cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, cu_or_dummy(cu_seqlens_q, q), cu_or_dummy(cu_seqlens_k, q),
        *strides(q, lay.varlen), *strides(k, lay.varlen), *strides(v, lay.varlen),
        *strides(o, lay.varlen), *rowvec_strides(lay),
        lay.n_q, lay.n_k, lay.groups, scale * LOG2E, int(window or 0),
        HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd,
        EVEN_D=bd == lay.head_dim, CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
        LONG=long_rows(lay, q, k, v, o), PREC=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse
