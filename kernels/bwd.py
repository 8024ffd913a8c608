"""First backward: the composer ``attn_bwd``. It runs the dQ pass (dq.py; it also forms
D = rowsum(dO∘O), and ρ with the row-sum correction), then the dK/dV pass (dkdv.py), each as
its Triton kernel or, where the plan (plan.py) selects it, its sm_90 Gluon kernel
(gluon/dq.py, gluon/dkdv.py).

    P = exp(S − L),  dP = dO Vᵀ,  D = rowsum(dO∘O),  dS = P∘(dP − D)
    dQ = τ dS K,   dK = τ dSᵀ Q,   dV = Pᵀ dO
"""

from __future__ import annotations

from . import plan as _plan
from .common import LOG2E
from .dkdv import _attn_bwd_dkdv_kernel
from .dq import _attn_bwd_dq_kernel
from . import configs
from .host import (block_d, call_cache, cdiv, cu_seqlens, dot_precision, layout, long_rows,
                   new_like, new_rowvec, new_rowvecs, on_input_device, prep, remember,
                   rowvec_strides, view)
from .launch import launch


_CALLS = call_cache()  # dense calls: key -> (lay, plan, dQ grid and keywords, dK/dV's)


def _bwd_call(q, k, v, o, do, dq, dk, dv, lay, causal_, use_window):
    """What a first backward's launches are, apart from their tensors and scalars: (lay,
    plan, dQ grid, dQ keywords, dK/dV grid, dK/dV keywords), the grids and keywords of
    Gluon passes None."""
    p = _plan.bwd(lay, q.dtype, q.device, window=use_window,
                  contiguous=q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
                  and do.is_contiguous(), o_contiguous=o.is_contiguous())
    bd = block_d(lay.head_dim)
    common = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                  CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
                  PREC=dot_precision(q.dtype), LONG=long_rows(lay, q, k, v, o, do, dq, dk, dv))
    dq_grid = dq_meta = dkdv_grid = dkdv_meta = None
    if not p.dq.gluon:
        cfg = p.dq.tiles
        dq_grid = (cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)
        dq_meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROWSUM=p.rowsum,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    if not p.dkdv.gluon:
        cfg = p.dkdv.tiles
        dkdv_grid = (cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
        dkdv_meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, QMAJOR=cfg.qmajor, ROWSUM=p.rowsum,
                         **common)
    return lay, p, dq_grid, dq_meta, dkdv_grid, dkdv_meta


@on_input_device
def attn_bwd(q, k, v, o, lse, do, *, scale, causal, window, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """First-backward composer (contract: docs/architecture.md). Returns (dq, dk, dv, delta).

    ``dk``/``dv`` are summed over the query heads of each key head (GQA). ``delta`` is the
    float32 row vector rowsum(dO ∘ O), in the layout of ``lse``. ``deterministic`` is
    accepted for the contract: both passes are atomic-free, so results are bitwise
    reproducible run to run whatever its value. A dense call's launches are cached per call
    shape (``host.call_cache``).
    """
    q, k, v, o, do = prep(q), prep(k), prep(v), prep(o), prep(do)
    lse = lse.contiguous()
    causal_ = bool(causal)
    use_window = causal_ and window is not None
    key = call = None
    if cu_seqlens_q is None:
        key = (q.shape, k.shape, v.shape, o.shape, do.shape, q.stride(), k.stride(), v.stride(),
               o.stride(), do.stride(), q.dtype, q.device, causal_, use_window,
               configs.generation())
        call = _CALLS.get(key)
    lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) if call is None else call[0]
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    dq = new_like(q)
    dk = new_like(k)
    dv = new_like(v)
    if call is None:
        call = _bwd_call(q, k, v, o, do, dq, dk, dv, lay, causal_, use_window)
        if key is not None:
            remember(_CALLS, key, call)
    _, p, dq_grid, dq_meta, dkdv_grid, dkdv_meta = call
    cu = cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    args = (lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    shifted = None  # float32: (ρ, j*, c, D − c), from the dQ pass to the dK/dV pass
    if p.rowsum:
        delta, *rest = new_rowvecs(lay, q.device, 5)
        shifted = tuple(rest)
    else:
        delta = new_rowvec(lay, q.device)
    varlen = lay.varlen
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
        launch(
            _attn_bwd_dq_kernel, dq_grid,
            view(q, varlen), view(k, varlen), view(v, varlen), view(o, varlen), view(do, varlen),
            view(dq, varlen), lse, delta, shifted, rowvec_strides(lay), cu, *args, **dq_meta,
        )
    elif dq.numel():
        dq.zero_()
        delta.zero_()
    if dk.numel():
        if p.dkdv.gluon:
            from .gluon import dkdv as _gluon_dkdv  # imported where it runs: sm_90

            cfg = p.dkdv.tiles
            _gluon_dkdv.launch_dkdv(q, k, v, do, lse, delta, scale=scale, causal=causal,
                                    block_n=cfg.block_n, block_m=cfg.block_m,
                                    num_warps=cfg.num_warps, consumers=cfg.consumers,
                                    stages=cfg.stages, maxnreg=cfg.maxnreg, out=(dk, dv))
        elif lay.n_k > 0:
            launch(
                _attn_bwd_dkdv_kernel, dkdv_grid,
                view(q, varlen), view(k, varlen), view(v, varlen), view(do, varlen),
                view(dk, varlen), view(dv, varlen), lse,
                delta if shifted is None else shifted[3],
                shifted and shifted[:3], rowvec_strides(lay), cu, *args, **dkdv_meta,
            )
        else:
            dk.zero_()
            dv.zero_()
    return dq, dk, dv, delta
