"""Exact pure-PyTorch attention: forward, first backward and backward-over-backward.

This module is the oracle every kernel is tested against and the CPU path of
:func:`ttt_flash.flash_attention`. It implements the closed form of
``docs/bob-math.md`` with query rows processed in chunks, so memory is
O(chunk × N_k) per head rather than O(N_q × N_k).

It exposes the composer contract of ``docs/architecture.md`` (``attn_fwd``,
``attn_bwd``, ``attn_bob``) plus :func:`naive_attention`, a materialised
autograd-able attention used as a second, independent oracle in tests, and
:func:`bob_vjp` / :func:`bob_jvp`, the derivatives of the backward-over-backward
(third order and up) by blockwise recomputation, on every backend.

Precision: float64 and float32 inputs are computed in their own precision;
float16 and bfloat16 inputs are computed in float32 and results cast back.
Row vectors (``lse``, ``delta``) are float64 for float64 inputs, float32 otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "attn_bob",
    "attn_jvp",
    "attn_tangent",
    "bob_vjp",
    "bob_jvp",
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


def _bob_rows(p, qc, doc, uqc, kf, vf, ukf, uvf, deltac, scale, stats_c=None):
    """The closed-form BoB (bob-math.md) for one block of query rows, out of place (so that
    autograd can differentiate it). ``p``: the block's probabilities (rows, N_k); ``kf``,
    ``vf``, ``ukf``, ``uvf``: keys expanded to the query heads; ``deltac``: D of the rows;
    ``stats_c``: the rows' (α, E + αD) or None. Returns (Q̄, dŌ) of the rows and the rows'
    contributions to K̄ (without the factor τ and the sum over shared heads) and V̄."""
    dp = torch.matmul(doc, vf.transpose(-1, -2))
    dp_minus_d = dp - deltac.unsqueeze(-1)
    # G = scale (U_Q Kᵀ + Q U_Kᵀ): cotangent reaching dS
    g = None
    if uqc is not None:
        g = torch.matmul(uqc, kf.transpose(-1, -2))
    if ukf is not None:
        t = torch.matmul(qc, ukf.transpose(-1, -2))
        g = t if g is None else g + t
    pbar = None
    dob_c = None
    vb_c = None
    if g is not None:
        g = g * scale
        if stats_c is None:
            alpha = (p * g).sum(-1, keepdim=True)
        else:
            alpha = stats_c[0].to(p.dtype).unsqueeze(-1)
        hmat = p * (g - alpha)  # cotangent reaching dP
        pbar = g * dp_minus_d - alpha * dp
        dob_c = torch.matmul(hmat, vf)
        vb_c = torch.matmul(hmat.transpose(-1, -2), doc)
    if uvf is not None:
        b_mat = torch.matmul(doc, uvf.transpose(-1, -2))  # B = dO U_Vᵀ
        pbar = b_mat if pbar is None else pbar + b_mat
        t = torch.matmul(p, uvf)
        dob_c = t if dob_c is None else dob_c + t
    if stats_c is None:
        e = (p * pbar).sum(-1, keepdim=True)
    else:  # E = (E + αD) − αD
        e = stats_c[1].to(p.dtype).unsqueeze(-1)
        if g is not None:
            e = e - alpha * deltac.unsqueeze(-1)
    r = p * (pbar - e)  # cotangent reaching S
    qb_c = torch.matmul(r, kf)
    kb_c = torch.matmul(r.transpose(-1, -2), qc)
    if ukf is not None:
        qb_c = qb_c + torch.matmul(p * dp_minus_d, ukf)
    if uqc is not None:
        kb_c = kb_c + torch.matmul((p * dp_minus_d).transpose(-1, -2), uqc)
    if dob_c is None:
        dob_c = torch.zeros_like(doc)
    if vb_c is None:
        vb_c = torch.zeros_like(vf)
    return scale * qb_c, dob_c, kb_c, vb_c


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
        p = _probs(_scores(qf[:, :, r0:r1], kf, scale, n_q, causal, window, r0, r1), lsef[:, :, r0:r1])
        qb[:, :, r0:r1], dob[:, :, r0:r1], kb_c, vb_c = _bob_rows(
            p, qf[:, :, r0:r1], dof[:, :, r0:r1], None if uqf is None else uqf[:, :, r0:r1], kf, vf,
            ukf, uvf, deltaf[:, :, r0:r1], scale,
            None if stats is None else tuple(x[:, :, r0:r1] for x in stats),
        )
        kb += kb_c
        vb += vb_c
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


# --------------------------------------------------------------------------- derivatives of the BoB
#
# The BoB is a function of (q, k, v, dO, U_Q, U_K, U_V) alone: O, L and D are functions of
# those. Its derivatives (third order and up) recompute it in blocks of query rows with the
# out-of-place ops above, O, L and D included, and differentiate each block (autograd or torch.func):
# a block's rows reach Q̄ and dŌ of those rows only and add a share to K̄ and V̄, so the
# vector-Jacobian (and Jacobian-vector) product is a sum over blocks, one block alive at a
# time: memory O(rows × N_k) per head, never N_q × N_k.

#: Most elements of one score-shaped (B, H, rows, N_k) block in the recomputation of the BoB
#: for its derivatives (:func:`_recompute_rows`).
RECOMPUTE_BLOCK_ELEMENTS = 1 << 25

#: Fewest elements of one score-shaped block (unless the whole problem is smaller): below it
#: the blocks are too small to keep the device busy.
RECOMPUTE_BLOCK_FLOOR = 1 << 20


def _recompute_rows(bh: int, n_q: int, n_k: int, d: int) -> int:
    """Query rows per block of the BoB's recomputation (at least 1): a score-shaped (bh, rows,
    N_k) block holds as many elements as the queries (bh, N_q, D) of the call, within
    [:data:`RECOMPUTE_BLOCK_FLOOR`, :data:`RECOMPUTE_BLOCK_ELEMENTS`]. The working set of the
    third derivative (about ten such blocks in the compute dtype) is then a fixed multiple of
    the inputs' own size, O(N_q·D) per head like the rest of the pass, and a block count of
    about N_k / D, instead of a fixed block that is most of the memory on short sequences."""
    elements = min(RECOMPUTE_BLOCK_ELEMENTS, max(RECOMPUTE_BLOCK_FLOOR, bh * n_q * d))
    return max(1, elements // max(1, bh * n_k))

#: Names of the BoB's differentiable inputs, in the order :func:`bob_vjp` and :func:`bob_jvp`
#: take them.
BOB_INPUTS = ("q", "k", "v", "do", "uq", "uk", "uv")


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """rowsum(a ∘ b) over the last axis: (…, rows, D) × (…, rows, D) → (…, rows)."""
    return (a * b).sum(-1)


def _bob_rows_lean(p, qf, dof, uqf, kf, vf, ukf, uvf, delta, scale):
    """The BoB of one block of query rows (as :func:`_bob_rows` without statistics), written
    so that differentiating it keeps few score-shaped (rows, N_k) tensors: its reverse-mode
    graph saves P, dP − D, P∘(dP − D), G − α, H = P∘(G − α), R and (with U_V) B − c, where
    :func:`_bob_rows` also saves S, G, dP, P̄ and P̄ − E. The row statistics come from
    (rows, D) products instead of score-shaped ones:

        α = rowsum(P∘G) = τ (U_Q·(P K) + Q·(P U_K))             (row-wise dot products)
        P̄ = (G − α)∘(dP − D) − αD + B,   B = dO U_Vᵀ
        E = rowsum(P∘P̄) = rowsum(H∘(dP − D)) − αD + dO·(P U_V)
        R = P∘(P̄ − E) = H∘(dP − D) + P∘(B − c),   c = αD + E = rowsum(H∘(dP − D)) + dO·(P U_V)

    (rowsum(P) = 1 identically on rows that see a key; on rows that see none P = 0 and α = 0,
    so the identities hold there too, and so do their derivatives.)

    Same outputs as :func:`_bob_rows`: (Q̄, dŌ) of the rows, and their K̄ share (without τ
    and the sum over shared heads) and V̄ share."""
    dpmd = torch.matmul(dof, vf.transpose(-1, -2)) - delta.unsqueeze(-1)
    has_g = uqf is not None or ukf is not None
    pd = p * dpmd if has_g else None
    puv = None if uvf is None else torch.matmul(p, uvf)
    hmat = hd = None
    c = None  # the row vector c = αD + E (E alone without G)
    if has_g:
        g, t, alpha = None, None, None
        if uqf is not None:
            g = torch.matmul(uqf, kf.transpose(-1, -2))
            alpha = _rowdot(uqf, torch.matmul(p, kf))
        if ukf is not None:
            t = torch.matmul(qf, ukf.transpose(-1, -2))
            g = t if g is None else g + t
            a = _rowdot(qf, torch.matmul(p, ukf))
            alpha = a if alpha is None else alpha + a
        alpha = scale * alpha
        gma = g * scale - alpha.unsqueeze(-1)
        del g, t  # only G − α is kept (locals would hold score-shaped tensors alive)
        hmat = p * gma
        hd = hmat * dpmd
        c = hd.sum(-1)
        if puv is not None:
            c = c + _rowdot(dof, puv)
    elif puv is not None:
        c = _rowdot(dof, puv)
    if uvf is not None:
        rest = p * (torch.matmul(dof, uvf.transpose(-1, -2)) - c.unsqueeze(-1))
        r = rest if hd is None else hd + rest
        del rest
    else:  # G is there (the BoB has a U)
        r = hd - p * c.unsqueeze(-1)
    del hd
    qb = torch.matmul(r, kf)
    kb = torch.matmul(r.transpose(-1, -2), qf)
    if ukf is not None:
        qb = qb + torch.matmul(pd, ukf)
    if uqf is not None:
        kb = kb + torch.matmul(pd.transpose(-1, -2), uqf)
    if hmat is not None:
        dob = torch.matmul(hmat, vf)
        vb = torch.matmul(hmat.transpose(-1, -2), dof)
        if puv is not None:
            dob = dob + puv
    else:
        dob = torch.zeros_like(dof) if puv is None else puv
        vb = torch.zeros_like(vf)
    return scale * qb, dob, kb, vb


def _bob_block(q, k, v, do, uq, uk, uv, scale, causal, window, n_q, n_k, r0, r1, k0):
    """(Q̄, K̄ share, V̄ share, dŌ) of query rows r0:r1 (q, do, uq hold those rows; k, v, uk,
    uv keys k0:k0 + k.shape[-2] of n_k, all those the rows see), recomputing P, O and D
    from q, k, v and dO, out of place: differentiable to any order. Rows that see no key give
    0 (and gradients 0, never NaN). P is a softmax (its graph saves P alone) and the BoB is
    :func:`_bob_rows_lean`."""
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf, dof = q.to(cd), _expand_kv(k.to(cd), groups), _expand_kv(v.to(cd), groups), do.to(cd)
    uqf = None if uq is None else uq.to(cd)
    ukf = None if uk is None else _expand_kv(uk.to(cd), groups)
    uvf = None if uv is None else _expand_kv(uv.to(cd), groups)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:  # attention_mask's rule, for keys k0:k0 + k.shape[-2] only
        i = torch.arange(r0, r1, device=q.device).unsqueeze(1) + (n_k - n_q)
        j = torch.arange(k0, k0 + k.shape[-2], device=q.device).unsqueeze(0)
        mask = (j <= i) if window is None else (j <= i) & (j > i - window)
        # a row without keys: softmax of zeros (finite), then P = 0 on the whole row
        empty = ~mask.any(-1, keepdim=True)
        s = s.masked_fill(~mask, float("-inf")).masked_fill(empty, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    del s
    delta = _rowdot(dof, torch.matmul(p, vf))
    qb, dob, kb, vb = _bob_rows_lean(p, qf, dof, uqf, kf, vf, ukf, uvf, delta, scale)
    kb = _reduce_kv(scale * kb, groups)
    vb = _reduce_kv(vb, groups)
    return qb.to(q.dtype), kb.to(k.dtype), vb.to(v.dtype), dob.to(do.dtype)


def _key_range(n_q: int, n_k: int, r0: int, r1: int, causal: bool, window: Optional[int]):
    """Keys k0:k1 that query rows r0:r1 may see (bottom-right aligned masks): the blocks skip
    the rest. At least one key (a block whose rows see none masks it whole)."""
    if not causal:
        return 0, n_k
    shift = n_k - n_q
    k1 = max(1, min(n_k, r1 + shift))
    k0 = 0 if window is None else max(0, r0 + shift - window + 1)
    return min(k0, k1 - 1), k1


#: Which of the BoB's inputs (:data:`BOB_INPUTS`) are indexed by query rows (the others by keys).
_ROW_INPUT = (True, False, False, True, True, False, False)


def _over_blocks(tensors, is_row, cu_q, cu_k, chunk, causal, window, fn):
    """Call ``fn(n_q, n_k, r0, r1, k0, sliced)`` for every block of query rows of every
    sequence (one sequence for dense (B, H, N, D) tensors; varlen (T, H, D) tensors are cut
    into (1, H, n, D) views per sequence). ``sliced``: ``tensors`` with the row-indexed ones
    (``is_row``) cut to the block's rows and the others to the keys k0:k1 those rows see
    (:func:`_key_range`). ``fn`` returns (row results, key results of keys k0:k1); returns
    [(q_start, q_end, [row results per block])], [(k_start, k_end, key results summed)]."""
    if cu_q is None:
        segments = [(0, tensors[0].shape[2], 0, tensors[1].shape[2], tuple(tensors))]
    else:
        segments = [
            (qs, qe, ks, ke, tuple(None if x is None else _seq(x, *((qs, qe) if r else (ks, ke)))
                                   for x, r in zip(tensors, is_row)))
            for qs, qe, ks, ke in _bounds(cu_q, cu_k)
        ]
    row_parts, key_parts = [], []
    for qs, qe, ks, ke, views in segments:
        n_q, n_k = qe - qs, ke - ks
        blocks, key_sum = [], None
        if n_q > 0 and n_k > 0:
            bh = views[0].shape[0] * views[0].shape[1]
            rows = chunk if chunk is not None else _recompute_rows(bh, n_q, n_k, views[0].shape[-1])
            for r0, r1 in _chunks(n_q, rows):
                k0, k1 = _key_range(n_q, n_k, r0, r1, causal, window)
                sliced = tuple(None if x is None else (x[:, :, r0:r1] if r else x[:, :, k0:k1])
                               for x, r in zip(views, is_row))
                row_res, key_res = fn(n_q, n_k, r0, r1, k0, sliced)
                key_res = tuple(None if t is None else torch.nn.functional.pad(t, (0, 0, k0, n_k - k1))
                                for t in key_res)
                blocks.append(row_res)
                key_sum = key_res if key_sum is None else tuple(
                    b if a is None else (a if b is None else a + b) for a, b in zip(key_sum, key_res))
        row_parts.append((qs, qe, blocks))
        key_parts.append((ks, ke, key_sum))
    return row_parts, key_parts


def _assemble(pieces, like: Tensor, varlen: bool) -> Tensor:
    """Join (start, end, tensor or None) pieces, in order and covering ``like``'s token axis,
    into ``like``'s layout (None: zeros)."""
    out = []
    for start, end, t in pieces:
        if t is not None:
            out.append(_unseq(t) if varlen else t)
        elif varlen:
            out.append(like.new_zeros((end - start,) + tuple(like.shape[1:])))
        else:
            out.append(like.new_zeros(like.shape[:2] + (end - start,) + like.shape[3:]))
    return out[0] if len(out) == 1 else torch.cat(out, dim=0 if varlen else 2)


def _join(row_parts, key_parts, row_like, key_like, varlen: bool):
    """Full tensors from :func:`_over_blocks`'s pieces, in the layouts of ``row_like`` and
    ``key_like`` (None entries stay None)."""
    rows = []
    for j, like in enumerate(row_like):
        if like is None:
            rows.append(None)
            continue
        pieces = []
        for qs, qe, blocks in row_parts:
            got = [b[j] for b in blocks if b[j] is not None]
            pieces.append((qs, qe, None if not got else (got[0] if len(got) == 1 else torch.cat(got, dim=2))))
        rows.append(_assemble(pieces, like, varlen))
    keys = []
    for j, like in enumerate(key_like):
        if like is None:
            keys.append(None)
            continue
        keys.append(_assemble([(ks, ke, None if ksum is None else ksum[j]) for ks, ke, ksum in key_parts],
                              like, varlen))
    return rows, keys


def _plain_autograd(tensors) -> bool:
    """True when a block's vjp may run as one ``torch.autograd.grad`` call: no torch.func
    transform is active (its wrapped tensors need ``torch.func.vjp``) and no forward-AD level
    (whose tangents a detached input would drop)."""
    if _forward_ad._current_level >= 0 or torch._C._functorch.maybe_current_level() is not None:
        return False
    return not any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _autograd_vjp(f, primals, cotangents):
    """Jᵀc of ``f`` at ``primals`` with ``torch.autograd.grad`` (None cotangents: zero). The
    graph is freed as the backward runs, so its saved tensors are not all alive at once at the
    end (``torch.func.vjp`` keeps them for a second call). Under grad mode (a derivative of
    the result is being recorded) and with an input or cotangent that requires grad, the graph
    is kept and connects to them: the result is differentiable again."""
    create = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in primals + tuple(cotangents))
    with torch.enable_grad():
        ins = tuple(x.view_as(x) if create and x.requires_grad else x.detach().requires_grad_() for x in primals)
        out = f(*ins)
        pairs = [(o, c) for o, c in zip(out, cotangents) if c is not None and o is not None and o.requires_grad]
        grads = (None,) * len(ins)
        if pairs:
            grads = torch.autograd.grad([o for o, _ in pairs], ins, [c for _, c in pairs],
                                        create_graph=create, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, primals))


def bob_vjp(
    inputs: Sequence[Optional[Tensor]],
    cotangents: Sequence[Optional[Tensor]],
    needs: Sequence[bool],
    *,
    scale: float,
    causal: bool,
    window: Optional[int],
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    chunk: Optional[int] = None,
):
    """Vector-Jacobian product of the BoB: the third derivatives of attention.

    ``inputs``: (q, k, v, dO, U_Q, U_K, U_V) (:data:`BOB_INPUTS`; any U may be None), in the
    layouts :func:`attn_bob` takes ((B, H, N, D), or (T, H, D) with ``cu_seqlens_*``);
    ``cotangents``: of the BoB's outputs (Q̄, K̄, V̄, dŌ), each of its output's shape, or
    None; ``needs``: which of the seven inputs want a gradient. Returns the seven gradients
    (None where not needed), total derivatives: O, L and D are recomputed from the inputs.

    Blocks of ``chunk`` query rows (None: :func:`_recompute_rows`, score blocks the size of
    the queries) are recomputed with out-of-place ops and differentiated one at a time, by
    one ``torch.autograd.grad`` call that frees the block's graph as it runs (under a
    torch.func transform or a forward-AD level: ``torch.func.vjp``): O(rows × N_k) memory per
    head, never N_q × N_k. The results are
    built of differentiable ops, so a fourth derivative differentiates them (that keeps every
    block's graph: O(N_q × N_k) per head)."""
    from torch.func import vjp

    needs = tuple(bool(n) and x is not None for n, x in zip(needs, inputs))
    if not any(needs) or all(c is None for c in cotangents):
        return (None,) * 7
    idx = [i for i in range(7) if needs[i]]
    gq, gk, gv, gdo = cotangents

    def block(n_q, n_k, r0, r1, k0, t):
        xs, (cq, ck, cv, cdo) = t[:7], t[7:]

        def f(*ps):
            vals = list(xs)
            for i, p in zip(idx, ps):
                vals[i] = p
            return _bob_block(*vals, scale, causal, window, n_q, n_k, r0, r1, k0)

        primals = tuple(xs[i] for i in idx)
        if _plain_autograd(primals + (cq, ck, cv, cdo)):
            g = dict(zip(idx, _autograd_vjp(f, primals, (cq, ck, cv, cdo))))
        else:
            out, fn = vjp(f, *primals)
            cot = tuple(torch.zeros_like(o) if c is None else c for o, c in zip(out, (cq, ck, cv, cdo)))
            g = dict(zip(idx, fn(cot)))
        return (g.get(0), g.get(3), g.get(4)), (g.get(1), g.get(2), g.get(5), g.get(6))

    is_row = _ROW_INPUT + (True, False, False, True)
    row_parts, key_parts = _over_blocks(tuple(inputs) + (gq, gk, gv, gdo), is_row, cu_seqlens_q,
                                        cu_seqlens_k, chunk, causal, window, block)
    like = [x if needs[i] else None for i, x in enumerate(inputs)]
    (g_q, g_do, g_uq), (g_k, g_v, g_uk, g_uv) = _join(
        row_parts, key_parts, (like[0], like[3], like[4]), (like[1], like[2], like[5], like[6]),
        cu_seqlens_q is not None)
    return g_q, g_k, g_v, g_do, g_uq, g_uk, g_uv


def _jvp_by_two_vjps(f, primals, tangents):
    """J t of ``f`` at ``primals`` by reverse mode twice: u ↦ Jᵀu is linear, and its vjp
    with cotangent t is J t. Inside a ``torch.autograd.forward_ad`` level, where
    ``torch.func.jvp`` cannot nest."""
    from torch.func import vjp

    out, fn = vjp(f, *primals)
    zeros = tuple(torch.zeros_like(o) for o in out)
    _, fn2 = vjp(lambda *u: fn(u), *zeros)
    return fn2(tuple(tangents))


def bob_jvp(
    inputs: Sequence[Optional[Tensor]],
    tangents: Sequence[Optional[Tensor]],
    *,
    scale: float,
    causal: bool,
    window: Optional[int],
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    chunk: Optional[int] = None,
):
    """Jacobian-vector product of the BoB (a jvp of a second derivative: third order).

    ``inputs`` as :func:`bob_vjp`; ``tangents``: one per input (None: not varied). Returns
    the tangents of (Q̄, K̄, V̄, dŌ) (all None when every tangent is None), computed block by
    block with ``torch.func.jvp`` over :func:`bob_vjp`'s blocks."""
    from torch.func import jvp

    idx = [i for i in range(7) if inputs[i] is not None and tangents[i] is not None]
    if not idx:
        return None, None, None, None

    def block(n_q, n_k, r0, r1, k0, t):
        xs, ts = t[:7], t[7:]

        def f(*ps):
            vals = list(xs)
            for i, p in zip(idx, ps):
                vals[i] = p
            return _bob_block(*vals, scale, causal, window, n_q, n_k, r0, r1, k0)

        primals, tans = tuple(xs[i] for i in idx), tuple(ts[i] for i in idx)
        if _forward_ad._current_level < 0:
            _, out = jvp(f, primals, tans)
        else:
            out = _jvp_by_two_vjps(f, primals, tans)
        return (out[0], out[3]), (out[1], out[2])

    row_parts, key_parts = _over_blocks(tuple(inputs) + tuple(tangents), _ROW_INPUT * 2, cu_seqlens_q,
                                        cu_seqlens_k, chunk, causal, window, block)
    q, k, v, do = inputs[:4]
    (t_q, t_do), (t_k, t_v) = _join(row_parts, key_parts, (q, do), (k, v), cu_seqlens_q is not None)
    return t_q, t_k, t_v, t_do
