"""Reptile: ``θ − φ`` after a graph-free inner loop, as the meta-gradient."""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._common import Adapt, LossFn, _check_params, select_adapted
from .imaml import proximal_inner_loop


class ReptileResult(NamedTuple):
    """What :func:`reptile_meta_gradient` returns for one task.

    Attributes:
        grads: ``{name: tensor}``: θ − φ for the adapted names, zeros for the rest (detached).
        adapted: ``{name: tensor}`` φ (detached) for the adapted names, the inputs for the rest.
    """

    grads: Dict[str, Tensor]
    adapted: Dict[str, Tensor]



def reptile_meta_gradient(
    model: nn.Module,
    params: Optional[Mapping[str, Tensor]],
    loss_fn: LossFn,
    support_batch,
    steps: int,
    lr: float,
    *,
    adapt: Adapt = None,
    optimizer: Union[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = "sgd",
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> ReptileResult:
    r"""Reptile (Nichol et al., 2018) for one task: ``θ − φ`` as the meta-gradient.

    φ is ``steps`` graph-free optimizer steps on ``L_task`` from θ
    (:func:`proximal_inner_loop` with λ = 0). An outer SGD step of size ε on this gradient is
    Reptile's update ``θ ← θ + ε (φ − θ)``; averaged over tasks it is the batched version.
    First order: no second derivatives, memory of one forward and backward pass.

    Args:
        model, params, loss_fn, support_batch, steps, lr, adapt, optimizer, betas, eps: as in
            :func:`proximal_inner_loop`.

    Returns:
        :class:`ReptileResult` ``(grads, adapted)``: ``grads[n] = θ_n − φ_n`` for the adapted
        names and zeros for the rest, detached.
    """
    fast = proximal_inner_loop(model, params, loss_fn, support_batch, steps, lr, 0.0, adapt=adapt,
                               optimizer=optimizer, betas=betas, eps=eps)
    params = _check_params(model, params)
    names = set(select_adapted(list(params), adapt))
    grads = {n: (p.detach() - fast[n]) if n in names else torch.zeros_like(p.detach())
             for n, p in params.items()}
    return ReptileResult(grads, fast)
