"""Third- and fourth-order derivatives through flash_attention (the BoB differentiated by
blockwise recomputation, ``reference.bob_vjp`` / ``bob_jvp``) against materialised attention
differentiated by autograd and by torch.func, float64, <= 1e-10 relative to the size of the
result; gradgradcheck of the BoB's outputs; no N_q x N_k tensor in the recomputation; MAML
over a memory-layer network (third order) against the math path; the CPU recipe's smoke run."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention.reference import composers, recompute
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen

F64 = torch.float64
TOL = 1e-10

# (H_q, H_kv, N_q, N_k, D, causal, window)
VARIANTS = [
    pytest.param((2, 2, 5, 5, 3, False, None), id="N5-d3"),
    pytest.param((2, 2, 6, 6, 3, True, None), id="N6-d3-causal"),
    pytest.param((2, 2, 7, 7, 3, True, 3), id="N7-d3-window3"),
    pytest.param((4, 2, 5, 5, 3, False, None), id="N5-d3-gqa2"),
    pytest.param((2, 1, 4, 7, 3, True, None), id="Nq4-Nk7-causal-mqa"),
    pytest.param((2, 2, 7, 4, 3, True, None), id="Nq7-Nk4-causal-rows-without-keys"),
]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # blocks of one or two query rows: every derivative crosses block boundaries
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", 1)


def _inputs(hq, hkv, nq, nk, d, b=1, dtype=F64):
    return [torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
            for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]


def _close(ours, ref, tol=TOL):
    for a, b in zip(ours, ref):
        scale = max(1.0, b.abs().max().item())
        assert torch.isfinite(a).all()
        err = (a - b).abs().max().item() / scale
        assert err <= tol, f"error {err:.3g} > {tol}"


def _third(attn, x, weights):
    """∂/∂x of Σ w₃∘(∂/∂x Σ w₂∘sin(∂/∂x Σ w₁∘O))²: a third derivative with nonlinear
    scalarisations in between (so every cotangent and tangent slot is exercised)."""
    w1, w2, w3 = weights
    o = attn(*x)
    g = torch.autograd.grad((o * w1).sum(), x, create_graph=True)
    h = torch.autograd.grad(sum((a.sin() * w).sum() for a, w in zip(g, w2)), x, create_graph=True)
    return torch.autograd.grad(sum((a.square() * w).sum() for a, w in zip(h, w3)), x)


def _weights(x, out_shape):
    return (torch.randn(out_shape, dtype=F64), [torch.randn_like(a) for a in x],
            [torch.randn_like(a) for a in x])


@pytest.mark.parametrize("case", VARIANTS)
def test_third_derivative_matches_materialised_autograd(case):
    hq, hkv, nq, nk, d, causal, window = case
    x = _inputs(hq, hkv, nq, nk, d)
    w = _weights(x, x[0].shape)
    ours = _third(lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window), x, w)
    ref = _third(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window), x, w)
    _close(ours, ref)


@pytest.mark.parametrize("case", VARIANTS)
def test_jacrev_of_jacrev_of_jacrev(case, monkeypatch):
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", 1 << 25)  # one block (speed)
    hq, hkv, nq, nk, d, causal, window = case
    # the third derivative has (3·numel)³ entries: 3 or 4 positions, keeping N_q vs N_k
    hq, nq, nk = min(hq, 2), min(nq, 3 + (nq > nk)), min(nk, 3 + (nk > nq))
    x = [a.detach() for a in _inputs(hq, min(hkv, hq), nq, nk, 2)]
    sizes = [a.numel() for a in x]
    w = torch.randn(x[0].shape, dtype=F64)

    def scalar(attn):
        def f(flat):
            q, k, v = (t.view_as(a) for t, a in zip(flat.split(sizes), x))
            return (attn(q, k, v, causal=causal, window=window).tanh() * w).sum()
        return f

    flat = torch.cat([a.reshape(-1) for a in x])
    ours = jacrev(jacrev(jacrev(scalar(flash_attention))))(flat)
    ref = jacrev(jacrev(jacrev(scalar(naive_attention))))(flat)
    assert ours.shape == (flat.numel(),) * 3
    _close([ours], [ref])


@pytest.mark.parametrize("case", VARIANTS[1:4])
def test_forward_mode_jvp_of_a_second_derivative(case):
    """torch.func.jvp of an HVP-like second derivative, jacfwd(jacrev(jacrev)) and
    torch.autograd.forward_ad through a create_graph double backward."""
    hq, hkv, nq, nk, d, causal, window = case
    x = [a.detach() for a in _inputs(hq, hkv, nq, nk, d)]
    t = [torch.randn_like(a) for a in x]
    w = torch.randn(x[0].shape, dtype=F64)

    def second(attn):
        def f(q, k, v):
            g = grad(lambda q, k, v: (attn(q, k, v, causal=causal, window=window) * w).sum(),
                     argnums=(0, 1, 2))(q, k, v)
            return sum((a.sin()).sum() for a in g)
        return grad(f, argnums=(0, 1, 2))

    _close(jvp(second(flash_attention), tuple(x), tuple(t))[1], jvp(second(naive_attention), tuple(x), tuple(t))[1])

    small = [a[:, :1, :3].contiguous() for a in x]
    f = lambda attn: lambda q: (attn(q, small[1], small[2], causal=causal, window=window) * w[:, :1, :3]).sum()  # noqa: E731
    _close([jacfwd(jacrev(jacrev(f(flash_attention))))(small[0])],
           [jacfwd(jacrev(jacrev(f(naive_attention))))(small[0])])

    def dual(attn):
        xs = [a.clone().requires_grad_() for a in x]
        with fwAD.dual_level():
            q = fwAD.make_dual(xs[0], t[0])
            o = attn(q, xs[1], xs[2], causal=causal, window=window)
            g = torch.autograd.grad((o * w).sum(), (q, xs[1], xs[2]), create_graph=True)
            h = torch.autograd.grad(sum(a.sin().sum() for a in g), (q, xs[1], xs[2]), create_graph=True)
            return [fwAD.unpack_dual(a).tangent for a in h]

    _close(dual(flash_attention), dual(naive_attention))


def _varlen_case():
    # lengths (q, k): (3, 3), (0, 2) empty queries, (4, 0) rows with no key, (5, 3) causal
    # with more queries than keys (rows without keys)
    cq = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)
    ck = torch.tensor([0, 3, 5, 5, 8], dtype=torch.int32)
    x = [torch.randn(12, 4, 3, dtype=F64, requires_grad=True)] + [
        torch.randn(8, 2, 3, dtype=F64, requires_grad=True) for _ in range(2)]
    ours = lambda q, k, v: flash_attention_varlen(q, k, v, cq, ck, 5, 3, causal=True)  # noqa: E731
    naive = lambda q, k, v: naive_attention_varlen(q, k, v, cq, ck, causal=True)  # noqa: E731
    return ours, naive, x


def test_varlen_third_and_jvp_of_second():
    ours, naive, x = _varlen_case()
    w = _weights(x, x[0].shape)
    _close(_third(ours, x, w), _third(naive, x, w))
    xd = tuple(a.detach() for a in x)
    t = tuple(torch.randn_like(a) for a in xd)

    def second(attn):
        def f(q, k, v):
            g = grad(lambda q, k, v: (attn(q, k, v) * w[0]).sum(), argnums=(0, 1, 2))(q, k, v)
            return sum((a.sin() * b).sum() for a, b in zip(g, w[1]))
        return grad(f, argnums=(0, 1, 2))

    _close(jvp(second(ours), xd, t)[1], jvp(second(naive), xd, t)[1])


def _bob(attn):
    """(q, k, v, dO, U_Q, U_K, U_V) -> the BoB's outputs (Q̄, K̄, V̄, dŌ), through autograd."""
    def f(q, k, v, do, uq, uk, uv):
        o = attn(q, k, v)
        g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        inner = sum((a * b).sum() for a, b in zip(g, (uq, uk, uv)))
        return torch.autograd.grad(inner, (q, k, v, do), create_graph=True)
    return f


# (H_q, H_kv, N_q, N_k, causal, window): small, for the finite differences
GRADCHECK = [
    pytest.param((2, 1, 4, 4, True, 2), id="N4-window2-mqa"),
    pytest.param((1, 1, 4, 3, True, None), id="Nq4-Nk3-causal-rows-without-keys"),
]


@pytest.mark.parametrize("case", GRADCHECK)
def test_gradgradcheck_of_the_bob_outputs(case, monkeypatch):
    """gradcheck (third order) and gradgradcheck (fourth order) of (Q̄, K̄, V̄, dŌ)."""
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", 3 * case[3])  # blocks of 3 rows
    hq, hkv, nq, nk, causal, window = case
    q, k, v = _inputs(hq, hkv, nq, nk, 2)
    do, uq = (torch.randn_like(q).requires_grad_() for _ in range(2))
    uk, uv = (torch.randn_like(k).requires_grad_() for _ in range(2))
    f = _bob(lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window))
    args = (q, k, v, do, uq, uk, uv)
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_fourth_derivative_matches_materialised():
    x = _inputs(2, 1, 5, 6, 3)
    w = _weights(x, x[0].shape)

    def fourth(attn):
        o = attn(*x, causal=True)
        g = torch.autograd.grad((o * w[0]).sum(), x, create_graph=True)
        h = torch.autograd.grad(sum((a.sin() * b).sum() for a, b in zip(g, w[1])), x, create_graph=True)
        t = torch.autograd.grad(sum((a.square() * b).sum() for a, b in zip(h, w[2])), x, create_graph=True)
        return torch.autograd.grad(sum(a.cos().sum() for a in t), x)

    _close(fourth(flash_attention), fourth(naive_attention))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_third_derivative_every_dtype(dtype):
    """Lower precisions: the third derivative against float64 materialised attention, within
    what the dtype's rounding allows (computed in float32, cast back)."""
    x64 = _inputs(2, 1, 6, 6, 4)
    x = [a.detach().to(dtype).requires_grad_() for a in x64]
    w = _weights(x64, x64[0].shape)
    wd = (w[0].to(dtype), [a.to(dtype) for a in w[1]], [a.to(dtype) for a in w[2]])
    ours = _third(lambda q, k, v: flash_attention(q, k, v, causal=True), x, wd)
    ref = _third(lambda q, k, v: naive_attention(q, k, v, causal=True),
                 [a.detach().to(dtype).to(F64).requires_grad_() for a in x64],
                 (wd[0].to(F64), [a.to(F64) for a in wd[1]], [a.to(F64) for a in wd[2]]))
    tol = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 2e-1}[dtype]
    for a, b in zip(ours, ref):
        assert a.dtype == dtype
        assert (a.double() - b).norm() <= tol * b.norm()


def test_triton_backend_third_derivative():
    """backend='triton' (the interpreter on the CPU): the BoB runs the kernels, its
    derivative the blockwise recomputation; float32 against float64 materialised."""
    x64 = _inputs(2, 1, 17, 17, 16)
    x = [a.detach().float().requires_grad_() for a in x64]
    w = _weights(x64, x64[0].shape)
    wf = (w[0].float(), [a.float() for a in w[1]], [a.float() for a in w[2]])
    ours = _third(lambda q, k, v: flash_attention(q, k, v, causal=True, backend="triton"), x, wf)
    ref = _third(lambda q, k, v: naive_attention(q, k, v, causal=True), x64, w)
    for a, b in zip(ours, ref):
        assert (a.double() - b).norm() <= 1e-4 * b.norm()


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window4"])
def test_recomputation_holds_no_full_score_matrix(window, monkeypatch):
    """Every tensor the third derivative's blockwise recomputation creates (the vjp of the
    BoB) holds at most one block of rows x N_k scores per head, never N_q x N_k; with a
    sliding window a block reads only rows + window keys (its largest tensors are then the
    N_k x D key gradients)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    vjp = recompute.bob_vjp

    def watched(*args, **kwargs):
        with Largest():
            return vjp(*args, **kwargs)

    n, rows = 64, 8
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", rows * n)
    monkeypatch.setattr(recompute, "bob_vjp", watched)
    x = _inputs(1, 1, n, n, 4)
    w = _weights(x, x[0].shape)
    ours = _third(lambda q, k, v: flash_attention(q, k, v, causal=True, window=window), x, w)
    assert 0 < Largest.most <= (rows * n if window is None else n * 4)
    _close(ours, _third(lambda q, k, v: naive_attention(q, k, v, causal=True, window=window), x, w))


def _bench():
    """scripts/third_order_bench.py as a module (its LiveBytes account and its worker)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "third_order_bench.py"
    spec = importlib.util.spec_from_file_location("third_order_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("present", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (1, 1, 1)],
                         ids=lambda p: "U" + "".join(n for n, b in zip("qkv", p) if b))
def test_lean_block_equals_the_closed_form(present):
    """The recomputation's rearranged BoB (_bob_rows_lean) gives the composer's closed form
    (_bob_rows) for every subset of U_Q, U_K, U_V, rows without keys included."""
    g = torch.Generator().manual_seed(0)
    hq, nq, nk, d, scale = 2, 7, 4, 3, 0.6
    q, do, uq = (torch.randn(1, hq, nq, d, generator=g, dtype=F64) for _ in range(3))
    k, v, uk, uv = (torch.randn(1, hq, nk, d, generator=g, dtype=F64) for _ in range(4))
    uq, uk, uv = (u if b else None for u, b in zip((uq, uk, uv), present))
    s = (q @ k.transpose(-1, -2)) * scale
    mask = composers.attention_mask(nq, nk, causal=True, window=None)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")).masked_fill(~mask.any(-1, keepdim=True), 0), -1)
    p = p.masked_fill(~mask.any(-1, keepdim=True), 0)
    assert (p.sum(-1) == 0).any()  # rows that see no key
    delta = (do * (p @ v)).sum(-1)
    lean = recompute._bob_rows_lean(p, q, do, uq, k, v, uk, uv, delta, scale)
    full = composers._bob_rows(p, q, do, uq, k, v, uk, uv, delta, scale)
    _close(lean, full, tol=1e-13)


def test_live_bytes_account():
    """LiveBytes adds a storage's bytes when an op creates it and takes them off when it is
    freed (views and in-place results share the storage); an opaque function counts as its
    outputs only."""
    live = _bench().LiveBytes()
    a = torch.ones(1000, dtype=F64)  # before the account: not counted
    with live.mode:
        b = a * 2
        c = b.view(10, 100).t()
        b.add_(1)
        assert live.live == live.peak == 8000
        del b
        assert live.live == 8000  # c keeps the storage
        del c
        assert live.live == 0 and live.peak == 8000

    class Mod:
        @staticmethod
        def f(x):
            scratch = x.repeat(4)  # 32,000 bytes a kernel would keep in registers
            return (scratch[:1000] + 1,)

    undo = live.opaque(Mod, ("f",))
    with live.mode:
        out = Mod.f(a)
    undo()
    assert live.peak == 8000 and live.live == 8000
    del out
    assert live.live == 0


def test_recompute_block_rule(monkeypatch):
    """Score blocks the size of the queries, within the floor and the cap."""
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", 1 << 25)
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_FLOOR", 1 << 20)
    rows = recompute._recompute_rows
    assert rows(8, 4096, 512, 64) == 512          # 8·512·512 = 8·4096·64 elements
    assert rows(8, 16384, 512, 64) == 2048
    assert rows(8, 256, 512, 64) == 256           # the floor: 2^20 elements
    assert rows(8, 65536, 65536, 64) == 64        # the cap: 2^25 elements
    assert rows(8, 4, 10**9, 64) == 1


def test_third_derivative_working_set_is_a_few_score_blocks(monkeypatch):
    """The vjp of the BoB (the third derivative) keeps at most 14 score-shaped blocks' worth of
    its compute dtype alive above what it was given (its graph saves 7 score-shaped tensors; the
    backward's gradients and the key-sized tensors are the rest), where differentiating the
    closed form as written with torch.func.vjp kept 21.6 at this shape."""
    live = _bench().LiveBytes()
    hq, nq, nk, d, rows = 2, 64, 512, 2, 16
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", hq * rows * nk)
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_FLOOR", hq * rows * nk)
    g = torch.Generator().manual_seed(0)
    q, do, uq, cq, cdo = (torch.randn(1, hq, nq, d, generator=g, dtype=F64) for _ in range(5))
    k, v, uk, uv, ck, cv = (torch.randn(1, hq, nk, d, generator=g, dtype=F64) for _ in range(6))
    kw = dict(scale=d ** -0.5, causal=False, window=None)
    with live.mode:
        start = live.live
        ours = recompute.bob_vjp((q, k, v, do, uq, uk, uv), (cq, ck, cv, cdo), (True,) * 7, **kw)
    block = hq * rows * nk * 8
    assert live.peak - start <= 14 * block, f"{(live.peak - start) / block:.1f} blocks"
    # the same vjp through autograd over the materialised BoB (one block)
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_ELEMENTS", 1 << 30)
    monkeypatch.setattr(recompute, "RECOMPUTE_BLOCK_FLOOR", 1 << 30)
    xs = [t.clone().requires_grad_() for t in (q, k, v, do, uq, uk, uv)]
    out = _bob(lambda a, b, c: naive_attention(a, b, c))(*xs[:4], *xs[4:])
    ref = torch.autograd.grad(out, xs, (cq, ck, cv, cdo))
    _close(ours, ref)


def test_bench_worker_reports_the_third_derivative_memory(capsys):
    """One CPU row of scripts/third_order_bench.py: the live-bytes peak, the memory when the
    third derivative starts and its peak inside, in that order of size."""
    import json

    bench = _bench()
    bench.main(["--worker-n", "32", "--worker-attention", "ttt_flash@auto", "--device", "cpu", "--dtype",
                "float32", "--d-model", "16", "--heads", "2", "--slots", "4", "--reps", "1"])
    row = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert row["status"] == "ok" and row["recompute"] == "auto"
    assert 0 < row["third_entry_gib"] < row["third_peak_gib"] <= row["peak_gib"]
    parts = row["peak_composition_mib"]  # what was alive at the peak, largest first
    assert parts and parts[0][2] >= parts[-1][2] and sum(p[2] for p in parts) <= 1.01 * 1024 * row["peak_gib"] + 1


# --------------------------------------------------------------------------- MAML over a memory layer


def _memory_net(attention, first_order=False, seed=0):
    from ttt_flash.models import NetConfig

    torch.manual_seed(seed)
    return NetConfig(kind="memory", in_dim=6, d_model=8, n_heads=2, attention=attention, memory_slots=4,
                     memory_chunk=4, memory_first_order=first_order).build().double()


def _task(seed=1, n=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, w, generator=g, dtype=F64) for w in (6, 1, 6, 1)]


def _count_third_order(monkeypatch):
    calls = []
    vjp = recompute.bob_vjp

    def counted(*args, **kwargs):
        calls.append(1)
        return vjp(*args, **kwargs)

    monkeypatch.setattr(recompute, "bob_vjp", counted)
    return calls


def test_maml_over_memory_layer_meta_gradient_equals_math(monkeypatch):
    """meta.inner_loop + meta.functional_loss over MemoryRegressor (second-order writes):
    the meta-gradient (third order through attention) equals the math path's."""
    from torch.nn.functional import mse_loss

    from ttt_flash.meta import functional_loss, inner_loop

    calls = _count_third_order(monkeypatch)
    xs, ys, xq, yq = _task()

    def meta_grad(net):
        params = dict(net.named_parameters())
        fast = inner_loop(net, params, mse_loss, (xs, ys), 2, 0.1)
        return torch.autograd.grad(functional_loss(net, fast, mse_loss, (xq, yq)), list(params.values()))

    ours = meta_grad(_memory_net("ttt_flash"))
    assert calls, "the third-order path did not run"
    ref = meta_grad(_memory_net("math"))
    _close(ours, ref)
    # first-order writes drop the third-order terms: a different meta-gradient
    fo = meta_grad(_memory_net("ttt_flash", first_order=True))
    assert max((a - b).abs().max().item() for a, b in zip(fo, ref)) > 1e-4


def test_lightning_maml_over_memory_layer_equals_math(monkeypatch):
    """The Lightning MAML module's per-task step (adapt, score) over a memory-layer network."""
    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig

    calls = _count_third_order(monkeypatch)
    xs, ys, xq, yq = _task(2)
    grads = []
    state = None
    for attention in ("ttt_flash", "math"):
        net = NetConfig(kind="memory", in_dim=6, d_model=8, n_heads=2, attention=attention, memory_slots=4,
                        memory_chunk=4)
        module = MAML(net=net, inner_steps=1, inner_lr=0.1, loss="mse").double()
        if state is None:
            state = module.state_dict()
        module.load_state_dict(state)
        fast = module.adapt((xs, ys), 1, first_order=False)
        loss = module._score(fast, (xq, yq))["loss"]
        grads.append(torch.autograd.grad(loss, list(module.parameters())))
    assert calls
    _close(grads[0], grads[1])


def test_memory_layer_recipe_fast_dev_run(monkeypatch, tmp_path):
    """recipes/maml_memory_layer.yaml: one meta-update and one validation batch, through the
    third-order path."""
    from pathlib import Path

    from ttt_flash.cli import main

    calls = _count_third_order(monkeypatch)
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "maml_memory_layer.yaml"
    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--config", str(recipe), "--trainer.fast_dev_run=true",
                 f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"])
    assert code == 0 and calls


@pytest.mark.parametrize("mechanism", ["gradmem", "fast_weight"])
def test_maml_over_gradmem_and_fast_weight_ttt_equals_math(mechanism, monkeypatch):
    """GradMem and FastWeightTTT (second-order inner writes) inside meta.inner_loop: the
    meta-gradient through ttt_flash equals the one through materialised attention."""
    import torch.nn.functional as F

    from ttt_flash.memory import FastWeightTTT, GradMem
    from ttt_flash.meta import functional_loss, inner_loop
    from ttt_flash.models import GPT, GPTConfig

    calls = _count_third_order(monkeypatch)

    def build(attention):
        torch.manual_seed(0)
        # two layers: the fast MLP of layer 0 feeds layer 1's attention, so the write's
        # gradient runs through an attention backward
        gpt = GPT(GPTConfig.tiny(vocab_size=11, n_layer=2, n_head=2, d_model=8, attention=attention,
                                 window=4 if mechanism == "fast_weight" else None)).double()
        if mechanism == "gradmem":
            return GradMem(gpt, memory_tokens=2, inner_steps=1, inner_lr=0.5)
        return FastWeightTTT(gpt, fast_layers=[0], chunk_size=4, inner_steps=1, inner_lr=0.5)

    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 11, (2, 8), generator=g)
    query = torch.randint(0, 11, (2, 3), generator=g)
    qt = torch.randint(0, 11, (2, 3), generator=g)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def meta_grad(model):
        params = {n: p for n, p in model.named_parameters() if n.startswith("model.")}
        batch = ((ctx, ctx.roll(-1, 1), query), qt)
        fast = inner_loop(model, params, loss_fn, batch, 1, 0.1)
        return torch.autograd.grad(functional_loss(model, fast, loss_fn, batch), list(params.values()),
                                   allow_unused=True, materialize_grads=True)

    ours = meta_grad(build("ttt_flash"))
    assert calls
    _close(ours, meta_grad(build("math")))


def test_docs_memory_layer_example_runs(monkeypatch, tmp_path):
    """The example of docs/memory.md ("a memory layer in your own model") runs as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "memory.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "class MyModel" in b]
    assert len(blocks) == 1
    calls = _count_third_order(monkeypatch)
    exec(compile(blocks[0], "docs/memory.md", "exec"), {"__name__": "docs_example"})
    assert calls


def test_hvp_inside_a_dual_level_has_the_exact_tangent():
    """A create_graph=False Hessian-vector product run inside a forward_ad level: its tangent
    (a third derivative) is exact, not dropped."""
    x = [a.detach() for a in _inputs(2, 1, 5, 6, 3)]
    t = torch.randn_like(x[0])
    w = torch.randn(x[0].shape, dtype=F64)
    vecs = [torch.randn_like(a) for a in x]

    def tangent(attn):
        xs = [a.clone().requires_grad_() for a in x]
        with fwAD.dual_level():
            q = fwAD.make_dual(xs[0], t)
            o = attn(q, xs[1], xs[2], causal=True)
            g = torch.autograd.grad((o * w).sum(), (q, xs[1], xs[2]), create_graph=True)
            h = torch.autograd.grad(g, (q, xs[1], xs[2]), vecs)
            return [fwAD.unpack_dual(a).tangent for a in h]

    ours = tangent(flash_attention)
    assert all(a is not None for a in ours)
    _close(ours, tangent(naive_attention))
