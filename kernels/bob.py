"""FlashBoB: the exact backward-over-backward composer ``attn_bob`` (bob-math.md).

The passes live by family: the precise row passes (statistics, direct; each with a float32
shifted form) in bob_row.py, the affine row pass in bob_affine.py, the key-tile (column) pass
in bob_col.py, their sm_90 Gluon versions in gluon/ (bob_row.py, bob_col.py). Which of them
run for a call, with which tiles, is decided by ``plan.bob`` (cached per call shape); this
module allocates the outputs and launches what the plan says.

No N×N tensor touches HBM; the extra memory is the row vectors α, E + αD, ρ. Every pass is
atomic-free: results are bitwise reproducible run to run on the same device and software.
"""

from __future__ import annotations

import torch

from . import plan as _plan
from .bob_affine import _bob_affine_kernel
from .bob_col import _bob_col_kernel
from .bob_row import (_bob_direct_kernel, _bob_direct_shift_kernel, _bob_stats_kernel,
                      _bob_stats_shift_kernel)
from .common import LOG2E
from . import configs
from .host import (block_d, call_cache, cdiv, cu_seqlens, dot_precision, layout, long_rows,
                   new_like, new_rowvecs, on_input_device, prep, remember, rowvec_strides,
                   shape, strides, view)
from .launch import launch


_CALLS = call_cache()  # dense calls: key -> _bob_call(...)


@on_input_device
def attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, *, scale, causal, window,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             needs=(True, True, True, True), precise=True, deterministic=False,
             split_row=False, split_col=False, stats=None):
    """BoB composer (contract: docs/architecture.md). Returns (qb, kb, vb, dob).

    ``uq``, ``uk``, ``uv`` are the cotangents of (dq, dk, dv), any of them None (zero,
    its work skipped at compile time). ``needs`` selects which of (qb, kb, vb, dob) are
    computed; the others come back as None. All cotangents None: every result is None.

    ``precise`` (default, as ``flash_attention(precise_bob=True)``): a statistics pass
    computes α, E first and the later passes form R and H per tile. False: the affine
    two-pass form of bob-math.md, which loses accuracy where attention is peaked (its
    α (P∘dP) K and E (P K) terms cancel; docs/benchmarks.md has the measured errors).

    ``deterministic``: accepted for the contract; every pass is atomic-free, so results
    are bitwise reproducible run to run whatever its value.

    ``split_row`` / ``split_col`` (16-bit inputs, precise only): the direct row pass / the
    column pass enter R and H as hi + lo pairs of 16-bit tiles (two more tile products per
    tile), which removes most of the 16-bit rounding of R and H.

    ``stats`` (precise only): None, or ``(alpha, ee, rho)``, float32 row vectors in ``lse``'s
    layout known to the caller: α = rowsum(P∘G), E + αD and ρ = 1 / rowsum(exp(S − L)) (None
    where unknown). The statistics pass is then skipped (where the row-sum correction is on,
    only if ``rho`` is given). With U = the tangent ẋ of a jvp they are the tangent forward's
    L̇, rowsum(dO∘Ȯ) and ρ (docs/forward-mode.md; ``attn_tangent``).
    """
    if uq is None and uk is None and uv is None:
        return None, None, None, None
    q, k, v, o, do = prep(q), prep(k), prep(v), prep(o), prep(do)
    uq, uk, uv = prep(uq), prep(uk), prep(uv)
    lse, delta = lse.contiguous(), delta.contiguous()
    needs = tuple(bool(x) for x in needs)
    precise = bool(precise)
    known = (stats is not None and stats[0] is not None and stats[1] is not None,
             stats is not None and stats[2] is not None)
    causal_ = bool(causal)
    use_window = causal_ and window is not None
    split_row, split_col = bool(split_row), bool(split_col)
    key = call = None
    if cu_seqlens_q is None:
        key = (q.shape, k.shape, v.shape, o.shape, do.shape, shape(uq), shape(uk), shape(uv),
               q.stride(), k.stride(), v.stride(), o.stride(), do.stride(), strides(uq),
               strides(uk), strides(uv), q.dtype, q.device, causal_, use_window, needs, precise,
               known, split_row, split_col, configs.generation())
        call = _CALLS.get(key)
    if call is None:
        lay = layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        tiles_in = (q, k, v, do, uq, uk, uv)
        p = _plan.bob(lay, q.dtype, q.device, window=use_window,
                      has_u=(uq is not None, uk is not None, uv is not None), needs=needs,
                      precise=precise, known=known, split_row=split_row, split_col=split_col,
                      contiguous=all(t is None or t.is_contiguous() for t in tiles_in),
                      rows_work=q.numel() > 0 and lay.n_q > 0,
                      cols_work=k.numel() > 0 and lay.n_k > 0)
    else:
        lay, p = call[0], call[1]
    scale = lay.head_dim ** -0.5 if scale is None else float(scale)
    need_qb, need_kb, need_vb, need_dob = needs

    qb = new_like(q) if need_qb else None
    dob = new_like(do) if need_dob else None
    kb = new_like(k) if p.col_kb else None
    if need_vb:
        vb = new_like(v) if p.col_vb else torch.zeros_like(
            v, memory_format=torch.contiguous_format)
    else:
        vb = None
    if call is None:
        call = _bob_call(lay, p, q, k, v, o, do, uq, uk, uv, qb, kb, vb, dob, needs, causal_,
                         use_window, split_row, split_col)
        if key is not None:
            remember(_CALLS, key, call)
    _, _, shift, affine, stats_launch, direct, col = call
    # float32 (p.rowsum): also ρ and, where this call's statistics pass forms them (not with
    # the caller's statistics nor the affine pass), the shifted statistics SH = (ρ, j*, c, g,
    # b, D − c) around each row's dominant key (bob_row.py, _bob_stats_shift_sweep)
    alpha = ee = rho = sh = None
    if p.given:
        alpha, ee = stats[0].contiguous(), stats[1].contiguous()
        if p.rowsum:
            rho = stats[2].contiguous()
    elif p.with_stats and shift:
        alpha, ee, *rest = new_rowvecs(lay, q.device, 8)
        sh = tuple(rest)
    elif p.with_stats and p.rowsum:
        alpha, ee, rho = new_rowvecs(lay, q.device, 3)
    elif p.with_stats:
        alpha, ee = new_rowvecs(lay, q.device, 2)

    varlen = lay.varlen
    # the kernels' arguments: views of the inputs (None for an absent cotangent), then after
    # each kernel's row vectors: their strides, cu_seqlens, the sizes and scales
    ins = (view(q, varlen), view(k, varlen), view(v, varlen), view(do, varlen), view(uq, varlen),
           view(uk, varlen), view(uv, varlen))
    sizes = (rowvec_strides(lay), cu_seqlens(cu_seqlens_q, cu_seqlens_k, q),
             lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, int(window or 0))
    # a direct pass that sweeps the statistics itself reads α, E + αD only to write them
    stats_out = (alpha, ee) if not p.stats_first or p.write_stats else (None, None)

    def gluon_kw(cfg):
        return dict(scale=scale, causal=causal, block_n=cfg.block_n, block_m=cfg.block_m,
                    num_warps=cfg.num_warps, stages=cfg.stages,
                    warp_specialize=cfg.warp_specialize, maxnreg=cfg.maxnreg)

    if affine is not None:
        grid, kw = affine
        q_, k_, v_, do_, uq_, uk_, uv_ = ins
        launch(
            _bob_affine_kernel, grid,
            q_, k_, v_, view(o, varlen), do_, uq_, uk_, uv_, view(qb, varlen),
            view(dob, varlen), lse, delta, alpha, ee, rho, *sizes, **kw)
    if p.stats is not None:
        if p.stats.gluon:
            from .gluon import bob_row as _gluon_row  # imported where it runs: sm_90

            cfg = p.stats.tiles
            _gluon_row.launch_bob_row(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee,
                                      stats=True, consumers=cfg.consumers,
                                      **gluon_kw(cfg))
        elif shift:
            grid, kw = stats_launch
            launch(_bob_stats_shift_kernel, grid, *ins, lse, alpha, ee, sh, *sizes, **kw)
        else:
            grid, kw = stats_launch
            launch(_bob_stats_kernel, grid, *ins, lse, delta, alpha, ee, *sizes, **kw)
    if p.direct is not None:
        if p.direct.gluon:
            from .gluon import bob_row as _gluon_row

            cfg = p.direct.tiles
            _gluon_row.launch_bob_row(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee,
                                      stats=False, out=(qb, dob), consumers=cfg.consumers,
                                      **gluon_kw(cfg))
        else:
            grid, kw = direct
            outs = (view(qb, varlen), view(dob, varlen))
            if shift:
                launch(_bob_direct_shift_kernel, grid, *ins, *outs, lse, *stats_out, sh,
                       *sizes, **kw)
            else:
                launch(_bob_direct_kernel, grid, *ins, *outs, lse, delta, *stats_out,
                       rho, *sizes, **kw)
    if p.col is not None:
        if p.col.gluon:
            from .gluon import bob_col as _gluon_col

            cfg = p.col.tiles
            _gluon_col.launch_bob_col(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, None,
                                      out=(kb, vb), consumers=cfg.consumers, **gluon_kw(cfg))
        else:
            grid, kw = col
            vb_col = vb if p.col_vb else None
            launch(
                _bob_col_kernel, grid,
                *ins, view(kb, varlen), view(vb_col, varlen), lse,
                None if shift else delta, alpha, ee, None if shift else rho, sh, *sizes, **kw)
    return qb, kb, vb, dob


def _bob_call(lay, p, q, k, v, o, do, uq, uk, uv, qb, kb, vb, dob, needs, causal_, use_window,
              split_row, split_col):
    """What a BoB call's launches are, apart from their tensors and scalars: (lay, plan,
    shift, then (grid, launch keywords) of the affine, statistics, direct and column passes,
    None for a pass that does not run or runs as its Gluon kernel)."""
    need_qb, _, _, need_dob = needs
    shift = p.rowsum and not p.given and p.affine is None
    bd = block_d(lay.head_dim)
    split = q.dtype != torch.float32
    flags = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                 CAUSAL=causal_, WINDOW=use_window, IS_VARLEN=lay.varlen,
                 PREC=dot_precision(q.dtype), HAS_UQ=uq is not None, HAS_UK=uk is not None,
                 HAS_UV=uv is not None, HAS_G=uq is not None or uk is not None,
                 LONG=long_rows(lay, q, k, v, o, do, uq, uk, uv, qb, kb, vb, dob))

    def row_grid(cfg):
        return (cdiv(lay.n_q, cfg.block_m), lay.h_q, lay.batch)

    def meta(cfg, **kw):
        return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, **kw, **flags)

    affine = stats = direct = col = None
    if p.affine is not None:
        cfg = p.affine.tiles
        affine = row_grid(cfg), meta(cfg, NEED_QB=need_qb, NEED_DOB=need_dob, NEED_E=p.need_e,
                                     WRITE_STATS=p.write_stats, ROWSUM=p.rowsum)
    if p.stats is not None and not p.stats.gluon:
        cfg = p.stats.tiles
        stats = row_grid(cfg), meta(cfg, NEED_E=p.need_e)
    if p.direct is not None and not p.direct.gluon:
        cfg = p.direct.tiles
        kw = meta(cfg, NEED_QB=need_qb, NEED_DOB=need_dob, SPLIT=split and split_row,
                  STATS_FIRST=p.stats_first, WRITE_STATS=p.write_stats, NEED_E=p.need_e)
        if not shift:
            kw = dict(kw, ROWSUM=p.rowsum)
        direct = row_grid(cfg), kw
    if p.col is not None and not p.col.gluon:
        cfg = p.col.tiles
        col = ((cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch),
               meta(cfg, NEED_KB=p.col_kb, NEED_VB=p.col_vb, SPLIT=split and split_col,
                    ROWSUM=p.rowsum, SHIFT=shift, QMAJOR=cfg.qmajor))
    return lay, p, shift, affine, stats, direct, col
