"""Model-agnostic inner loops for MAML-family meta-learning.

MAML (Finn et al., 2017) adapts a model to a task with a few gradient steps on the task's
*support* set and trains the initial weights so that the adapted model does well on the
task's *query* set. The outer (meta) gradient differentiates through every inner step,
which needs second derivatives of the model: through a transformer, second derivatives
of attention, which :func:`ttt_flash.flash_attention` computes exactly.

Two equivalent paths are provided:

* :func:`inner_loop`: functional, built on :func:`torch.func.functional_call`. The model
  is never mutated; parameters live in a ``{name: tensor}`` dict that carries the graph.
  Supports second- and first-order MAML, Meta-SGD (learnable per-parameter step sizes),
  ANIL-style adaptation of a parameter subset and a differentiable Adam.
* :func:`higher_inner_loop`: the same through ``higher.innerloop_ctx`` for any torch
  optimizer that ``higher`` knows (SGD, Adam, RMSprop, ...).

Two algorithms keep no graph of the inner loop, so their memory does not grow with the
number of inner steps:

* :func:`imaml_meta_gradient`: implicit MAML. A graph-free inner loop
  (:func:`proximal_inner_loop`) on ``L_task + (λ/2)‖φ − θ‖²``, then the meta-gradient by
  :func:`conjugate_gradient` on exact Hessian-vector products (:mod:`ttt_flash.second_order`).
* :func:`reptile_meta_gradient`: Reptile, ``θ − φ``.

Both return the adapted parameters as a dict that :func:`functional_loss` evaluates on
the query set::

    >>> import torch
    >>> from torch import nn
    >>> from ttt_flash.meta import inner_loop, functional_loss
    >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> mse = nn.functional.mse_loss
    >>> support = (torch.randn(5, 1), torch.randn(5, 1))   # (inputs, target)
    >>> query = (torch.randn(7, 1), torch.randn(7, 1))
    >>> fast = inner_loop(net, None, mse, support, steps=2, lr=0.1)
    >>> functional_loss(net, fast, mse, query).backward()  # second-order meta-gradient
    >>> net[0].weight.grad.shape
    torch.Size([8, 1])

Batches are ``(inputs, target)`` pairs: ``inputs`` is one tensor or a tuple of tensors
passed positionally to the model, and ``loss_fn(model(*inputs), target)`` must return a
scalar. ``target`` may be anything ``loss_fn`` understands.

One module per algorithm: ``maml.py`` (:func:`inner_loop`, :func:`higher_inner_loop`,
:class:`MAML`), ``imaml.py``, ``reptile.py``; ``_common.py`` holds what they share. The
package imports torch, :mod:`ttt_flash.second_order` and ``higher`` (lazily) only and knows
nothing about the model it adapts.
"""


from ._common import INNER_OPTIMIZERS, check_inner_optimizer, functional_loss, meta_sgd_lrs, select_adapted
from .imaml import (HESSIAN_MODES, CGReport, IMAMLResult, conjugate_gradient, imaml_meta_gradient,
                    proximal_inner_loop)
from .maml import MAML, Learner, higher_inner_loop, inner_loop
from .reptile import ReptileResult, reptile_meta_gradient

__all__ = [
    "inner_loop",
    "higher_inner_loop",
    "MAML",
    "Learner",
    "functional_loss",
    "select_adapted",
    "meta_sgd_lrs",
    "INNER_OPTIMIZERS",
    "check_inner_optimizer",
    "proximal_inner_loop",
    "imaml_meta_gradient",
    "reptile_meta_gradient",
    "conjugate_gradient",
    "CGReport",
    "IMAMLResult",
    "ReptileResult",
    "HESSIAN_MODES",
]

