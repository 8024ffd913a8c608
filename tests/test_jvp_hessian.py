"""Forward-over-reverse (mode="fwd_rev") Hessian-vector products in ttt_flash.second_order, the
optimizers and the Sophia-H refresh callback: the same numbers as reverse over reverse."""

import lightning.pytorch as pl
import pytest
import torch

from ttt_flash.second_order import (
    HessianOperator,
    hutchinson_diagonal,
    hutchinson_trace,
    hvp,
    top_eigenvalue,
)
from ttt_flash.lightning import ByteTextDataModule, HessianRefresh, LanguageModel
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.second_order.optim import SophiaH

F64 = torch.float64


def _close(a, b, tol=1e-10):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)


def _gpt_loss(attention="ttt_flash", **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=1, d_model=32, n_head=2, attention=attention, **kw)).double()
    idx = torch.randint(0, 256, (2, 11))
    return model, (lambda: model.loss(idx[:, :-1], idx[:, 1:]))


@pytest.mark.parametrize("kv", [2, 1], ids=["mha", "mqa"])
def test_fwd_rev_hvp_of_a_gpt_matches_rev_rev_and_materialised_attention(kv):
    model, loss = _gpt_loss(n_kv_head=kv)
    vecs = [torch.randn_like(p) for p in model.parameters()]
    rr = hvp(loss, model, vecs)
    fr = hvp(loss, model, vecs, mode="fwd_rev")
    _close(fr, rr)
    assert max(h.abs().max().item() for h in fr) > 1e-3  # not trivially zero
    math_model, math_loss = _gpt_loss(attention="math", n_kv_head=kv)
    _close(fr, hvp(math_loss, math_model, vecs, mode="fwd_rev"))


def test_fwd_rev_on_plain_tensors_uses_forward_ad():
    """params given as tensors (no module): tangents attached in place with forward_ad."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(3, 5, dtype=F64, requires_grad=True), torch.randn(5, dtype=F64, requires_grad=True)
    x = torch.randn(7, 3, dtype=F64)
    loss = lambda: ((x @ w1).tanh() @ w2).square().mean()  # noqa: E731
    vecs = [torch.randn_like(w1), torch.randn_like(w2)]
    op = HessianOperator(loss, [w1, w2], mode="fwd_rev")
    _close(op.mv(vecs), hvp(loss, [w1, w2], vecs))
    _close(op.gradient, torch.autograd.grad(loss(), [w1, w2]))
    assert op.reached == [True, True] and op.mode == "fwd_rev"
    # the tangents are gone after the product: a later dual level sees none
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        assert fwAD.unpack_dual(w1).tangent is None


def test_estimators_in_fwd_rev_mode_match_rev_rev():
    model, loss = _gpt_loss()
    params = {n: p for n, p in model.named_parameters() if "attn" in n}
    out = {}
    for mode in ("rev_rev", "fwd_rev"):
        gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
        diag = hutchinson_diagonal(loss, params, 1, generator=gen(), mode=mode, module=model)
        trace = hutchinson_trace(loss, params, 1, generator=gen(), mode=mode, module=model)
        eig = top_eigenvalue(loss, params, 3, generator=gen(), mode=mode, module=model)
        out[mode] = (diag, trace, eig)
    _close(out["fwd_rev"][0], out["rev_rev"][0])
    assert abs(out["fwd_rev"][1] - out["rev_rev"][1]) <= 1e-9 * max(1.0, abs(out["rev_rev"][1]))
    assert abs(out["fwd_rev"][2].value - out["rev_rev"][2].value) <= 1e-9 * abs(out["rev_rev"][2].value)


def test_sophia_update_hessian_fwd_rev_matches_rev_rev():
    states = {}
    for mode in ("rev_rev", "fwd_rev"):
        model, loss = _gpt_loss()
        opt = SophiaH(model.parameters(), weight_decay=0.0)
        if mode == "rev_rev":
            opt.update_hessian(loss(), generator=torch.Generator().manual_seed(1))
        else:
            opt.update_hessian(loss, generator=torch.Generator().manual_seed(1), mode="fwd_rev", module=model)
        states[mode] = torch.cat([opt.state[p]["hessian"].reshape(-1) for p in model.parameters()])
    err = (states["fwd_rev"] - states["rev_rev"]).norm() / states["rev_rev"].norm()
    assert err <= 1e-10, f"relative error {err:.3e}"


def test_language_model_trains_with_fwd_rev_refresh():
    dm = ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**15, train_batches=2, val_batches=1)
    torch.manual_seed(0)
    model = LanguageModel(GPTConfig.tiny(n_layer=1, d_model=32, n_head=2), optimizer="sophiah",
                          hessian_every=1, hessian_mode="fwd_rev")
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1,
                         num_sanity_val_steps=0)
    trainer.fit(model, dm)
    refresh = [c for c in trainer.callbacks if isinstance(c, HessianRefresh)]
    assert len(refresh) == 1 and refresh[0].mode == "fwd_rev" and refresh[0].refreshes == 2
    opt = trainer.optimizers[0]
    assert all(s["hessian_step"] == 2 for s in opt.state.values())
    # the backward stayed first-order: no gradient carries a graph
    assert all(not p.grad.requires_grad for p in model.parameters() if p.grad is not None)


def test_fwd_rev_refresh_estimate_equals_rev_rev_refresh():
    """The callback's fwd_rev refresh (loss re-run on the batch) gives the estimate the
    rev_rev refresh takes from the backward's graph, for the same probe."""
    idx = torch.randint(0, 256, (2, 13))
    batch = (idx[:, :-1], idx[:, 1:])
    states = {}
    for mode in ("rev_rev", "fwd_rev", "fwd_rev+recompute"):
        torch.manual_seed(0)
        model = LanguageModel(GPTConfig.tiny(n_layer=2, d_model=32, n_head=2), optimizer="sophiah").double()
        opt = SophiaH(model.parameters(), weight_decay=0.0)
        if mode == "fwd_rev+recompute":
            cb = HessianRefresh(every_k=1, mode="fwd_rev", recompute="model.blocks")
        else:
            cb = HessianRefresh(every_k=1, mode=mode)
        torch.manual_seed(5)
        if mode == "rev_rev":
            model.hessian_refresh_pending = True
            model.backward(model.hessian_loss(batch))
            cb.on_before_optimizer_step(None, model, opt)
        else:
            cb._batch = batch
            cb.on_before_optimizer_step(None, model, opt)
        states[mode] = torch.cat([opt.state[p]["hessian"].reshape(-1) for p in model.parameters()])
    for mode in ("fwd_rev", "fwd_rev+recompute"):
        err = (states[mode] - states["rev_rev"]).norm() / states["rev_rev"].norm()
        assert err <= 1e-10, f"{mode}: relative error {err:.3e}"


def test_language_model_hessian_recompute_reaches_the_refresh():
    model = LanguageModel(GPTConfig.tiny(n_layer=2, d_model=32, n_head=2), optimizer="sophiah",
                          hessian_mode="fwd_rev", hessian_recompute=True)
    (cb,) = model.configure_callbacks()
    assert cb.mode == "fwd_rev" and cb.recompute == "model.blocks"
    plain = LanguageModel(GPTConfig.tiny(n_layer=2, d_model=32, n_head=2), optimizer="sophiah",
                          hessian_mode="fwd_rev")
    assert plain.configure_callbacks()[0].recompute is None


def test_fwd_rev_refresh_with_recompute_peaks_lower():
    """The refresh with recomputed blocks holds fewer live bytes at its peak than without
    (the test fails if ``recompute`` is not passed on to the products)."""
    from ttt_flash.bench.jvp import LiveBytes

    idx = torch.randint(0, 256, (8, 33))
    peaks = {}
    for recompute in (None, "model.blocks"):
        torch.manual_seed(0)
        model = LanguageModel(GPTConfig.tiny(n_layer=4, d_model=32, n_head=2), optimizer="sophiah").double()
        opt = SophiaH(model.parameters(), weight_decay=0.0)
        cb = HessianRefresh(every_k=1, mode="fwd_rev", recompute=recompute)
        cb._batch = (idx[:, :-1], idx[:, 1:])
        with LiveBytes() as m:
            cb.on_before_optimizer_step(None, model, opt)
        assert cb.refreshes == 1
        peaks[recompute] = m.peak
    assert peaks["model.blocks"] < 0.8 * peaks[None], peaks


def test_fwd_rev_bad_arguments():
    model, loss = _gpt_loss()
    with pytest.raises(TypeError, match="zero-argument callable"):
        HessianOperator(loss(), model, mode="fwd_rev")
    with pytest.raises(ValueError, match="mode must be one of"):
        HessianOperator(loss, model, mode="fwd_fwd")
    with pytest.raises(ValueError, match="not parameters of the module"):
        HessianOperator(loss, [torch.zeros(2, requires_grad=True)], mode="fwd_rev", module=model)
    with pytest.raises(ValueError, match="zero-argument callable"):
        SophiaH(model.parameters()).update_hessian(loss(), mode="fwd_rev")
    with pytest.raises(ValueError, match="mode"):
        HessianRefresh(mode="forward")
    with pytest.raises(ValueError, match="hessian_mode"):
        LanguageModel(GPTConfig.tiny(n_layer=1), hessian_mode="fwd")
    with pytest.raises(ValueError, match="needs mode='fwd_rev'"):
        HessianRefresh(recompute="model.blocks")
    with pytest.raises(ValueError, match="needs mode='fwd_rev'"):
        SophiaH(model.parameters()).update_hessian(loss(), recompute="blocks")
    with pytest.raises(ValueError, match="hessian_recompute=True needs hessian_mode='fwd_rev'"):
        LanguageModel(GPTConfig.tiny(n_layer=1), hessian_recompute=True)
