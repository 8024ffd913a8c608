"""GPU test of the gradient-memory language model's outer gradient (the meta-gradient through
every slot write) on the Triton kernels, against materialised softmax attention in float64.

The model is :class:`ttt_flash.memory.MemoryLM` with the recall layer of the memory recipes
(``qk_norm``, ``kv_shift``, ``slot_query="key"``, slot-normalised or gradient writes, the
parallel write). In float32 with ``attention="ttt_flash"`` the writes differentiate through
the kernels' backward-over-backward; the same weights in float64 with ``attention="math"``
give the exact gradient. The kernels' error must be at most twice the error of the same
computation through materialised attention in float32, plus a small floor; the second-order
gradient must differ from the first-order one by far more than that error.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash.memory import MemoryLM  # noqa: E402

DEV = "cuda"


def _grads(state, rule, attention, dtype, first_order=False):
    torch.manual_seed(0)
    model = MemoryLM(97, d_model=64, n_layer=2, heads=4, memory_slots=16, chunk_size=64, attention=attention,
                     conv=1, write_gate=True, write_rule=rule, qk_norm=True, kv_shift=True, slot_query="key",
                     first_order=first_order)
    model.load_state_dict(state)
    model = model.to(DEV, dtype)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2, 512), generator=gen).to(DEV)
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits[:, -64:].reshape(-1, 97).double(), idx[:, -64:].reshape(-1))
    named = list(model.named_parameters())
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=first_order)  # first order: no path to some
    return {n: (torch.zeros_like(p) if g is None else g).double() for (n, p), g in zip(named, grads)}


def _rel(a, b):
    num = sum(((a[n] - b[n]) ** 2).sum() for n in a)
    den = sum((b[n] ** 2).sum() for n in b)
    return (num / den).sqrt().item()


@pytest.mark.parametrize("rule", ["slot_normalized", "gradient"])
def test_memory_lm_meta_gradient_on_the_kernels_matches_math(rule):
    torch.manual_seed(0)
    state = MemoryLM(97, d_model=64, n_layer=2, heads=4, memory_slots=16, chunk_size=64, conv=1, write_gate=True,
                     write_rule=rule, qk_norm=True, kv_shift=True, slot_query="key").state_dict()
    exact = _grads(state, rule, "math", torch.float64)
    kernels = _grads(state, rule, "ttt_flash", torch.float32)
    math32 = _grads(state, rule, "math", torch.float32)
    first = _grads(state, rule, "math", torch.float64, first_order=True)
    err, err_math = _rel(kernels, exact), _rel(math32, exact)
    gap = _rel(first, exact)
    print(f"{rule}: relative L2 error kernels {err:.2e}, math fp32 {err_math:.2e}; first vs second order {gap:.2e}")
    assert err <= 2 * err_math + 1e-6, (err, err_math)
    assert gap > 100 * err, (gap, err)
