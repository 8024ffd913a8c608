"""CPU tests of the choice between the Gluon (sm_90) passes and the Triton ones.

The verifiers of ``kernels/gluon/scope.py`` and the plans of ``kernels/plan.py`` are exercised
with the GPU capability, the interpreter check and the Gluon import mocked: the in-scope call
selects the table's Gluon tiles, and every condition outside the Gluon kernels' scope (or the
switch, or a tile override) selects Triton, with a reason. The call sites in ``attn_fwd``,
``attn_bwd`` and ``attn_bob`` are run under the interpreter with the real plans (told the tensors are on an
sm_90 device) and the Gluon launchers replaced by float64 implementations of their
documented formulas: the results must equal the Triton pass's, so the arguments handed over
mean what the Gluon kernels expect. Gluon itself is never compiled here (no GPU), and nothing
here needs it to import.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import re

import pytest
import torch

from ttt_flash.kernels import attn_bob, attn_fwd, configs, plan
from ttt_flash.kernels.host import Layout
from ttt_flash.kernels.gluon import scope

attn_bwd_mod = importlib.import_module("ttt_flash.kernels.bwd")
CUDA0 = torch.device("cuda", 0)
KINDS = ["fwd", "bwd_dq", "bwd_dkdv", "bob_col", "bob_stats", "bob_direct"]


@pytest.fixture(autouse=True)
def _fresh_plans():
    plan.clear_cache()
    yield
    plan.clear_cache()


@pytest.fixture
def sm90(monkeypatch):
    """Pretend: a capability-9.0 GPU, no interpreter, Gluon importable."""
    monkeypatch.setattr(plan, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(scope, "importable", lambda kind: True)


def _lay(b=1, h_q=2, h_kv=2, d=64, n_q=16384, n_k=16384, varlen=False):
    return Layout(varlen, b, h_q, h_kv, h_q // h_kv, d, n_q, n_k, b * n_q)


def _plan_pass(kind, lay=None, dtype=torch.bfloat16, device=CUDA0, window=False,
               contiguous=True, complete=True):
    """The plan's pass for ``kind`` (a ``plan.Pass``); ``complete``: the caller's own
    conditions for the Gluon pass hold (all three cotangents, every output wanted)."""
    lay = lay or _lay(d=min(d for k, d in configs.GLUON if k == kind))  # a head dim it covers
    if kind == "fwd":
        return plan.fwd(lay, dtype, device, window=window, contiguous=contiguous)
    if kind == "bwd_dkdv":
        return plan.bwd(lay, dtype, device, window=window, contiguous=contiguous).dkdv
    if kind == "bwd_dq":
        return plan.bwd(lay, dtype, device, window=window, contiguous=contiguous).dq
    needs = (True, True, True, True)
    if not complete:
        needs = {"bob_col": (True, False, True, True), "bob_direct": (True, True, True, False)
                 }.get(kind, needs)
    p = plan.bob(lay, dtype, device, window=window,
                 has_u=(True, True, True) if complete or kind != "bob_stats" else (False, True, True),
                 needs=needs, precise=True, known=(False, False), split_row=False,
                 split_col=False, contiguous=contiguous, rows_work=True, cols_work=True)
    return {"bob_col": p.col, "bob_stats": p.stats, "bob_direct": p.direct}[kind]


def _select(kind="bob_col", lay=None, dtype=torch.bfloat16, device=CUDA0, window=False,
            rowsum=False, contiguous=True, complete=True):
    """The Gluon tiles the plan takes for ``kind``, or None (Triton); ``rowsum`` forces the
    ρ correction on for the dtype."""
    with contextlib.ExitStack() as stack:
        if rowsum:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setitem(configs.ROWSUM_CORRECTION, dtype, True)
            plan.clear_cache()
        ps = _plan_pass(kind, lay, dtype, device, window, contiguous, complete)
        plan.clear_cache()
    if ps is None or not ps.gluon:
        return None
    return ps.tiles


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lay", [_lay(), _lay(b=2, h_q=12, h_kv=12, n_q=65536, n_k=65536),
                                 _lay(h_q=32, h_kv=8), _lay(h_q=4, h_kv=1),
                                 _lay(h_q=8, h_kv=8, d=128), _lay(h_q=32, h_kv=8, d=128)],
                         ids=["N16K", "N64K-H12-B2", "GQA-32-8", "MQA-4-1", "d128-H8",
                              "GQA-32-8-d128"])
def test_in_scope_selects_the_table_tiles(sm90, kind, dtype, lay):
    entry = configs.GLUON.get((kind, lay.head_dim))
    assert _select(kind, lay, dtype) == entry  # no entry at this head dim: Triton
    why = plan.explain(kind, lay, dtype, CUDA0, **_flags(kind))
    assert (why == "Gluon") is (entry is not None), why


def _flags(kind, **over):
    flags = dict(window=False, rowsum=False, contiguous=True)
    if kind == "fwd":  # the forward never applies the ρ correction
        del flags["rowsum"]
    if kind not in ("fwd", "bwd_dq", "bwd_dkdv"):
        flags.update(precise=True, all_u=True)
    if kind == "bob_direct":
        flags.update(need_qb=True, need_dob=True, split=False)
    if kind == "bob_col":
        flags.update(need_kb=True, need_vb=True, split=False)
    flags.update(over)
    return flags


def test_table_tiles_are_the_measured_ones():
    for key, fwd in configs.GLUON.items():  # the forward: a row pass, 16 queries per warp
        if key[0] == "fwd":
            assert fwd.block_m == 16 * fwd.num_warps and fwd.min_keys == 16384
    assert configs.GLUON[("bwd_dkdv", 64)] == configs.GluonConfig(64, 64, 4, min_keys=16384)
    col = configs.GLUON[("bob_col", 64)]
    assert (col.block_n, col.block_m, col.num_warps, col.stages) == (64, 64, 4, 2)
    assert col.warp_specialize and col.maxnreg == 128
    # the BoB row passes: two 4-warp consumer partitions of 64 queries, 64-key ring slots
    two = dict(warp_specialize=True, consumers=2, min_keys=16384)
    assert configs.GLUON[("bob_stats", 64)] == configs.GluonConfig(64, 128, 8, stages=3, **two)
    assert configs.GLUON[("bob_direct", 64)] == configs.GluonConfig(64, 128, 8, stages=2, **two)
    assert {d for _, d in configs.GLUON} == {64, 128}
    # d = 128: tiles that fit the registers without spills (two 128-wide accumulators)
    assert configs.GLUON[("bwd_dkdv", 128)] == configs.GluonConfig(64, 64, 4, min_keys=16384)
    col = configs.GLUON[("bob_col", 128)]
    assert (col.block_n, col.block_m, col.num_warps, col.stages) == (128, 32, 8, 2)
    assert col.warp_specialize and col.maxnreg == 168 and col.min_keys == 16384
    # two consumers: statistics 64-key slots, direct 32-key slots (its two accumulators)
    assert configs.GLUON[("bob_stats", 128)] == configs.GluonConfig(64, 128, 8, stages=2, **two)
    assert configs.GLUON[("bob_direct", 128)] == configs.GluonConfig(32, 128, 8, stages=3,
                                                                      **two)
    # the dQ pass: the forward's shape, two 4-warp consumer partitions of 64 queries each
    # at d = 128 only (at d = 64 the Triton dQ pass is faster)
    assert ("bwd_dq", 64) not in configs.GLUON
    assert configs.GLUON[("bwd_dq", 128)] == configs.GluonConfig(128, 128, 8, stages=2, **two)


OUT_OF_SCOPE = {
    "capability-8.0": dict(cap=(8, 0)),
    "capability-10.0": dict(cap=(10, 0)),
    "capability-9.x-other": dict(cap=(9, 1)),
    "interpreter": dict(interp=True),
    "cpu-device": dict(device=torch.device("cpu")),
    "gluon-not-importable": dict(importable=False),
    "float32": dict(dtype=torch.float32),
    "d96": dict(lay=_lay(d=96)),
    "d32": dict(lay=_lay(d=32)),
    "d256": dict(lay=_lay(d=256)),
    "varlen": dict(lay=_lay(varlen=True)),
    "h_q-not-multiple-of-h_kv": dict(lay=Layout(False, 1, 3, 2, 1, 64, 16384, 16384, 16384)),
    "nq-ne-nk": dict(lay=_lay(n_q=16384, n_k=32768)),
    "n-not-multiple-of-tile": dict(lay=_lay(n_q=16400, n_k=16400)),
    "n-below-min-keys": dict(lay=_lay(n_q=8192, n_k=8192)),
    "n-zero": dict(lay=_lay(n_q=0, n_k=0)),
    "int32-coordinates": dict(lay=_lay(b=1, h_q=2048, h_kv=2048, n_q=2 ** 20, n_k=2 ** 20)),
    "window": dict(window=True),
    "rowsum": dict(rowsum=True),
    "caller-incomplete": dict(complete=False),
    "non-contiguous": dict(contiguous=False),
}


@pytest.mark.parametrize("kind,case", [(kind, case) for kind in KINDS for case in OUT_OF_SCOPE
                                       # the forward, dQ and dK/dV passes have no caller
                                       # conditions; the forward has no ρ correction
                                       if (kind, case) not in (("bwd_dkdv", "caller-incomplete"),
                                                               ("bwd_dq", "caller-incomplete"),
                                                               ("fwd", "caller-incomplete"),
                                                               ("fwd", "rowsum"))])
def test_out_of_scope_falls_back_to_triton(monkeypatch, kind, case):
    spec = dict(OUT_OF_SCOPE[case])
    cap = spec.pop("cap", (9, 0))
    monkeypatch.setattr(plan, "device_capability", lambda index: cap)
    interp = spec.pop("interp", False)
    monkeypatch.setattr(configs, "interpreting", lambda: interp)
    importable = spec.pop("importable", True)
    monkeypatch.setattr(scope, "importable", lambda k: importable)
    assert _select(kind, **spec) is None


@pytest.mark.parametrize("kind,flag,value,words", [
    (kind, *why) for kind in KINDS
    for why in (("window", True, "window"), ("rowsum", True, "row-sum"),
                ("contiguous", False, "contiguous"))
    if (kind, why[0]) != ("fwd", "rowsum")])  # the forward has no ρ correction
def test_the_verifiers_say_why(sm90, kind, flag, value, words):
    """Each verifier names the condition that fails (plan.explain prints it)."""
    lay = _lay(d=min(d for k, d in configs.GLUON if k == kind))  # a head dim it covers
    text = plan.explain(kind, lay, torch.bfloat16, CUDA0, **_flags(kind, **{flag: value}))
    assert text.startswith("Triton: ") and words in text
    why = plan.explain(kind, _lay(d=96), torch.bfloat16, CUDA0, **_flags(kind))
    assert "head dim 96" in why


@pytest.mark.parametrize("kind", KINDS)
def test_switch_and_tile_override_select_triton(sm90, kind):
    assert configs.gluon_passes_enabled()
    with configs.use_gluon_passes(False):
        assert not configs.gluon_passes_enabled()
        assert _select(kind) is None
        with configs.use_gluon_passes(True):  # nests
            assert _select(kind) is not None
        assert _select(kind) is None
    assert _select(kind) is not None
    with configs.tile_overrides({kind: configs.TileConfig(64, 64, 4, 2, True)}):
        assert _select(kind) is None  # an explicit Triton tile for this kind
    other = "bob_col" if kind != "bob_col" else "bwd_dkdv"
    with configs.tile_overrides({other: configs.TileConfig(64, 64, 4, 2, True)}):
        assert _select(kind) is not None
    with pytest.raises(RuntimeError), configs.use_gluon_passes(False):
        raise RuntimeError
    assert configs.gluon_passes_enabled()  # restored after an exception


def _load_script(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_forward_variants_are_launchable():
    """Every forward variant of the table, the GPU sweep and the compile script satisfies
    the entry point's rules (gluon_attn_fwd's checks) and fits the H200's shared memory
    (Q tile + ``stages`` K and V tiles, 16-bit), so no GPU time goes to a refused launch."""
    import ast
    import pathlib

    sweep = _load_script("gluon_pass_sweep")
    # the compile script stubs the CUDA driver and unsets TRITON_INTERPRET when imported:
    # read its list without running it
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "gluon_compile_sm90.py"
    compile_variants = next(
        ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FWD_VARIANTS")
    variants = [(d, v) for d, vs in sweep.FWD_DEFAULTS.items() for v in vs]
    variants += [(d, v) for v in compile_variants for d in (64, 128)]
    for d in (d for kind, d in configs.GLUON if kind == "fwd"):
        c = configs.GLUON[("fwd", d)]
        ws = (3 if c.pingpong else 2) if c.consumers == 2 else int(c.warp_specialize)
        assert c.consumers in (1, 2) and (c.consumers == 1 or c.warp_specialize)
        assert c.consumers == 2 or not c.pingpong
        variants.append((d, (c.block_m, c.block_n, c.num_warps, c.stages, ws, c.maxnreg or 0)))
    assert set(sweep.FWD_DEFAULTS) == {64, 128}
    for d, (bm, bn, w, st, ws, mr) in variants:
        # ws: 0 single partition, 1 TMA producer, 2 producer + two consumer partitions,
        # 3 the same taking turns (pingpong)
        assert w in (4, 8) and bm == 16 * w and bn in (32, 64, 128), (d, bm, bn, w)
        assert 2 <= st <= 4 and ws in (0, 1, 2, 3) and (mr == 0 or 24 < mr <= 255), (st, ws, mr)
        assert ws < 2 or w == 8, (ws, w)
        assert 2 * d * (bm + 2 * st * bn) <= 227 * 1024, (d, bm, bn, st)


def _compile_list(name):
    """A variant list of scripts/kernels/gluon_compile_sm90.py, read without running the script (its
    import stubs the CUDA driver and unsets TRITON_INTERPRET)."""
    import ast
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "gluon_compile_sm90.py"
    return next(
        ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name)


def _key_tile_smem(kind, d, bn, bm, st, consumers):
    """Shared memory (bytes) of a 16-bit key-tile pass: the key-side tiles of the program
    (K, V and, for the column pass, U_K, U_V: block_n rows over all consumer partitions),
    the ring of query-side tiles (dO, Q and, for the column pass, U_Q with up to 8 float32
    row vectors), the one-partition dK / dV pass's ring having two slots."""
    if kind == "bob_col":
        return 2 * d * 4 * bn + st * (2 * d * 3 * bm + 4 * 8 * bm)
    return 2 * d * 2 * bn + (st if consumers == 2 else 2) * 2 * d * 2 * bm


def test_key_tile_variants_are_launchable():
    """Every column-pass and dK / dV variant of the table, the GPU sweep and the compile script
    satisfies the entry points' rules (gluon_bob_col's and gluon_dkdv's checks; two consumer
    partitions: 8 warps, block_m dividing block_n / 2, the column pass warp-specialised) and
    fits the H200's shared memory, so no GPU time goes to a refused launch."""
    sweep = _load_script("gluon_pass_sweep")
    # (kind, d, block_n, block_m, num_warps, stages, warp_specialize, consumers)
    variants = []
    for d, kinds in sweep.KEY_TILE_DEFAULTS.items():
        for bn, bm, w, st, ws, _ in kinds["bob_col"]:
            variants.append(("bob_col", d, bn, bm, w, st, ws > 0, 2 if ws >= 3 else 1))
        for var in kinds["bwd_dkdv"]:
            kw = dict(zip(sweep.FIELDS["bwd_dkdv"], var))
            variants.append(("bwd_dkdv", d, kw["block_n"], kw["block_m"], kw["num_warps"],
                             kw.get("stages", 2), False, kw.get("consumers", 1)))
    for bn, bm, w, st, ws, _ in _compile_list("BOB_COL_VARIANTS"):
        variants.append(("bob_col", 64, bn, bm, w, st, ws > 0, 2 if ws >= 3 else 1))
    for bn, bm, w, st, ws, _ in _compile_list("DKDV_VARIANTS"):
        variants.append(("bwd_dkdv", 64, bn, bm, w, max(st, 2), False, 2 if ws >= 3 else 1))
    for (kind, d), c in configs.GLUON.items():
        if kind in ("bob_col", "bwd_dkdv"):
            variants.append((kind, d, c.block_n, c.block_m, c.num_warps, c.stages,
                             c.warp_specialize, c.consumers))
    assert set(sweep.KEY_TILE_DEFAULTS) == {64, 128}
    assert any(v[-1] == 2 for v in variants if v[0] == "bob_col")
    assert any(v[-1] == 2 for v in variants if v[0] == "bwd_dkdv")
    for kind, d, bn, bm, w, st, ws, consumers in variants:
        case = (kind, d, bn, bm, w, st, ws, consumers)
        assert w in (4, 8) and bn == 16 * w and bm in (32, 64, 128) and bn % bm == 0, case
        assert 2 <= st <= 4 and consumers in (1, 2), case
        if consumers == 2:
            assert w == 8 and (bn // 2) % bm == 0, case
            assert kind == "bwd_dkdv" or ws, case
        assert _key_tile_smem(kind, d, bn, bm, st, consumers) <= 227 * 1024, case


def test_key_tile_smem_model_matches_the_compiled_kernels():
    """The shared-memory model above against scripts/kernels/gluon_compile_sm90.py's sm_90 builds
    (triton 3.9, bf16; the column pass with 4 row vectors, so 4 float32 rows per slot less
    than the model's 8): within 1 KiB."""
    compiled = {("bob_col", 64, 128, 64, 2, 2): 114.4, ("bob_col", 64, 128, 32, 3, 2): 102.0,
                ("bob_col", 128, 128, 32, 3, 2): 202.0, ("bob_col", 64, 64, 64, 2, 1): 82.3,
                ("bwd_dkdv", 64, 128, 64, 3, 2): 80.3, ("bwd_dkdv", 128, 128, 32, 3, 2): 112.3,
                ("bwd_dkdv", 64, 64, 64, 2, 1): 48.0}
    for (kind, d, bn, bm, st, consumers), kib in compiled.items():
        model = _key_tile_smem(kind, d, bn, bm, st, consumers)
        if kind == "bob_col":
            model -= st * 4 * 4 * bm
        assert abs(model / 1024 - kib) <= 1.0, (kind, d, bn, bm, st, consumers, model / 1024)


_BAD_CONSUMERS = [(kind, bad) for kind in ("bob_col", "bwd_dkdv") for bad in (
    dict(consumers=3), dict(consumers=0), dict(consumers=2, num_warps=4, block_n=64),
    dict(consumers=2, block_m=128))] + [("bob_col", dict(consumers=2, warp_specialize=False))]


def _key_tile_call(monkeypatch, kind, **kw):
    """gluon_bob_col / gluon_dkdv on CPU tensors with the module's availability mocked and
    its launcher replaced by a recorder; returns the launcher's keyword arguments."""
    from ttt_flash.kernels.gluon import bob_col, dkdv

    mod = bob_col if kind == "bob_col" else dkdv
    seen = {}
    monkeypatch.setattr(mod, "available", lambda device=None: True)
    monkeypatch.setattr(mod, "launch_bob_col" if kind == "bob_col" else "launch_dkdv",
                        lambda *a, **k: seen.update(k))
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256)
    if kind == "bob_col":
        bob_col.gluon_bob_col(*(q,) * 7, r, r, r, r, **kw)
    else:
        dkdv.gluon_dkdv(q, q, q, q, r, r, **kw)
    return seen


@pytest.mark.parametrize("kind,bad", _BAD_CONSUMERS,
                         ids=[f"{k}-{'-'.join(f'{a}{b}' for a, b in bad.items())}"
                              for k, bad in _BAD_CONSUMERS])
def test_key_tile_entry_points_refuse_bad_consumers(monkeypatch, kind, bad):
    """gluon_bob_col / gluon_dkdv refuse a ``consumers`` they cannot launch with a ValueError
    naming the argument, before anything is launched."""
    kw = dict(block_n=128, block_m=64, num_warps=8)
    if kind == "bob_col":
        kw["warp_specialize"] = True
    kw.update(bad)
    with pytest.raises(ValueError, match="consumers"):
        _key_tile_call(monkeypatch, kind, **kw)


@pytest.mark.parametrize("kind", ["bob_col", "bwd_dkdv"])
def test_key_tile_entry_points_hand_consumers_to_the_launcher(monkeypatch, kind):
    """A valid ``consumers=2`` (and the ring's ``stages``) reaches the launcher unchanged;
    the default is one partition."""
    kw = dict(block_n=128, block_m=32, num_warps=8, stages=3)
    if kind == "bob_col":
        kw["warp_specialize"] = True
    seen = _key_tile_call(monkeypatch, kind, consumers=2, **kw)
    assert seen["consumers"] == 2 and seen["stages"] == 3 and seen["block_n"] == 128
    assert _key_tile_call(monkeypatch, kind)["consumers"] == 1


def test_forward_plan_names_its_tiles_and_reason(monkeypatch):
    """The forward's plan: the Gluon tiles on sm_90 in scope, else the Triton forward's table
    tiles (what ``attn_fwd`` launched before the Gluon pass), and ``explain`` says why."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(scope, "importable", lambda kind: True)
    for cap, gluon in (((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(plan, "device_capability", lambda index, _c=cap: _c)
        plan.clear_cache()
        for d in (64, 128):
            lay = _lay(h_q=12, h_kv=4, d=d)
            p = plan.fwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True)
            entry = configs.GLUON.get(("fwd", d)) if gluon else None
            assert p.kind == "fwd" and p.gluon is (entry is not None)
            want = entry or configs.table_config("fwd", d, torch.bfloat16, cap[0])
            assert p.tiles == want
            assert plan.fwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True) is p
    plan.clear_cache()
    monkeypatch.setattr(plan, "device_capability", lambda index: (9, 0))
    d = next(d for kind, d in configs.GLUON if kind == "fwd")  # a head dim it covers
    flags = dict(window=False, contiguous=True)
    why = plan.explain("fwd", _lay(n_q=16384, n_k=32768, d=d), torch.bfloat16, CUDA0, **flags)
    assert why == "Triton: N_q = 16384 differs from N_k = 32768"
    why = plan.explain("fwd", _lay(n_q=8192, n_k=8192, d=d), torch.float16, CUDA0, **flags)
    assert why == "Triton: N = 8192 is below the pass's min_keys = 16384"
    assert plan.explain("fwd", _lay(d=d), torch.float16, CUDA0, **flags) == "Gluon"
    why = plan.explain("fwd", _lay(d=96), torch.float16, CUDA0, **flags)
    assert why == "Triton: head dim 96: no Gluon tiles for 'fwd' (configs.GLUON)"


def test_dq_variants_are_launchable():
    """Every dQ variant of the table, the GPU sweep and the compile script satisfies the
    entry point's rules (gluon_attn_dq's checks) and fits the H200's shared memory (Q and dO
    tiles + ``stages`` K and V tiles, 16-bit)."""
    import ast
    import pathlib

    sweep = _load_script("gluon_pass_sweep")
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "gluon_compile_sm90.py"
    compile_variants = next(
        ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DQ_VARIANTS")
    assert set(sweep.DQ_DEFAULTS) == {64, 128}
    variants = [(d, v) for d, vs in sweep.DQ_DEFAULTS.items() for v in vs]
    variants += [(d, v) for v in compile_variants for d in (64, 128)]
    for d in (64, 128):
        c = configs.GLUON.get(("bwd_dq", d))
        if c is None:  # that head dim runs the Triton dQ pass
            continue
        assert c.consumers in (1, 2) and (c.consumers == 1 or c.warp_specialize)
        assert not c.pingpong  # the dQ pass has no turn-taking
        ws = 2 if c.consumers == 2 else int(c.warp_specialize)
        variants.append((d, (c.block_m, c.block_n, c.num_warps, c.stages, ws, c.maxnreg or 0)))
    for d, (bm, bn, w, st, ws, mr) in variants:
        # ws: 0 single partition, 1 TMA producer, 2 producer + two consumer partitions,
        # 3 the same with deferred dS K waits, 4 producer + one consumer with deferred waits
        assert w in (4, 8) and bm == 16 * w and bn in (32, 64, 128), (d, bm, bn, w)
        assert 2 <= st <= 4 and ws in range(5) and (mr == 0 or 24 < mr <= 255), (st, ws, mr)
        assert ws not in (2, 3) or w == 8, (ws, w)
        assert 2 * d * (2 * bm + 2 * st * bn) <= 227 * 1024, (d, bm, bn, st)


def test_dq_plan_names_its_tiles_and_reason(monkeypatch):
    """The dQ pass's plan: the Gluon tiles on sm_90 in scope (GQA too), else the Triton dQ
    tiles of the table (what ``attn_bwd`` launched before); the ρ correction (float32, or
    forced on) and a non-contiguous O keep it on Triton (O only for dQ: the dK/dV pass,
    which does not read O, stays Gluon), and ``explain`` says why."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(scope, "importable", lambda kind: True)
    for cap, gluon in (((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(plan, "device_capability", lambda index, _c=cap: _c)
        plan.clear_cache()
        for d in (64, 128):
            lay = _lay(h_q=12, h_kv=4, d=d)
            p = plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True)
            entry = configs.GLUON.get(("bwd_dq", d)) if gluon else None
            assert p.dq.kind == "bwd_dq" and p.dq.gluon is (entry is not None)
            assert not p.rowsum
            want = entry or configs.table_config("bwd_dq", d, torch.bfloat16, cap[0])
            assert p.dq.tiles == want
    monkeypatch.setattr(plan, "device_capability", lambda index: (9, 0))
    plan.clear_cache()
    lay = _lay(d=128)
    assert plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True).dq.gluon
    p = plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True, o_contiguous=False)
    assert not p.dq.gluon and p.dkdv.gluon
    assert p.dq.tiles == configs.table_config("bwd_dq", 128, torch.bfloat16, 9)
    p = plan.bwd(lay, torch.float32, CUDA0, window=False, contiguous=True)
    assert p.rowsum and not p.dq.gluon
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(configs.ROWSUM_CORRECTION, torch.bfloat16, True)
        plan.clear_cache()
        assert not plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True).dq.gluon
    plan.clear_cache()
    flags = dict(window=False, rowsum=False, contiguous=True)
    assert plan.explain("bwd_dq", lay, torch.bfloat16, CUDA0, **flags) == "Gluon"
    why = plan.explain("bwd_dq", lay, torch.bfloat16, CUDA0, **dict(flags, rowsum=True))
    assert why == "Triton: the ρ row-sum correction is on"
    why = plan.explain("bwd_dq", _lay(n_q=8192, n_k=8192, d=128), torch.float16, CUDA0,
                       **flags)
    assert why == "Triton: N = 8192 is below the pass's min_keys = 16384"
    for d in (64, 96):  # 64: the Triton dQ pass is the faster one there
        why = plan.explain("bwd_dq", _lay(d=d), torch.float16, CUDA0, **flags)
        assert why == f"Triton: head dim {d}: no Gluon tiles for 'bwd_dq' (configs.GLUON)"


def test_plans_are_cached_and_follow_the_switches(sm90):
    """One plan per call shape (the same object back), a new one when a switch changes."""
    lay = _lay()
    a = plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True)
    assert plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True) is a
    assert a.dkdv.gluon
    with configs.use_gluon_passes(False):
        b = plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True)
        assert not b.dkdv.gluon
    assert plan.bwd(lay, torch.bfloat16, CUDA0, window=False, contiguous=True).dkdv.gluon


def test_unmocked_cpu_and_interpreter_never_select_gluon():
    assert configs.interpreting()  # tests/conftest.py on a machine without CUDA
    for device in (torch.device("cpu"), CUDA0):
        for kind in KINDS:
            assert _select(kind, device=device) is None


@pytest.mark.parametrize("version,ok", [((3, 5), False), ((3, 6), True), ((3, 9), True),
                                        ((3, 10), False), ((4, 0), False)])
def test_triton_version_range(monkeypatch, version, ok):
    from ttt_flash.kernels.gluon import common

    monkeypatch.setattr(scope, "_triton_version", lambda: version)
    scope.importable.cache_clear()
    try:
        assert scope.importable("bwd_dkdv") is (ok and common.HAVE_GLUON)
        for kind in ("fwd", "bwd_dq", "bob_col", "bob_stats", "bob_direct"):
            assert scope.importable(kind) is (ok and common.HAVE_GLUON
                                              and common.HAVE_WARP_SPECIALIZE)
    finally:
        scope.importable.cache_clear()


def test_gluon_modules_import_without_gpu():
    from ttt_flash.kernels.gluon import bob_col, bob_row, dkdv, dq, fwd

    assert not dkdv.available() and not bob_col.available()
    assert not bob_row.available() and not fwd.available() and not dq.available()
    with pytest.raises(RuntimeError, match="sm_90"):
        fwd.gluon_attn_fwd(*(torch.empty(1, 1, 128, 64, dtype=torch.bfloat16),) * 3)
    with pytest.raises(RuntimeError, match="sm_90"):
        dq.gluon_attn_dq(*(torch.empty(1, 1, 128, 64, dtype=torch.bfloat16),) * 5,
                         torch.empty(1, 1, 128))
    with pytest.raises(RuntimeError, match="sm_90"):
        dkdv.gluon_dkdv(*(torch.empty(1, 1, 64, 64, dtype=torch.bfloat16),) * 4,
                        torch.empty(1, 1, 64), torch.empty(1, 1, 64))


# --------------------------------------------------------------------------- call sites


def _expand(x, q):
    """Key-side (B, H_kv, N, d) ``x`` in float64, repeated to q's H_q heads (query head h
    reads kv head h // (H_q / H_kv))."""
    return x.double().repeat_interleave(q.shape[1] // x.shape[1], dim=1)


def _fold(x, like):
    """Per-query-head (B, H_q, N, d) ``x`` summed over the query heads of each kv head of
    ``like`` (B, H_kv, N, d)."""
    b, hk = like.shape[:2]
    return x.reshape(b, hk, x.shape[1] // hk, *x.shape[2:]).sum(2)


def _fake_fwd(calls):
    """launch_fwd's documented result (O and the natural-log L of softmax(τ Q Kᵀ), GQA:
    query head h reads kv head h // G) in float64, written into ``out`` = (o, lse)."""

    def fake(q, k, v, *, scale, causal, out, **tiles):
        calls.append(("fwd", tiles))
        assert out[0].shape == q.shape and out[0].dtype == q.dtype
        assert out[1].shape == q.shape[:3] and out[1].dtype == torch.float32
        assert all(x.is_contiguous() for x in (q, k, v, *out))
        s = scale * q.double() @ _expand(k, q).transpose(-1, -2)
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[0].copy_(torch.softmax(s, -1) @ _expand(v, q))
        out[1].copy_(torch.logsumexp(s, -1))
        return out

    return fake


def _fake_dq(calls):
    """launch_dq's documented result (τ dS K and D = rowsum(dO∘O), GQA: query head h reads
    kv head h // G) in float64, written into ``out`` = (dq, delta)."""

    def fake(q, k, v, o, do, lse, *, scale, causal, out, **tiles):
        calls.append(("bwd_dq", tiles))
        assert out[0].shape == q.shape and out[0].dtype == q.dtype
        assert out[1].shape == q.shape[:3] and out[1].dtype == torch.float32
        assert o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        assert all(x.is_contiguous() for x in (q, k, v, o, do, lse, *out))
        k, v = (_expand(x, q) for x in (k, v))
        q, do = q.double(), do.double()
        delta = (o.double() * do).sum(-1)
        ds = _probs(q, k, lse, scale, causal) * (do @ v.transpose(-1, -2) - delta[..., None])
        out[0].copy_(scale * ds @ k)
        out[1].copy_(delta)
        return out

    return fake


def _fake_dkdv(calls):
    """gluon_dkdv's documented result in float64 (GQA: summed over each kv head's query
    heads), written into ``out``."""

    def fake(q, k, v, do, lse, delta, *, scale, causal, out, **tiles):
        calls.append(("bwd_dkdv", tiles))
        like = k
        k, v = (_expand(x, q) for x in (k, v))
        q, do = q.double(), do.double()
        p = _probs(q, k, lse, scale, causal)
        ds = p * (do @ v.transpose(-1, -2) - delta.double()[..., None])
        out[0].copy_(_fold(scale * ds.transpose(-1, -2) @ q, like))
        out[1].copy_(_fold(p.transpose(-1, -2) @ do, like))
        return out

    return fake


def _fake_bob_col(calls):
    """gluon_bob_col's documented result (K̄, V̄ from α and E + αD) in float64, into ``out``."""

    def fake(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, rho, *, scale, causal, out, **tiles):
        calls.append(("bob_col", tiles))
        assert rho is None
        like = k
        k, v, uk, uv = (_expand(x, q) for x in (k, v, uk, uv))
        q, do, uq = (x.double() for x in (q, do, uq))
        tr = lambda x: x.transpose(-1, -2)  # noqa: E731
        p = _probs(q, k, lse, scale, causal)
        g = scale * (q @ tr(uk) + uq @ tr(k)) - alpha.double()[..., None]
        ds = p * (do @ tr(v) - delta.double()[..., None])
        r = g * ds + p * (do @ tr(uv) - ee.double()[..., None])
        out[0].copy_(_fold(scale * (tr(r) @ q + tr(ds) @ uq), like))
        out[1].copy_(_fold(tr(p * g) @ do, like))
        return out

    return fake


def _row_products(q, k, v, do, uq, uk, uv, lse, delta, scale, causal):
    """P, G (unshifted), dP − D and B of the whole (B, H_q, N, N) problem in float64."""
    k, v, uk, uv = (_expand(x, q) for x in (k, v, uk, uv))
    q, do, uq = (x.double() for x in (q, do, uq))
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    p = _probs(q, k, lse, scale, causal)
    g = scale * (q @ tr(uk) + uq @ tr(k))
    return p, g, do @ tr(v) - delta.double()[..., None], do @ tr(uv)


def _fake_bob_stats(calls):
    """gluon_bob_stats's documented result (α, E + αD) in float64, into ``out``."""

    def fake(q, k, v, do, uq, uk, uv, lse, delta, *, scale, causal, out, **tiles):
        calls.append(("bob_stats", tiles))
        p, g, dpc, bm = _row_products(q, k, v, do, uq, uk, uv, lse, delta, scale, causal)
        alpha = (p * g).sum(-1)
        out[0].copy_(alpha)
        out[1].copy_((p * (g * (dpc + delta.double()[..., None]) + bm)).sum(-1)
                     - alpha * delta.double())
        return out

    return fake


def _fake_bob_direct(calls):
    """gluon_bob_direct's documented result (Q̄, dŌ from α and E + αD) in float64, into
    ``out``."""

    def fake(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, *, scale, causal, out, **tiles):
        calls.append(("bob_direct", tiles))
        p, g, dpc, bm = _row_products(q, k, v, do, uq, uk, uv, lse, delta, scale, causal)
        g = g - alpha.double()[..., None]
        ds = p * dpc
        r = g * ds + p * (bm - ee.double()[..., None])
        out[0].copy_(scale * (r @ _expand(k, q) + ds @ _expand(uk, q)))
        out[1].copy_((p * g) @ _expand(v, q) + p @ _expand(uv, q))
        return out

    return fake


def _probs(q, k, lse, scale, causal):
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.exp(s - lse.double()[..., None])


def _fake_bob_row(calls):
    """launch_bob_row: the statistics (``stats=True``: into ``alpha``, ``ee``) or the direct
    pass (into ``out``), as the two stand-ins above."""
    stats_fake, direct_fake = _fake_bob_stats(calls), _fake_bob_direct(calls)

    def fake(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, *, stats, out=None, **kw):
        if stats:
            return stats_fake(q, k, v, do, uq, uk, uv, lse, delta, out=(alpha, ee), **kw)
        return direct_fake(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, out=out, **kw)

    return fake


@contextlib.contextmanager
def _gluon_on_cpu(monkeypatch, calls, key_consumers=1):
    """The real plans, told the CPU tensors sit on an sm_90 GPU (the Gluon verifiers' view
    only: the Triton passes keep the interpreter's tiles), with d = 16 / 32-wide tiles in the
    Gluon table (interpreter-sized; the key-tile passes with ``key_consumers`` consumer
    partitions), and the float64 stand-ins for the Gluon launchers."""
    from ttt_flash.kernels.gluon import bob_col, bob_row, dkdv, dq, fwd

    monkeypatch.setattr(plan, "_gluon_capability", lambda device: (9, 0))
    monkeypatch.setattr(scope, "importable", lambda kind: True)
    monkeypatch.setattr(configs, "GLUON", {
        ("fwd", 16): configs.GluonConfig(16, 32, 2, stages=3, warp_specialize=True),
        ("bwd_dq", 16): configs.GluonConfig(32, 16, 2, stages=2, warp_specialize=True,
                                            consumers=2),
        ("bwd_dkdv", 16): configs.GluonConfig(32, 32, 2, consumers=key_consumers),
        ("bob_col", 16): configs.GluonConfig(32, 32, 2, stages=2, warp_specialize=True,
                                             maxnreg=128, consumers=key_consumers),
        ("bob_stats", 16): configs.GluonConfig(16, 32, 2, stages=3),
        ("bob_direct", 16): configs.GluonConfig(16, 32, 2, stages=2, warp_specialize=True)})
    monkeypatch.setattr(fwd, "launch_fwd", _fake_fwd(calls))
    monkeypatch.setattr(dq, "launch_dq", _fake_dq(calls))
    monkeypatch.setattr(dkdv, "launch_dkdv", _fake_dkdv(calls))
    monkeypatch.setattr(bob_col, "launch_bob_col", _fake_bob_col(calls))
    monkeypatch.setattr(bob_row, "launch_bob_row", _fake_bob_row(calls))
    plan.clear_cache()
    yield


def _inputs(h_q=2, h_kv=2, n=64, d=16):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, h_q, n, d), (1, h_kv, n, d), (1, h_kv, n, d), (1, h_q, n, d),
              (1, h_q, n, d), (1, h_kv, n, d), (1, h_kv, n, d)]
    return [torch.randn(s, generator=g).to(torch.float16) for s in shapes]


def _chain(ts, kw, **bob_kw):
    q, k, v, do, uq, uk, uv = ts
    o, lse = attn_fwd(q, k, v, **kw)
    dq, dk, dv, delta = attn_bwd_mod.attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    outs = attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, deterministic=True, **kw, **bob_kw)
    return dict(zip(("o", "lse", "dq", "dk", "dv", "qb", "kb", "vb", "dob"),
                    (o, lse, dq, dk, dv, *outs)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (2, 1)], ids=["mha", "gqa-4-2", "mqa-2-1"])
def test_call_sites_hand_over_what_the_gluon_kernels_expect(monkeypatch, one_thread, causal,
                                                            heads):
    ts = _inputs(*heads)
    kw = dict(scale=None, causal=causal, window=None)
    want = _chain(ts, kw)
    calls = []
    with _gluon_on_cpu(monkeypatch, calls):
        got = _chain(ts, kw)
    assert [c[0] for c in calls] == ["fwd", "bwd_dq", "bwd_dkdv", "bob_stats", "bob_direct",
                                     "bob_col"]
    assert calls[0][1] == dict(block_n=16, block_m=32, num_warps=2, stages=3,
                               warp_specialize=True, consumers=1, pingpong=False, maxnreg=None)
    assert calls[1][1] == dict(block_n=32, block_m=16, num_warps=2, stages=2,
                               warp_specialize=True, consumers=2, maxnreg=None)
    assert calls[2][1] == dict(block_n=32, block_m=32, num_warps=2, consumers=1, stages=2,
                               maxnreg=None)
    assert calls[3][1] == dict(block_n=16, block_m=32, num_warps=2, stages=3,
                               warp_specialize=False, consumers=1, maxnreg=None)
    assert calls[4][1] == dict(block_n=16, block_m=32, num_warps=2, stages=2,
                               warp_specialize=True, consumers=1, maxnreg=None)
    assert calls[5][1] == dict(block_n=32, block_m=32, num_warps=2, stages=2,
                               warp_specialize=True, consumers=1, maxnreg=128)
    for name, x in want.items():
        y = got[name]
        assert y.dtype == x.dtype and y.shape == x.shape, name
        mag = x.double().abs().max().item()
        err = (y.double() - x.double()).abs().max().item()
        assert err <= 4 * 2.0 ** -11 * mag, (name, err, mag)  # four fp16 units


def test_call_sites_hand_over_the_key_tile_consumers(monkeypatch, one_thread):
    """A table entry with two consumer partitions reaches the column and dK / dV launchers
    (``consumers=cfg.consumers``, the dK / dV pass's ring ``stages`` too), and the chain's
    results are unchanged."""
    ts = _inputs(4, 2)
    kw = dict(scale=None, causal=True, window=None)
    want = _chain(ts, kw)
    calls = []
    with _gluon_on_cpu(monkeypatch, calls, key_consumers=2):
        got = _chain(ts, kw)
    tiles = dict(calls)
    assert tiles["bwd_dkdv"]["consumers"] == 2 and tiles["bwd_dkdv"]["stages"] == 2
    assert tiles["bob_col"]["consumers"] == 2 and tiles["bob_col"]["warp_specialize"]
    assert tiles["fwd"]["consumers"] == 1  # the forward's own entry
    for name in ("dk", "dv", "kb", "vb"):
        x, y = want[name].double(), got[name].double()
        assert (y - x).abs().max().item() <= 4 * 2.0 ** -11 * x.abs().max().item(), name


@pytest.mark.parametrize("drop", ["bob_direct", "bob_stats"])
def test_call_sites_mix_gluon_and_triton_row_passes(monkeypatch, one_thread, drop):
    """A table with one of the two row passes (the other takes the Triton kernel, reading or
    writing α, E + αD in HBM): same results as the Triton passes, GQA 4 / 2. The two row
    sweeps run as separate launches, as they do from FUSED_ROW_MAX_KEYS keys on."""
    monkeypatch.setattr(configs, "FUSED_ROW_MAX_KEYS", 0)
    ts = _inputs(4, 2)
    kw = dict(scale=None, causal=True, window=None)
    want = _chain(ts, kw)
    calls = []
    with _gluon_on_cpu(monkeypatch, calls):
        table = dict(configs.GLUON)
        del table[(drop, 16)]
        monkeypatch.setattr(configs, "GLUON", table)
        plan.clear_cache()
        got = _chain(ts, kw)
    kept = "bob_stats" if drop == "bob_direct" else "bob_direct"
    assert [c[0] for c in calls] == ["fwd", "bwd_dq", "bwd_dkdv", kept, "bob_col"]
    for name, x in want.items():
        mag = x.double().abs().max().item()
        err = (got[name].double() - x.double()).abs().max().item()
        assert err <= 4 * 2.0 ** -11 * mag, (name, err, mag)


@pytest.mark.parametrize("case", [
    "window", "split_col", "split_row", "affine", "uq-missing", "kb-not-wanted",
    "dob-not-wanted", "n-not-tiled", "switched-off"])
def test_call_sites_fall_back_outside_scope(monkeypatch, one_thread, case):
    ts = _inputs(n=48 if case == "n-not-tiled" else 64)
    kw = dict(scale=None, causal=True, window=16 if case == "window" else None)
    bob_kw = {"split_col": dict(split_col=True), "split_row": dict(split_row=True),
              "affine": dict(precise=False),
              "kb-not-wanted": dict(needs=(True, False, True, True)),
              "dob-not-wanted": dict(needs=(True, True, True, False))}.get(case, {})
    if case == "uq-missing":
        ts[4] = None
    calls = []
    with _gluon_on_cpu(monkeypatch, calls), (
            configs.use_gluon_passes(False) if case == "switched-off" else contextlib.nullcontext()):
        _chain(ts, kw, **bob_kw)
    row = ["bob_stats", "bob_direct"]
    # the row passes without the Gluon direct pass: one Triton launch (statistics sweep
    # first, the keys being below FUSED_ROW_MAX_KEYS), so no Gluon statistics pass either
    # the forward has no BoB conditions: it runs wherever the common scope holds
    first = ["fwd", "bwd_dq", "bwd_dkdv"]
    expect = {"split_col": [*first, *row], "split_row": [*first, "bob_col"],
              "affine": first, "uq-missing": first, "kb-not-wanted": [*first, *row],
              "dob-not-wanted": [*first, "bob_col"]}.get(case, [])
    assert [c[0] for c in calls] == expect


@pytest.mark.parametrize("case", ["rowsum", "o-not-contiguous"])
def test_call_site_keeps_the_triton_dq_where_it_must(monkeypatch, one_thread, case):
    """The composer launches the Triton dQ pass where the plan says so: with the ρ
    correction on (the Gluon pass never forms ρ; every Gluon pass then stands down) and
    with a non-contiguous O (read by the dQ pass only: dK/dV stays Gluon); dQ, D and the
    rest of the first backward as the Triton passes give them, GQA 4 / 2."""
    q, k, v, do = _inputs(4, 2)[:4]
    kw = dict(scale=None, causal=True, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    if case == "o-not-contiguous":
        o = o.transpose(1, 2).contiguous().transpose(1, 2)
        assert not o.is_contiguous()
    calls = []
    with contextlib.ExitStack() as stack:
        if case == "rowsum":
            stack.enter_context(pytest.MonkeyPatch.context()).setitem(
                configs.ROWSUM_CORRECTION, torch.float16, True)
        plan.clear_cache()
        want = attn_bwd_mod.attn_bwd(q, k, v, o, lse, do, **kw)
        stack.enter_context(_gluon_on_cpu(monkeypatch, calls))
        got = attn_bwd_mod.attn_bwd(q, k, v, o, lse, do, **kw)
    assert [c[0] for c in calls] == ([] if case == "rowsum" else ["bwd_dkdv"])
    for name, x, y in zip(("dq", "dk", "dv", "delta"), want, got):
        mag = x.double().abs().max().item()
        err = (y.double() - x.double()).abs().max().item()
        assert err <= 4 * 2.0 ** -11 * mag, (name, err, mag)


# --------------------------------------------------------------------------- A/B script


def test_chain_ab_script_runs_on_cpu(tmp_path, capsys, monkeypatch, one_thread):
    """scripts/kernels/gluon_chain_ab.py end to end on the CPU (no Gluon there: 0 launches)."""
    import importlib.util
    import json
    import pathlib

    from ttt_flash.kernels.gluon import bob_col, bob_row, dkdv, dq, fwd

    # the script wraps the launchers to count launches: put them back afterwards
    monkeypatch.setattr(fwd, "launch_fwd", fwd.launch_fwd)
    monkeypatch.setattr(dq, "launch_dq", dq.launch_dq)
    monkeypatch.setattr(dkdv, "launch_dkdv", dkdv.launch_dkdv)
    monkeypatch.setattr(bob_col, "launch_bob_col", bob_col.launch_bob_col)
    monkeypatch.setattr(bob_row, "launch_bob_row", bob_row.launch_bob_row)

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "gluon_chain_ab.py"
    spec = importlib.util.spec_from_file_location("gluon_chain_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--device", "cpu", "--seq-lens", "32", "--causal", "both", "--heads", "1",
                     "--head-dim", "16", "--dtype", "float32", "--reps", "2",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gluon_chain_ab.json").read_text())["rows"]
    assert [(r["N"], r["causal"]) for r in rows] == [(32, False), (32, True)]
    for r in rows:
        assert r["gluon_launches_per_chain"] == 0 and len(r["on_all_ms"]) == 2
        assert r["ratio_on"] == pytest.approx(r["on_ms"] / r["sdpa_ms"])
        assert r["speedup"] == pytest.approx(r["off_ms"] / r["on_ms"])
    table = capsys.readouterr().out.splitlines()[-2:]
    assert table[0].startswith("| 32 | no |") and table[1].startswith("| 32 | yes |")


def test_pass_sweep_times_the_triton_forward_and_refuses_wrong_variants(monkeypatch, one_thread):
    """scripts/kernels/gluon_pass_sweep.py's forward rows on the CPU (the Triton forward under the
    interpreter, a float64 stand-in for the Gluon one that is wrong for one variant): the
    baseline row first, a speed for each variant that agrees with it, none for the other."""
    import triton.testing

    from ttt_flash.kernels.gluon import fwd

    sweep = _load_script("gluon_pass_sweep")

    def stand_in(q, k, v, *, causal, consumers, pingpong, **tiles):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        _fake_fwd([])(q, k, v, scale=q.shape[-1] ** -0.5, causal=causal, out=(o, lse))
        return (o + 1 if pingpong else o), lse  # the pingpong variant is wrong

    monkeypatch.setattr(fwd, "gluon_attn_fwd", stand_in)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 2.0)[1])
    x = _inputs(h_q=4, h_kv=2, n=64, d=16)
    variants = [(128, 128, 8, 2, 1, 0), (128, 128, 8, 2, 2, 0), (128, 128, 8, 2, 3, 0)]
    rows = sweep.run_fwd(variants, x, True)
    assert [r["variant"] for r in rows] == ["triton", *map(list, variants)]
    assert all(r["ms"] == 2.0 for r in rows[:3]) and "ms" not in rows[3]
    assert "disagrees with the Triton forward" in rows[3]["error"]
    assert rows[1]["o_maxdiff"] <= 4 and rows[1]["lse_maxdiff"] <= 1e-3
    table = sweep.format_table(rows).splitlines()
    assert table[2] == "| fwd | triton | 2.000 | 0 | 1.000x |"
    assert table[-1] == "| fwd | 128,128,8,2,3,0 | failed | | |"


# --------------------------------------------------------------------------- BoB row passes:
# two consumer partitions (kernels/gluon/bob_row.py, ``consumers``)

ROW_KINDS = ("bob_stats", "bob_direct")


def _row_entry(kind, q, r, **kw):
    """Call the checked entry point of ``kind`` on CPU tensors (``q`` for every tile input,
    ``r`` for every row vector)."""
    from ttt_flash.kernels.gluon import bob_row

    if kind == "bob_stats":
        return bob_row.gluon_bob_stats(*(q,) * 7, r, r, **kw)
    return bob_row.gluon_bob_direct(*(q,) * 7, r, r, r, r, **kw)


@pytest.fixture
def row_launches(monkeypatch):
    """The row passes' entry points with Gluon 'available' on the CPU and the launcher
    replaced by a recorder of its keywords (nothing is compiled)."""
    from ttt_flash.kernels.gluon import bob_row

    launched = []
    monkeypatch.setattr(bob_row, "available", lambda device=None: True)
    monkeypatch.setattr(bob_row, "launch_bob_row",
                        lambda *a, **kw: launched.append(kw) or (a[0], a[0]))
    return launched


def _row_smem(d, bm, bn, stages):
    """Shared memory (bytes) of a row-pass program: Q, dO, U_Q of its query tile and
    ``stages`` ring slots of K, V, U_K, U_V, 16-bit."""
    return 2 * d * (3 * bm + 4 * stages * bn)


def test_row_pass_variants_are_launchable(row_launches):
    """Every row-pass variant of the table, the GPU sweep (per head dim) and the compile
    script passes the entry points' checks, reaches the launcher with its ``consumers``
    (warp_specialize 2: two consumer partitions with the TMA producer) and fits the H200's
    shared memory, so no GPU time goes to a refused launch."""
    import ast
    import pathlib

    sweep = _load_script("gluon_pass_sweep")
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "gluon_compile_sm90.py"
    compile_variants = next(
        ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "BOB_ROW_VARIANTS")
    assert set(sweep.ROW_DEFAULTS) == {64, 128}
    variants = [(kind, d, v) for d, kinds in sweep.ROW_DEFAULTS.items()
                for kind in ROW_KINDS for v in kinds[kind]]
    assert any(v[4] == 2 for _, _, v in variants), "no two-consumer variant in the sweep"
    assert any(v[4] == 2 for v in compile_variants), "no two-consumer variant to compile"
    # the compile script's default head dim is 64
    variants += [(kind, 64, v) for kind in ROW_KINDS for v in compile_variants]
    for kind, d in configs.GLUON:
        if kind in ROW_KINDS:
            c = configs.GLUON[(kind, d)]
            ws = 2 if c.consumers == 2 else int(c.warp_specialize)
            variants.append((kind, d, (c.block_m, c.block_n, c.num_warps, c.stages, ws,
                                       c.maxnreg or 0)))
            assert c.consumers == 1 or c.warp_specialize, (kind, d)
    for kind, d, (bm, bn, w, st, ws, mr) in variants:
        assert ws in (0, 1, 2) and (mr == 0 or 24 < mr <= 255), (kind, d, ws, mr)
        assert _row_smem(d, bm, bn, st) <= 227 * 1024, (kind, d, bm, bn, st)
        q = torch.zeros(1, 2, 256, d, dtype=torch.bfloat16)
        r = torch.zeros(1, 2, 256)
        row_launches.clear()
        _row_entry(kind, q, r, block_m=bm, block_n=bn, num_warps=w,
                   stages=st, warp_specialize=ws > 0, consumers=2 if ws == 2 else 1,
                   maxnreg=mr or None)
        (kw,) = row_launches
        assert kw["stats"] == (kind == "bob_stats")
        assert (kw["block_m"], kw["block_n"], kw["num_warps"], kw["stages"]) == (bm, bn, w, st)
        assert kw["consumers"] == (2 if ws == 2 else 1) and kw["warp_specialize"] == (ws > 0)


@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("bad", [
    dict(consumers=3, warp_specialize=True),
    dict(consumers=0, warp_specialize=True),
    dict(consumers=2, warp_specialize=False),
    dict(consumers=2, warp_specialize=True, block_m=64, num_warps=4),
], ids=["three", "zero", "no-producer", "four-warps"])
def test_row_passes_refuse_bad_consumers(row_launches, kind, bad):
    """``consumers`` other than 1, or 2 without the producer partition and 8 warps: a
    ValueError naming the argument, before anything is launched."""
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256)
    kw = dict(block_m=128, block_n=64, num_warps=8, stages=2, **{
        k: v for k, v in bad.items() if k not in ("block_m", "num_warps")})
    kw.update({k: v for k, v in bad.items() if k in ("block_m", "num_warps")})
    with pytest.raises(ValueError, match=f"gluon_{kind}: consumers must be 1, or 2 with "
                                         "warp_specialize=True and num_warps=8"):
        _row_entry(kind, q, r, **kw)
    assert row_launches == []
    # the same call with consumers=2, the producer and 8 warps is handed over
    _row_entry(kind, q, r, block_m=128, block_n=64, num_warps=8, stages=2,
               warp_specialize=True, consumers=2)
    assert [kw["consumers"] for kw in row_launches] == [2]


def test_call_sites_hand_the_row_passes_their_consumers(monkeypatch, one_thread):
    """A table whose row-pass entries have two consumer partitions: ``attn_bob`` hands
    ``consumers=2`` (with the rest of the entry) to the Gluon row launcher, and the results
    equal the Triton passes'."""
    import dataclasses

    from ttt_flash.kernels.gluon import bob_row

    ts = _inputs(4, 2)
    kw = dict(scale=None, causal=True, window=None)
    want = _chain(ts, kw)
    calls, consumers = [], []
    with _gluon_on_cpu(monkeypatch, calls):
        table = dict(configs.GLUON)
        for kind in ROW_KINDS:
            table[(kind, 16)] = dataclasses.replace(table[(kind, 16)], warp_specialize=True,
                                                    consumers=2)
        monkeypatch.setattr(configs, "GLUON", table)
        fake = bob_row.launch_bob_row
        monkeypatch.setattr(bob_row, "launch_bob_row", lambda *a, **k: (
            consumers.append((k["stats"], k["consumers"], k["warp_specialize"])) or fake(*a, **k)))
        plan.clear_cache()
        got = _chain(ts, kw)
    assert [c[0] for c in calls] == ["fwd", "bwd_dq", "bwd_dkdv", "bob_stats", "bob_direct",
                                     "bob_col"]
    assert consumers == [(True, 2, True), (False, 2, True)]
    for name, x in want.items():
        mag = x.double().abs().max().item()
        err = (got[name].double() - x.double()).abs().max().item()
        assert err <= 4 * 2.0 ** -11 * mag, (name, err, mag)


def test_pass_sweep_checks_the_gluon_dq_against_triton(monkeypatch, one_thread):
    """scripts/kernels/gluon_pass_sweep.py's dQ rows on the CPU (the Triton dQ pass under the
    interpreter as the reference, its time stood in for; a float64 stand-in for the Gluon
    pass that is wrong in dQ for one variant and in D for another): the baseline row first,
    a speed for each variant that agrees with it, none for the others."""
    import triton.testing

    from ttt_flash.kernels.gluon import dq

    sweep = _load_script("gluon_pass_sweep")

    def stand_in(q, k, v, o, do, lse, *, causal, block_n, consumers, defer, **tiles):
        assert not defer
        out = (torch.empty_like(q), torch.empty(q.shape[:3]))
        _fake_dq([])(q, k, v, o, do, lse, scale=q.shape[-1] ** -0.5, causal=causal, out=out)
        if block_n == 64:  # wrong dQ
            return out[0] * 1.1, out[1]
        if consumers == 1:  # wrong D
            return out[0], out[1] + 1e-2 * out[1].abs().max()
        return out

    monkeypatch.setattr(dq, "gluon_attn_dq", stand_in)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 2.0)[1])
    monkeypatch.setattr(sweep, "triton_dq_ms", lambda *a, **kw: 3.0)
    x = _inputs(h_q=4, h_kv=2, n=64, d=16)
    variants = [(128, 128, 8, 2, 2, 0), (128, 64, 8, 2, 2, 0), (128, 128, 8, 2, 0, 0)]
    rows = sweep.run_dq(variants, x, True)
    assert [r["variant"] for r in rows] == ["triton", *map(list, variants)]
    assert rows[0]["ms"] == 3.0 and rows[1]["ms"] == 2.0
    assert rows[1]["dq_maxdiff"] <= 4 and rows[1]["delta_maxdiff"] <= 1e-4
    assert rows[1]["tflops"] == pytest.approx(6 * 16 * 4 * 64 * 64 * 0.5 / 2.0 / 1e9)
    for r in rows[2:]:
        assert "ms" not in r and "disagrees with the Triton dQ pass" in r["error"]
    def dq_units(row):
        return float(re.search(r"dQ by ([0-9.]+)", row["error"]).group(1))

    assert dq_units(rows[2]) > 4 and dq_units(rows[3]) <= 4  # the second is wrong in D
    table = sweep.format_table(rows).splitlines()
    assert table[2] == "| bwd_dq | triton | 3.000 | 0 | 1.000x |"
    assert table[3] == "| bwd_dq | 128,128,8,2,2,0 | 2.000 | 0 | 1.500x |"
    assert table[-1] == "| bwd_dq | 128,128,8,2,0,0 | failed | | |"


# --------------------------------------------------------------------------- names the Gluon kernels resolve

GLUON_PASSES = ["common", "fwd", "dq", "dkdv", "bob_row", "bob_col"]


def _free_names(fn: ast.FunctionDef) -> set:
    """Names a function reads that it neither takes nor binds (its globals)."""
    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
    loads = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and node is not fn:
            args = node.args
            bound |= {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}
    return loads - bound


@pytest.mark.parametrize("name", GLUON_PASSES)
def test_every_global_a_gluon_kernel_reads_is_defined_in_its_module(name):
    """A Gluon kernel compiles only on an sm_90 GPU; a name its body reads that the module does
    not define (e.g. a helper left out of gluon/common.py's header) fails there at compile
    time. Here every global read by a jit function of the pass module must be bound in it."""
    import builtins
    import importlib

    common = importlib.import_module("ttt_flash.kernels.gluon.common")
    if not common.HAVE_GLUON:
        pytest.skip("the installed triton has no Gluon")
    module = importlib.import_module(f"ttt_flash.kernels.gluon.{name}")
    tree = ast.parse(open(module.__file__).read())
    jitted = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
              and any("jit" in ast.unparse(d) for d in n.decorator_list)]
    assert jitted, f"no jit functions found in gluon/{name}.py"
    missing = {f"{fn.name}: {free}" for fn in jitted for free in _free_names(fn)
               if not hasattr(module, free) and not hasattr(builtins, free)}
    assert not missing, f"gluon/{name}.py: names not defined in the module: {sorted(missing)}"
