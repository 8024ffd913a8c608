"""GPU tests of the Triton kernels (bf16, fp16, fp32) against a float64 reference.

For every variant the full chain runs on the kernels: ``attn_fwd`` -> ``attn_bwd`` (fed
the kernel's own o, lse) -> ``attn_bob`` (fed the kernel's delta; the default precise form,
and the affine form in bf16); every pass is atomic-free. Also the fp32 / bf16 large-logit
sweep and bitwise reproducibility of ``deterministic=True``. Each output's max error
against float64 autograd through ``naive_attention`` must be at most 2x the error of
PyTorch's own math path in the same dtype, plus one rounding unit at the output's scale.
Also: bf16 relative L2 error of the four BoB outputs at the GPT-2 shape (N=1024, H=12,
d=64) <= 2.5e-3, and a forward over a tensor of >= 2^31 elements (64-bit offsets).

Self-contained and quick: the kernel variants are compiled in parallel subprocesses
first (filling Triton's on-disk cache), since compilation dominates the run time.
Set TTT_FLASH_NO_PARALLEL_WARMUP=1 to skip that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash.attention import reference  # noqa: E402
from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, host  # noqa: E402
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen  # noqa: E402

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# one unit of rounding at the output's scale
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20}


# --------------------------------------------------------------------------- cases

CASES = {
    # id: dict(b, hq, hkv, nq, nk, d, causal, window) or varlen dict(lens_q, lens_k, ...)
    "Nq200-Nk200-d64-b2-gqa2": dict(b=2, hq=4, hkv=2, nq=200, nk=200, d=64, causal=False),
    "Nq150-Nk250-d64-causal": dict(b=1, hq=2, hkv=2, nq=150, nk=250, d=64, causal=True),
    "Nq250-Nk150-d64-causal-emptyrows": dict(b=1, hq=2, hkv=2, nq=250, nk=150, d=64, causal=True),
    "Nq180-Nk160-d64-window40-mqa4": dict(b=1, hq=4, hkv=1, nq=180, nk=160, d=64, causal=True,
                                           window=40),
    "varlen-d128-causal-gqa2": dict(lens_q=[100, 0, 37, 200, 1], lens_k=[120, 0, 0, 190, 9],
                                    hq=4, hkv=2, d=128, causal=True),
    "varlen-d16-noncausal": dict(lens_q=[33, 0, 140], lens_k=[50, 7, 0], hq=2, hkv=2, d=16,
                                 causal=False),
    "N130-d96-causal-gqa3": dict(b=1, hq=3, hkv=1, nq=130, nk=130, d=96, causal=True),
    "Nq100-Nk140-d256-window64": dict(b=1, hq=2, hkv=2, nq=100, nk=140, d=256, causal=True,
                                      window=64),
}
PLAN = (  # (case, dtype, precise): the default path (precise) for every case and dtype,
    # and the opt-in affine path (precise_bob=False) in bf16
    [(c, dt, True) for c in CASES for dt in ("bf16", "fp16", "fp32")]
    + [(c, "bf16", False) for c in CASES]
)


def make_tensors(spec, dtype, seed=0):
    """q, k, v, do, uq, uk, uv on the GPU, and the keyword arguments of the composers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kw = dict(scale=spec["d"] ** -0.5, causal=spec["causal"], window=spec.get("window"))
    if "lens_q" in spec:
        cu_q = torch.tensor([0] + spec["lens_q"]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + spec["lens_k"]).cumsum(0).to(torch.int32)
        qs = (int(cu_q[-1]), spec["hq"], spec["d"])
        ks = (int(cu_k[-1]), spec["hkv"], spec["d"])
        kw.update(cu_seqlens_q=cu_q.to(DEV), cu_seqlens_k=cu_k.to(DEV),
                  max_seqlen_q=max(spec["lens_q"]), max_seqlen_k=max(spec["lens_k"]))
    else:
        qs = (spec["b"], spec["hq"], spec["nq"], spec["d"])
        ks = (spec["b"], spec["hkv"], spec["nk"], spec["d"])
    ts = [torch.randn(s, generator=g).to(device=DEV, dtype=dtype) for s in (qs, ks, ks, qs, qs, ks, ks)]
    return ts, kw


def torch_chain(ts, kw, dtype):
    """o, lse, dq, dk, dv, qb, kb, vb, dob by autograd through the materialised math path."""
    q, k, v, do, uq, uk, uv = (t.to(dtype).detach().requires_grad_(i < 4) for i, t in enumerate(ts))
    mask_kw = dict(scale=kw["scale"], causal=kw["causal"], window=kw["window"])
    if "cu_seqlens_q" in kw:
        o = naive_attention_varlen(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], **mask_kw)
    else:
        o = naive_attention(q, k, v, **mask_kw)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    total = (dq * uq).sum() + (dk * uk).sum() + (dv * uv).sum()
    qb, kb, vb, dob = torch.autograd.grad(total, (q, k, v, do))
    return dict(o=o, dq=dq, dk=dk, dv=dv, qb=qb, kb=kb, vb=vb, dob=dob)


def kernel_chain(ts, kw, precise=False, deterministic=True):
    q, k, v, do, uq, uk, uv = ts
    o, lse = attn_fwd(q, k, v, **kw)
    dq, dk, dv, delta = attn_bwd(q, k, v, o, lse, do, deterministic=deterministic, **kw)
    qb, kb, vb, dob = attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, precise=precise,
                               deterministic=deterministic, **kw)
    return dict(o=o, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv, qb=qb, kb=kb, vb=vb, dob=dob)


def ref_lse(ts, kw):
    """float64 log-sum-exp rows, layout of the kernel's lse."""
    q, k = ts[0].double(), ts[1].double()
    if "cu_seqlens_q" in kw:
        cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        out = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=DEV)
        for b in range(len(cq) - 1):
            if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
                qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
                ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
                out[:, cq[b]:cq[b + 1]] = _lse_dense(qs, ks, kw)[0]
        return out
    return _lse_dense(q, k, kw)


def _lse_dense(q, k, kw):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * kw["scale"]
    mask = reference.attention_mask(q.shape[-2], k.shape[-2], causal=kw["causal"],
                                    window=kw["window"], device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(s, dim=-1)


# --------------------------------------------------------------------------- warm-up


_WARM_CODE = r"""
import json, sys, torch
sys.path.insert(0, {here!r})
import test_kernels_gpu as t
for case, dt, precise in json.loads(sys.argv[1]):
    ts, kw = t.make_tensors(t.CASES[case], t.DTYPES[dt])
    t.kernel_chain(ts, kw, precise)
torch.cuda.synchronize()
"""


@pytest.fixture(scope="module", autouse=True)
def _parallel_compile():
    """Compile every (case, dtype) variant in subprocesses at once (best effort)."""
    if os.environ.get("TTT_FLASH_NO_PARALLEL_WARMUP"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    code = _WARM_CODE.format(here=here)
    plan = list(PLAN)
    workers = min(len(plan), max(1, (os.cpu_count() or 2) - 1), 12)
    chunks = [plan[i::workers] for i in range(workers)]

    def run(chunk):
        return subprocess.run([sys.executable, "-c", code, json.dumps(chunk)],
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(run, chunks))


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(host, "POISON_OUTPUTS", True)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case,dt,precise", [
    pytest.param(c, d, p, id=f"{c}-{d}" + ("" if p else "-affine")) for c, d, p in PLAN])
def test_chain_vs_float64(case, dt, precise):
    dtype = DTYPES[dt]
    spec = CASES[case]
    ts, kw = make_tensors(spec, dtype)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 baseline in true fp32
    try:
        ref = torch_chain(ts, kw, torch.float64)
        base = torch_chain(ts, kw, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    got = kernel_chain(ts, kw, precise)
    failures = []
    for name in ("o", "dq", "dk", "dv", "qb", "kb", "vb", "dob"):
        x, r, b = got[name], ref[name], base[name]
        assert x.dtype == dtype and x.shape == r.shape and x.is_contiguous(), name
        assert not torch.isnan(x).any(), f"{name}: NaN"
        mag = r.abs().max().item()
        err = (x.double() - r).abs().max().item()
        base_err = (b.double() - r).abs().max().item()
        tol = 2.0 * base_err + UNIT[dtype] * mag + 1e-6
        if not err <= tol:
            failures.append(f"{name}: err {err:.3e} > tol {tol:.3e} (math path {base_err:.3e}, max|ref| {mag:.3e})")
    lse, lse_ref = got["lse"], ref_lse(ts, kw)
    assert lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "lse: -inf rows differ"
    fin = torch.isfinite(lse_ref)
    if fin.any():
        lerr = (lse[fin].double() - lse_ref[fin]).abs().max().item()
        if lerr > 1e-4 * max(1.0, lse_ref[fin].abs().max().item()):
            failures.append(f"lse: err {lerr:.3e}")
    assert not failures, "\n".join(failures)


def test_bob_bf16_gpt2_shape_relative_l2():
    """N=1024, B=1, H=12, d=64, bf16: relative L2 error of each BoB output <= 2.5e-3 (the
    issue 3 target) for the affine and the precise (default) form, deterministic or not;
    <= 2.2e-3 with the hi + lo split of R and H switched on (measured ~1.9e-3 and ~1.7e-3
    for V̄)."""
    spec = dict(b=1, hq=12, hkv=12, nq=1024, nk=1024, d=64, causal=False)
    ts, kw = make_tensors(spec, torch.bfloat16, seed=1)
    ref = torch_chain(ts, kw, torch.float64)
    got = kernel_chain(ts, kw, precise=False)
    q, k, v, do, uq, uk, uv = ts

    def errors(res):
        return {n: ((x.double() - ref[n]).norm() / ref[n].norm()).item()
                for n, x in zip(("qb", "kb", "vb", "dob"), res)}

    errs = {n: ((got[n].double() - ref[n]).norm() / ref[n].norm()).item()
            for n in ("qb", "kb", "vb", "dob")}
    print("bf16 relative L2, affine:", {n: f"{e:.2e}" for n, e in errs.items()})
    assert all(e <= 2.5e-3 for e in errs.values()), errs
    precise = errors(attn_bob(q, k, v, got["o"], got["lse"], do, got["delta"], uq, uk, uv,
                              precise=True, **kw))
    print("bf16 relative L2, precise:", {n: f"{e:.2e}" for n, e in precise.items()})
    assert all(e <= 2.5e-3 for e in precise.values()), precise
    split = errors(attn_bob(q, k, v, got["o"], got["lse"], do, got["delta"], uq, uk, uv,
                            precise=True, split_row=True, split_col=True, **kw))
    print("bf16 relative L2, precise + split:", {n: f"{e:.2e}" for n, e in split.items()})
    assert all(split[n] <= min(precise[n], 2.2e-3) for n in split), (precise, split)


def test_deterministic_chain_bitwise_bf16():
    """flash_attention(deterministic=True): two chains bitwise identical (N=2048, causal)."""
    from ttt_flash import flash_attention

    g = torch.Generator(device="cpu").manual_seed(3)
    x = [torch.randn(1, 4, 2048, 64, generator=g).to(DEV, torch.bfloat16) for _ in range(7)]

    def chain():
        q, k, v = (t.clone().requires_grad_() for t in x[:3])
        o = flash_attention(q, k, v, causal=True, deterministic=True)
        gr = torch.autograd.grad(o, (q, k, v), x[3], create_graph=True)
        inner = sum((a * b).sum() for a, b in zip(gr, x[4:]))
        return [o, *gr, *torch.autograd.grad(inner, (q, k, v))]

    for a, b in zip(chain(), chain()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("n,d,qk_scale", [(24, 8, 24.0), (256, 64, 20.0)],
                         ids=["N24-d8-logit2600", "N256-d64-logit2000"])
def test_large_logits(n, d, qk_scale, causal, dt):
    """q, k scaled to max |logit| ~2,000: the relative error (max |error| / max |reference|)
    of each chain output against float64 on the same inputs is within max(4x the worst
    error of PyTorch's math chain in the same dtype, 1e-5), with either ``deterministic``."""
    from ttt_flash import flash_attention

    dtype = DTYPES[dt]
    g = torch.Generator(device="cpu").manual_seed(0)
    ts = [torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for _ in range(7)]
    ts[0], ts[1] = ts[0] * qk_scale, ts[1] * qk_scale
    ts = [t.to(dtype).double().to(DEV) for t in ts]
    logit = (ts[0] @ ts[1].transpose(-1, -2) * d**-0.5).abs().max().item()
    assert logit > 1000

    def chain(attn, xs):
        q, k, v, do = (t.detach().clone().requires_grad_() for t in xs[:4])
        o = attn(q, k, v)
        gr = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        inner = sum((a * b).sum() for a, b in zip(gr, xs[4:]))
        return [o.detach(), *(t.detach() for t in gr), *torch.autograd.grad(inner, (q, k, v, do))]

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        naive = lambda q, k, v: naive_attention(q, k, v, causal=causal)  # noqa: E731
        ref = chain(naive, ts)
        low = [t.to(dtype) for t in ts]
        base = chain(naive, low)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev

    def rel(a, r):
        return ((a.double() - r).abs().max() / r.abs().max()).item()

    tol = max(4 * max(rel(a, r) for a, r in zip(base, ref)), 1e-5)
    for det in (True, False):
        ours = chain(lambda q, k, v: flash_attention(q, k, v, causal=causal, deterministic=det),
                     low)
        errs = {nm: rel(a, r) for nm, a, r in zip(("o", "dq", "dk", "dv", "qb", "kb", "vb", "dob"),
                                                  ours, ref)}
        print(f"{dt} causal={causal} max|logit| {logit:.0f} det={det}: tol {tol:.1e}",
              {nm: f"{e:.1e}" for nm, e in errs.items()})
        assert all(e <= tol for e in errs.values()), (det, logit, tol, errs)


def test_bob_cotangent_subset_bf16():
    """A pruned specialisation compiled for the GPU: only U_V, only (K̄, dŌ) wanted."""
    spec = CASES["Nq150-Nk250-d64-causal"]
    ts, kw = make_tensors(spec, torch.bfloat16)
    q, k, v, do, uq, uk, uv = ts
    ts64 = [t.double() for t in ts]
    qd, kd, vd, dod = (t.clone().requires_grad_() for t in ts64[:4])
    o = naive_attention(qd, kd, vd, scale=kw["scale"], causal=True)
    _, _, dv = torch.autograd.grad(o, (qd, kd, vd), dod, create_graph=True)
    kb_ref, dob_ref = torch.autograd.grad((dv * ts64[6]).sum(), (kd, dod))
    o_k, lse = attn_fwd(q, k, v, **kw)
    _, _, _, delta = attn_bwd(q, k, v, o_k, lse, do, **kw)
    qb, kb, vb, dob = attn_bob(q, k, v, o_k, lse, do, delta, None, None, uv,
                               needs=(False, True, False, True), **kw)
    assert qb is None and vb is None
    for name, x, r in (("kb", kb, kb_ref), ("dob", dob, dob_ref)):
        rel = ((x.double() - r).norm() / r.norm()).item()
        assert rel < 1e-2, (name, rel)


def test_forward_int64_offsets():
    """q, k, v, o of 2^31 elements each (4 GiB in bf16): rows of the last batch/head."""
    b, h, n, d = 128, 16, 16384, 64  # = 2^31 elements
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip("needs ~20 GiB of free GPU memory")
    q = torch.empty((b, h, n, d), dtype=torch.bfloat16, device=DEV).normal_()
    k = torch.empty_like(q).normal_()
    v = torch.empty_like(q).normal_()
    assert q.numel() >= 2**31
    o, lse = attn_fwd(q, k, v, scale=d**-0.5, causal=True, window=None)
    rows = slice(n - 64, n)
    for bi, hi in ((b - 1, h - 1), (b // 2, 3)):
        qs = q[bi:bi + 1, hi:hi + 1, rows].double()
        ks, vs = k[bi:bi + 1, hi:hi + 1].double(), v[bi:bi + 1, hi:hi + 1].double()
        s = qs @ ks.transpose(-1, -2) * d**-0.5
        i = torch.arange(n - 64, n, device=DEV)[:, None]
        s = s.masked_fill(torch.arange(n, device=DEV)[None, :] > i, float("-inf"))
        ref = torch.softmax(s, -1) @ vs
        err = (o[bi:bi + 1, hi:hi + 1, rows].double() - ref).abs().max().item()
        assert err < 2e-2, (bi, hi, err)
        lerr = (lse[bi, hi, rows].double() - torch.logsumexp(s, -1)[0, 0]).abs().max().item()
        assert lerr < 1e-3, (bi, hi, lerr)
    del q, k, v, o, lse
    torch.cuda.empty_cache()
