"""Exact pure-PyTorch attention: forward, first backward and backward-over-backward.

This module is the oracle every kernel is tested against and the CPU path of
:func:`ttt_flash.flash_attention`. It implements the closed form of
``docs/bob-math.md`` with query rows processed in chunks, so memory is
O(chunk × N_k) per head rather than O(N_q × N_k).

It exposes the composer contract of ``docs/architecture.md`` (``attn_fwd``,
``attn_bwd``, ``attn_bob``) plus :func:`naive_attention`, a materialised
autograd-able attention used as a second, independent oracle in tests.

Precision: float64 and float32 inputs are computed in their own precision;
float16 and bfloat16 inputs are computed in float32 and results cast back.
Row vectors (``lse``, ``delta``) are float64 for float64 inputs, float32 otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "attn_bob",
    "attn_jvp",
    "attn_tangent",
    "naive_attention",
    "naive_attention_varlen",
    "attention_mask",
    "DEFAULT_CHUNK",
]

#: Query rows processed at once per (batch, head): memory is O(chunk × N_k).
DEFAULT_CHUNK = 256


# --------------------------------------------------------------------------- masks


def attention_mask(
    n_q: int,
    n_k: int,
    *,
    causal: bool,
    window: Optional[int],
    device=None,
    row_start: int = 0,
    row_end: Optional[int] = None,
) -> Optional[Tensor]:
    """Boolean mask (rows, N_k), True where query i may attend to key j.

    Rows ``row_start:row_end`` of the full (N_q, N_k) mask. Causal masks are aligned
    to the bottom-right: query i sees key j iff j <= i + N_k - N_q; a window w also
    requires j > i + N_k - N_q - w. Returns None when nothing is masked.
    """
    if not causal:
        return None
    row_end = n_q if row_end is None else row_end
    i = torch.arange(row_start, row_end, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    shift = n_k - n_q
    mask = j <= i + shift
    if window is not None:
        mask = mask & (j > i + shift - window)
    return mask


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float64, torch.float32) else torch.float32


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """(B, H_kv, N, D) -> (B, H_kv*groups, N, D), query head h using key head h // groups."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)


def _reduce_kv(x: Tensor, groups: int) -> Tensor:
    """Sum a (B, H_q, N, D) gradient over the query heads that share a key head."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // groups, groups, n, d).sum(dim=2)


# --------------------------------------------------------------------------- naive oracle


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> Tensor:
    """Materialised softmax attention built from differentiable torch ops.

    Layout (B, H_q, N_q, D) / (B, H_kv, N_k, D). Builds the full N_q × N_k score
    matrix, so use it on small shapes only; autograd through it gives any order of
    derivative, which makes it an independent oracle for the closed forms.
    Rows that see no key return 0.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    k = _expand_kv(k, groups)
    v = _expand_kv(v, groups)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[-2], k.shape[-2], causal=causal, window=window, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
        # rows with no visible key: softmax of all -inf is NaN; give them P = 0
        empty = ~mask.any(dim=-1, keepdim=True)
        s = s.masked_fill(empty, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


def naive_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> Tensor:
    """:func:`naive_attention` applied to each packed sequence; layout (T, H, D)."""
    outs = []
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        if qs.shape[2] == 0:
            outs.append(q[cq[b] : cq[b + 1]] * 0)
            continue
        if ks.shape[2] == 0:
            outs.append(q[cq[b] : cq[b + 1]] * 0)
            continue
        o = naive_attention(qs, ks, vs, causal=causal, scale=scale, window=window)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


# --------------------------------------------------------------------------- chunked closed forms
#
# Each composer works on one dense layout (B, H, N, D); varlen inputs are split into
# their sequences and each sequence is handled as a (1, H, n, D) dense problem.


def _chunks(n: int, chunk: int):
    for r0 in range(0, n, chunk):
        yield r0, min(n, r0 + chunk)


def _scores(qc: Tensor, k: Tensor, scale: float, n_q: int, causal, window, r0, r1) -> Tensor:
    """Masked scores S = scale * Q Kᵀ for query rows r0:r1 (masked entries are -inf)."""
    s = torch.matmul(qc, k.transpose(-1, -2)) * scale
    mask = attention_mask(n_q, k.shape[-2], causal=causal, window=window, device=qc.device,
                          row_start=r0, row_end=r1)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    """P = exp(S - L), with P = 0 on rows that see no key (L = -inf), and NaN on rows with a
    +inf score (L = +inf: their softmax is undefined, NaN as in the kernels and SDPA)."""
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - lse_safe.unsqueeze(-1))


def _poison_nonfinite_rows(lse: Tensor, qc: Tensor, n_q: int, n_k: int, causal, window, r0, r1) -> Tensor:
    """L = NaN on rows whose q holds a NaN / ±inf and that see a key: their softmax is
    undefined (NaN in the kernels and in materialised attention), not ±inf or 0."""
    bad = ~torch.isfinite(qc).all(-1)
    if n_k == 0 or not bool(bad.any()):
        return lse
    mask = attention_mask(n_q, n_k, causal=causal, window=window, device=qc.device, row_start=r0, row_end=r1)
    if mask is not None:
        bad = bad & mask.any(-1)
    return lse.masked_fill(bad, float("nan"))


def _fwd_dense(q, k, v, scale, causal, window, chunk):
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups)
    b, h, n_q, d = q.shape
    o = torch.empty(b, h, n_q, d, dtype=cd, device=q.device)
    lse = torch.empty(b, h, n_q, dtype=cd, device=q.device)
    for r0, r1 in _chunks(n_q, chunk):
        s = _scores(qf[:, :, r0:r1], kf, scale, n_q, causal, window, r0, r1)
        l = torch.logsumexp(s, dim=-1) if s.shape[-1] > 0 else s.new_full(s.shape[:-1], float("-inf"))
        l = _poison_nonfinite_rows(l, qf[:, :, r0:r1], n_q, k.shape[-2], causal, window, r0, r1)
        p = _probs(s, l)
        o[:, :, r0:r1] = torch.matmul(p, vf)
        lse[:, :, r0:r1] = l
    return o.to(q.dtype), lse


def _bwd_dense(q, k, v, o, lse, do, scale, causal, window, chunk):
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups)
    dof, lsef = do.to(cd), lse.to(cd)
    n_q = q.shape[2]
    delta = (dof * o.to(cd)).sum(-1)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for r0, r1 in _chunks(n_q, chunk):
        qc, doc = qf[:, :, r0:r1], dof[:, :, r0:r1]
        p = _probs(_scores(qc, kf, scale, n_q, causal, window, r0, r1), lsef[:, :, r0:r1])
        dp = torch.matmul(doc, vf.transpose(-1, -2))
        ds = p * (dp - delta[:, :, r0:r1].unsqueeze(-1))
        dq[:, :, r0:r1] = scale * torch.matmul(ds, kf)
        dk += scale * torch.matmul(ds.transpose(-1, -2), qc)
        dv += torch.matmul(p.transpose(-1, -2), doc)
    dk, dv = _reduce_kv(dk, groups), _reduce_kv(dv, groups)
    rd = torch.float64 if q.dtype == torch.float64 else torch.float32
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta.to(rd)


def _bob_dense(q, k, v, o, lse, do, delta, uq, uk, uv, scale, causal, window, chunk, stats=None):
    """Closed-form backward-over-backward (bob-math.md), query rows in chunks. ``stats``:
    the row statistics (α, E + αD) given instead of formed here."""
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups)
    dof, lsef, deltaf = do.to(cd), lse.to(cd), delta.to(cd)
    uqf = None if uq is None else uq.to(cd)
    ukf = None if uk is None else _expand_kv(uk.to(cd), groups)
    uvf = None if uv is None else _expand_kv(uv.to(cd), groups)
    n_q = q.shape[2]
    qb = torch.empty_like(qf)
    dob = torch.empty_like(qf)
    kb = torch.zeros_like(kf)
    vb = torch.zeros_like(vf)
    for r0, r1 in _chunks(n_q, chunk):
        qc, doc = qf[:, :, r0:r1], dof[:, :, r0:r1]
        p = _probs(_scores(qc, kf, scale, n_q, causal, window, r0, r1), lsef[:, :, r0:r1])
        dp = torch.matmul(doc, vf.transpose(-1, -2))
        dp_minus_d = dp - deltaf[:, :, r0:r1].unsqueeze(-1)
        ds = p * dp_minus_d
        # G = scale (U_Q Kᵀ + Q U_Kᵀ): cotangent reaching dS
        g = None
        if uqf is not None:
            g = torch.matmul(uqf[:, :, r0:r1], kf.transpose(-1, -2))
        if ukf is not None:
            t = torch.matmul(qc, ukf.transpose(-1, -2))
            g = t if g is None else g + t
        pbar = torch.zeros_like(p)
        qb_c = torch.zeros_like(qc)
        dob_c = torch.zeros_like(doc)
        if g is not None:
            g = g * scale
            if stats is None:
                alpha = (p * g).sum(-1, keepdim=True)
            else:
                alpha = stats[0][:, :, r0:r1].to(cd).unsqueeze(-1)
            hmat = p * (g - alpha)  # cotangent reaching dP
            pbar = g * dp_minus_d - alpha * dp
            dob_c = dob_c + torch.matmul(hmat, vf)
            vb += torch.matmul(hmat.transpose(-1, -2), doc)
        if uvf is not None:
            pbar = pbar + torch.matmul(doc, uvf.transpose(-1, -2))  # B = dO U_Vᵀ
            dob_c = dob_c + torch.matmul(p, uvf)
        if stats is None:
            e = (p * pbar).sum(-1, keepdim=True)
        else:  # E = (E + αD) − αD
            e = stats[1][:, :, r0:r1].to(cd).unsqueeze(-1)
            if g is not None:
                e = e - alpha * deltaf[:, :, r0:r1].unsqueeze(-1)
        r = p * (pbar - e)  # cotangent reaching S
        qb_c = qb_c + torch.matmul(r, kf)
        kb += torch.matmul(r.transpose(-1, -2), qc)
        if ukf is not None:
            qb_c = qb_c + torch.matmul(ds, ukf)
        if uqf is not None:
            kb += torch.matmul(ds.transpose(-1, -2), uqf[:, :, r0:r1])
        qb[:, :, r0:r1] = scale * qb_c
        dob[:, :, r0:r1] = dob_c
    kb = _reduce_kv(scale * kb, groups)
    vb = _reduce_kv(vb, groups)
    return qb.to(q.dtype), kb.to(k.dtype), vb.to(v.dtype), dob.to(do.dtype)


# --------------------------------------------------------------------------- varlen plumbing


def _seq(x: Tensor, start: int, end: int) -> Tensor:
    """(T, H, D)[start:end] -> (1, H, n, D) view."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def _row(x: Tensor, start: int, end: int) -> Tensor:
    """(H, T)[:, start:end] -> (1, H, n) view."""
    return x[:, start:end].unsqueeze(0)


def _unseq(x: Tensor) -> Tensor:
    return x.squeeze(0).transpose(0, 1)


def _bounds(cu_q: Tensor, cu_k: Tensor):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _row_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- composers


def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    """Forward: returns ``(o, lse)``. Layouts as in ``docs/architecture.md``."""
    if cu_seqlens_q is None:
        o, lse = _fwd_dense(q, k, v, scale, causal, window, chunk)
        return o, lse.to(_row_dtype(q.dtype))
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_row_dtype(q.dtype), device=q.device)
    for qs, qe, ks, ke in _bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        oi, li = _fwd_dense(_seq(q, qs, qe), _seq(k, ks, ke), _seq(v, ks, ke), scale, causal, window, chunk)
        o[qs:qe] = _unseq(oi)
        lse[:, qs:qe] = li[0]
    return o, lse


def attn_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
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
    """First backward: returns ``(dq, dk, dv, delta)`` with ``delta = rowsum(dO ∘ O)``."""
    if cu_seqlens_q is None:
        return _bwd_dense(q, k, v, o, lse, do, scale, causal, window, chunk)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    delta = torch.zeros((q.shape[1], q.shape[0]), dtype=_row_dtype(q.dtype), device=q.device)
    for qs, qe, ks, ke in _bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        r = _bwd_dense(_seq(q, qs, qe), _seq(k, ks, ke), _seq(v, ks, ke), _seq(o, qs, qe),
                       _row(lse, qs, qe), _seq(do, qs, qe), scale, causal, window, chunk)
        dq[qs:qe] = _unseq(r[0])
        dk[ks:ke] = _unseq(r[1])
        dv[ks:ke] = _unseq(r[2])
        delta[:, qs:qe] = r[3][0]
    return dq, dk, dv, delta


def attn_bob(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    delta: Tensor,
    uq: Optional[Tensor],
    uk: Optional[Tensor],
    uv: Optional[Tensor],
    *,
    scale: float,
    causal: bool,
    window: Optional[int],
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    needs: Sequence[bool] = (True, True, True, True),
    precise: bool = False,
    stats: Optional[Sequence[Optional[Tensor]]] = None,
    chunk: int = DEFAULT_CHUNK,
):
    """Backward-over-backward: returns ``(q̄, k̄, v̄, dŌ)`` for cotangents ``(uq, uk, uv)``
    of ``(dq, dk, dv)``. The reference always computes all four (``needs`` and ``precise``
    are accepted for the shared contract; the reference forms R and H directly); all are None when every cotangent is None.

    ``stats``: None, or ``(alpha, ee, rho)``, the row statistics α = rowsum(P∘G) and
    E + αD (``lse``'s layout) known to the caller, used instead of forming them (``rho``, the
    kernels' row-sum correction, is not read here). With U = the tangent ẋ of a jvp they are
    the tangent forward's L̇ and rowsum(dO∘Ȯ) (docs/forward-mode.md)."""
    if uq is None and uk is None and uv is None:
        return None, None, None, None
    if stats is not None:
        stats = (stats[0], stats[1])
    if cu_seqlens_q is None:
        return _bob_dense(q, k, v, o, lse, do, delta, uq, uk, uv, scale, causal, window, chunk, stats)
    qb = torch.zeros_like(q, memory_format=torch.contiguous_format)
    kb = torch.zeros_like(k, memory_format=torch.contiguous_format)
    vb = torch.zeros_like(v, memory_format=torch.contiguous_format)
    dob = torch.zeros_like(do, memory_format=torch.contiguous_format)
    for qs, qe, ks, ke in _bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        r = _bob_dense(
            _seq(q, qs, qe), _seq(k, ks, ke), _seq(v, ks, ke), _seq(o, qs, qe), _row(lse, qs, qe),
            _seq(do, qs, qe), _row(delta, qs, qe),
            None if uq is None else _seq(uq, qs, qe),
            None if uk is None else _seq(uk, ks, ke),
            None if uv is None else _seq(uv, ks, ke),
            scale, causal, window, chunk,
            None if stats is None else tuple(_row(x, qs, qe) for x in stats),
        )
        qb[qs:qe] = _unseq(r[0])
        kb[ks:ke] = _unseq(r[1])
        vb[ks:ke] = _unseq(r[2])
        dob[qs:qe] = _unseq(r[3])
    return qb, kb, vb, dob


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
