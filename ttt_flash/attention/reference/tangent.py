"""The reference's forward-mode composers: the tangent forward (``attn_jvp``) and the tangent of a
computed forward (``attn_tangent``), in query-row chunks."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .composers import (DEFAULT_CHUNK, _bounds, _chunks, _compute_dtype, _expand_kv, _probs, _row, _row_dtype,
                        _scores, _seq, _unseq)

__all__ = ["attn_jvp", "attn_tangent"]

# --------------------------------------------------------------------------- tangent forward (jvp)


def _jvp_dense(q, k, v, qd, kd, vd, scale, causal, window, chunk):
    """O, L and their tangents Ȯ, L̇ in direction (Q̇, K̇, V̇), query rows in chunks:
    Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ), L̇ = rowsum(P∘Ṡ), Ȯ = (P∘Ṡ) V − L̇ ∘ O + P V̇."""
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups)
    qdf = None if qd is None else qd.to(cd)
    kdf = None if kd is None else _expand_kv(kd.to(cd), groups)
    vdf = None if vd is None else _expand_kv(vd.to(cd), groups)
    b, h, n_q, d = q.shape
    o = torch.empty(b, h, n_q, d, dtype=cd, device=q.device)
    od = torch.empty_like(o)
    lse = torch.empty(b, h, n_q, dtype=cd, device=q.device)
    lsed = torch.empty_like(lse)
    for r0, r1 in _chunks(n_q, chunk):
        s = _scores(qf[:, :, r0:r1], kf, scale, n_q, causal, window, r0, r1)
        l = torch.logsumexp(s, dim=-1) if s.shape[-1] > 0 else s.new_full(s.shape[:-1], float("-inf"))
        p = _probs(s, l)
        oc = torch.matmul(p, vf)
        sd = None
        if qdf is not None:
            sd = torch.matmul(qdf[:, :, r0:r1], kf.transpose(-1, -2))
        if kdf is not None:
            t = torch.matmul(qf[:, :, r0:r1], kdf.transpose(-1, -2))
            sd = t if sd is None else sd + t
        odc = torch.zeros_like(oc)
        ldc = oc.new_zeros(oc.shape[:-1])
        if sd is not None:
            psd = p * (sd * scale)  # P∘Ṡ (0 where masked: P = 0 there)
            ldc = psd.sum(-1)
            odc = torch.matmul(psd, vf) - ldc.unsqueeze(-1) * oc
        if vdf is not None:
            odc = odc + torch.matmul(p, vdf)
        o[:, :, r0:r1], od[:, :, r0:r1] = oc, odc
        lse[:, :, r0:r1], lsed[:, :, r0:r1] = l, ldc
    return o.to(q.dtype), lse, od.to(q.dtype), lsed


def attn_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qd: Optional[Tensor],
    kd: Optional[Tensor],
    vd: Optional[Tensor],
    *,
    scale: float,
    causal: bool,
    window: Optional[int],
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    chunk: int = DEFAULT_CHUNK,
):
    """Tangent forward: returns ``(o, lse, od, lsed)``, the forward's outputs and their
    tangents in direction ``(qd, kd, vd)`` (each of its input's shape, or None for a zero
    tangent). ``od`` has ``o``'s shape and dtype; ``lsed`` is a row vector like ``lse``
    (0 on rows that see no key)."""
    rd = _row_dtype(q.dtype)
    if cu_seqlens_q is None:
        o, lse, od, lsed = _jvp_dense(q, k, v, qd, kd, vd, scale, causal, window, chunk)
        return o, lse.to(rd), od, lsed.to(rd)
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    od = torch.zeros_like(o)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=rd, device=q.device)
    lsed = torch.zeros_like(lse)
    for qs, qe, ks, ke in _bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        r = _jvp_dense(
            _seq(q, qs, qe), _seq(k, ks, ke), _seq(v, ks, ke),
            None if qd is None else _seq(qd, qs, qe),
            None if kd is None else _seq(kd, ks, ke),
            None if vd is None else _seq(vd, ks, ke),
            scale, causal, window, chunk,
        )
        o[qs:qe], od[qs:qe] = _unseq(r[0]), _unseq(r[2])
        lse[:, qs:qe], lsed[:, qs:qe] = r[1][0], r[3][0]
    return o, lse, od, lsed


def _tangent_dense(q, k, v, o, lse, qd, kd, vd, scale, causal, window, chunk):
    """Ȯ, L̇ and ρ = 1 / rowsum(P) from the forward's O and L, P = exp(S − L), query rows in
    chunks (what :func:`ttt_flash.kernels.attn_tangent` computes)."""
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups)
    of, lsef = o.to(cd), lse.to(cd)
    qdf = None if qd is None else qd.to(cd)
    kdf = None if kd is None else _expand_kv(kd.to(cd), groups)
    vdf = None if vd is None else _expand_kv(vd.to(cd), groups)
    n_q = q.shape[2]
    od = torch.empty_like(of)
    lsed = torch.empty_like(lsef)
    rho = torch.empty_like(lsef)
    for r0, r1 in _chunks(n_q, chunk):
        p = _probs(_scores(qf[:, :, r0:r1], kf, scale, n_q, causal, window, r0, r1), lsef[:, :, r0:r1])
        rs = p.sum(-1)
        inv = 1.0 / torch.where(rs > 0, rs, torch.ones_like(rs))
        sd = None
        if qdf is not None:
            sd = torch.matmul(qdf[:, :, r0:r1], kf.transpose(-1, -2))
        if kdf is not None:
            t = torch.matmul(qf[:, :, r0:r1], kdf.transpose(-1, -2))
            sd = t if sd is None else sd + t
        odc = torch.zeros_like(of[:, :, r0:r1])
        ldc = inv * 0
        if sd is not None:
            psd = p * (sd * scale)
            ldc = psd.sum(-1) * inv
            odc = torch.matmul(psd, vf) * inv.unsqueeze(-1) - ldc.unsqueeze(-1) * of[:, :, r0:r1]
        if vdf is not None:
            odc = odc + torch.matmul(p, vdf) * inv.unsqueeze(-1)
        od[:, :, r0:r1], lsed[:, :, r0:r1], rho[:, :, r0:r1] = odc, ldc, inv
    return od.to(q.dtype), lsed, rho


def attn_tangent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    qd: Optional[Tensor],
    kd: Optional[Tensor],
    vd: Optional[Tensor],
    *,
    scale: float,
    causal: bool,
    window: Optional[int],
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    chunk: int = DEFAULT_CHUNK,
):
    """Tangent of a computed forward: returns ``(od, lsed, rho)`` from the forward's ``o`` and
    ``lse`` in direction ``(qd, kd, vd)`` (any of them None): Ȯ and L̇ as :func:`attn_jvp`
    returns them, and ρ = 1 / rowsum(exp(S − L)) (1 on rows that see no key), in ``lse``'s
    layout."""
    rd = _row_dtype(q.dtype)
    if cu_seqlens_q is None:
        od, lsed, rho = _tangent_dense(q, k, v, o, lse, qd, kd, vd, scale, causal, window, chunk)
        return od, lsed.to(rd), rho.to(rd)
    od = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lsed = torch.zeros((q.shape[1], q.shape[0]), dtype=rd, device=q.device)
    rho = torch.ones_like(lsed)
    for qs, qe, ks, ke in _bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        r = _tangent_dense(
            _seq(q, qs, qe), _seq(k, ks, ke), _seq(v, ks, ke), _seq(o, qs, qe), _row(lse, qs, qe),
            None if qd is None else _seq(qd, qs, qe),
            None if kd is None else _seq(kd, ks, ke),
            None if vd is None else _seq(vd, ks, ke),
            scale, causal, window, chunk,
        )
        od[qs:qe] = _unseq(r[0])
        lsed[:, qs:qe], rho[:, qs:qe] = r[1][0], r[2][0]
    return od, lsed, rho
