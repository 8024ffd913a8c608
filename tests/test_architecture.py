"""The house's floors (docs/architecture.md), read from the source: every import of a library
module points down or across a floor, never up, and the imports form no circle.

Reads the files with ``ast`` (nothing is imported), so a new upward import fails here with the
file, the line and the two floors.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Where the installed package's parts live (pyproject.toml's package-dir).
PACKAGE_DIRS = {"ttt_flash": ROOT / "ttt_flash", "ttt_flash.kernels": ROOT / "kernels",
                "ttt_flash.models": ROOT / "models"}

#: The floors, lowest first: a module may import modules of its own floor or lower ones.
#: The first matching prefix (longest first) gives a module's floor.
FLOORS: Dict[str, int] = {
    # 0: helpers that import the standard library and torch only
    "ttt_flash._checks": 0,
    "ttt_flash._select": 0,
    "ttt_flash.second_order.grad": 0,
    "ttt_flash.cuda_graph": 0,
    # 1: kernels, the reference, model-agnostic loops, Hessian tools, tasks and data
    "ttt_flash.kernels": 1,
    "ttt_flash.attention.reference": 1,
    "ttt_flash.meta": 1,
    "ttt_flash.second_order": 1,
    "ttt_flash.tasks": 1,
    # 2: the attention core, attention across processes, data-parallel averaging, optimisers
    "ttt_flash.attention": 2,
    "ttt_flash.distributed": 2,
    "ttt_flash.second_order.optim": 2,
    "ttt_flash.second_order.hessian_optimizer": 2,
    "ttt_flash.fsdp": 2,
    "ttt_flash": 2,  # the package façade: flash_attention, flash_attention_varlen
    # 3: the registry of attention implementations
    "ttt_flash.attention.registry": 3,
    # 4: models, memory layers, benchmarks, integrations
    "ttt_flash.models": 4,
    "ttt_flash.memory": 4,
    "ttt_flash.bench": 4,
    "ttt_flash.integrations": 4,
    # 5: Lightning glue
    "ttt_flash.lightning": 5,
    # 6: the command line
    "ttt_flash._recipe_cli": 6,
    "ttt_flash._cli_errors": 6,
    "ttt_flash.cli": 6,
}

#: Imports allowed to point up, each with its reason.
EXCEPTIONS = {
    ("ttt_flash", "ttt_flash.memory"): "the façade's __getattr__ lends GradientMemoryAttention on first use",
}

#: Third-party packages only the Lightning floors (5 and up) may import.
LIGHTNING = ("lightning", "pytorch_lightning", "jsonargparse")


def _modules() -> Dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            # subpackages of ttt_flash that live elsewhere are listed under their own key
            if pkg == "ttt_flash" and parts and f"ttt_flash.{parts[0]}" in PACKAGE_DIRS:
                continue
            mods[name] = path
    return mods


MODULES = _modules()


def floor(module: str) -> int:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return FLOORS[prefix]
    raise KeyError(f"{module} has no floor: add it to FLOORS here and to docs/architecture.md")


def _where(module: str) -> str:
    path = MODULES[module]
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def imports(module: str) -> List[Tuple[str, int]]:
    """(imported library module, line) for every import in ``module``'s file, lazy ones too."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    here = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return [(name, line) for name, line in out]


def _library(name: str) -> str:
    """The library module an import names (the longest known prefix), or '' if third-party."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def test_every_module_has_a_floor():
    assert "ttt_flash.memory.gradmem" in MODULES and "ttt_flash.models.regressors" in MODULES
    for module in MODULES:
        floor(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    bad = []
    for name, line in imports(module):
        target = _library(name)
        if not target or target == module:
            continue
        if floor(target) > floor(module) and (module, target) not in EXCEPTIONS:
            bad.append(f"{_where(module)}:{line} imports {target} "
                       f"(floor {floor(target)}) from floor {floor(module)}")
    for name, line in imports(module):
        if name.split(".")[0] in LIGHTNING and floor(module) < 5:
            bad.append(f"{_where(module)}:{line} imports {name} below the Lightning floor")
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)


def test_kernels_import_torch_and_triton_only():
    for module in (m for m in MODULES if m.startswith("ttt_flash.kernels")):
        for name, line in imports(module):
            target = _library(name)
            assert not target or target.startswith("ttt_flash.kernels"), \
                f"{_where(module)}:{line} imports {target}"


def test_reference_never_imports_kernels():
    modules = [m for m in MODULES if m.startswith("ttt_flash.attention.reference")]
    assert len(modules) >= 3
    assert not [(m, n) for m in modules for n, _ in imports(m) if _library(n).startswith("ttt_flash.kernels")]


def test_no_import_circle():
    graph = {m: sorted({_library(n) for n, _ in imports(m)} - {"", m}) for m in MODULES}
    for a, b in EXCEPTIONS:
        graph[a] = [t for t in graph[a] if t != b]
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            # importing a.b.c runs the packages a and a.b first; those edges are package inits
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    # A floor-1 module importing a floor-4 one is reported (the check is not vacuous).
    fake = tmp_path / "meta.py"
    fake.write_text("from .models import GPT\n")
    monkeypatch.setitem(MODULES, "ttt_flash.meta", fake)
    with pytest.raises(AssertionError, match="imports ttt_flash.models \\(floor 4\\) from floor 1"):
        test_imports_point_down("ttt_flash.meta")


def test_the_checker_sees_a_circle(tmp_path, monkeypatch):
    # chain.py importing step.py, which imports chain.py, is a circle.
    for name, text in (("chain", "from .step import run_step_bench\n"),
                       ("step", "from .chain import median_ms\n")):
        fake = tmp_path / f"{name}.py"
        fake.write_text(text)
        monkeypatch.setitem(MODULES, f"ttt_flash.bench.{name}", fake)
    with pytest.raises(pytest.fail.Exception, match="import circle: .*bench"):
        test_no_import_circle()


def test_every_subpackage_is_installed():
    # pyproject.toml lists packages by hand (kernels/ and models/ install under ttt_flash): a
    # new subpackage missing there would import from a checkout but not from an install.
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m in MODULES if _is_package(m)}
    assert packages == set(tool["packages"])
    for pkg in packages:
        folder = MODULES[pkg].parent
        assert (ROOT / tool["package-dir"][pkg]).resolve() == folder, pkg


def test_one_attention_vocabulary():
    # The names recipes are checked against (typed signatures) are the registry's names.
    from typing import get_args

    from ttt_flash.attention.registry import ATTENTION_IMPLS, AttentionName
    from ttt_flash.memory import MEMORY_ATTENTION_IMPLS, MemoryAttentionName
    from ttt_flash.models import ATTENTION_IMPLS as MODEL_IMPLS

    assert get_args(AttentionName) == ATTENTION_IMPLS == MODEL_IMPLS
    assert get_args(MemoryAttentionName) == MEMORY_ATTENTION_IMPLS
    assert set(MEMORY_ATTENTION_IMPLS) <= set(ATTENTION_IMPLS)


# --------------------------------------------------------------------------- kernels/ house rules


def test_kernel_configs_are_data():
    # configs.py holds tables and thresholds: it imports no kernel module (the plan reads it)
    assert not [n for n, _ in imports("ttt_flash.kernels.configs") if _library(n)]
    assert "ttt_flash.kernels.plan" in MODULES and "ttt_flash.kernels.gluon.scope" in MODULES


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ttt_flash.kernels")))
def test_kernel_modules_stay_small(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= 550, f"{_where(module)} has {lines} lines: split it by pass family"


def test_house_ab_shim_imports_the_named_tree(tmp_path, capsys):
    # scripts/house_ab.py --dry-run: each tree's packages come from that tree's folders
    import importlib.util

    spec = importlib.util.spec_from_file_location("house_ab", ROOT / "scripts" / "house_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.package_dirs(str(ROOT))["ttt_flash.kernels"] == str(ROOT / "kernels")
    assert mod.main(["--trees", str(ROOT), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name, rel in (("ttt_flash.kernels.bob ", "kernels/bob.py"),
                      ("ttt_flash.attention ", "ttt_flash/attention/__init__.py")):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert line.split()[-1] == str(ROOT / rel)


def test_the_docs_floor_table_is_this_one():
    # docs/architecture.md's table of floors states FLOORS (one table: a row that disagrees fails)
    import re

    rows = [ln for ln in (ROOT / "docs" / "architecture.md").read_text().splitlines()
            if re.match(r"\| \d \| ", ln)]
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        level, where = int(cells[1]), re.findall(r"`([^`]+)`", cells[2])
        folder = ""
        for token in where:
            if "/" in token:
                folder = token if token.endswith("/") else token.rpartition("/")[0] + "/"
                path = token
            else:
                path = folder + token
            parts = path.rstrip("/").removesuffix(".py").split("/")
            parts = [p for p in parts if p != "__init__"]
            if parts[0] != "ttt_flash":
                parts = ["ttt_flash", *parts]
            module = ".".join(parts)
            assert floor(module) == level, f"{row[:60]}...: {module} is floor {floor(module)}"
            seen.add(module)
    assert {"ttt_flash.kernels", "ttt_flash.attention", "ttt_flash.cli"} <= seen


def _kernels():
    """(module, kernel name, parameter count) of every @triton.jit / @gluon.jit kernel in
    kernels/ (a function named ``*_kernel``)."""
    out = []
    for module in sorted(m for m in MODULES if m.startswith("ttt_flash.kernels")):
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                out.append((module, node.name, len(node.args.args)))
    return out


def test_kernels_take_few_parameters():
    # a tensor travels as one view tuple (pointer, strides), cu_seqlens as one pair
    found = _kernels()
    assert {"_bob_direct_kernel", "_bob_col_kernel", "_gluon_bob_row_kernel"} <= {
        name for _, name, _ in found}
    over = [f"{m}.{name}: {n}" for m, name, n in found if n > 45]
    assert not over, "kernels over 45 parameters: " + ", ".join(over)


def test_no_timings_or_planning_in_kernels():
    # timings, issue numbers and dated notes belong in docs/benchmarks.md and commit messages
    import re

    pattern = re.compile(r"[0-9](\.[0-9]+)? ?ms\b|\b[Ii]ssue [0-9]+|\bitem [0-9]\b|"
                         r"step (one|two|three|four)|[0-9]\.[0-9]+x (faster|slower)|"
                         r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b")
    bad = []
    for module in (m for m in MODULES if m.startswith("ttt_flash.kernels")):
        for n, line in enumerate(MODULES[module].read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{_where(module)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_benchmarks_live_in_one_subpackage():
    # The benchmark modules sit in ttt_flash/bench/, not flat among the library's modules, and
    # the documented entry points still work: `from ttt_flash.bench import main`, `python -m`.
    import subprocess
    import sys

    assert not sorted((ROOT / "ttt_flash").glob("bench*.py"))
    assert {"ttt_flash.bench.chain", "ttt_flash.bench.common", "ttt_flash.bench.step",
            "ttt_flash.bench.jvp", "ttt_flash.bench.cp", "ttt_flash.bench.graph"} <= set(MODULES)
    from ttt_flash.bench import chain, main

    assert main is chain.main
    out = subprocess.run([sys.executable, "-m", "ttt_flash.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ttt-flash bench" in out.stdout


#: Packages whose modules share private names among themselves (each is one unit): the
#: kernels (``@triton.jit`` helpers of kernels/common.py, the pass kernels bob.py composes), and
#: the packages split from one module by concern (the attention Functions and their checks, the
#: reference's composers, the meta-learning algorithms, the Hessian operator and estimators).
#: A private name never crosses from one of these packages to another module.
PRIVATE_WITHIN = ("ttt_flash.kernels", "ttt_flash.attention", "ttt_flash.meta", "ttt_flash.second_order")


def _same_unit(module: str, target: str) -> bool:
    return any((module == u or module.startswith(u + ".")) and (target == u or target.startswith(u + "."))
               for u in PRIVATE_WITHIN)


def test_no_private_name_crosses_modules():
    # `from x import _name` between library modules: the name is public in x or the user moves.
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = module if _is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not _library(target) or _same_unit(module, _library(target)):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and f"{target}.{a.name}" not in MODULES:
                    bad.append(f"{_where(module)}:{node.lineno} imports {a.name} from {target}")
    for path in sorted((ROOT / "scripts").glob("*.py")):  # the scripts use the public names too
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("ttt_flash"):
                bad += [f"scripts/{path.name}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                        and f"{node.module}.{a.name}" not in MODULES]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_private_name_check_is_not_vacuous(tmp_path, monkeypatch):
    fake = tmp_path / "gradmem.py"
    fake.write_text("from ._common import _secret\n")
    monkeypatch.setitem(MODULES, "ttt_flash.memory.gradmem", fake)
    with pytest.raises(AssertionError, match="imports _secret from ttt_flash.memory._common"):
        test_no_private_name_crosses_modules()


# --------------------------------------------------------------------------- one idea per module

#: The most lines a library module may have (ttt_flash/, kernels/, models/).
MAX_MODULE_LINES = 600

#: Modules allowed over the limit, each with its reason.
LONG_MODULES: dict = {}

#: The most lines of code (its docstring not counted) a function may have.
MAX_FUNCTION_LINES = 80

#: Functions allowed over the limit ("module.qualname"), each with its reason.
LONG_FUNCTIONS = {
    "ttt_flash.kernels.bob.attn_bob": "allocates and launches the BoB passes the plan names; its branches "
                                      "are the plan's cases in launch order",
    "ttt_flash.kernels.bob_affine._bob_affine_kernel": "a Triton kernel: one program's loop over key tiles, "
                                                     "its helpers already @triton.jit functions",
    "ttt_flash.kernels.tune.main": "the offline sweep's command line: argument parsing and the table it "
                                   "prints, run by maintainers only",
    "ttt_flash.cli._check": "`ttt-flash check`: one linear report of the install, line by line",
    "ttt_flash._recipe_cli.recipe_cli": "LightningCLI set-up: the order of its steps is LightningCLI's",
}


def _code_lines(node) -> int:
    n = node.end_lineno - node.lineno + 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        n -= body[0].end_lineno - body[0].lineno + 1
    return n


def _functions(module: str):
    """(qualname, code lines) of every function in ``module``."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, _code_lines(child)))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(ast.parse(MODULES[module].read_text()), "")
    return out


def test_library_modules_stay_small():
    over = {m: MODULES[m].read_text().count("\n") for m in MODULES}
    over = {m: n for m, n in over.items() if n > MAX_MODULE_LINES and m not in LONG_MODULES}
    assert not over, "modules over %d lines (split them by idea): %s" % (
        MAX_MODULE_LINES, ", ".join(f"{_where(m)} ({n})" for m, n in sorted(over.items())))
    stale = [m for m in LONG_MODULES if m not in MODULES or MODULES[m].read_text().count("\n") <= MAX_MODULE_LINES]
    assert not stale, f"LONG_MODULES entries no longer needed: {stale}"


def test_functions_stay_short():
    over = [f"{m}.{q}: {n} lines" for m in MODULES for q, n in _functions(m)
            if n > MAX_FUNCTION_LINES and f"{m}.{q}" not in LONG_FUNCTIONS]
    assert not over, "functions over %d lines of code (split them, or add a reason to LONG_FUNCTIONS):\n%s" % (
        MAX_FUNCTION_LINES, "\n".join(over))
    known = {f"{m}.{q}": n for m in MODULES for q, n in _functions(m)}
    stale = [f for f in LONG_FUNCTIONS if known.get(f, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"LONG_FUNCTIONS entries no longer needed: {stale}"


def test_the_size_checks_see_a_long_function(tmp_path, monkeypatch):
    fake = tmp_path / "tasks.py"
    fake.write_text("def f():\n    '''doc'''\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1))
    monkeypatch.setitem(MODULES, "ttt_flash.tasks", fake)
    with pytest.raises(AssertionError, match="ttt_flash.tasks.f: 82 lines"):
        test_functions_stay_short()
    fake.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    with pytest.raises(AssertionError, match="modules over 600 lines"):
        test_library_modules_stay_small()


def test_no_aliases_of_old_module_paths():
    # one path per module: the package installs no import hook, and the paths modules had
    # before they moved into subpackages do not import
    import importlib
    import sys

    importlib.import_module("ttt_flash")
    hooks = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("ttt_flash")]
    assert not hooks, f"import hooks from the library on sys.meta_path: {hooks}"
    for old in ("ops", "impls", "reference", "context_parallel", "hessian", "hessian_recompute", "optim"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"ttt_flash.{old}")


def test_no_floor_numbers_in_the_library():
    # the floors are FLOORS above (and docs/architecture.md's table): a number copied into a
    # docstring goes stale when a module moves
    import re

    pattern = re.compile(r"\b[Ff]loor [0-9]\b")
    bad = [f"{_where(m)}:{n}: {line.strip()}" for m in MODULES
           for n, line in enumerate(MODULES[m].read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, "\n".join(bad)


def test_the_gluon_pass_header_is_written_once():
    # every Gluon pass module takes its header (Gluon's guarded names, LOG2E) from gluon/common.py
    passes = [m for m in MODULES if m.startswith("ttt_flash.kernels.gluon.")
              and m.rpartition(".")[2] not in ("common", "scope")]
    assert len(passes) == 5
    for module in passes:
        text = MODULES[module].read_text()
        assert "from .common import *" in text, module
        assert "triton.experimental" not in text.split('"""', 2)[-1], f"{module} imports Gluon itself"
        assert "if _gc.HAVE_GLUON:" not in text and "LOG2E = " not in text, f"{module} repeats the header"


# --------------------------------------------------------------------------- one pass, one name


def _gluon_stands_in_for():
    """(Gluon module, Triton kernel, Triton module) from each Gluon pass's docstring: "launches
    it instead of the Triton ``_kernel`` [/ ``_kernel``] (module.py)"."""
    import re

    found = []
    for module in sorted(m for m in MODULES if m.startswith("ttt_flash.kernels.gluon.")):
        name = module.rpartition(".")[2]
        if name in ("common", "scope"):
            continue
        doc = " ".join(ast.get_docstring(ast.parse(MODULES[module].read_text())).split())
        hit = re.search(r"instead of the Triton ((?:``\w+``(?: / )?)+) \((\w+)\.py\)", doc)
        assert hit, f"{module}: its docstring names no Triton kernel it stands in for"
        for kernel in re.findall(r"``(\w+)``", hit.group(1)):
            found.append((name, kernel, hit.group(2)))
    return found


def test_triton_and_gluon_passes_share_module_names():
    # kernels/X.py and kernels/gluon/X.py hold the same pass: the Gluon module's name is the
    # Triton module's, and that module defines the Triton kernel the Gluon one stands in for
    triton_modules = {m.rpartition(".")[2]: m for m in MODULES
                      if m.startswith("ttt_flash.kernels.") and m.count(".") == 2}
    found = _gluon_stands_in_for()
    assert {g for g, _, _ in found} == {"fwd", "dq", "dkdv", "bob_row", "bob_col"}
    for gluon_name, kernel, triton_name in found:
        assert triton_name == gluon_name, f"gluon/{gluon_name}.py stands in for {triton_name}.py"
        assert gluon_name in triton_modules, f"kernels/{gluon_name}.py is missing"
        tree = ast.parse(MODULES[triton_modules[gluon_name]].read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert kernel in defined, f"kernels/{gluon_name}.py does not define {kernel}"


def test_the_docs_kernel_tables_name_every_module():
    # docs/architecture.md's "Inside kernels/" names every module of kernels/ and kernels/gluon/
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Inside `kernels/`"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    named = set(re.findall(r"`((?:gluon/)?\w+\.py)`", section))
    gluon_passes = {m.rpartition(".")[2] + ".py" for m in MODULES
                    if m.startswith("ttt_flash.kernels.gluon.")} - {"__init__.py"}
    triton_modules = {m.rpartition(".")[2] + ".py" for m in MODULES
                      if m.startswith("ttt_flash.kernels.") and m.count(".") == 2
                      and m != "ttt_flash.kernels.gluon"} | {"__init__.py"}
    missing = sorted((triton_modules - named) | {f"gluon/{g}" for g in gluon_passes
                                                  if g not in named and f"gluon/{g}" not in named})
    assert not missing, f"docs/architecture.md's kernels/ tables miss {missing}"
