"""Derivatives of the backward-over-backward (third order and up) by blockwise recomputation:
:func:`bob_vjp` and :func:`bob_jvp`, differentiable again, on every backend."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

from .composers import (_bounds, _chunks, _masked_softmax, _prologue, _reduce_kv, _seq, _to_compute, _unseq,
                        attention_mask)

__all__ = ["bob_vjp", "bob_jvp"]

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
    cd, groups, qf, kf, vf = _prologue(q, k, v)
    dof = do.to(cd)
    uqf, ukf, uvf = _to_compute(uq, uk, uv, cd, groups)
    mask = attention_mask(n_q, n_k, causal=causal, window=window, device=q.device, row_start=r0, row_end=r1,
                          col_start=k0, col_end=k0 + k.shape[-2])
    p = _masked_softmax(torch.matmul(qf, kf.transpose(-1, -2)) * scale, mask)
    delta = _rowdot(dof, torch.matmul(p, vf))
    qb, dob, kb, vb = _bob_rows_lean(p, qf, dof, uqf, kf, vf, ukf, uvf, delta, scale)
    kb = _reduce_kv(scale * kb, groups)
    vb = _reduce_kv(vb, groups)
    return qb.to(q.dtype), kb.to(k.dtype), vb.to(v.dtype), dob.to(do.dtype)


def _block_fn(xs, idx, scale, causal, window, n_q, n_k, r0, r1, k0):
    """:func:`_bob_block` of one block as a function of the inputs ``xs[i]`` for ``i`` in
    ``idx`` (the others held at ``xs``), for ``torch.func`` and autograd."""

    def f(*ps):
        vals = list(xs)
        for i, p in zip(idx, ps):
            vals[i] = p
        return _bob_block(*vals, scale, causal, window, n_q, n_k, r0, r1, k0)

    return f


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
        f = _block_fn(xs, idx, scale, causal, window, n_q, n_k, r0, r1, k0)
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
        f = _block_fn(xs, idx, scale, causal, window, n_q, n_k, r0, r1, k0)
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
