"""First backward: the composer ``attn_bwd``. It runs the dQ pass (dq.py; it also forms
D = rowsum(dO∘O), and ρ with the row-sum correction), then the dK/dV pass (dkdv.py), each as
its Triton kernel or, where the plan (plan.py) selects it, its sm_90 Gluon kernel
(gluon/dq.py, gluon/dkdv.py).

    P = exp(S − L),  dP = dO Vᵀ,  D = rowsum(dO∘O),  dS = P∘(dP − D)
    dQ = τ dS K,   dK = τ dSᵀ Q,   dV = Pᵀ dO
"""

from __future__ import annotations

import triton

from . import plan as _plan
from .common import LOG2E
from .dkdv import _attn_bwd_dkdv_kernel
from .dq import _attn_bwd_dq_kernel
from .host import (block_d, cu_seqlens, dot_precision, layout, long_rows, new_empty, new_rowvec,
                   new_rowvecs, on_input_device, prep, rowvec_strides, view)
from .launch import launch


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
    cu = cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    common = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                  CAUSAL=bool(causal), WINDOW=use_window, IS_VARLEN=lay.varlen,
                  PREC=dot_precision(q.dtype), LONG=long_rows(lay, q, k, v, o, do, dq, dk, dv))
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    shifted = None  # float32: (ρ, j*, c, D − c), from the dQ pass to the dK/dV pass
    if p.rowsum:
        delta, *rest = new_rowvecs(lay, q.device, 5)
        shifted = tuple(rest)
    else:
        delta = new_rowvec(lay, q.device)
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
        launch(
            _attn_bwd_dq_kernel, grid,
            *(view(x, lay.varlen) for x in (q, k, v, o, do, dq)), lse, delta,
            shifted, rowvec_strides(lay), cu, *args,
            BLOCK_M=cfg.block_m,
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
            launch(
                _attn_bwd_dkdv_kernel, grid,
                *(view(x, lay.varlen) for x in (q, k, v, do, dk, dv)), lse,
                delta if shifted is None else shifted[3],
                shifted and shifted[:3], rowvec_strides(lay), cu, *args,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, QMAJOR=cfg.qmajor, ROWSUM=p.rowsum, **common,
            )
        else:
            dk.zero_()
            dv.zero_()
    return dq, dk, dv, delta
