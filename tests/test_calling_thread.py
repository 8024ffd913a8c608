"""The library's backward passes run on the calling thread (``calling_thread_backward``):
``second_order_grad`` and what goes through it (MAML inner loops), the benchmark chain; the
switch off gives PyTorch's per-device autograd threads back; the setting never leaks."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from ttt_flash import flash_attention
from ttt_flash.bench.common import attention_chain
from ttt_flash.second_order import calling_thread_backward, second_order_grad, use_calling_thread
from ttt_flash.second_order import grad as grad_mod


class Spy(torch.autograd.Function):
    """Identity whose backward records (multithreading flag, thread id) into ``seen``."""

    seen: list = []

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        Spy.seen.append((torch._C._is_multithreading_enabled(), threading.get_ident()))
        return g


@pytest.fixture(autouse=True)
def _clear():
    Spy.seen.clear()
    yield
    Spy.seen.clear()


def _loss(device="cpu"):
    x = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    return (Spy.apply(x) ** 2).sum(), x


def test_second_order_grad_runs_its_backward_on_the_calling_thread_and_restores():
    assert torch._C._is_multithreading_enabled()
    loss, x = _loss()
    (g,) = second_order_grad(loss, [x], create_graph=True)
    assert Spy.seen == [(False, threading.get_ident())]
    assert torch._C._is_multithreading_enabled()  # restored
    torch.testing.assert_close(g, 2 * x)
    # the gradient's own graph is intact: its backward (under plain autograd) works
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, torch.full_like(x, 2.0))


def test_switch_off_leaves_pytorch_default():
    loss, x = _loss()
    with use_calling_thread(False):
        assert grad_mod.CALLING_THREAD is False
        second_order_grad(loss, [x])
    assert grad_mod.CALLING_THREAD is True
    assert Spy.seen[0][0] is True


def test_setting_restored_after_an_error_and_when_nested():
    class Boom(Spy):
        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        second_order_grad(Boom.apply(x).sum(), [x])
    assert torch._C._is_multithreading_enabled()
    with torch.autograd.set_multithreading_enabled(False):
        with calling_thread_backward():
            assert not torch._C._is_multithreading_enabled()
        assert not torch._C._is_multithreading_enabled()  # the caller's setting, not True
    assert torch._C._is_multithreading_enabled()


def test_maml_inner_loop_and_benchmark_chain_take_the_calling_thread():
    from ttt_flash.meta import inner_loop

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1, dtype=torch.float64)

        def forward(self, x):
            return Spy.apply(self.lin(x))

    net = Net()
    batch = (torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64))
    inner_loop(net, None, torch.nn.functional.mse_loss, batch, steps=1, lr=0.1)
    assert Spy.seen and all(flag is False for flag, _ in Spy.seen)

    Spy.seen.clear()
    q, k, v, do = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(4))
    u = [torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3)]
    out = attention_chain(lambda a, b, c: flash_attention(Spy.apply(a), b, c, backend="reference"),
                          q, k, v, do, u)
    assert len(out) == 8 and Spy.seen and all(flag is False for flag, _ in Spy.seen)
    with use_calling_thread(False):
        Spy.seen.clear()
        attention_chain(lambda a, b, c: flash_attention(Spy.apply(a), b, c, backend="reference"),
                        q, k, v, do, u)
        assert Spy.seen and all(flag is True for flag, _ in Spy.seen)


def test_environment_turns_the_switch_off():
    code = "from ttt_flash.second_order import grad; print(grad.CALLING_THREAD)"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "TTT_FLASH_CALLING_THREAD_BACKWARD": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backward_runs_on_the_calling_thread_only_with_the_switch_on():
    me = threading.get_ident()
    loss, x = _loss("cuda")
    second_order_grad(loss, [x])
    assert Spy.seen == [(False, me)]
    Spy.seen.clear()
    loss, x = _loss("cuda")
    with use_calling_thread(False):
        second_order_grad(loss, [x])
    assert Spy.seen[0][1] != me  # PyTorch's autograd thread for the device


def _record_backward_flags(monkeypatch):
    """``torch.autograd.backward`` (what ``Tensor.backward`` calls) recording the flag it sees."""
    seen = []
    real = torch.autograd.backward

    def spy(*args, **kwargs):
        seen.append(torch._C._is_multithreading_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", spy)
    return seen


def _lightning_modules():
    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.lightning.data import InContextRegressionDataModule
    from ttt_flash.lightning.maml import MAML
    from ttt_flash.lightning.memory import AssociativeRecallDataModule, GradMemKV
    from ttt_flash.memory import GradMem
    from ttt_flash.models import GPTConfig, NetConfig

    maml = MAML(net=NetConfig(kind="transformer", in_dim=6, d_model=16, n_heads=2, n_layers=1), inner_steps=1,
                inner_lr=0.05, loss="incontext_mse")
    yield "maml", maml, InContextRegressionDataModule(dim=4, seq_len=8, support_size=2, query_size=2,
                                                      meta_batch_size=2, train_batches=2, val_batches=1)
    mem = GradMemKV(GradMem(GPTConfig(vocab_size=9, n_layer=1, n_head=2, d_model=16), memory_tokens=2))
    yield "memory", mem, AssociativeRecallDataModule(num_keys=4, num_values=4, num_pairs=2, num_queries=2,
                                                     context_len=8, batch_size=2, train_batches=2, val_batches=1)
    lm = LanguageModel(GPTConfig.tiny(n_layer=1, d_model=32, n_head=2), optimizer="sophiah", hessian_every=1)
    yield "lm", lm, ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**14, train_batches=2, val_batches=1)


def test_lightning_modules_run_their_backward_on_the_calling_thread(monkeypatch, tmp_path):
    import lightning.pytorch as pl

    for name, module, data in _lightning_modules():
        seen = _record_backward_flags(monkeypatch)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                             num_sanity_val_steps=0, default_root_dir=tmp_path)
        trainer.fit(module, data)
        assert len(seen) >= 2 and not any(seen), (name, seen)
        assert torch._C._is_multithreading_enabled()
        monkeypatch.undo()
