r"""Context parallelism: one sequence across processes, exact to second order (Ulysses).

Every process of a group of P holds one contiguous block of the sequence: rank r holds tokens
``N·r//P … N·(r+1)//P − 1`` (:func:`block_bounds`; blocks differ in length by at most one).
Attention needs every key for every query, so before attention an all-to-all turns the
sequence shards of q, k and v into *head* shards over the whole sequence (rank r then holds
heads ``H·r//P … H·(r+1)//P − 1`` of all N tokens), :func:`ttt_flash.flash_attention` runs
locally on those heads, and the inverse all-to-all turns the output back into sequence
shards (DeepSpeed-Ulysses).

Why this is exact to second order: an all-to-all is a fixed permutation of the elements of
the P processes' tensors, a linear map A. Its adjoint Aᵀ (the backward) is the inverse
all-to-all, again a permutation, and linear maps are their own linearisation. So
:class:`_AllToAll` 's backward is :class:`_AllToAll` with the split sizes swapped: the first
backward, the backward-over-backward and forward-mode tangents go through the same
collective, and the attention between them is :func:`~ttt_flash.flash_attention`'s exact
double backward. Padding (uneven blocks are padded to the longest before the exchange and
the padding is cut off after it, so no padded key ever reaches attention), GQA key/value
replication and the head moves are ordinary differentiable tensor operations.

Gradients of the *sum over ranks* of the per-rank losses: a backward started on every rank
from its own loss ``L_r`` leaves on rank r the gradient of ``Σ_s L_s`` with respect to rank
r's inputs (the backward all-to-all brings every rank's contribution). Parameters that every
rank holds a copy of get only their rank's share; :func:`all_reduce_sum` (differentiable:
its backward is itself) adds the shares, also inside an inner loop whose gradient is
differentiated again (MAML over a context-parallel sequence).
"""

from __future__ import annotations

import numbers
import struct
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .attention import flash_attention, flash_attention_varlen

__all__ = [
    "context_parallel_attention",
    "context_parallel_attention_varlen",
    "all_reduce_sum",
    "block_bounds",
    "shard_sequence",
    "sequence_offset",
    "head_plan",
    "context_parallel_groups",
    "reduce_gradients",
]


# --------------------------------------------------------------------------- groups and blocks


def group_size_rank(group) -> Tuple[int, int]:
    """(P, r) of ``group`` (None: the default group); (1, 0) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(
                "a context-parallel group was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first"
            )
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the process group given; "
            "pass the group this rank belongs to (e.g. its cp_group from context_parallel_groups), or None for "
            "the default group")
    return dist.get_world_size(group), rank


def block_bounds(seq_len: int, rank: int, size: int) -> Tuple[int, int]:
    """``(start, end)``: the tokens ``start … end − 1`` of a length-``seq_len`` sequence that
    rank ``rank`` of ``size`` holds: ``seq_len·rank//size`` to ``seq_len·(rank+1)//size``."""
    return seq_len * rank // size, seq_len * (rank + 1) // size


def _block_lengths(seq_len: int, size: int) -> List[int]:
    return [block_bounds(seq_len, r, size)[1] - block_bounds(seq_len, r, size)[0] for r in range(size)]


def shard_sequence(x: Tensor, dim: int, *, group=None) -> Tensor:
    """This rank's block of a full sequence ``x`` along ``dim`` (a view; every rank passes the
    same full tensor). The inverse layout of what :func:`context_parallel_attention` takes."""
    size, rank = group_size_rank(group)
    start, end = block_bounds(x.shape[dim], rank, size)
    return x.narrow(dim, start, end - start)


def _code(value) -> int:
    """A stable int64 for one argument of a call (bools, ints, None, floats, strings)."""
    if value is None:
        return -(2**62)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return zlib.crc32(repr(value).encode()) + 2**40


#: Call signatures (group, this rank's signature) already checked across their group.
_CHECKED: set = set()


def _agree(what: str, fields: Dict[str, object], n_local: int, seq_len: Optional[int], group, device) -> List[int]:
    """Check, across the ranks of ``group``, that a call's ``fields`` (name -> value) are equal
    on every rank and that the ranks' blocks (``n_local`` tokens each) are the shares of one
    sequence (of ``seq_len`` tokens when given); return every rank's block length.

    Every rank raises the same ``ValueError`` on a mismatch (one small all-gather of the
    signatures, so no rank is left waiting in a collective). Without ``seq_len`` the gather
    runs on every call (it also gives the block lengths); with it, once per signature."""
    size, rank = group_size_rank(group)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral)
                                or seq_len < 0):
        raise ValueError(f"seq_len must be None or an int >= 0 (the whole sequence's length), got {seq_len!r}")
    local = [int(n_local), -1 if seq_len is None else int(seq_len), *(_code(v) for v in fields.values())]
    key = (id(group) if group is not None else None, tuple(local))
    if seq_len is not None and key in _CHECKED:
        return _block_lengths(int(seq_len), size)
    t = torch.tensor(local, dtype=torch.int64, device=device)
    rows = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(rows, t, group=group)
    table = torch.stack(rows).tolist()  # one device synchronisation
    names = ["seq_len", *fields]
    differing = [names[j - 1] for j in range(1, len(local)) if len({row[j] for row in table}) > 1]
    if differing:
        shown: List[object] = [None] * size
        dist.all_gather_object(shown, {"seq_len": seq_len, **fields}, group=group)
        detail = "; ".join(f"{name}: " + ", ".join(f"rank {r}: {shown[r][name]!r}" for r in range(size))
                           for name in differing)
        raise ValueError(
            f"{what}: the ranks of the group called it with different arguments ({detail}); every rank must "
            "pass the same arguments and shapes, apart from its own block of the sequence")
    lens = [row[0] for row in table]
    if seq_len is None:
        expect = _block_lengths(sum(lens), size)
        if lens != expect:
            raise ValueError(
                f"{what}: the ranks' blocks have lengths {lens}, but rank r must hold tokens "
                f"N·r//P … N·(r+1)//P − 1 of the N = {sum(lens)} tokens (lengths {expect}); "
                "split the sequence with ttt_flash.distributed.shard_sequence"
            )
        return lens
    expect = _block_lengths(int(seq_len), size)
    if lens != expect:
        raise ValueError(
            f"{what}: the ranks hold blocks of {lens} tokens, but the blocks of seq_len={seq_len} over {size} "
            f"ranks (rank r: tokens seq_len·r//P … seq_len·(r+1)//P − 1) have {expect}; pass the whole "
            "sequence's length as seq_len (or None to gather the block lengths)"
        )
    if len(_CHECKED) >= 4096:  # e.g. varlen batches, each with its own cu_seqlens
        _CHECKED.clear()
    _CHECKED.add(key)
    return expect


def _lengths(n_local: int, seq_len: Optional[int], group, device, what: str) -> List[int]:
    """Every rank's block length (checked across the group, see :func:`_agree`)."""
    return _agree(what, {}, n_local, seq_len, group, device)


def sequence_offset(n_local: int, *, group=None, seq_len: Optional[int] = None,
                    device=None) -> Tuple[int, int]:
    """``(offset, N)``: the global index of this rank's first token and the whole sequence's
    length, for positions (RoPE) of a block of ``n_local`` tokens. One small all-gather when
    ``seq_len`` is not given."""
    size, rank = group_size_rank(group)
    if size == 1:
        return 0, n_local if seq_len is None else int(seq_len)
    lens = _lengths(n_local, seq_len, group, device, "sequence_offset")
    return sum(lens[:rank]), sum(lens)


# --------------------------------------------------------------------------- collectives


def _splits_or_none(splits: Sequence[int]):
    return None if len(set(splits)) == 1 else list(splits)


def _all_to_all(x: Tensor, in_splits: Tuple[int, ...], out_splits: Tuple[int, ...], group) -> Tensor:
    """``dist.all_to_all_single`` along dim 0: rows ``in_splits[s]`` go to rank s; rank s's
    ``out_splits[s]`` rows arrive in order."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=_splits_or_none(out_splits),
                           input_split_sizes=_splits_or_none(in_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0, differentiable to any order: the adjoint of the exchange
    (in_splits → out_splits) is the exchange (out_splits → in_splits), applied through this
    Function again so that its own backward is recorded when a graph is kept."""

    @staticmethod
    def forward(x, in_splits, out_splits, group):
        return _all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.in_splits, ctx.out_splits, ctx.group = inputs

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.out_splits, ctx.in_splits, ctx.group), None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _AllToAll.apply(tangent, ctx.in_splits, ctx.out_splits, ctx.group)


class _AllReduceSum(torch.autograd.Function):
    """``y = Σ_r x_r`` on every rank. For an objective ``Σ_r f_r(y)`` the adjoint is
    ``x̄_r = Σ_s ȳ_s``: the same all-reduce, applied through this Function again."""

    @staticmethod
    def forward(x, group):
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.apply(grad, ctx.group), None

    @staticmethod
    def jvp(ctx, tangent, _):
        return _AllReduceSum.apply(tangent, ctx.group)


def all_reduce_sum(x: Tensor, *, group=None) -> Tensor:
    """``Σ_r x_r`` over the ranks of ``group``, differentiable to any order (backward: the
    same sum of the ranks' cotangents). Use it for the shares of a replicated parameter's
    gradient inside an inner loop that is differentiated again. Returns ``x`` unchanged
    without several processes."""
    if group_size_rank(group)[0] == 1:
        return x
    return _AllReduceSum.apply(x, group)


# --------------------------------------------------------------------------- head plan


def head_plan(heads: int, kv_heads: int, size: int) -> Tuple[int, List[int], List[int]]:
    """How the heads are dealt out to ``size`` ranks: ``(repeat, q_splits, kv_splits)``.

    Key/value heads are first repeated ``repeat`` times each (a divisor of the GQA group
    ``heads // kv_heads``, the smallest for which the key/value heads divide evenly among the
    ranks, else the smallest that gives every rank at least one); rank s then gets
    ``kv_splits[s]`` key/value heads and the ``q_splits[s] = kv_splits[s]·heads/(kv_heads·
    repeat)`` query heads that use them. Raises ``ValueError`` when there are fewer query
    heads than ranks (docs/distributed.md: why not a ring)."""
    if heads < size:
        raise ValueError(
            f"context parallelism over {size} ranks needs at least {size} query heads, got {heads}: "
            "each rank attends with whole heads over the whole sequence (Ulysses). Use a smaller "
            "context-parallel group (data parallel across groups), or more heads "
            "(docs/distributed.md explains why there is no ring variant)"
        )
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) (grouped-query attention)")
    g = heads // kv_heads
    divisors = [r for r in range(1, g + 1) if g % r == 0]
    repeat = next((r for r in divisors if (kv_heads * r) % size == 0), None)
    if repeat is None:
        repeat = next(r for r in divisors if kv_heads * r >= size)
    hk = kv_heads * repeat
    kv_splits = [hk * (s + 1) // size - hk * s // size for s in range(size)]
    q_splits = [n * (g // repeat) for n in kv_splits]
    return repeat, q_splits, kv_splits


# --------------------------------------------------------------------------- layout moves


def _seq_to_heads(x: Tensor, seq_axis: int, head_axis: int, lens: List[int], head_splits: List[int],
                  rank: int, group) -> Tensor:
    """Sequence shard (all heads, ``lens[rank]`` tokens) → head shard (``head_splits[rank]``
    heads, all ``sum(lens)`` tokens), same axis layout. Differentiable to any order."""
    size, n_max = len(lens), max(lens)
    pad = n_max - x.shape[seq_axis]
    if pad:
        x = torch.cat([x, x.new_zeros((*x.shape[:seq_axis], pad, *x.shape[seq_axis + 1:]))], dim=seq_axis)
    x = x.movedim(head_axis, 0)
    s = seq_axis + 1 if seq_axis < head_axis else seq_axis  # the sequence axis after movedim
    h = head_splits[rank]
    y = _AllToAll.apply(x, tuple(head_splits), (h,) * size, group).unflatten(0, (size, h))
    if pad or len(set(lens)) > 1:  # cut each block's padding off: no padded key reaches attention
        y = torch.cat([y[p].narrow(s, 0, lens[p]) for p in range(size)], dim=s)
    else:
        y = torch.cat(y.unbind(0), dim=s)
    return y.movedim(0, head_axis)


def _heads_to_seq(y: Tensor, seq_axis: int, head_axis: int, lens: List[int], head_splits: List[int],
                  rank: int, group) -> Tensor:
    """Inverse of :func:`_seq_to_heads`: head shard over the whole sequence → this rank's
    block of the sequence with all heads."""
    size, n_max = len(lens), max(lens)
    y = y.movedim(head_axis, 0)
    s = seq_axis + 1 if seq_axis < head_axis else seq_axis
    blocks = []
    for block in y.split(lens, dim=s):
        pad = n_max - block.shape[s]
        if pad:
            block = torch.cat([block, block.new_zeros((*block.shape[:s], pad, *block.shape[s + 1:]))], dim=s)
        blocks.append(block)
    z = torch.stack(blocks, 0).flatten(0, 1)
    h = head_splits[rank]
    out = _AllToAll.apply(z, (h,) * size, tuple(head_splits), group)
    if out.shape[s] != lens[rank]:
        out = out.narrow(s, 0, lens[rank])
    return out.movedim(0, head_axis)


def _repeat_kv(x: Tensor, repeat: int, head_axis: int) -> Tensor:
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=head_axis)


def _check_group_tensors(q, k, v, layout: str, seq_axis: int) -> None:
    want = 4 if layout == "bhnd" else 3
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != want:
            shape = "(B, H, N_local, D)" if layout == "bhnd" else "(T_local, H, D)"
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[seq_axis] != k.shape[seq_axis]:
        raise ValueError(
            "context-parallel attention is self-attention over one sharded sequence: q and k must "
            f"hold the same tokens, got {q.shape[seq_axis]} query and {k.shape[seq_axis]} key tokens"
        )


def _call_fields(q: Tensor, k: Tensor, v: Tensor, kw: Dict[str, object]) -> Dict[str, object]:
    """What every rank of a group must pass alike: shapes but the sequence axis, dtype,
    device type and the attention arguments."""
    seq_axis = 2 if q.dim() == 4 else 0
    def rest(x):
        return tuple(n for i, n in enumerate(x.shape) if i != seq_axis)
    return {"q shape (but tokens)": rest(q), "k shape (but tokens)": rest(k), "v shape (but tokens)": rest(v),
            "dtype": str(q.dtype), "device type": q.device.type, **kw}


# --------------------------------------------------------------------------- public API


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    seq_len: Optional[int] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
) -> Tensor:
    r""":func:`ttt_flash.flash_attention` over a sequence sharded across the ranks of
    ``group``, differentiable twice exactly (Ulysses all-to-all; module docstring).

    Args:
        q: (B, H_q, N_local, D): this rank's block of the queries, tokens ``N·r//P …
            N·(r+1)//P − 1`` of the N-token sequence (:func:`shard_sequence`).
        k, v: (B, H_kv, N_local, D): the same tokens' keys and values. H_q ≥ P is needed
            (every rank attends with whole heads); H_kv may be smaller than P (key/value
            heads are then repeated, :func:`head_plan`).
        group: the context-parallel process group (None: the default group). Every rank of
            it must call this function with the same shapes apart from N_local.
        seq_len: N, if known (saves one all-gather of the block lengths per call).
        causal, scale, window, backend, precise_bob, deterministic: as in
            :func:`~ttt_flash.flash_attention`, applied to the whole sequence (global token
            indices), so the result is one process's over all N tokens.

    Returns:
        (B, H_q, N_local, D): this rank's block of the output.

    Gradients: a backward from every rank's own loss ``L_r`` gives each rank the gradient of
    ``Σ_r L_r`` w.r.t. its own inputs; first backward, backward-over-backward and
    forward-mode tangents are exact. Without several processes this is
    :func:`~ttt_flash.flash_attention`.

    Example (on each of P processes, after ``torch.distributed.init_process_group``)::

        q, k, v = (shard_sequence(x, 2) for x in (q_full, k_full, v_full))
        o = context_parallel_attention(q, k, v, causal=True)   # == shard_sequence(o_full, 2)
    """
    kw = dict(causal=causal, scale=scale, window=window, backend=backend, precise_bob=precise_bob,
              deterministic=deterministic)
    size, rank = group_size_rank(group)
    if size == 1:
        return flash_attention(q, k, v, **kw)
    _check_group_tensors(q, k, v, "bhnd", 2)
    lens = _agree("context_parallel_attention", _call_fields(q, k, v, kw), q.shape[2], seq_len, group, q.device)
    repeat, q_splits, kv_splits = head_plan(q.shape[1], k.shape[1], size)
    k, v = _repeat_kv(k, repeat, 1), _repeat_kv(v, repeat, 1)
    qh = _seq_to_heads(q, 2, 1, lens, q_splits, rank, group)
    kh = _seq_to_heads(k, 2, 1, lens, kv_splits, rank, group)
    vh = _seq_to_heads(v, 2, 1, lens, kv_splits, rank, group)
    oh = flash_attention(qh, kh, vh, **kw)
    return _heads_to_seq(oh, 2, 1, lens, q_splits, rank, group)


def context_parallel_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: Optional[int] = None,
    *,
    group=None,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
) -> Tensor:
    r""":func:`ttt_flash.flash_attention_varlen` (self-attention) over packed sequences whose
    packed token axis is sharded across the ranks of ``group``.

    Args:
        q: (T_local, H_q, D): tokens ``T·r//P … T·(r+1)//P − 1`` of the T packed tokens.
        k, v: (T_local, H_kv, D), the same tokens.
        cu_seqlens: int32 (B + 1,): the *global* cumulative sequence lengths of the packing
            (the same on every rank; its last entry is T). Blocks may cut sequences anywhere.
        max_seqlen: the longest sequence, or None to compute it.
        group, causal, scale, window, backend, precise_bob, deterministic: as in
            :func:`context_parallel_attention`.

    Returns:
        (T_local, H_q, D): this rank's block of the packed output.
    """
    kw = dict(causal=causal, scale=scale, window=window, backend=backend, precise_bob=precise_bob,
              deterministic=deterministic)
    size, rank = group_size_rank(group)
    if size == 1:
        return flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)
    _check_group_tensors(q, k, v, "thd", 0)
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor of the global cumulative sequence lengths")
    total = int(cu_seqlens[-1].item())
    fields = {**_call_fields(q, k, v, kw), "cu_seqlens": tuple(int(x) for x in cu_seqlens.tolist()),
              "max_seqlen": max_seqlen}
    lens = _agree("context_parallel_attention_varlen", fields, q.shape[0], total, group, q.device)
    repeat, q_splits, kv_splits = head_plan(q.shape[1], k.shape[1], size)
    k, v = _repeat_kv(k, repeat, 1), _repeat_kv(v, repeat, 1)
    qh = _seq_to_heads(q, 0, 1, lens, q_splits, rank, group)
    kh = _seq_to_heads(k, 0, 1, lens, kv_splits, rank, group)
    vh = _seq_to_heads(v, 0, 1, lens, kv_splits, rank, group)
    oh = flash_attention_varlen(qh, kh, vh, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)
    return _heads_to_seq(oh, 0, 1, lens, q_splits, rank, group)


# --------------------------------------------------------------------------- groups of groups


def context_parallel_groups(size: int):
    """Split the default group's W ranks into W / ``size`` context-parallel groups of
    ``size`` consecutive ranks (one sequence each) and ``size`` data-parallel groups (the
    ranks with the same position in every context-parallel group). Every rank must call it,
    in the same order as its other collectives. Returns this rank's ``(cp_group, dp_group)``.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"size must be an int >= 1 (ranks per context-parallel group), got {size!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_groups needs torch.distributed to be initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(
            f"the {world} processes cannot be split into context-parallel groups of {size}: "
            f"choose a size that divides {world}"
        )
    cp_group = dp_group = None
    for g in range(world // size):  # every rank creates every group (torch.distributed requires it)
        ranks = list(range(g * size, (g + 1) * size))
        pg = dist.new_group(ranks)
        if rank in ranks:
            cp_group = pg
    for j in range(size):
        ranks = list(range(j, world, size))
        pg = dist.new_group(ranks)
        if rank in ranks:
            dp_group = pg
    return cp_group, dp_group


def local_gradients(params) -> List[Tensor]:
    """The parameters that require grad, each with a ``p.grad`` ready to reduce: a missing
    gradient becomes zeros (so that every process reduces the same tensors), a gradient that
    carries a graph is detached (take Hessian-vector products before reducing)."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.requires_grad:
            p.grad = p.grad.detach()
    return params


def reduce_gradients(params, *, cp_group=None, dp_group=None, weight: Optional[float] = None) -> None:
    """Gradients of replicated parameters under context parallelism (and data parallelism
    across context-parallel groups): ``p.grad`` ← the sum over ``cp_group`` of the ranks'
    shares, then the mean over ``dp_group`` weighted by ``weight`` (this group's share of
    the global batch; None: 1). A missing gradient counts as zero; gradients carrying a graph
    are detached. Each step: one all-reduce per dtype and device and group."""
    params = local_gradients(params)
    w = 1.0 if weight is None else float(weight)
    if not w >= 0:
        raise ValueError(f"weight must be >= 0, got {weight}")
    cp_size = group_size_rank(cp_group)[0] if cp_group is not None else 1
    dp_size = group_size_rank(dp_group)[0] if dp_group is not None else 1
    buckets = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for (dtype, device), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if cp_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=cp_group)
        if dp_size > 1:
            flat = torch.cat([flat * w, torch.full((1,), w, dtype=dtype, device=device)])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
            if not flat[-1] > 0:
                raise ValueError("reduce_gradients: the weights of the data-parallel groups sum to 0")
            flat = flat[:-1] / flat[-1]
        offset = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
