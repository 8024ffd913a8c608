"""Second order: Hessian-vector products, the estimators and optimizers built on them, and
gradients of gradients with a clear refusal where PyTorch cannot take them.

The modules: ``grad.py`` (:func:`second_order_grad`), ``hessian.py`` (:class:`HessianOperator`,
parameter selection, probes), ``estimators.py`` (:func:`hvp`, Hutchinson, power iteration),
``recomputation.py`` (recomputation units for forward-over-reverse products) and ``optim.py``
(Sophia-H, AdaHessian: :mod:`ttt_flash.second_order.optim`, imported by name, as it averages
across processes with :mod:`ttt_flash.distributed`). This package exports the names of the
first four.

Hessian-vector products, for any scalar loss:

For a scalar loss L(θ) over parameters θ = (θ_1, ..., θ_m) (tensors of any shapes), a
Hessian-vector product ``H v = ∇²L(θ) v`` is computed in one of two :data:`MODES`:

* ``"rev_rev"`` (default), reverse over reverse: the gradient g = ∇L is built once with
  ``create_graph=True``, then each product is ``∇_θ ⟨g, v⟩`` (one reverse pass through
  the kept graph). The loss may be a tensor.
* ``"fwd_rev"``, forward over reverse: each product re-runs the loss (a zero-argument
  callable) and takes the tangent in direction v of a plain gradient. No ``create_graph``
  graph of the model is kept, so peak memory is lower (docs/forward-mode.md). When the
  parameters belong to a module (``params`` is the module, or ``module=`` names it), the
  product is ``torch.func.jvp`` of ``torch.func.grad`` with the module's parameters swapped
  in (``torch.func.functional_call``), which covers every PyTorch op torch.func covers;
  otherwise v is attached to the parameters (leaf tensors) as their
  ``torch.autograd.forward_ad`` tangents, which needs forward-mode formulas for the
  backward ops of the loss (``silu_backward``, e.g., has none: pass ``module=``).

  ``recompute`` (either mode; needs a module and a loss callable) names submodules, e.g.
  ``"blocks"``, whose calls are recomputation units (:mod:`ttt_flash.second_order.recomputation`). Under
  ``"fwd_rev"`` each unit keeps only its inputs and their tangents and is recomputed in the
  backward pass, so the peak memory is that of the unit inputs plus one unit, well below reverse
  over reverse, which must keep the ``create_graph`` graph of every unit (with ``recompute`` its
  units are ``torch.utils.checkpoint`` regions, which that graph keeps alive anyway). The
  product then attaches v to the parameters in place (the ``forward_ad`` route), with the units'
  backward ops differentiated inside the units, so SwiGLU models need no ``torch.func``.

Through a transformer whose attention is :func:`ttt_flash.flash_attention`, every product
is exact in both modes and never materialises an N × N attention matrix on the Triton
backend.

Public names:

* :class:`HessianOperator`: the linear map v ↦ H v of one loss, gradient graph built once
  (reuse it for many products).
* :func:`hvp`: one Hessian-vector product.
* :func:`hutchinson_diagonal`: unbiased estimate of diag(H), mean of z ∘ (H z).
* :func:`hutchinson_trace`: unbiased estimate of tr(H), mean of zᵀ H z.
* :func:`top_eigenvalue`: dominant eigenvalue (largest |λ|) and eigenvector by power iteration.
* :func:`exact_diagonal`: diag(H) exactly, one product per scalar parameter (small sets only).
* :func:`select_params`: ``{name: parameter}`` of a module, by names, prefixes or a predicate.
* :func:`probe_like`: one random probe (Rademacher ±1 or Gaussian) per parameter.
* :data:`PROBES`: accepted probe distributions; :data:`MODES`: accepted ``mode`` values.
* :func:`recompute`, :func:`recomputed`: recomputation units (:mod:`ttt_flash.second_order.recomputation`).

Parameters (the ``params`` argument everywhere) may be an ``nn.Module`` (its parameters
that require grad), one tensor, a sequence of tensors or a ``{name: tensor}`` mapping
(e.g. from :func:`select_params`, to work on a subset). Every tensor must require grad.
Results are lists of tensors in the order of ``params``, each of its parameter's shape.

The loss (the ``loss`` argument everywhere) is a scalar tensor whose graph reaches the
parameters, a zero-argument callable returning one, or a :class:`HessianOperator` built
before (its graph is reused; ``params`` must then be omitted).

Example: the trace and top eigenvalue of a small network's loss Hessian::

    >>> import torch
    >>> from torch import nn
    >>> from ttt_flash.second_order import HessianOperator, hutchinson_trace, top_eigenvalue
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x, y = torch.randn(32, 3), torch.randn(32, 1)
    >>> op = HessianOperator(nn.functional.mse_loss(net(x), y), net)
    >>> op.numel
    41
    >>> isinstance(hutchinson_trace(op, n_samples=20), float)
    True
    >>> top_eigenvalue(op, n_iter=50).value > 0
    True

The package imports torch (and tqdm, lazily, for progress bars) only and knows nothing about
the model.
"""


from .estimators import Eigen, exact_diagonal, hutchinson_diagonal, hutchinson_trace, hvp, top_eigenvalue
from .grad import COMPILE_DOUBLE_BACKWARD_MESSAGE, calling_thread_backward, second_order_grad, use_calling_thread
from .hessian import MODES, PROBES, HessianOperator, probe_like, select_params
from .recomputation import forward_over_reverse, recompute, recomputed, unit_modules

__all__ = [
    "second_order_grad",
    "calling_thread_backward",
    "use_calling_thread",
    "COMPILE_DOUBLE_BACKWARD_MESSAGE",
    "HessianOperator",
    "Eigen",
    "hvp",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "top_eigenvalue",
    "exact_diagonal",
    "select_params",
    "probe_like",
    "PROBES",
    "MODES",
    "recompute",
    "recomputed",
    "forward_over_reverse",
    "unit_modules",
]
