"""Capturable SophiaH / AdaHessian: the update split into a host part (counters, the step's
scalars written into device tensors) and a device part with no host reads, bitwise equal to
the per-parameter update with Python floats (the formulas of the Sophia and AdaHessian papers
as the optimizers computed them before the split)."""

import math
import warnings

import pytest
import torch

from ttt_flash.second_order.optim import AdaHessian, SophiaH


class _PythonFloatSophiaH(SophiaH):
    """Reference: the update with Python floats and int counters, one parameter at a time."""

    def host_step(self, pairs):
        self._prepared = [()] * len(pairs)

    def device_step(self, pairs):
        self._clipped, self._counted = [], 0
        for group, p in pairs:
            state = self._init_state(p)
            assert state["hessian_step"] > 0
            state["step"] += 1
            beta1, lr = group["betas"][0], group["lr"]
            m = state["exp_avg"]
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            ratio = (m.abs() / (group["rho"] * state["hessian"]).clamp_min(group["eps"])).clamp_max_(1.0)
            self._clipped.append((ratio >= 1.0).sum())
            self._counted += ratio.numel()
            p.addcmul_(m.sign(), ratio, value=-lr)
        self.clip_fraction = torch.stack(self._clipped).sum() / self._counted


class _PythonFloatAdaHessian(AdaHessian):
    def host_step(self, pairs):
        self._prepared = [()] * len(pairs)

    def device_step(self, pairs):
        for group, p in pairs:
            state = self._init_state(p)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            m, v = state["exp_avg"], state["exp_hessian_diag_sq"]
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            bias1 = 1 - beta1 ** state["step"]
            bias2 = 1 - beta2 ** state["hessian_step"]
            denom = (v.sqrt() / math.sqrt(bias2)).pow_(group["hessian_power"]).add_(group["eps"])
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(m, denom, value=-lr / bias1)


def _run(cls, dtype, steps=7, **kw):
    """Steps of a two-group problem with a decaying learning rate (LambdaLR), refreshing the
    Hessian every 2 steps; the losses, parameters and optimizer state after each step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(7, 5, dtype=dtype))
    b = torch.nn.Parameter(torch.randn(5, dtype=dtype))
    a = torch.randn(5, 5, dtype=dtype)
    opt = cls([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.05, k=2, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((w @ a @ b).tanh() ** 2).sum() + 0.01 * (w ** 4).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # create_graph cycle, broken by update_hessian
            loss.backward(create_graph=opt.hessian_due)
        if opt.hessian_due:
            opt.update_hessian(generator=gen)
        opt.step()
        sched.step()
        out.append([loss.detach().clone(), w.detach().clone(), b.detach().clone()]
                   + [t.clone() for p in (w, b) for k, t in sorted(opt.state[p].items()) if k not in ("step", "hessian_step")])
    return out, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("cls,ref", [(SophiaH, _PythonFloatSophiaH), (AdaHessian, _PythonFloatAdaHessian)])
def test_update_is_bitwise_the_python_float_update(cls, ref, dtype, capturable):
    expected, ref_opt = _run(ref, dtype)
    got, opt = _run(cls, dtype, capturable=capturable)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert len(e) == len(g)
        for x, y in zip(e, g):
            assert torch.equal(x, y), f"step {step}"
    if cls is SophiaH:  # the clipped coordinates, counted per tensor by the multi-tensor update
        assert torch.equal(opt.clip_fraction, ref_opt.clip_fraction)
        assert 0 < opt.clip_fraction.item() <= 1
    steps = opt.state[next(iter(opt.state))]["step"]
    if capturable:  # device counters (float32 0-dim tensors, as torch.optim's capturable Adam)
        assert isinstance(steps, torch.Tensor) and steps.dim() == 0 and steps.item() == 7
    else:
        assert steps == 7


@pytest.mark.parametrize("cls", [SophiaH, AdaHessian])
def test_update_and_refresh_take_as_many_operations_for_3_as_for_30_parameters(cls):
    """The update and the refresh's fold work on a param group's tensors together
    (torch._foreach_*): the number of tensor operations does not grow with the parameters
    (one CUDA launch each per ~100 tensors, not several per parameter)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    def ops(n):
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(n)]
        opt = cls([{"params": ws[: n // 3], "weight_decay": 0.1}, {"params": ws[n // 3:], "weight_decay": 0.0}],
                  lr=0.1, capturable=True)
        pairs = opt._trainable()
        for w in ws:
            w.grad = torch.randn_like(w)
            opt._init_state(w)
        counted = {}
        for part in ("refresh", "update"):
            with Count() as c:
                if part == "refresh":
                    opt.host_refresh(pairs)
                    opt.device_refresh(pairs, [torch.ones_like(w) for w in ws])
                else:
                    opt.host_step(pairs)
                    opt.device_step(pairs)
            counted[part] = [str(f) for f in c.ops if "fill" not in str(f) and "ones_like" not in str(f)]
        return counted

    few, many = ops(3), ops(30)
    assert few == many
    assert any("_foreach" in f for f in few["update"]) and len(few["update"]) < 40


@pytest.fixture
def no_host_reads(monkeypatch):
    """A context in which reading a tensor's value on the host raises."""
    import contextlib

    @contextlib.contextmanager
    def forbid():
        def boom(*args, **kwargs):
            raise AssertionError("host read of a tensor value")

        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, boom)
            yield

    return forbid


@pytest.mark.parametrize("cls", [SophiaH, AdaHessian])
def test_capturable_step_reads_no_tensor_value_on_the_host(cls, no_host_reads):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([w], lr=0.1, k=3, capturable=True)
    pairs = opt._trainable()
    for i in range(5):
        opt.zero_grad()
        loss = (w.sin() ** 2).sum()
        if i % 3 == 0:
            opt.update_hessian(loss, generator=torch.Generator().manual_seed(i))
            loss = (w.sin() ** 2).sum()
        loss.backward()
        with no_host_reads():
            due = opt.hessian_due  # from the host mirror of the device counters
            opt.step()
            # the device parts, as a CUDA graph replays them after the host parts
            opt.host_refresh(pairs)
            opt.device_refresh(pairs, [torch.ones_like(w)])
            opt.host_step(pairs)
            opt.device_step(pairs)
        assert due == (i % 3 == 0)
    assert opt.state[w]["step"].item() == 10 and opt.state[w]["hessian_step"].item() == 7
    assert opt._counts(opt.param_groups[0], w) == [10, 7]


@pytest.mark.parametrize("cls", [SophiaH, AdaHessian])
def test_host_read_guard_catches_a_counter_read(cls, no_host_reads):
    """The guard above is live: with the host mirror dropped, the step reads the device
    counters (once) and the guard raises."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([w], lr=0.1, capturable=True)
    opt.update_hessian((w.sin() ** 2).sum())
    opt.state[w]["step"] = torch.tensor(0.0)  # a device counter behind the host mirror's back
    opt._host.clear()
    (w.sin() ** 2).sum().backward()
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            opt.step()


def test_state_dict_moves_between_capturable_and_not():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    a = SophiaH([w], lr=0.1, k=2, capturable=True)
    for _ in range(3):
        a.zero_grad()
        (w.sin() ** 2).sum().backward(create_graph=a.hessian_due)
        a.step()
    b = SophiaH([w], lr=0.1, k=2)
    b.load_state_dict(a.state_dict())
    assert b.param_groups[0]["capturable"] is False and b.state[w]["step"] == 3 and b.hessian_due is False
    c = SophiaH([w], lr=0.1, k=2, capturable=True)
    c.load_state_dict(b.state_dict())
    assert c.param_groups[0]["capturable"] is True and isinstance(c.state[w]["step"], torch.Tensor)
    assert c.hessian_due is False and c._group_steps(c.param_groups[0]) == 3


@pytest.mark.parametrize("capturable", [True, False])
def test_a_loaded_hessian_counter_keeps_counting_past_256_for_bf16_parameters(capturable):
    # torch casts floating optimizer state to the parameter's dtype on load (except "step");
    # a bf16 counter would read 256 for 257 and every later bias correction would be off.
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    a = SophiaH([w], lr=0.1, k=1, capturable=True)
    (w.float().sin() ** 2).sum().backward(create_graph=True)
    a.step()
    a.state[w]["hessian_step"].fill_(257.0)
    a.state[w]["step"].fill_(257.0)
    b = SophiaH([w], lr=0.1, k=1, capturable=capturable)
    b.load_state_dict(a.state_dict())
    assert int(b.state[w]["hessian_step"]) == 257 and int(b.state[w]["step"]) == 257


def test_skip_next_update_runs_only_the_closure():
    w = torch.nn.Parameter(torch.ones(3))
    opt = SophiaH([w], lr=0.1, capturable=True)
    opt.update_hessian((w ** 2).sum())
    (w ** 2).sum().backward()
    opt.skip_next_update()
    assert opt.step(lambda: torch.tensor(2.0)).item() == 2.0
    assert torch.equal(w.detach(), torch.ones(3)) and not opt.state[w]["step"]
    opt.step()
    assert not torch.equal(w.detach(), torch.ones(3)) and opt.state[w]["step"].item() == 1


def test_capturable_must_be_a_bool():
    with pytest.raises(TypeError, match="capturable must be a bool"):
        SophiaH([torch.nn.Parameter(torch.ones(1))], capturable="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [SophiaH, AdaHessian])
def test_captured_device_step_replays_bitwise_equal_to_eager_with_a_schedule(cls):
    """The device part captured once (CapturedStep) and replayed for 10 steps, the learning
    rate of a LambdaLR schedule and the bias corrections written by host_step before each
    replay: parameters bitwise those of the eager optimizer."""
    from ttt_flash.cuda_graph import CapturedStep

    def setup(capturable):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 32, device="cuda"))
        x = torch.randn(16, 64, device="cuda")
        opt = cls([w], lr=0.05, k=1000, capturable=capturable)
        opt.update_hessian((x @ w).tanh().pow(2).sum(), generator=torch.Generator("cuda").manual_seed(0))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
        return w, x, opt, sched

    w, x, opt, sched = setup(False)
    for _ in range(10):
        opt.zero_grad()
        (x @ w).tanh().pow(2).sum().backward()
        opt.step()
        sched.step()
    expected = w.detach().clone()

    w, x, opt, sched = setup(True)
    pairs = opt.param_pairs()

    def step(xs):
        opt.zero_grad(set_to_none=False)  # the first warm-up run finds no gradient yet
        (xs @ w).tanh().pow(2).sum().backward()
        opt.device_step(pairs)

    opt.host_step(pairs)
    graph = CapturedStep(step, (x,), params=[w], optimizers=[opt])
    for i in range(10):
        if i:
            opt.host_step(pairs)
        graph(x)
        sched.step()
    assert torch.equal(w.detach(), expected)
    assert opt.state[w]["step"].item() == 10
