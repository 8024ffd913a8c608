"""Chain time of several source trees of this repository, measured in one run (A/B of a
refactor that must keep the kernels' speed).

    python scripts/house_ab.py --trees .old,. --out DIR          # on the GPU machine
    python scripts/house_ab.py --trees .old,. --dry-run          # any machine: the shim only

Each tree is a directory holding a copy of this repository (``.old``: the tree before the
change, ``.``: this one). Every measurement runs in a fresh Python process whose imports of
``ttt_flash``, ``ttt_flash.kernels`` and ``ttt_flash.models`` resolve to that tree's folders (a
small import shim that reads the tree's ``pyproject.toml`` package-dir table, placed before any
installed copy), so the trees never share a module. The trees alternate over ``--rounds``
rounds (old, new, old, new, ...), so drifts of the machine hit both.

Per shape, the chain of ``ttt_flash.bench`` (forward, ``autograd.grad(..., create_graph=True)``,
backward-over-backward of ``flash_attention``, bf16) is timed with CUDA events
(``attention_chain`` and ``event_times`` of this checkout's ``ttt_flash/bench/common.py``, the
same code for every tree): ``--warmup`` chains, then ``--reps`` timed ones; a tree's figure is the median over all its rounds. Shapes:
N = 4,096, 16,384, 65,536 with B = 1, H = 12, d = 64, and at N = 16,384 d = 128 with H = 8 and
GQA 32 / 8 at d = 128, each non-causal and causal; and the host time per eager chain at
N = 1,024 (``-host`` rows: milliseconds of Python and launch work to issue one chain). Prints one line per (tree, round), then a
table (median ms per tree, ratio last tree / first tree) as the last lines; writes
``house_ab.json`` into ``--out``. ``--dry-run`` imports each tree in its own process and prints
which files it loaded (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: (name, B, H_q, H_kv, N, d, causal)
SHAPES = [(f"N{n // 1024}K-d64{'-causal' if c else ''}", 1, 12, 12, n, 64, c)
          for n in (4096, 16384, 65536) for c in (False, True)]
SHAPES += [(f"N16K-d128-H8{'-causal' if c else ''}", 1, 8, 8, 16384, 128, c) for c in (False, True)]
SHAPES += [(f"N16K-d128-GQA32-8{'-causal' if c else ''}", 1, 32, 8, 16384, 128, c)
           for c in (False, True)]
#: Shapes whose figure is the host time per eager chain (the Python and launch work to issue it,
#: no synchronisation inside the timed reps): at N = 1,024 the kernels take a fraction of it.
HOST_SHAPES = [(f"N1K-d64{'-causal' if c else ''}-host", 1, 12, 12, 1024, 64, c) for c in (False, True)]
SHAPES += HOST_SHAPES


# --------------------------------------------------------------------------- import shim


def package_dirs(tree: str) -> dict:
    """{package: folder} of a tree, from its pyproject.toml ([tool.setuptools.package-dir])."""
    text = open(os.path.join(tree, "pyproject.toml")).read()
    out, inside = {}, False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            inside = line == "[tool.setuptools.package-dir]"
            continue
        if inside and "=" in line:
            key, val = (x.strip().strip('"') for x in line.split("=", 1))
            out[key] = os.path.join(os.path.abspath(tree), val)
    return out or {"ttt_flash": os.path.join(os.path.abspath(tree), "ttt_flash")}


def install_shim(tree: str) -> None:
    """Resolve the tree's packages to its folders, ahead of any installed ttt_flash."""
    import importlib.abc
    import importlib.util

    dirs = package_dirs(tree)

    class TreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            folder = dirs.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])

    for name in [m for m in sys.modules if m == "ttt_flash" or m.startswith("ttt_flash.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, TreeFinder())


# --------------------------------------------------------------------------- worker


def _bench_common():
    """This checkout's ttt_flash/bench/common.py (the chain and its CUDA-event timing), loaded by
    path under its own name: every tree is timed by the same code, whatever the tree holds."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ttt_flash", "bench", "common.py")
    spec = importlib.util.spec_from_file_location("house_ab_bench_common", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _host_times(fn, reps: int, warmup: int) -> list:
    """Host milliseconds per call of ``fn``, one figure per group of 10 calls issued back to back
    (the device is synchronised before each group, not inside it)."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        out.append((time.perf_counter() - t0) / 10 * 1e3)
    torch.cuda.synchronize()
    return out


def _worker(spec: dict) -> dict:
    """In a fresh process: import the tree, time every shape, return {shape: [ms, ...]}."""
    install_shim(spec["tree"])
    import importlib

    import torch

    from ttt_flash import flash_attention

    bench = _bench_common()

    if spec.get("dry_run"):
        names = ["ttt_flash", "ttt_flash.attention", "ttt_flash.kernels", "ttt_flash.kernels.bob",
                 "ttt_flash.kernels.configs", "ttt_flash.models"]
        return {n: importlib.import_module(n).__file__ for n in names}
    out = {}
    for name, b, h, hk, n, d, causal in SHAPES:
        if spec["shapes"] and name not in spec["shapes"]:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = [torch.randn(b, hh, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
             for hh in (h, hk, hk, h, h, hk, hk)]
        q, k, v, do = (t.requires_grad_() for t in x[:4])
        u = x[4:]

        def chain():  # forward, first backward with its graph, Q̄, K̄, V̄ and dŌ
            return bench.attention_chain(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal),
                                         q, k, v, do, u)

        if name.endswith("-host"):
            out[name] = _host_times(chain, reps=spec["reps"], warmup=spec["warmup"])
        else:
            out[name] = bench.event_times(chain, reps=spec["reps"], warmup=spec["warmup"], cuda=True)
        del q, k, v, do, u, x
        torch.cuda.empty_cache()
    return out


def run_tree(tree: str, spec: dict) -> dict:
    spec = dict(spec, tree=tree)
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "import json, house_ab; "
            f"print('HOUSE_AB ' + json.dumps(house_ab._worker(json.loads({json.dumps(spec)!r}))))")
    env = dict(os.environ, PYTHONPATH="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.abspath(tree))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("HOUSE_AB ")]
    if r.returncode or not lines:
        raise RuntimeError(f"tree {tree}: worker failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("HOUSE_AB "):])


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=".old,.", help="comma list of source trees (first: baseline)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    p.add_argument("--out", default=None, help="folder for house_ab.json")
    p.add_argument("--dry-run", action="store_true", help="import each tree, print its files")
    a = p.parse_args(argv)
    trees = [t for t in a.trees.split(",") if t]
    spec = dict(warmup=a.warmup, reps=a.reps, shapes=[s for s in a.shapes.split(",") if s],
                dry_run=a.dry_run)
    if a.dry_run:
        for tree in trees:
            files = run_tree(tree, spec)
            print(f"tree {tree}:")
            for name, path in files.items():
                print(f"  {name:<28} {path}")
        return 0
    times = {t: {} for t in trees}
    for rnd in range(a.rounds):
        order = trees if rnd % 2 == 0 else trees[::-1]
        for tree in order:
            t0 = time.time()
            got = run_tree(tree, spec)
            for name, ts in got.items():
                times[tree].setdefault(name, []).extend(ts)
            print(f"round {rnd} tree {tree}: " + ", ".join(
                f"{n} {statistics.median(ts):.2f}" for n, ts in got.items())
                + f" ({time.time() - t0:.0f} s)", flush=True)
    base, last = trees[0], trees[-1]
    rows = []
    for name, *_ in SHAPES:
        if name not in times[base]:
            continue
        med = {t: statistics.median(times[t][name]) for t in trees}
        rows.append(dict(shape=name, median_ms=med, ratio=med[last] / med[base],
                         all_ms={t: times[t][name] for t in trees}))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "house_ab.json"), "w") as f:
            json.dump(dict(trees=trees, rounds=a.rounds, warmup=a.warmup, reps=a.reps,
                           rows=rows), f, indent=1)
    print("| shape | " + " | ".join(f"{t} ms" for t in trees) + f" | {last} / {base} |")
    print("| --- |" + " --- |" * (len(trees) + 1))
    for r in rows:
        print(f"| {r['shape']} | " + " | ".join(f"{r['median_ms'][t]:.2f}" for t in trees)
              + f" | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
