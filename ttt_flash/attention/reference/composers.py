"""The chunked closed forms of the reference: masks, the naive (materialised) oracle, and the
composers ``attn_fwd``, ``attn_bwd``, ``attn_bob`` (the package docstring states the contract)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["attn_fwd", "attn_bwd", "attn_bob", "naive_attention", "naive_attention_varlen", "attention_mask",
           "DEFAULT_CHUNK"]


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
    col_start: int = 0,
    col_end: Optional[int] = None,
) -> Optional[Tensor]:
    """Boolean mask (rows, keys), True where query i may attend to key j.

    Rows ``row_start:row_end`` and key columns ``col_start:col_end`` of the full (N_q, N_k)
    mask. Causal masks are aligned to the bottom-right: query i sees key j iff
    j <= i + N_k - N_q; a window w also requires j > i + N_k - N_q - w. Returns None when
    nothing is masked.
    """
    if not causal:
        return None
    row_end = n_q if row_end is None else row_end
    col_end = n_k if col_end is None else col_end
    i = torch.arange(row_start, row_end, device=device).unsqueeze(1)
    j = torch.arange(col_start, col_end, device=device).unsqueeze(0)
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


def _to_compute(q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], cd: torch.dtype, groups: int):
    """``(q, k, v)`` (or a direction ``(U_Q, U_K, U_V)``; any None) in the compute dtype ``cd``,
    keys and values expanded to the query heads."""
    return (None if q is None else q.to(cd), None if k is None else _expand_kv(k.to(cd), groups),
            None if v is None else _expand_kv(v.to(cd), groups))


def _prologue(q: Tensor, k: Tensor, v: Tensor):
    """``(cd, groups, qf, kf, vf)``: the compute dtype, query heads per key head, and
    :func:`_to_compute` of ``(q, k, v)``."""
    cd = _compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    return (cd, groups) + _to_compute(q, k, v, cd, groups)


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
    return torch.matmul(_masked_softmax(s, mask), v)


def _masked_softmax(s: Tensor, mask: Optional[Tensor]) -> Tensor:
    """softmax(S) over the keys ``mask`` allows (None: all), out of place; a row with no
    visible key gets P = 0 (its softmax of zeros is finite, so its gradients are 0, never NaN)."""
    if mask is None:
        return torch.softmax(s, dim=-1)
    empty = ~mask.any(dim=-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(empty, 0.0)
    return torch.softmax(s, dim=-1).masked_fill(empty, 0.0)


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
    cd, groups, qf, kf, vf = _prologue(q, k, v)
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
    cd, groups, qf, kf, vf = _prologue(q, k, v)
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


def _score_direction(uqc: Optional[Tensor], kf: Tensor, qc: Tensor, ukf: Optional[Tensor]) -> Optional[Tensor]:
    """U_Q Kᵀ + Q U_Kᵀ for a block of query rows (without the scale), from a direction's
    ``uqc`` (the rows') and ``ukf`` (either None); None when both are: the tangent Ṡ / τ of
    the scores, and G / τ of the backward-over-backward."""
    g = None if uqc is None else torch.matmul(uqc, kf.transpose(-1, -2))
    if ukf is not None:
        t = torch.matmul(qc, ukf.transpose(-1, -2))
        g = t if g is None else g + t
    return g


def _bob_rows(p, qc, doc, uqc, kf, vf, ukf, uvf, deltac, scale, stats_c=None):
    """The closed-form BoB (bob-math.md) for one block of query rows, out of place (so that
    autograd can differentiate it). ``p``: the block's probabilities (rows, N_k); ``kf``,
    ``vf``, ``ukf``, ``uvf``: keys expanded to the query heads; ``deltac``: D of the rows;
    ``stats_c``: the rows' (α, E + αD) or None. Returns (Q̄, dŌ) of the rows and the rows'
    contributions to K̄ (without the factor τ and the sum over shared heads) and V̄."""
    dp = torch.matmul(doc, vf.transpose(-1, -2))
    dp_minus_d = dp - deltac.unsqueeze(-1)
    g = _score_direction(uqc, kf, qc, ukf)  # G = scale (U_Q Kᵀ + Q U_Kᵀ): cotangent reaching dS
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


def _bob_dense(q, k, v, o, lse, do, delta, uq, uk, uv, alpha, ee, scale, causal, window, chunk):
    """Closed-form backward-over-backward (bob-math.md), query rows in chunks. ``alpha``,
    ``ee``: the row statistics (α, E + αD) given instead of formed here, or None."""
    cd, groups, qf, kf, vf = _prologue(q, k, v)
    dof, lsef, deltaf = do.to(cd), lse.to(cd), delta.to(cd)
    uqf, ukf, uvf = _to_compute(uq, uk, uv, cd, groups)
    stats = None if alpha is None else (alpha, ee)
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


def _cut(x: Optional[Tensor], kind: str, qs: int, qe: int, ks: int, ke: int) -> Optional[Tensor]:
    """One sequence of a packed tensor as a dense view: ``kind`` ``"q"`` (T_q, H, D) rows qs:qe,
    ``"k"`` (T_k, H, D) rows ks:ke, ``"r"`` a (H, T_q) row vector's columns qs:qe."""
    if x is None:
        return None
    if kind == "r":
        return _row(x, qs, qe)
    return _seq(x, qs, qe) if kind == "q" else _seq(x, ks, ke)


def _per_sequence(dense, inputs, kinds: str, outputs, out_kinds: str, cu_q: Tensor, cu_k: Tensor, *rest):
    """Run the dense composer ``dense(*views, *rest)`` on each packed sequence with queries: the
    ``inputs`` (of ``kinds``, one letter each, as :func:`_cut`) cut to the sequence, its
    results written into the packed ``outputs`` (of ``out_kinds``). Returns ``outputs``."""
    for qs, qe, ks, ke in _bounds(cu_q, cu_k):
        if qe == qs:
            continue
        results = dense(*(_cut(x, kd, qs, qe, ks, ke) for x, kd in zip(inputs, kinds)), *rest)
        for out, kd, r in zip(outputs, out_kinds, results):
            if kd == "r":
                out[:, qs:qe] = r[0]
            elif kd == "q":
                out[qs:qe] = _unseq(r)
            else:
                out[ks:ke] = _unseq(r)
    return outputs


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
    return _per_sequence(_fwd_dense, (q, k, v), "qkk", (o, lse), "qr", cu_seqlens_q, cu_seqlens_k,
                         scale, causal, window, chunk)


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
    return _per_sequence(_bwd_dense, (q, k, v, o, lse, do), "qkkqrq", (dq, dk, dv, delta), "qkkr",
                         cu_seqlens_q, cu_seqlens_k, scale, causal, window, chunk)


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
    alpha, ee = (None, None) if stats is None else (stats[0], stats[1])
    inputs = (q, k, v, o, lse, do, delta, uq, uk, uv, alpha, ee)
    if cu_seqlens_q is None:
        return _bob_dense(*inputs, scale, causal, window, chunk)
    outputs = tuple(torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, do))
    return _per_sequence(_bob_dense, inputs, "qkkqrqrqkkrr", outputs, "qkkq", cu_seqlens_q, cu_seqlens_k,
                         scale, causal, window, chunk)
