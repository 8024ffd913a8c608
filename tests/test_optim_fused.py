"""The multi-tensor Sophia-H update kernel (ttt_flash.kernels.optim): on the CPU under the
Triton interpreter against the update as PyTorch operations (SophiaH's own path for CPU
tensors), its table cache, when it applies; on the GPU, SophiaH takes it and stays equal to the
CPU update and to its captured replay."""

import os

import pytest
import torch

from ttt_flash.kernels import optim as fused
from ttt_flash.second_order.optim import SophiaH

SHAPES = [(3, 5), (fused.BLOCK + 7,), (2, fused.BLOCK), (1,)]


def _tensors(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda s, scale=1.0: (torch.randn(s, generator=g) * scale).to(device)  # noqa: E731
    params = [make(s) for s in SHAPES]
    grads = [make(s) for s in SHAPES]
    ms = [make(s, 0.1) for s in SHAPES]
    hs = [make(s).abs() * 2 for s in SHAPES]
    hs[0][0, 0] = 0.0  # an unestimated coordinate: the sign step
    hs[1][:5] = -1.0  # negative curvature: the sign step
    return params, grads, ms, hs


def _by_operations(params, grads, ms, hs, decay, neg_lr, beta1, rho, eps, weight_decay):
    """The update as SophiaH's PyTorch operations, one tensor at a time; clipped counts."""
    counts = []
    for p, g, m, h in zip(params, grads, ms, hs):
        if weight_decay:
            p.mul_(decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        ratio = (m.abs() / (rho * h).clamp_min(eps)).clamp_max_(1.0)
        counts.append(int((ratio >= 1.0).sum()))
        p.addcmul_(m.sign().mul_(neg_lr), ratio)
    return counts


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                       reason="runs on a GPU or under the Triton interpreter")


@needs_interpreter
@pytest.mark.parametrize("weight_decay", [True, False])
def test_one_launch_updates_every_tensor_as_the_operations_do(weight_decay):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decay, neg_lr = torch.tensor(0.98, device=device), torch.tensor(-0.01, device=device)
    args = (0.965, 0.04, 1e-15)
    expected = _tensors()
    counts_expected = _by_operations(*expected, decay.cpu(), neg_lr.cpu(), *args, weight_decay)
    got = _tensors(device)
    counts = fused.sophia_update_(*got, decay, neg_lr, *args, weight_decay)
    assert counts.tolist() == counts_expected and 0 < sum(counts_expected) < sum(p.numel() for p in got[0])
    for e_list, g_list in zip(expected, got):
        for e, g in zip(e_list, g_list):
            torch.testing.assert_close(g.cpu(), e, rtol=2e-6, atol=1e-7)
    # the coordinates without a positive curvature took the sign step: moved by exactly lr
    before = _tensors()[0]
    if not weight_decay:
        assert torch.allclose((got[0][1][:5].cpu() - before[1][:5]).abs(), torch.full((5,), 0.01))


@needs_interpreter
def test_the_table_of_a_list_is_made_once_and_the_cache_is_bounded(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fused, "_TABLES", type(fused._TABLES)())
    monkeypatch.setattr(fused, "MAX_TABLES", 2)
    one = torch.tensor(1.0, device=device)
    lists = [_tensors(device, seed) for seed in range(3)]
    first = fused._table(*lists[0])
    assert fused._table(*lists[0]) is first  # same tensors: the same table
    table, n_tensors, n_programs = first
    assert n_tensors == len(SHAPES) and n_programs == sum(-(-p.numel() // fused.BLOCK) for p in lists[0][0])
    fused.sophia_update_(*lists[1], one, -one, 0.9, 0.04, 1e-15, False)
    fused.sophia_update_(*lists[2], one, -one, 0.9, 0.04, 1e-15, False)
    assert len(fused._TABLES) == 2 and fused._table(*lists[0]) is not first  # the oldest was dropped


def test_it_applies_to_float32_contiguous_plain_tensors_on_one_device():
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    x = torch.zeros(4, 4)
    assert fused.fused_update_applies([x], [x.clone()]) == (interpret or torch.cuda.is_available() and x.is_cuda)
    assert not fused.fused_update_applies([x.double()], [x.double()])
    assert not fused.fused_update_applies([x.t()], [x])  # not contiguous
    assert not fused.fused_update_applies([x], [x.half()])


@pytest.mark.gpu
def test_sophia_on_cuda_takes_the_kernel_and_matches_the_cpu_update(monkeypatch):
    calls = []
    real = fused.sophia_update_

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr("ttt_flash.second_order.optim.sophia_update_", spy)

    def run(device):
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(torch.randn(*s).to(device)) for s in SHAPES]
        opt = SophiaH([{"params": ws[:2], "weight_decay": 0.1}, {"params": ws[2:], "weight_decay": 0.0}], lr=0.05, k=2)
        for i in range(5):
            opt.zero_grad()
            loss = sum((w.sin() ** 2).sum() * (j + 1) for j, w in enumerate(ws))
            loss.backward(create_graph=opt.hessian_due)
            if opt.hessian_due:
                opt.update_hessian(generator=torch.Generator().manual_seed(i))
            opt.step()
        return [w.detach().cpu() for w in ws], opt.clip_fraction.cpu()

    cpu_ws, cpu_clip = run("cpu")
    assert not calls
    gpu_ws, gpu_clip = run("cuda")
    assert calls == [2, 2] * 5  # each group in one launch, every step
    for a, b in zip(cpu_ws, gpu_ws):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert gpu_clip.item() == pytest.approx(cpu_clip.item(), abs=0.02)


@pytest.mark.gpu
def test_a_captured_update_replays_its_table_and_a_new_list_cannot_be_captured():
    tensors = _tensors("cuda")
    copy = [[t.clone() for t in ts] for ts in tensors]
    decay, neg_lr = torch.tensor(0.99, device="cuda"), torch.tensor(-0.01, device="cuda")
    fused.sophia_update_(*tensors, decay, neg_lr, 0.9, 0.04, 1e-15, True)  # warm-up: the table is made
    key = fused.table_key(*tensors)
    # the warm-up made the table (or found one of a freed list at the same addresses, kept by
    # an earlier capture in this process: the same table)
    assert key in fused._TABLES or key in fused._CAPTURED
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.sophia_update_(*tensors, decay, neg_lr, 0.9, 0.04, 1e-15, True)
    # other tests in the process may have captured tables of their own: look for this one
    assert key in fused._CAPTURED and key not in fused._TABLES
    for _ in range(3):
        fused.sophia_update_(*copy, decay, neg_lr, 0.9, 0.04, 1e-15, True)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(tensors[0] + tensors[2], copy[0] + copy[2]):
        assert torch.equal(a, b)
    fresh = _tensors("cuda", seed=5)
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused.sophia_update_(*fresh, decay, neg_lr, 0.9, 0.04, 1e-15, True)
