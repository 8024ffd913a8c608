"""ttt_flash.lightning.lm: LanguageModel with each optimizer, HessianRefresh, ByteTextDataModule."""

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch

from ttt_flash.lightning import ByteTextDataModule, HessianRefresh, LanguageModel
from ttt_flash.tasks import stdlib_source_files
from ttt_flash.models import GPTConfig
from ttt_flash.second_order.optim import SophiaH


def _gpt(**kw):
    return GPTConfig.tiny(n_layer=1, d_model=32, n_head=2, **kw)


def _trainer(max_steps=3, callbacks=None):
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def data():
    dm = ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**15, train_batches=3, val_batches=1)
    dm.setup()
    return dm


def test_stdlib_corpus_yields_byte_tokens(data):
    files = stdlib_source_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert data.train_tokens.dtype == torch.uint8 and data.train_tokens.numel() + data.val_tokens.numel() == 2**15
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    # The corpus starts with the first stdlib file's bytes.
    assert bytes(data.train_tokens[:64].tolist()) == files[0].read_bytes()[:64]


def test_windows_are_reproducible_fresh_per_epoch_and_val_fixed(data):
    # Two new modules: a DataModule's training order carries on across train_dataloader()
    # calls (it is part of a checkpoint), so the shared fixture may be past epoch 0.
    one, other = (ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**15, train_batches=3, val_batches=1)
                  for _ in range(2))
    one.setup()
    other.setup()
    loader_a, loader_b = one.train_dataloader(), other.train_dataloader()
    first = [x for x, _ in loader_a]
    assert all(torch.equal(a, b) for a, (b, _) in zip(first, loader_b))  # same seed, same windows
    second = [x for x, _ in loader_a]  # next epoch: fresh windows
    assert not all(torch.equal(a, b) for a, b in zip(first, second))
    v1 = [x for x, _ in data.val_dataloader()]
    v2 = [x for x, _ in data.val_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))


def test_text_files_by_path_and_errors(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hello world " * 50)
    dm = ByteTextDataModule(paths=[str(tmp_path)], seq_len=8, batch_size=4, val_fraction=0.1, max_bytes=None)
    dm.setup()
    assert [f.name for f in dm.files] == ["a.txt", "b.txt"]
    assert dm.train_tokens.numel() + dm.val_tokens.numel() == 1024 + 1 + 600 + 1
    dm = ByteTextDataModule(paths=[str(tmp_path / "*.txt")], seq_len=8)
    dm.setup()
    assert [f.name for f in dm.files] == ["a.txt"]
    with pytest.raises(FileNotFoundError):
        ByteTextDataModule(paths=[str(tmp_path / "missing.txt")]).setup()
    with pytest.raises(ValueError, match="fewer than seq_len"):
        ByteTextDataModule(paths=[str(tmp_path / "a.txt")], seq_len=512).setup()
    with pytest.raises(ValueError, match="seq_len"):
        ByteTextDataModule(seq_len=0)
    with pytest.raises(ValueError, match="val_fraction"):
        ByteTextDataModule(val_fraction=1.0)


@pytest.mark.parametrize("optimizer", ["sophiah", "adamw", "adahessian"])
def test_language_model_trains_with_each_optimizer(data, optimizer):
    torch.manual_seed(0)
    model = LanguageModel(_gpt(), optimizer=optimizer, lr=1e-3, warmup_steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(max_steps=3)
    trainer.fit(model, data)
    metrics = trainer.callback_metrics
    assert math.isfinite(metrics["train/loss"].item()) and math.isfinite(metrics["val/loss"].item())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    refresh = [c for c in trainer.callbacks if isinstance(c, HessianRefresh)]
    opt = trainer.optimizers[0]
    if optimizer == "adamw":
        assert not refresh
        return
    assert len(refresh) == 1  # added by LanguageModel.configure_callbacks
    # Sophia-H refreshes before step 0 (k = 10); AdaHessian before every step (k = 1).
    assert refresh[0].refreshes == (1 if optimizer == "sophiah" else 3)
    assert all(not p.grad.requires_grad for p in model.parameters() if p.grad is not None)
    assert all(s["hessian_step"] == refresh[0].refreshes for s in opt.state.values())
    if optimizer == "sophiah":
        assert 0.0 <= metrics["train/clip_fraction"].item() <= 1.0


def test_user_hessian_refresh_is_kept_and_checkpoint_loads(data, tmp_path):
    model = LanguageModel(_gpt(n_kv_head=1), optimizer="sophiah", hessian_every=10)
    cb = HessianRefresh(every_k=1)
    trainer = _trainer(max_steps=2, callbacks=[cb])
    trainer.fit(model, data)
    assert [c for c in trainer.callbacks if isinstance(c, HessianRefresh)] == [cb]
    assert cb.refreshes == 2
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    loaded = LanguageModel.load_from_checkpoint(tmp_path / "lm.ckpt")  # torch.load(weights_only=True)
    assert loaded.gpt_config == model.gpt_config and loaded.gpt_config.n_kv_head == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


def test_hessian_refresh_through_language_model_is_exact():
    """The estimate refreshed from LanguageModel.backward's graph is the same with ttt_flash
    attention as with materialised attention, in float64, for the same probe."""
    idx = torch.randint(0, 256, (2, 13))
    states = {}
    for attention in ("ttt_flash", "math"):
        torch.manual_seed(0)
        model = LanguageModel(_gpt(attention=attention), optimizer="sophiah").double()
        opt = SophiaH(model.parameters(), weight_decay=0.0)
        model.hessian_refresh_pending = True
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # LanguageModel.backward silences the reference-cycle warning
            model.backward(model.model.loss(idx[:, :-1], idx[:, 1:]))
        assert all(p.grad.requires_grad for p in model.parameters())
        opt.update_hessian(generator=torch.Generator().manual_seed(1))
        states[attention] = torch.cat([opt.state[p]["hessian"].reshape(-1) for p in model.parameters()])
    err = (states["ttt_flash"] - states["math"]).norm() / states["math"].norm()
    assert err <= 1e-8, f"relative error {err:.3e}"


def test_language_model_bad_arguments():
    with pytest.raises(ValueError, match="optimizer"):
        LanguageModel(_gpt(), optimizer="sgd")
    with pytest.raises(ValueError, match="lr"):
        LanguageModel(_gpt(), lr=0.0)
    with pytest.raises(ValueError, match="hessian_every"):
        LanguageModel(_gpt(), hessian_every=0)
    with pytest.raises(TypeError, match="GPTConfig"):
        LanguageModel(gpt="tiny")
    with pytest.raises(ValueError, match="every_k"):
        HessianRefresh(every_k=0)


def test_language_model_takes_an_injected_gpt(tmp_path):
    # `gpt:` with class_path ttt_flash.models.GPT: the module trains the given model, and its
    # checkpoint still rebuilds it from the config (the config is the hyperparameter)
    from ttt_flash.models import GPT

    gpt = GPT(_gpt(n_kv_head=1))
    model = LanguageModel(gpt, optimizer="adamw")
    assert model.model is gpt and model.gpt_config is gpt.config
    assert model.hparams["gpt"]["n_kv_head"] == 1
    with pytest.raises(TypeError, match="gpt must be a GPT or a GPTConfig"):
        LanguageModel(torch.nn.Linear(2, 2))


def test_graphed_step_writes_gradients_into_the_existing_tensors():
    """The captured step's gradients are copied into each parameter's existing ``.grad`` (the
    tensors the graph keeps writing), a new one where there is none, and a parameter the loss
    does not reach keeps a zeroed ``.grad``."""
    from ttt_flash.lightning._step import write_grads

    a, b, c, d = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    a.grad, c.grad = torch.full((2,), 5.0), torch.full((2,), 7.0)
    held = a.grad
    write_grads([a, b, c, d], [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), None, None])
    assert a.grad is held and torch.equal(a.grad, torch.tensor([1.0, 2.0]))
    assert torch.equal(b.grad, torch.tensor([3.0, 4.0])) and not b.grad.requires_grad
    assert torch.equal(c.grad, torch.zeros(2)) and d.grad is None


def test_graphed_plain_step_leaves_the_gradients_of_backward():
    from ttt_flash.lightning import LanguageModel
    from ttt_flash.models import GPTConfig

    torch.manual_seed(0)
    module = LanguageModel(GPTConfig.tiny(n_layer=1), optimizer="sophiah")
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    module.model.loss(x, y).backward()
    expected = [p.grad.clone() for p in module.model.parameters()]
    held = [p.grad for p in module.model.parameters()]
    for g in held:
        g.fill_(3.0)
    module._graphed_grads(x, y)
    for p, g, e in zip(module.model.parameters(), held, expected):
        assert p.grad is g and torch.equal(p.grad, e)
