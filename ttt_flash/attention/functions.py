"""Softmax attention with exact first and second derivatives.

Autograd structure (three ``torch.autograd.Function`` s, ``forward`` + ``setup_context``
style so that ``torch.func`` transforms compose with them):

* ``_Attention``: (q, k, v) -> o. Its backward calls
* ``_AttentionBackward``: (q, k, v, o, lse, dO) -> (dq, dk, dv), the first backward as a
  differentiable function of its inputs. Its backward calls
* ``_AttentionBoB``: the closed-form backward-over-backward (bob-math.md), returning the
  gradients of ⟨U_Q,dq⟩+⟨U_K,dk⟩+⟨U_V,dv⟩ w.r.t. (q, k, v, dO). Its backward and jvp (third
  order) recompute it in blocks of query rows with plain PyTorch ops and differentiate
  those with torch.func (``reference.bob_vjp`` / ``bob_jvp``): O(rows × N_k) memory, and
  differentiable again, so any order of derivative works.
* ``_AttentionTangent``: (q, k, v, o, lse, q̇, k̇, v̇) -> (ȯ, l̇, ρ), the tangent of the
  computed forward (``_Attention.jvp`` calls it; docs/forward-mode.md). Its backward is the
  first backward (for q̇, k̇, v̇) plus the BoB with U = ẋ (for q, k, v), given its row
  statistics α = l̇, E + αD = rowsum(Ō̇∘ȯ): reverse mode through a jvp.
  ``_AttentionBackward.jvp`` (forward-over-reverse) is the first backward with dO = dȮ plus
  the BoB's (q̄, k̄, v̄) with U = ẋ. Other forward-mode compositions raise.
* ``_LogSumExp``: (q, k, lse) -> lse, the differentiable row log-sum-exp of
  ``return_lse=True``; its backward runs ``_Attention`` and ``_AttentionBackward`` on
  (q, k, k), so every order of derivative is theirs (docs/bob-math.md).

A backward that records no graph (``create_graph=False``, no torch.func transform) calls the
next composer directly instead of through the next Function: nothing will differentiate it.

The inputs are validated before they reach this module (:mod:`ttt_flash.attention.checks`, called
by the public functions of :mod:`ttt_flash.attention.api`); the composers run are the ones
:func:`ttt_flash.attention.backend.backend_module` names. :func:`_apply` is the one dispatch of a
call: the Functions eagerly, the custom operators of :mod:`ttt_flash.attention.ops` while
``torch.compile`` traces; both call the same composers.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead  # as Function.apply does
from torch.autograd import forward_ad as _forward_ad

from . import ops
from .reference import recompute
from . import backend as backends

_functorch_active = torch._C._are_functorch_transforms_active


def _apply(q, k, v, spec: "_Spec", cu_q, cu_k, with_lse: bool = False):
    """Eager: the autograd.Functions (differentiable twice, vmap rules). While
    ``torch.compile`` traces: the custom operators of :mod:`ttt_flash.attention.ops` (first order).
    ``with_lse`` (``return_lse=True``): ``(o, lse)``, the row log-sum-exp made differentiable
    by ``_LogSumExp``; under ``torch.compile`` that call runs eagerly (the compiled operator
    returns the output only)."""
    if spec.backend == "triton" and not q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # The Triton interpreter (CPU) computes 16-bit dots wrongly: run the kernels in float32.
        out = _apply(q.float(), k.float(), v.float(), spec, cu_q, cu_k, with_lse)
        return (out[0].to(q.dtype), out[1]) if with_lse else out.to(q.dtype)
    if torch.compiler.is_compiling():
        if with_lse:
            return _apply_lse_eager(q, k, v, spec, cu_q, cu_k)
        return ops.compiled_attention(
            q, k, v, cu_q, cu_k, scale=spec.scale, causal=spec.causal, window=spec.window,
            max_seqlen_q=spec.max_seqlen_q, max_seqlen_k=spec.max_seqlen_k, backend=spec.backend,
        )
    o, lse = _Attention.fast_apply(q, k, v, spec, cu_q, cu_k)
    if with_lse:
        return o, _LogSumExp.fast_apply(q, k, lse, spec, cu_q, cu_k)
    return o


# --------------------------------------------------------------------------- vmap
#
# torch.func.vmap over attention folds the vmapped dimension into the head dimension:
# V copies of H heads become V·H heads. With grouped-query attention this keeps the
# mapping right: query head v·H_q + h uses key head (v·H_q + h) // g = v·H_kv + h // g.


def _head_axis(kind: str, varlen: bool) -> int:
    """Axis of the heads: 1 for (B, H, N, D) / (T, H, D) tensors and (B, H, N) rows; 0 for
    varlen rows (H, T)."""
    return 0 if (kind == "row" and varlen) else 1


def _fold(x, bdim, size: int, axis: int):
    if x is None:
        return None
    if bdim is None:
        x = x.unsqueeze(axis).expand(*x.shape[:axis], size, *x.shape[axis:])
    else:
        x = x.movedim(bdim, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def _unfold(x, size: int, axis: int):
    if x is None:
        return None
    return x.reshape(*x.shape[:axis], size, x.shape[axis] // size, *x.shape[axis + 1 :])


def _vmap_rule(fn, info, in_dims, args, kinds, out_kinds):
    """Shared vmap rule: fold, apply ``fn`` once, unfold. ``kinds`` names each argument
    "tensor", "row" or "static" (passed through; must not be vmapped)."""
    cu_q = [a for a, k in zip(args, kinds) if k == "cu"]
    varlen = cu_q[0] is not None
    folded = []
    for a, d, kind in zip(args, in_dims, kinds):
        if kind == "static":
            folded.append(a)
        elif kind == "cu":
            if d is not None:
                raise NotImplementedError(
                    "torch.func.vmap over cu_seqlens of flash_attention_varlen is not supported; "
                    "vmap over q, k, v only"
                )
            folded.append(a)
        else:
            folded.append(_fold(a, d, info.batch_size, _head_axis(kind, varlen)))
    out = fn(*folded)
    outs = tuple(_unfold(o, info.batch_size, _head_axis(k, varlen)) for o, k in zip(out, out_kinds))
    return outs, tuple(None if o is None else _head_axis(k, varlen) for o, k in zip(outs, out_kinds))


# --------------------------------------------------------------------------- autograd


@dataclass(frozen=True)
class _Spec:
    """Everything non-tensor the composers need (hashable, passed through ``apply``)."""

    scale: float
    causal: bool
    window: Optional[int]
    backend: str
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    precise_bob: bool = True
    deterministic: bool = False

    @functools.cached_property
    def _kernel_kw(self) -> dict:
        return {} if self.backend == "reference" else {"deterministic": self.deterministic}

    @functools.cached_property
    def _dense_kw(self) -> dict:
        return self._kwargs(None, None)

    def kernel_kwargs(self) -> dict:
        """Keywords only the Triton composers take (a dict kept on the spec: pass it as
        ``**``, never change it)."""
        return self._kernel_kw

    def kwargs(self, cu_q, cu_k) -> dict:
        """The composers' keywords. A dense call's (no ``cu_seqlens``) is kept on the spec
        (host time per call): pass it as ``**``, never change it."""
        return self._dense_kw if cu_q is None and cu_k is None else self._kwargs(cu_q, cu_k)

    def _kwargs(self, cu_q, cu_k) -> dict:
        return dict(
            scale=self.scale,
            causal=self.causal,
            window=self.window,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
        )


def _no_graph() -> bool:
    """True inside a backward that records no graph (``create_graph=False``) and runs under
    no torch.func transform and no ``torch.autograd.forward_ad`` level: a backward may then
    call the next composer directly instead of through an autograd.Function (host time per
    call at short lengths)."""
    return not torch.is_grad_enabled() and not _functorch_active() and _forward_ad._current_level < 0


def _forward_mode_possible() -> bool:
    """Whether a ``jvp`` may follow this call: a ``forward_ad`` level is open or a torch.func
    transform runs (otherwise ``setup_context`` skips ``save_for_forward``: host time)."""
    return _forward_ad._current_level >= 0 or _functorch_active()


def _plain_backward() -> bool:
    """True inside a backward that records no graph, runs under no torch.func transform and
    outside ``forward_ad`` levels. Backwards whose results are second derivatives then call
    the composers directly; inside a level they go through ``_AttentionBoB``, whose ``jvp``
    gives the tangent of a second derivative (third order)."""
    return _no_graph()


def _primals(args: tuple) -> tuple:
    """``args`` with every dual tensor replaced by its primal (inside a forward_ad level)."""
    if _forward_ad._current_level < 0:
        return args
    return tuple(_forward_ad.unpack_dual(a).primal if isinstance(a, Tensor) else a for a in args)


#: What forward mode supports, named in the errors of the compositions it does not.
_FORWARD_MODES = (
    "ttt_flash attention supports torch.func.jvp / jacfwd / torch.autograd.forward_ad of the "
    "attention output, reverse mode through a jvp (backward through the tangent output), and "
    "forward-over-reverse (a jvp of the gradient: torch.func.hessian, jacfwd(jacrev), "
    "ttt_flash.second_order with mode='fwd_rev'); "
)


def _unsupported_forward(what: str):
    raise NotImplementedError(
        _FORWARD_MODES + f"{what} is not supported. For a Hessian use forward-over-reverse "
        "(torch.func.hessian or jacfwd(jacrev(f))) or reverse-over-reverse, not jacfwd(jacfwd(f))"
    )


class _Function(torch.autograd.Function):
    """Base of the three Functions below: ``fast_apply``."""

    @classmethod
    def fast_apply(cls, *args):
        """``apply`` with every argument positional. Outside torch.func transforms it goes
        straight to the C++ apply that ``Function.apply`` ends in (skipping its per-call
        default-argument binding through ``inspect``); under a transform, ``Function.apply``
        (the vmap rules)."""
        if _functorch_active():
            return cls.apply(*args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


class _Attention(_Function):
    _KINDS = ("tensor", "tensor", "tensor", "static", "cu", "cu")

    @staticmethod
    def vmap(info, in_dims, q, k, v, spec, cu_q, cu_k):
        return _vmap_rule(_Attention.apply, info, in_dims, (q, k, v, spec, cu_q, cu_k),
                          _Attention._KINDS, ("tensor", "row"))

    @staticmethod
    def forward(q, k, v, spec: _Spec, cu_q, cu_k):
        return backends.backend_module(spec.backend).attn_fwd(q, k, v, **spec.kwargs(cu_q, cu_k))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, spec, cu_q, cu_k = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, o, lse, cu_q, cu_k)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, qd, kd, vd, *_):
        """(ȯ, l̇) in direction (q̇, k̇, v̇), through ``_AttentionTangent`` (differentiable:
        reverse mode through a jvp)."""
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        if qd is None and kd is None and vd is None:
            return None, None
        od = _AttentionTangent.fast_apply(q, k, v, o, lse, qd, kd, vd, ctx.spec, cu_q, cu_k)[0]
        return od, None

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return None, None, None, None, None, None
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        if _no_graph():  # plain first-order backward: no Function node needed
            dq, dk, dv, _ = _AttentionBackward.forward(q, k, v, o, lse, do, ctx.spec, cu_q, cu_k)
        else:
            dq, dk, dv, _ = _AttentionBackward.fast_apply(q, k, v, o, lse, do, ctx.spec, cu_q, cu_k)
        return dq, dk, dv, None, None, None


class _AttentionBackward(_Function):
    """(q, k, v, o, lse, dO) -> (dq, dk, dv). o and lse are functions of (q, k, v); the
    BoB below returns the total derivative w.r.t. q, k, v, so o and lse get none."""

    _KINDS = ("tensor", "tensor", "tensor", "tensor", "row", "tensor", "static", "cu", "cu")

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_rule(_AttentionBackward.apply, info, in_dims, args, _AttentionBackward._KINDS,
                          ("tensor", "tensor", "tensor", "row"))

    @staticmethod
    def forward(q, k, v, o, lse, do, spec: _Spec, cu_q, cu_k):
        dq, dk, dv, delta = backends.backend_module(spec.backend).attn_bwd(q, k, v, o, lse, do, **spec.kwargs(cu_q, cu_k),
                                                          **spec.kernel_kwargs())
        return dq, dk, dv, delta

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, do, spec, cu_q, cu_k = inputs
        ctx.mark_non_differentiable(output[3])
        ctx.save_for_backward(q, k, v, o, lse, do, output[3], cu_q, cu_k)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, o, lse, do, output[3], cu_q, cu_k)
        ctx.spec = spec
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, qd, kd, vd, _od, _lsed, dod, *_):
        """Forward-over-reverse: the tangent of (dq, dk, dv) in direction (q̇, k̇, v̇, dȮ) is
        the first backward with dO = dȮ plus the BoB's (q̄, k̄, v̄) with U = (q̇, k̇, v̇) (the
        Hessian of ⟨O, dO⟩ is symmetric). The tangents of o and lse are those (q̇, k̇, v̇)
        induce (o and lse are functions of q, k, v), so they are not read."""
        q, k, v, o, lse, do, delta, cu_q, cu_k = ctx.saved_tensors
        out = [None, None, None]
        if dod is not None:
            out = list(_AttentionBackward.fast_apply(q, k, v, o, lse, dod, ctx.spec, cu_q, cu_k)[:3])
        if qd is not None or kd is not None or vd is not None:
            bob = _AttentionBoB.fast_apply(q, k, v, o, lse, do, delta, qd, kd, vd, None, None, None,
                                           ctx.spec, cu_q, cu_k, (True, True, True, False))
            out = [b if a is None else (a if b is None else a + b) for a, b in zip(out, bob[:3])]
        return out[0], out[1], out[2], None

    @staticmethod
    def backward(ctx, uq, uk, uv, _udelta):
        if uq is None and uk is None and uv is None:
            return (None,) * 9
        q, k, v, o, lse, do, delta, cu_q, cu_k = ctx.saved_tensors
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],
            ctx.needs_input_grad[5],
        )
        args = (q, k, v, o, lse, do, delta, uq, uk, uv, None, None, None, ctx.spec, cu_q, cu_k, needs)
        if _plain_backward():  # the usual second backward (create_graph=False): run the composer
            qb, kb, vb, dob = _AttentionBoB.forward(*_primals(args))
        else:  # a graph is recorded: the Function node's backward gives third derivatives
            qb, kb, vb, dob = _AttentionBoB.fast_apply(*args)
        return qb, kb, vb, None, None, dob, None, None, None


class _AttentionBoB(_Function):
    """Backward-over-backward. ``alpha``, ``ee``, ``rho``: the row statistics when the caller
    knows them (None: the composer forms them; ``attn_bob``'s ``stats``). Its derivatives
    (third order) recompute it in blocks of query rows with differentiable PyTorch ops
    (``reference.bob_vjp`` / ``bob_jvp``), so they are differentiable again: any order."""

    _KINDS = (("tensor",) * 4 + ("row", "tensor", "row") + ("tensor",) * 3 + ("row",) * 3
              + ("static", "cu", "cu", "static"))

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_rule(_AttentionBoB.apply, info, in_dims, args, _AttentionBoB._KINDS, ("tensor",) * 4)

    @staticmethod
    def forward(q, k, v, o, lse, do, delta, uq, uk, uv, alpha, ee, rho, spec: _Spec, cu_q, cu_k,
                needs):
        stats = None if alpha is None else (alpha, ee, rho)
        out = backends.backend_module(spec.backend).attn_bob(
            q, k, v, o, lse, do, delta, uq, uk, uv, needs=needs, precise=spec.precise_bob,
            stats=stats, **spec.kwargs(cu_q, cu_k), **spec.kernel_kwargs(),
        )
        return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, _o, _lse, do, _delta, uq, uk, uv, _alpha, _ee, _rho, spec, cu_q, cu_k, _needs = inputs
        # The BoB is a function of (q, k, v, dO, U) alone (o, lse, delta and the statistics
        # are functions of them): its derivatives recompute the rest.
        ctx.save_for_backward(q, k, v, do, uq, uk, uv, cu_q, cu_k)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, do, uq, uk, uv, cu_q, cu_k)
        ctx.spec = spec
        ctx.present = tuple(o is not None for o in output)  # the composer may skip outputs
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, gq, gk, gv, gdo):
        """Third derivatives: the vector-Jacobian product of the BoB (``reference.bob_vjp``)."""
        none = [None] * 17
        if gq is None and gk is None and gv is None and gdo is None:
            return tuple(none)
        q, k, v, do, uq, uk, uv, cu_q, cu_k = ctx.saved_tensors
        ni = ctx.needs_input_grad
        slots = (0, 1, 2, 5, 7, 8, 9)  # positions of (q, k, v, do, uq, uk, uv) in forward
        grads = recompute.bob_vjp(
            (q, k, v, do, uq, uk, uv), (gq, gk, gv, gdo), tuple(ni[i] for i in slots),
            scale=ctx.spec.scale, causal=ctx.spec.causal, window=ctx.spec.window,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        )
        for i, g in zip(slots, grads):
            none[i] = g
        return tuple(none)

    @staticmethod
    def jvp(ctx, tq, tk, tv, _to, _tlse, tdo, _tdelta, tuq, tuk, tuv, *_):
        """A jvp of a second derivative (third order): ``reference.bob_jvp``. The tangents of
        o, lse, delta and the statistics are the ones the other tangents induce: not read."""
        q, k, v, do, uq, uk, uv, cu_q, cu_k = ctx.saved_tensors
        out = recompute.bob_jvp(
            (q, k, v, do, uq, uk, uv), (tq, tk, tv, tdo, tuq, tuk, tuv),
            scale=ctx.spec.scale, causal=ctx.spec.causal, window=ctx.spec.window,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        )
        return tuple(t if present else None for t, present in zip(out, ctx.present))


def _row_dot(a: Tensor, b: Tensor, like: Tensor, varlen: bool) -> Tensor:
    """rowsum(a∘b) of two (B, H, N, D) (varlen: (T, H, D)) tensors, in the dtype and layout of
    the row vector ``like`` ((B, H, N); varlen (H, T))."""
    r = (a.to(like.dtype) * b.to(like.dtype)).sum(-1)
    return (r.transpose(0, 1) if varlen else r).contiguous()


class _AttentionTangent(_Function):
    """(q, k, v, o, lse, q̇, k̇, v̇) -> (ȯ, l̇, ρ): the tangent of the computed forward (o, lse)
    (q̇, k̇, v̇ may be None; ``attn_tangent``), ρ the row-sum correction of the recomputed P.
    Backward with cotangent Ō̇ of ȯ: x̄ = BoB_x(dO = Ō̇, U = ẋ), ẋ̄ = bwd(dO = Ō̇); o and lse
    get none (the total derivative goes to q, k, v). The BoB's row statistics are known
    (docs/forward-mode.md): with U = ẋ, G = Ṡ, so α = L̇ and E + αD = rowsum(Ō̇∘Ȯ); its
    statistics pass is skipped."""

    _KINDS = ("tensor",) * 4 + ("row",) + ("tensor",) * 3 + ("static", "cu", "cu")

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_rule(_AttentionTangent.apply, info, in_dims, args, _AttentionTangent._KINDS,
                          ("tensor", "row", "row"))

    @staticmethod
    def forward(q, k, v, o, lse, qd, kd, vd, spec: _Spec, cu_q, cu_k):
        od, lsed, rho = backends.backend_module(spec.backend).attn_tangent(q, k, v, o, lse, qd, kd, vd,
                                                          **spec.kwargs(cu_q, cu_k))
        return od, lsed, rho

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, qd, kd, vd, spec, cu_q, cu_k = inputs
        ctx.save_for_backward(q, k, v, o, lse, qd, kd, vd, cu_q, cu_k, *output)
        ctx.spec = spec
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, god, _glsed, _grho):
        if god is None:
            return (None,) * 11
        q, k, v, o, lse, qd, kd, vd, cu_q, cu_k, od, lsed, rho = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = [None] * 11
        plain = _plain_backward()
        if plain:
            q, k, v, o, lse, qd, kd, vd, god, od, lsed, rho = _primals(
                (q, k, v, o, lse, qd, kd, vd, god, od, lsed, rho))
        fn = _AttentionBackward.forward if plain else _AttentionBackward.fast_apply
        dq, dk, dv, delta = fn(q, k, v, o, lse, god, ctx.spec, cu_q, cu_k)
        grads[5], grads[6], grads[7] = (dq if need[5] else None, dk if need[6] else None,
                                        dv if need[7] else None)
        if (need[0] or need[1] or need[2]) and (qd is not None or kd is not None or vd is not None):
            ee = _row_dot(god, od, lsed, cu_q is not None)  # E + αD = rowsum(Ō̇∘Ȯ)
            args = (q, k, v, o, lse, god, delta, qd, kd, vd, lsed, ee, rho, ctx.spec, cu_q, cu_k,
                    (need[0], need[1], need[2], False))
            fn = _AttentionBoB.forward if plain else _AttentionBoB.fast_apply
            grads[0], grads[1], grads[2], _ = fn(*args)
        return tuple(grads)

    @staticmethod
    def jvp(ctx, *tangents):
        _unsupported_forward("a jvp of a jvp (forward-over-forward, e.g. jacfwd(jacfwd(f)))")


# Function.apply binds default arguments with inspect.signature(forward) on every call when
# setup_context is defined; fast_apply (above) skips it outside torch.func transforms, and
# under a transform each forward's precomputed signature is what inspect.signature returns.
for _fn in (_Attention, _AttentionBackward, _AttentionBoB, _AttentionTangent):
    _fn.forward.__signature__ = inspect.signature(_fn.forward)
del _fn


# --------------------------------------------------------------------------- return_lse
#
# ``return_lse=True`` makes the row log-sum-exp L a second, differentiable output. L is a
# function of (q, k) alone; with L̄ its cotangent (docs/bob-math.md, "The log-sum-exp as an
# output") its first backward adds L̄∘P to dS:
#
#     Q̄ += τ L̄ ∘ (P K)        K̄ += τ Pᵀ (L̄ ∘ Q)
#
# P K is the attention output with K as the values, Pᵀ (L̄∘Q) the dV of a first backward with
# dO = L̄∘Q: ``_LogSumExp.backward`` forms both with the existing Functions (or, recording no
# graph, their composers), so its derivatives are theirs: exact to any order, no N×N tensor.


class _LogSumExp(_Function):
    """(q, k, lse) -> lse, made differentiable in (q, k): ``lse`` is the forward's row
    log-sum-exp ((B, H_q, N_q); varlen (H_q, T_q)), returned as a new tensor. Backward:
    (τ L̄∘(P K), τ Pᵀ(L̄∘Q)) through ``_Attention`` and ``_AttentionBackward`` with the keys
    as the values; jvp: L̇ = rowsum(P∘Ṡ) = τ (rowsum(Q̇∘(P K)) + rowsum(Q∘(P K̇)))."""

    _KINDS = ("tensor", "tensor", "row", "static", "cu", "cu")

    @staticmethod
    def vmap(info, in_dims, q, k, lse, spec, cu_q, cu_k):
        outs, dims = _vmap_rule(lambda *a: (_LogSumExp.apply(*a),), info, in_dims,
                                (q, k, lse, spec, cu_q, cu_k), _LogSumExp._KINDS, ("row",))
        return outs[0], dims[0]

    @staticmethod
    def forward(q, k, lse, spec: _Spec, cu_q, cu_k):
        return lse.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, _lse, spec, cu_q, cu_k = inputs
        ctx.save_for_backward(q, k, cu_q, cu_k)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, cu_q, cu_k)
        ctx.spec = spec
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, glse):
        if glse is None:
            return (None,) * 6
        q, k, cu_q, cu_k = ctx.saved_tensors
        spec = ctx.spec
        # L̄ broadcast over the head dim of q: (B, H, N, 1); varlen (T, H, 1)
        w = (glse.transpose(0, 1) if cu_q is not None else glse).unsqueeze(-1)
        if _no_graph():
            composers = backends.backend_module(spec.backend)
            pk, lse = composers.attn_fwd(q, k, k, **spec.kwargs(cu_q, cu_k))
            pq = composers.attn_bwd(q, k, k, pk, lse, (w * q).to(q.dtype), **spec.kwargs(cu_q, cu_k),
                                    **spec.kernel_kwargs())[2]
        else:  # a graph is recorded: through the Functions, so that it differentiates again
            pk, lse = _Attention.fast_apply(q, k, k, spec, cu_q, cu_k)
            pq = _AttentionBackward.fast_apply(q, k, k, pk, lse, (w * q).to(q.dtype), spec, cu_q, cu_k)[2]
        return (spec.scale * w * pk).to(q.dtype), (spec.scale * pq).to(k.dtype), None, None, None, None

    @staticmethod
    def jvp(ctx, qd, kd, _lsed, *_):
        q, k, cu_q, cu_k = ctx.saved_tensors
        spec = ctx.spec
        acc = None
        if qd is not None:
            acc = (qd * _Attention.fast_apply(q, k, k, spec, cu_q, cu_k)[0]).sum(-1)
        if kd is not None:
            t = (q * _Attention.fast_apply(q, k, kd, spec, cu_q, cu_k)[0]).sum(-1)
            acc = t if acc is None else acc + t
        if acc is None:
            return None
        acc = spec.scale * (acc.transpose(0, 1) if cu_q is not None else acc)
        return acc.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()


_LogSumExp.forward.__signature__ = inspect.signature(_LogSumExp.forward)


def _apply_lse_eager(q, k, v, spec: _Spec, cu_q, cu_k):
    """``_apply(..., with_lse=True)`` outside the graph that ``torch.compile`` traces (a graph
    break; ``fullgraph=True`` refuses it, naming this reason)."""
    return _apply(q, k, v, spec, cu_q, cu_k, with_lse=True)


_EAGER_LSE_REASON = ("flash_attention(return_lse=True) runs eagerly under torch.compile (the compiled "
                     "attention operator returns the output only): compile without fullgraph=True, "
                     "or call it with return_lse=False")
try:
    _apply_lse_eager = torch.compiler.disable(_apply_lse_eager, reason=_EAGER_LSE_REASON)
except TypeError:  # a torch whose disable takes no reason
    _apply_lse_eager = torch.compiler.disable(_apply_lse_eager)
