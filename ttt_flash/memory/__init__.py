r"""Memory written by gradient descent: three ways to store a context in weights or slots by
inner gradient steps whose effect is meta-learned by differentiating through them.

* :class:`GradMem` (model level, GradMem-style): ``m`` learned memory tokens are prepended to
  a context; ``k`` inner gradient steps on the LM loss of the context update *only the
  memory tokens* (weights fixed); the model then answers queries from ``[memory; query]``,
  without the context.
* :class:`FastWeightTTT` (end-to-end test-time training): chosen MLP sublayers of a
  :class:`~ttt_flash.models.GPT` are fast weights, updated by gradient steps of the
  next-token loss over successive chunks of the context (sliding-window attention in the
  model); the adapted model then answers queries.
* :class:`GradientMemoryAttention`: a drop-in attention layer (B, N, d_model) → (B, N,
  d_model) that reads memory slots plus the current chunk and writes each chunk into the
  slots by gradient steps of a reconstruction loss through softmax attention.
  :class:`MemoryLM` is a small language model built from it.

In all three, the outer loss differentiates through every inner step
(``torch.autograd.grad(..., create_graph=True)``): second order, exactly, through
:func:`ttt_flash.flash_attention`. ``first_order=True`` treats the inner gradients as
constants (the outer gradient then still reaches the initial state and the step size,
through ``state − η · g``, but not through ``g``). Inner step sizes are learned as
``log η``.

Inner loops run with gradients enabled even when called under ``torch.no_grad()`` (they
need them); the result is then detached. Under ``torch.inference_mode()`` they cannot run:
leave it first (``with torch.inference_mode(False), torch.enable_grad():`` and clone
inference tensors).

Context parallelism (one sequence across processes, docs/distributed.md): :class:`GradMem`
and :class:`FastWeightTTT` follow their GPT's ``context_parallel`` switch (or
``set_context_parallel``): the written sequence is cut across the ranks, every rank holds the
whole memory / fast weights and adds the ranks' inner-gradient shares with the differentiable
:func:`ttt_flash.distributed.all_reduce_sum`, and the short read runs whole on every rank.
:class:`MemoryLM` has no such switch (its chunks are written one after another).

One module per mechanism: :mod:`~ttt_flash.memory.gradmem`, :mod:`~ttt_flash.memory.fast_weight`,
:mod:`~ttt_flash.memory.attention_layer`, :mod:`~ttt_flash.memory.memory_lm`; every inner loop
takes its steps through :func:`ttt_flash.memory._common.inner_step`.
"""

from ._common import masked_lm_loss
from .attention_layer import MEMORY_ATTENTION_IMPLS, GradientMemoryAttention, MemoryAttentionName
from .fast_weight import FastWeightTTT
from .gradmem import GradMem
from .memory_lm import MemoryLM

__all__ = [
    "MEMORY_ATTENTION_IMPLS",
    "MemoryAttentionName",
    "masked_lm_loss",
    "GradMem",
    "FastWeightTTT",
    "GradientMemoryAttention",
    "MemoryLM",
]
