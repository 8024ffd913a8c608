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

This module is the only place that validates attention inputs and the only place that
chooses between the Triton kernels and the PyTorch reference.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead  # as Function.apply does
from torch.autograd import forward_ad as _forward_ad

from . import ops, reference

__all__ = ["flash_attention", "flash_attention_varlen", "BACKENDS", "LAYOUTS"]

#: Accepted values of the ``backend`` argument.
BACKENDS = ("auto", "triton", "reference")

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_functorch_active = torch._C._are_functorch_transforms_active


# --------------------------------------------------------------------------- backend choice


def _triton_module():
    from . import kernels  # imported lazily: importing triton is slow and optional on CPU

    return kernels


def _interpreting() -> bool:
    # The one reader of TRITON_INTERPRET is kernels/configs.py (the Triton interpreter is a
    # kernels matter); backend="triton" imports the kernels anyway.
    from .kernels import configs

    return configs.interpreting()


def resolve_backend(backend: str, q: Tensor) -> str:
    """The backend that runs for ``backend`` ("auto", "triton" or "reference") on query ``q``
    (..., N, d): "auto" picks "triton" for CUDA float16/bfloat16/float32 inputs within the
    kernels' head-dim limit, else "reference". Raises for a backend the inputs cannot run on."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    head_dim = q.shape[-1]
    if backend == "auto":
        if q.is_cuda and q.dtype in _KERNEL_DTYPES:
            max_d = _triton_module().MAX_HEAD_DIM
            if head_dim > max_d:
                warnings.warn(
                    f"head dim {head_dim} exceeds the Triton kernels' maximum {max_d}; "
                    "using the (slower, exact) PyTorch reference backend",
                    stacklevel=3,
                )
                return "reference"
            return "triton"
        return "reference"
    if backend == "triton":
        if q.dtype not in _KERNEL_DTYPES:
            raise TypeError(
                f"backend='triton' supports float16, bfloat16 and float32 inputs, got {q.dtype}; "
                "use backend='reference' (or 'auto') for float64"
            )
        if not q.is_cuda and not _interpreting():
            raise RuntimeError(
                "backend='triton' needs CUDA tensors; on the CPU it runs only under the Triton "
                "interpreter: set TRITON_INTERPRET=1 in the environment before importing "
                "ttt_flash, or use backend='reference' (what 'auto' picks on the CPU)"
            )
        max_d = _triton_module().MAX_HEAD_DIM
        if head_dim > max_d:
            raise ValueError(
                f"head dim (q.shape[-1] = {head_dim}) is larger than the Triton kernels support "
                f"({max_d}); use backend='reference'"
            )
    return backend


def backend_module(backend: str):
    """The module whose ``attn_fwd``, ``attn_bwd``, ``attn_bob``, ``attn_tangent`` and ``attn_jvp``
    run a resolved backend: :mod:`ttt_flash.reference` or the Triton kernels."""
    return reference if backend == "reference" else _triton_module()


ops.register_composers("reference", lambda: reference)
ops.register_composers("triton", _triton_module)


def _apply(q, k, v, spec: "_Spec", cu_q, cu_k, with_lse: bool = False):
    """Eager: the autograd.Functions (differentiable twice, vmap rules). While
    ``torch.compile`` traces: the custom operators of :mod:`ttt_flash.ops` (first order).
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

    def kernel_kwargs(self) -> dict:
        """Keywords only the Triton composers take."""
        return {} if self.backend == "reference" else {"deterministic": self.deterministic}

    def kwargs(self, cu_q, cu_k) -> dict:
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
    "ttt_flash.hessian with mode='fwd_rev'); "
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
        return backend_module(spec.backend).attn_fwd(q, k, v, **spec.kwargs(cu_q, cu_k))

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
        dq, dk, dv, delta = backend_module(spec.backend).attn_bwd(q, k, v, o, lse, do, **spec.kwargs(cu_q, cu_k),
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
        out = backend_module(spec.backend).attn_bob(
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
        grads = reference.bob_vjp(
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
        out = reference.bob_jvp(
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
        od, lsed, rho = backend_module(spec.backend).attn_tangent(q, k, v, o, lse, qd, kd, vd,
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
            composers = backend_module(spec.backend)
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


# --------------------------------------------------------------------------- validation


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _flag(name: str, value) -> bool:
    """``value`` as a bool: True/False or a NumPy bool; anything else (a string such as "no",
    an int) is a TypeError, so that no flag is read as True by accident."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {kind.__name__} {value!r}")


def _check_common(q, k, v, scale, window, causal) -> float:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}; "
            "cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q: {q.device}, k: {k.device}, v: {v.device}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (the number of most recent keys a query sees), got {window}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from each query)")
    if q.dim() > 0 and q.shape[-1] == 0:
        raise ValueError(f"head dim (q.shape[-1]) must be >= 1, got 0 (q of shape {tuple(q.shape)})")
    if scale is None:
        return q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_heads(hq: int, hkv: int) -> None:
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value "
            f"heads ({hkv}) (grouped-query attention)"
        )


def _check_cu_seqlens(name: str, cu, tokens: int, device, read: bool = True) -> Optional[list]:
    """The checked values of ``cu`` as a list; None (the values unchecked, nothing read back
    to the host) when ``read`` is False and ``cu`` is on a GPU: with ``max_seqlen_*`` given the
    call stays free of device synchronisations (CUDA-graph capture, docs/cuda-graphs.md)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}; use {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch_size + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")
    if not read and cu.device.type != "cpu":
        return None
    try:
        values = cu.tolist()
    except RuntimeError as e:  # e.g. a vmapped (batched) tensor has no data to read
        raise NotImplementedError(
            f"{name} must be a concrete tensor: torch.func.vmap over cu_seqlens is not supported; "
            "vmap over q, k, v only"
        ) from e
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {values}")
    if values[-1] != tokens:
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens ({tokens}), got {values[-1]}"
        )
    return values


#: Accepted values of ``flash_attention``'s ``layout`` argument.
LAYOUTS = ("bhnd", "bnhd")


def _check_layout(layout: Optional[str], q: Tensor, k: Tensor) -> str:
    """The layout to use: ``layout`` itself, or ``"bhnd"`` when None, warning when the shapes
    look like FlashAttention's (B, N, H, D): more heads than positions in q and in k."""
    if layout is not None:
        if layout not in LAYOUTS:
            raise ValueError(
                f"layout must be 'bhnd' (batch, heads, seq_len, head_dim; the default, as "
                f"scaled_dot_product_attention) or 'bnhd' (batch, seq_len, heads, head_dim, as "
                f"FlashAttention's flash_attn_func), got {layout!r}"
            )
        return layout
    if (q.dim() == 4 and k.dim() == 4 and 0 < q.shape[2] < q.shape[1] and 0 < k.shape[2] < k.shape[1]):
        warnings.warn(
            f"flash_attention reads q {tuple(q.shape)} and k {tuple(k.shape)} as (batch, heads, "
            f"seq_len, head_dim): {q.shape[1]} heads over {q.shape[2]} queries and "
            f"{k.shape[1]} heads over {k.shape[2]} keys. If they are (batch, seq_len, heads, "
            "head_dim) (FlashAttention's layout), pass layout='bnhd'; pass layout='bhnd' to "
            "state the layout and silence this warning",
            UserWarning,
            stacklevel=3,
        )
    return "bhnd"


def _check_heads_bhnd(q: Tensor, k: Tensor, layout_given: bool) -> None:
    """:func:`_check_heads` for (B, H, N, D) tensors, with a hint when the tensors would be
    consistent read as (B, N, H, D)."""
    try:
        _check_heads(q.shape[1], k.shape[1])
    except ValueError as e:
        hkv = k.shape[2]
        # the hint only for shapes that look like (B, N, H, D), as the layout warning's: more
        # "heads" than positions in q and k (not ordinary self-attention shapes)
        looks_bnhd = q.shape[1] > q.shape[2] and k.shape[1] > k.shape[2]
        if not layout_given and hkv and q.shape[2] % hkv == 0 and looks_bnhd:
            raise ValueError(
                f"{e}; q {tuple(q.shape)} and k {tuple(k.shape)} are read as (batch, heads, "
                "seq_len, head_dim): if they are (batch, seq_len, heads, head_dim) "
                "(FlashAttention's layout), pass layout='bnhd'"
            ) from None
        raise


# --------------------------------------------------------------------------- public API


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
    layout: Optional[str] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention on (B, H, N, D) tensors (``layout="bnhd"``: (B, N, H, D)), differentiable to any order exactly.

    ``o = softmax(scale · q kᵀ + mask) v`` for each batch and head, with exact gradients
    and exact gradients of gradients (Hessian-vector products, MAML, gradient-written
    memory), never materialising the N_q × N_k matrix on the Triton backend.

    Args:
        q: queries, shape (B, H_q, N_q, D).
        k: keys, shape (B, H_kv, N_k, D). H_q must be a multiple of H_kv (grouped-query
            attention: query head h uses key head h // (H_q / H_kv)).
        v: values, shape (B, H_kv, N_k, D).
        causal: mask future keys. Aligned to the bottom-right when N_q ≠ N_k: query i
            sees key j iff j ≤ i + N_k − N_q (FlashAttention-2 convention).
        scale: softmax scale; defaults to D^-1/2.
        window: with ``causal=True``, each query sees only its ``window`` most recent
            keys, its own aligned position included: j > i + N_k − N_q − window.
        backend: ``"auto"`` (Triton kernels for CUDA float16/bfloat16/float32, the
            PyTorch reference otherwise), ``"triton"`` or ``"reference"``.
        precise_bob: Triton backend only. True (default): the backward-over-backward runs a
            row-statistics pass, then forms the cotangents of S and dP per tile, keeping
            16-bit errors below PyTorch's own math path even where attention is peaked
            (bf16 ~2.4e-3 relative L2). False: the two-pass affine form of
            docs/bob-math.md (fewer products), whose 16-bit error grows where attention is
            peaked (terms cancel).
        deterministic: accepted for compatibility; it changes nothing. Every pass of both
            backends is atomic-free (each output element is written by one program, its sums
            taken in a fixed order), so results are bitwise reproducible run to run on one
            device with the same torch and triton, whatever its value; different GPUs or
            tile tables may round differently.
        layout: axis order of q, k, v and the output. ``"bhnd"``: (B, H, N, D), as
            ``torch.nn.functional.scaled_dot_product_attention`` (the shapes above).
            ``"bnhd"``: (B, N, H, D), as FlashAttention's ``flash_attn_func``; the inputs
            are read through transposed views (no copies) and the output is returned as
            a (B, N_q, H_q, D) view (its memory is (B, H, N, D)-contiguous; gradients come
            back in the inputs' shapes). ``None`` (default): ``"bhnd"``, with a
            ``UserWarning`` when the shapes look like (B, N, H, D), i.e. when q and k both
            have more heads than positions (``q.shape[1] > q.shape[2]`` and
            ``k.shape[1] > k.shape[2]``); and a ``ValueError`` on mismatched head counts
            says so when the tensors would be consistent read as (B, N, H, D). Tensors of
            one layout with equal shapes and at least as many positions as heads cannot
            be told apart: pass ``layout`` explicitly to state it (and silence the check).
        return_lse: also return the row log-sum-exp of the masked, scaled scores,
            ``lse[b, h, i] = log Σ_j exp(scale · q_i·k_j)`` over the keys query i sees, as
            FlashAttention's ``return_softmax_lse`` / ``return_attn_probs``. ``lse`` is
            differentiable like the output: first, second and higher derivatives of a loss
            of (o, lse) are exact, with no N_q × N_k tensor (docs/bob-math.md, "The
            log-sum-exp as an output"). A cotangent of ``lse`` costs one more forward and
            first backward in each backward (with K as the values). Under ``torch.compile``
            the call runs eagerly (a graph break; ``fullgraph=True`` refuses it).

    Returns:
        Tensor of shape (B, H_q, N_q, D) (``layout="bnhd"``: (B, N_q, H_q, D)), dtype of
        ``q``. A query row that sees no key returns 0, and all its gradients are 0.
        With ``return_lse=True``: the pair ``(o, lse)``, ``lse`` of shape (B, H_q, N_q) in
        either layout, float64 for float64 inputs and float32 otherwise; a row that sees no
        key has ``lse = -inf`` (gradients through it stay 0, never NaN).

    Inputs may be non-contiguous (e.g. produced by ``transpose``). Derivatives of any order
    are exact: the third and higher recompute the backward-over-backward in blocks of query
    rows with plain PyTorch ops (O(rows × N_k) memory per head; docs/second-order.md).

    Example: an exact Hessian-vector product through attention::

        >>> import torch
        >>> from ttt_flash import flash_attention
        >>> q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        >>> loss = flash_attention(q, k, v, causal=True).square().sum()
        >>> grads = torch.autograd.grad(loss, (q, k, v), create_graph=True)
        >>> vecs = [torch.randn_like(g) for g in grads]
        >>> hvp = torch.autograd.grad(grads, (q, k, v), grad_outputs=vecs)
        >>> [tuple(h.shape) for h in hvp]
        [(1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8)]
    """
    causal, precise_bob, deterministic = (_flag(n, x) for n, x in (("causal", causal), ("precise_bob", precise_bob),
                                                                  ("deterministic", deterministic)))
    scale = _check_common(q, k, v, scale, window, causal)
    layout_given = layout is not None
    layout = _check_layout(layout, q, k)
    axes = "(batch, seq_len, heads, head_dim)" if layout == "bnhd" else "(batch, heads, seq_len, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions {axes} (layout={layout!r}), got shape "
                f"{tuple(x.shape)}; for packed sequences use flash_attention_varlen"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if layout == "bnhd":  # views: the kernels and the reference take strides
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    _check_heads_bhnd(q, k, layout_given)
    if "meta" in (q.device.type, k.device.type, v.device.type):  # shapes only (model tooling on the meta device)
        o = q.new_empty(*q.shape[:3], v.shape[-1], device="meta")
        if return_lse is not False and _flag("return_lse", return_lse):
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            return (o.transpose(1, 2) if layout == "bnhd" else o), o.new_empty(q.shape[:3], dtype=lse_dtype)
        return o.transpose(1, 2) if layout == "bnhd" else o
    backend = resolve_backend(backend, q)
    if q.numel() == 0 or k.shape[2] == 0:
        backend = "reference"  # nothing for a kernel to do; the reference handles empties
    spec = _Spec(scale=scale, causal=causal, window=None if window is None else int(window), backend=backend,
                 precise_bob=bool(precise_bob), deterministic=bool(deterministic))
    if return_lse is not False and _flag("return_lse", return_lse):
        o, lse = _apply(q, k, v, spec, None, None, with_lse=True)
        return (o.transpose(1, 2) if layout == "bnhd" else o), lse
    o = _apply(q, k, v, spec, None, None)
    return o.transpose(1, 2) if layout == "bnhd" else o


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention over variable-length sequences packed along the token axis.

    Sequence b owns query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; no token attends across sequences. Empty
    sequences are allowed. Masks (``causal``, ``window``), ``scale``, ``backend``,
    ``precise_bob``, ``deterministic`` and ``return_lse`` are as in :func:`flash_attention`, applied per sequence with that sequence's lengths.

    The packed (T, H, D) layout is FlashAttention's ``flash_attn_varlen_func`` layout (no
    ``layout`` argument here).

    Args:
        q: (T_q, H_q, D) packed queries.
        k, v: (T_k, H_kv, D) packed keys and values.
        cu_seqlens_q, cu_seqlens_k: int32 tensors of shape (B + 1,): 0, then cumulative
            sequence lengths; the last entry equals T_q (resp. T_k).
        max_seqlen_q, max_seqlen_k: the longest query (key) sequence, or None to compute
            it (one device synchronisation).

    Returns:
        (T_q, H_q, D) tensor, differentiable twice like :func:`flash_attention`. With
        ``return_lse=True``: the pair ``(o, lse)``, ``lse`` the differentiable row
        log-sum-exp of shape (H_q, T_q) (FlashAttention's varlen layout), float64 for
        float64 inputs and float32 otherwise, ``-inf`` on rows that see no key.

    Example::

        >>> import torch
        >>> from ttt_flash import flash_attention_varlen
        >>> cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # lengths 3, 0, 5
        >>> q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
        >>> flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True).shape
        torch.Size([8, 2, 4])
    """
    causal, precise_bob, deterministic = (_flag(n, x) for n, x in (("causal", causal), ("precise_bob", precise_bob),
                                                                  ("deterministic", deterministic)))
    scale = _check_common(q, k, v, scale, window, causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions (total_tokens, heads, head_dim) for varlen "
                f"attention, got shape {tuple(x.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    _check_heads(q.shape[1], k.shape[1])
    read = max_seqlen_q is None or max_seqlen_k is None  # both given on a GPU: no host read-back
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, read)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, read)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    longest_q = None if cq is None else max(b - a for a, b in zip(cq, cq[1:]))
    longest_k = None if ck is None else max(b - a for a, b in zip(ck, ck[1:]))
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
        if longest is not None and given < longest:
            raise ValueError(f"{name} ({given}) is smaller than the longest sequence ({longest})")
    backend = resolve_backend(backend, q)
    if q.numel() == 0 or k.shape[0] == 0:
        backend = "reference"
    spec = _Spec(
        scale=scale,
        causal=causal,
        window=None if window is None else int(window),
        backend=backend,
        max_seqlen_q=int(longest_q if max_seqlen_q is None else max_seqlen_q),
        max_seqlen_k=int(longest_k if max_seqlen_k is None else max_seqlen_k),
        precise_bob=bool(precise_bob),
        deterministic=bool(deterministic),
    )
    if return_lse is not False and _flag("return_lse", return_lse):
        return _apply(q, k, v, spec, cu_seqlens_q, cu_seqlens_k, with_lse=True)
    return _apply(q, k, v, spec, cu_seqlens_q, cu_seqlens_k)
