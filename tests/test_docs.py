"""The documentation matches the code: docstring examples run, every Python snippet of
README.md and docs/*.md runs on the CPU, links point at files that exist, the documented
``ttt-flash check --backend triton`` runs on the CPU, and every benchmark figure names its
command, date and GPU."""

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ttt_flash.attention.api

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPU_MARK = "<!-- gpu -->"
# Snippets that are known fragments in pages this suite does not own the text of; strict, so
# the test fails (and the entry must go) once the page is fixed.
KNOWN_FRAGMENTS: dict = {}


def test_attention_docstring_examples():
    result = doctest.testmod(ttt_flash.attention.api)
    assert result.attempted > 0 and result.failed == 0


def test_registry_docstring_examples():
    import ttt_flash.attention.registry

    result = doctest.testmod(ttt_flash.attention.registry)
    assert result.attempted > 0 and result.failed == 0


def _snippets():
    """(page, index within the page, needs a GPU, source) for every ```python block."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i, n = 0, 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                n += 1
                out.append((page.relative_to(ROOT).as_posix(), n, prev == GPU_MARK, "\n".join(lines[i + 1:j])))
                i = j
            i += 1
    return out


SNIPPETS = _snippets()
# A snippet that appears on several pages (README.md repeats integrations.md's) runs once.
UNIQUE = [s for n, s in enumerate(SNIPPETS) if all(t[3] != s[3] for t in SNIPPETS[:n])]


def test_snippets_are_found():
    assert len(SNIPPETS) >= 15 and any(p == "README.md" for p, *_ in SNIPPETS)


@pytest.mark.parametrize("page,index,gpu,source", [
    pytest.param(*s, id=f"{s[0]}#{s[1]}",
                 marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FRAGMENTS[s[:2]])] if s[:2] in KNOWN_FRAGMENTS else [])
    for s in UNIQUE
])
@pytest.mark.slow  # one Python process per snippet (README: the slow tests)
def test_snippet_runs(page, index, gpu, source, tmp_path):
    if gpu and not torch.cuda.is_available():
        pytest.skip(f"{page} snippet {index} is marked {GPU_MARK}")
    # the installed package, not the checkout on sys.path: the checkout's top-level kernels/
    # would shadow the PyPI package "kernels" that transformers imports when it finds one
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}
    r = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"{page} snippet {index} failed:\n{source}\n--- stderr ---\n{r.stderr[-3000:]}"


def test_known_fragments_exist():
    found = {(p, i) for p, i, *_ in SNIPPETS}
    assert set(KNOWN_FRAGMENTS) <= found


_PATH = re.compile(r"`((?:docs|examples|scripts|recipes|tests|ttt_flash|kernels|models|\.ci)/[\w./-]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_paths_exist(page):
    """Markdown links and backquoted repository paths (``docs/x.md``, ``examples/y.py``) name
    files that exist; placeholders (NAME, *, {...}) are not paths."""
    text = page.read_text()
    missing = [link for link in _LINK.findall(text)
               if not link.startswith(("http://", "https://", "mailto:")) and not (page.parent / link).exists()]
    missing += [path for path in _PATH.findall(text)
                if not any(c in path for c in "*{<") and "NAME" not in path and not (ROOT / path).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_check_backend_triton_on_cpu_runs_under_the_interpreter():
    """README: ``ttt-flash check --backend triton`` on a machine without CUDA reruns itself
    under the Triton interpreter in float32 (a fresh process without TRITON_INTERPRET set)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path of --backend triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "ttt_flash.cli", "check", "--backend", "triton", "--batch", "1",
                        "--seq-len", "16", "--head-dim", "8"], env={**env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "float32 on cpu, backend=triton" in r.stdout and r.stdout.strip().endswith("OK")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_check_backend_triton_on_cpu_other_dtypes_are_one_line(dtype, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU path of --backend triton")
    from ttt_flash.cli import main

    with pytest.raises(SystemExit) as e:
        main(["check", "--backend", "triton", "--dtype", dtype])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"Triton interpreter in float32 only, got --dtype {dtype}" in err and "Traceback" not in err


def _benchmark_sections():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return [(part.splitlines()[0], part) for part in parts]


@pytest.mark.parametrize("title,body", _benchmark_sections(), ids=lambda x: x if len(x) < 60 else "")
def test_benchmark_section_names_date_gpu_command_and_raw_data(title, body):
    """Every figure on the benchmarks page says when (a date), where (which GPU), how (a
    command in backquotes) and where its raw data is (a file in docs/results/, or "none kept")."""
    assert re.search(r"\*\*Date:\*\* 20\d\d-\d\d-\d\d", body), f"{title!r}: no **Date:** YYYY-MM-DD"
    assert re.search(r"\*\*GPU:\*\* [^·\n]*H200", body), f"{title!r}: no **GPU:** naming the GPU"
    assert re.search(r"\*\*Command:\*\* `[^`]+`", body), f"{title!r}: no **Command:** `...`"
    raw = re.search(r"\*\*Raw data:\*\*(.*?)(?:\n- \*\*|\n\n)", body, flags=re.S)
    assert raw, f"{title!r}: no **Raw data:**"
    files = re.findall(r"`(docs/results/[^`]+)`", raw.group(1))
    assert files or "none kept" in raw.group(1), f"{title!r}: raw data names no file and not 'none kept'"
    for f in files:
        assert (ROOT / f).is_file(), f"{title!r}: {f} does not exist"


def test_benchmarks_page_has_no_dated_session_logs():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(_benchmark_sections()) >= 10
    assert not re.search(r"\bsession\b|\bissue \d+|\(issues? \d", text, flags=re.I)


def test_raw_results_live_in_docs_results():
    assert not list((ROOT / "docs").glob("*.json")), "raw JSON belongs in docs/results/"
    assert list((ROOT / "docs" / "results").glob("*.json"))


# --------------------------------------------------------------------------- words for users

USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "reference").glob("*.md")),
              *sorted((ROOT / "recipes").glob("*.yaml"))]
# Lab-notebook wording: how the work was organised or how the code used to be, not what it does.
NOTEBOOK = {
    "session": r"\bsessions?\b",
    "GPU session": r"\bGPU session",
    "one call": r"\bone(?:-| )call\b",
    "device call": r"\bdevice calls?\b",
    "10-minute call": r"\b\d+-minute call",
    "a machine kind": r"nvidia-[a-z]\d+|\bh200-x\d",
    "floor N": r"\bfloors? \d",
    "used to": r"\bused to\b",
    "until then": r"\buntil then\b",
    "appended section": r"\bappended section\b",
    "git show": r"\bgit show\b",
    "a commit id": r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.-])",
    "a path outside the repository": r"(?<![\w.])shared/|\]\(\.\./\.\./|(?<![\w/])\.\./(?!index\.md|[\w-]+\.md)",
}
# docs/architecture.md defines the import floors (tests/test_architecture.py holds the table).
NOTEBOOK_EXEMPT = {("docs/architecture.md", "floor N")}


def _notebook_hits(text: str, where: str):
    hits = []
    for name, pattern in NOTEBOOK.items():
        if (where, name) in NOTEBOOK_EXEMPT:
            continue
        for m in re.finditer(pattern, text, flags=re.I):
            line = text.count("\n", 0, m.start()) + 1
            hits.append(f"{where}:{line}: {name!r}: ...{text[max(0, m.start() - 40):m.end() + 40]!r}...")
    return hits


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_user_pages_have_no_lab_notebook_words(page):
    """README, docs/, the API pages and the recipes speak to users: no sessions, device calls,
    machine kinds, import floors, "used to", `git show` or files outside the repository."""
    hits = _notebook_hits(page.read_text(), page.relative_to(ROOT).as_posix())
    assert not hits, "\n".join(hits)


def _docstrings():
    import ast

    for folder in ("ttt_flash", "kernels", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            nodes = [tree, *(n for n in ast.walk(tree)
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
            for node in nodes:
                doc = ast.get_docstring(node)
                if doc:
                    yield path.relative_to(ROOT).as_posix(), getattr(node, "name", "<module>"), doc


def test_docstrings_have_no_lab_notebook_words():
    """The API reference is built from the docstrings: the same rule as the pages."""
    found = list(_docstrings())
    assert len(found) > 300
    hits = []
    for where, name, doc in found:
        hits += _notebook_hits(doc, f"{where} ({name})")
    assert not hits, "\n".join(hits)


def test_the_notebook_rule_catches_what_it_names():
    for text in ("Commands for the GPU session", "Longer than one 10-minute call", "in one call",
                 "on the nvidia-h200-x2 machine", "This module is floor 1", "Where the error used to be",
                 "Until then the meta-gradient stopped", "(`ttt_flash.tasks`, appended section)",
                 "`git show fd5eb20:recipes/x.yaml`", "(`shared/docs/anchors.md`)", "the kernels at d553abd",
                 "(at commit 568e3b8: 6 blocks"):
        assert _notebook_hits(text, "x"), text
    for text in ("a single call", "the floor of the loss", "each user's run", "docs/reference/x.md",
                 "[Home](../index.md)", "1048576 tokens", "rope_base: 10000000", "facade", "0x1f2e3d4c"):
        assert not _notebook_hits(text, "x"), text


# --------------------------------------------------------------------------- quoted CPU numbers

_NUMBERS_MARK = re.compile(r"<!-- numbers: ((?:docs/results/[\w.-]+\.json(?:#[\w.-]+)?\s*)+)-->")
# a decimal number, with its sign where the text writes one (− or +; a hyphen is a range)
_DECIMAL = re.compile(r"(?<![\w.])([−+]?\d+\.\d+)(?![\w.])")
_RECIPE = re.compile(r"recipes/(\w+)\.yaml")
_SCRIPT_COMMAND = re.compile(r"^(?:OMP_NUM_THREADS=1 )?python3? (scripts/[\w-]+\.py)(?: |$)")
# The pages' CPU results and the recipes or scripts they come from (each needs a marked block).
QUOTED_RECIPES = {
    "docs/memory.md": {"gradmem_kv", "ttt_e2e_mqar", "memory_layer_mqar", "scripts/memory_recall_probe.py",
                       "scripts/maml_memory_layer_seeds.py"},
    "docs/meta-learning.md": {"maml_sinusoid", "maml_transformer", "imaml_regression", "reptile_sinusoid"},
    "docs/second-order.md": {"sophia_gpt_tiny"},
}


def _numbers_blocks():
    """(page, marker line, results files, block text) for every ``<!-- numbers: FILES -->``
    marker: the block is the text after it up to the next blank line. ``FILE#key`` names the
    part ``key`` of a file (one variant of several in one JSON)."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = _NUMBERS_MARK.search(line)
            if m:
                block = []
                for row in lines[i + 1:]:
                    if not row.strip():
                        break
                    block.append(row)
                out.append((page.relative_to(ROOT).as_posix(), i + 1, m.group(1).split(), "\n".join(block)))
    return out


def _values(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _values(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _values(v)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield float(tree)


def _records(tree, seed=None):
    """(seed, values) of every dict in ``tree``: its seed (``"seed"``, else its parent's) and
    every number below it. A table row's numbers must all be values of one record."""
    if isinstance(tree, dict):
        seed = tree.get("seed", seed)
        yield seed, list(_values(tree))
        for v in tree.values():
            yield from _records(v, seed)
    elif isinstance(tree, list):
        for v in tree:
            yield from _records(v, seed)


def _commands(tree):
    """Every string under a ``command`` / ``commands`` key of ``tree``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in ("command", "commands"):
                yield from ([v] if isinstance(v, str) else v)
            else:
                yield from _commands(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _commands(v)


def _source(d):
    """What made a results file: its recipe (a ``ttt-flash fit`` command) or its script."""
    if "recipe" in d:
        return d["recipe"]
    scripts = {m.group(1) for c in _commands(d) if (m := _SCRIPT_COMMAND.match(c))}
    return scripts.pop() if len(scripts) == 1 else None


def _cells(row):
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _block_errors(page, line, files, text, load):
    """What is wrong with one marked block (an empty list: nothing). ``load(file)`` gives a
    results file's JSON (``file#key``: its part ``key``).

    Each file must hold the command that made it: a recipe's file its fit command, any other
    one the command of one script of scripts/. Every decimal number of the block (with its
    sign) must be one of the files' values at its printed precision. A table row is held to
    one record (one dict of a file): the numbers of the row all come from a single record, of
    a file of the recipe the row names (a row naming only other recipes is theirs, not checked)
    and, where the table has a ``seed`` column, of that seed (an empty seed cell continues the
    row above; a word such as "mean" is no seed)."""
    errors, data = [], {}
    for f in files:
        d = load(f)
        if "recipe" in d:
            if not any(c.startswith(f"OMP_NUM_THREADS=1 ttt-flash fit --config recipes/{d['recipe']}.yaml")
                       for c in d.get("commands", [])):
                errors.append(f"{f}: no `OMP_NUM_THREADS=1 ttt-flash fit --config recipes/{d['recipe']}.yaml` command")
        else:
            script = _source(d)
            if script is None or not (ROOT / script).is_file():
                errors.append(f"{f}: no command of one script of scripts/ (`python scripts/<name>.py ...`)")
        data[f] = (d, list(_records(d, d.get("seed"))))
    recipes = {d["recipe"] for d, _ in data.values() if "recipe" in d}
    seed_col, seed, checked = None, None, 0
    rows = text.splitlines()
    for i, row in enumerate(rows):
        numbers = _DECIMAL.findall(row)
        is_table = row.lstrip().startswith("|")
        if is_table and i + 1 < len(rows) and re.fullmatch(r"\|?[\s|:-]+\|?", rows[i + 1].strip()):
            header = [c.lower() for c in _cells(row)]
            seed_col, seed = (header.index("seed") if "seed" in header else None), None
            continue
        named = set(_RECIPE.findall(row))
        if named and not named & recipes:
            continue  # another recipe's row
        candidates = [f for f in files if not named or data[f][0].get("recipe") in named]
        records = {f: [vals for _, vals in data[f][1]] for f in candidates}
        if is_table and seed_col is not None:
            cells = _cells(row)
            if seed_col < len(cells) and cells[seed_col]:
                seed = int(cells[seed_col]) if cells[seed_col].isdigit() else None
            if seed is not None:
                records = {f: [vals for s, vals in data[f][1] if s == seed] for f in candidates}
                candidates = [f for f in candidates if records[f]]

        def holds(values, number):
            places = len(number.split(".")[1])
            return any(abs(round(v, places) - float(number)) < 0.5 * 10 ** -places for v in values)

        for number in (n.replace("−", "-") for n in numbers):
            if not any(holds(vals, number) for f in candidates for vals in records[f]):
                errors.append(f"{page}:{line}: {number} is in no value of {candidates}:\n{row}")
        if is_table and numbers and not any(all(holds(vals, n.replace("−", "-")) for n in numbers)
                                            for f in candidates for vals in records[f]):
            errors.append(f"{page}:{line}: the numbers of one row come from no single file of {candidates}:\n{row}")
        checked += len(numbers)
    if not checked:
        errors.append(f"{page}:{line}: a marked block without numbers")
    return errors


def _load(f):
    import json

    path, _, key = f.partition("#")
    d = json.loads((ROOT / path).read_text())
    return d[key] if key else d


def test_quoted_cpu_numbers_come_from_results_files_with_their_command():
    """Every decimal number in a block marked ``<!-- numbers: docs/results/X.json -->`` is a
    value of those files at the printed precision, a table row's from the file of its recipe
    and seed (``_block_errors``); each file holds the exact command that made it; every page
    quoting CPU-recipe results marks them."""
    blocks = _numbers_blocks()
    marked, errors = {}, []
    for page, line, files, text in blocks:
        errors += _block_errors(page, line, files, text, _load)
        marked.setdefault(page, set()).update(_source(_load(f)) for f in files)
    assert not errors, "\n".join(errors)
    for page, recipes in QUOTED_RECIPES.items():
        assert recipes <= marked.get(page, set()), f"{page}: quotes {recipes - marked.get(page, set())} unmarked"


def _reptile_block():
    return next(b for b in _numbers_blocks() if any("reptile_sinusoid" in f for f in b[2]))


def test_the_numbers_rule_catches_a_stale_number():
    page, line, files, text = _reptile_block()
    assert not _block_errors(page, line, files, text, _load)
    seed0 = _load("docs/results/cpu_reptile_sinusoid_seed0.json")
    final = f"{seed0['validations'][-1]['val/loss_post']:.3f}"
    assert final in text
    stale = f"{float(final) + 0.01:.3f}"
    assert not any(round(v, 3) == float(stale) for f in files for v in _values(_load(f)))
    errors = _block_errors(page, line, files, text.replace(final, stale), _load)
    assert any(f"{stale} is in no value" in e for e in errors), errors


def test_the_numbers_rule_holds_a_row_to_its_seed_and_its_file():
    page, line, files, text = _reptile_block()
    rows = text.splitlines()
    seed_rows = [i for i, r in enumerate(rows) if r.startswith("|") and _DECIMAL.search(r)]
    assert len(seed_rows) == 3
    # seed 1's row labelled seed 2: its numbers are values of a file, but not of seed 2's
    relabelled = rows[:]
    relabelled[seed_rows[2]] = re.sub(r"^\|([^|]*)\|\s*1\s*\|", r"|\1| 2 |", rows[seed_rows[1]])
    assert relabelled[seed_rows[2]] != rows[seed_rows[1]]
    errors = _block_errors(page, line, files, "\n".join(relabelled), _load)
    assert any("is in no value of ['docs/results/cpu_reptile_sinusoid_seed2.json']" in e for e in errors), errors
    # one row's numbers from two files (the seed column removed): each is a value, no file holds both
    a, b = _cells(rows[seed_rows[0]]), _cells(rows[seed_rows[1]])
    mixed = f"| recipe | after epoch 0 | final |\n| --- | --- | --- |\n| `reptile_sinusoid` | {a[2]} | {b[3]} |"
    errors = _block_errors(page, line, files, mixed, _load)
    assert errors and all("no single file" in e for e in errors), errors
    # a file without its command
    no_command = lambda f: {**_load(f), "commands": []}  # noqa: E731
    assert any("no `OMP_NUM_THREADS=1 ttt-flash fit" in e for e in _block_errors(page, line, files, text, no_command))


def _block_of(name):
    return next(b for b in _numbers_blocks() if any(name in f for f in b[2]))


def test_the_numbers_rule_checks_script_results_and_their_parts():
    # the recall-probe table: a changed number of the page, or of a results file, fails
    page, line, files, text = _block_of("cpu_memory_recall_probe_key_seed1")
    assert not _block_errors(page, line, files, text, _load)
    row = next(r for r in text.splitlines() if "1,024: 0.984, 4,096: 0.984" in r)
    errors = _block_errors(page, line, files, text.replace(row, row.replace("4,096: 0.984", "4,096: 0.985")), _load)
    assert any("0.985 is in no value" in e for e in errors), errors

    def shifted(f):
        d = _load(f)
        return {**d, "longer": {k: v + 0.01 for k, v in d["longer"].items()}} if "key_seed1" in f else d

    assert any("0.984 is in no value" in e for e in _block_errors(page, line, files, text, shifted))
    # a script's results file without its command
    no_command = lambda f: {k: v for k, v in _load(f).items() if k != "commands"}  # noqa: E731
    assert any("no command of one script" in e for e in _block_errors(page, line, files, text, no_command))
    # one part (#key) of a file with several: the chunk-4 table is not the recipe defaults'
    page, line, files, text = _block_of("#chunk4_inner_lr0.01")
    assert not _block_errors(page, line, files, text, _load)
    other = [f.replace("#chunk4_inner_lr0.01", "#recipe_defaults") for f in files]
    assert any("is in no value" in e for e in _block_errors(page, line, other, text, _load))
    # the mean ± standard deviation row comes from the part's summary
    summary = _load(files[0])["summary"]["exact"]
    assert f"{summary['val_loss_post']:.4f}** ± {summary['val_loss_post_stdev']:.4f}" in text
    # a signed difference keeps its sign
    page, line, files, text = next(b for b in _numbers_blocks() if b[2] == ["docs/results/maml_memory_layer_seeds_cpu.json"])
    assert "−0.0006" in text and not _block_errors(page, line, files, text, _load)
    assert any("0.0006 is in no value" in e
               for e in _block_errors(page, line, files, text.replace("−0.0006", "+0.0006"), _load))
