"""The reference site (``mkdocs.yml``): ``mkdocs build --strict`` passes without a warning, its
API pages document the public names of the modules they cover, and the griffe extensions the
build relies on (``docs/griffe_extensions.py``) do what it needs.

The strict build is the gate on the docs: a docstring that names a parameter the signature
lacks, a broken link between pages, a missing ``:::`` target or a page of docs/ left out of
the nav all fail it (mkdocs.yml's ``validation``).
"""

import ast
import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

# the docs tools come with the dev extra (`pip install -e ".[dev]"`, what CI installs); a
# machine with the library alone (the GPU machine) skips this file
griffe = pytest.importorskip("griffe")
load_config = pytest.importorskip("mkdocs.config").load_config

ROOT = Path(__file__).resolve().parents[1]

#: API page (docs/reference/NAME.md) -> the modules whose ``__all__`` it documents in full.
PAGES = {
    "meta": ["ttt_flash/meta/__init__.py"],
    "second-order": ["ttt_flash/second_order/__init__.py", "ttt_flash/second_order/optim.py", "ttt_flash/fsdp.py"],
    "distributed": ["ttt_flash/distributed/__init__.py"],
    "cuda-graph": ["ttt_flash/cuda_graph.py"],
    "memory": ["ttt_flash/memory/__init__.py"],
    "models": ["models/__init__.py"],
    "lightning": ["ttt_flash/lightning/__init__.py"],
}


def _extensions():
    spec = importlib.util.spec_from_file_location("griffe_extensions", ROOT / "docs" / "griffe_extensions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all(path):
    """``__all__`` of a source file, read with ``ast``."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no __all__")


def _module_name(path):
    parts = list(Path(path).with_suffix("").parts)
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(["ttt_flash", *parts] if parts[0] in ("kernels", "models") else parts)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr, out


def test_site_builds_strict_without_warnings(site):
    code, log, out = site
    assert code == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    assert not re.search(r"^(WARNING|ERROR)\b", log, flags=re.M), log
    assert (out / "index.html").is_file() and (out / "reference" / "kernels" / "index.html").is_file()


def test_home_page_is_the_readme(site):
    _, _, out = site
    page = (out / "index.html").read_text()
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert headings and all(f">{h.replace('`', '')}" in re.sub(r"</?code>", "", page) for h in headings)


def _nav_pages(nav):
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            yield from (_nav_pages(value) if isinstance(value, list) else [value])


def test_every_page_is_in_the_nav():
    nav = list(_nav_pages(load_config(str(ROOT / "mkdocs.yml"))["nav"]))
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages


@pytest.mark.parametrize("page", sorted(PAGES))
def test_api_page_documents_every_public_name(site, page):
    _, _, out = site
    html = (out / "reference" / page / "index.html").read_text()
    anchors = set(re.findall(r'id="(ttt_flash[\w.]*)"', html))
    missing = [f"{_module_name(src)}.{name}" for src in PAGES[page] for name in _all(src)
               if f"{_module_name(src)}.{name}" not in anchors]
    assert not missing, f"docs/reference/{page}.md does not document {missing}"


def test_package_and_kernel_pages(site):
    _, _, out = site
    # ttt_flash's public names: on its page, or (lent lazily from ttt_flash.memory) on the memory page
    html = (out / "reference" / "attention" / "index.html").read_text()
    memory = (out / "reference" / "memory" / "index.html").read_text()
    for name in _all("ttt_flash/__init__.py"):
        assert f'id="ttt_flash.{name}"' in html or f'id="ttt_flash.memory.{name}"' in memory, name
    # the composers, documented where they are defined (kernels/NAME.py), under their installed names
    html = (out / "reference" / "kernels" / "index.html").read_text()
    for name in ("attn_fwd", "attn_bwd", "attn_bob", "attn_tangent", "attn_jvp"):
        assert re.search(rf'id="ttt_flash\.kernels\.\w+\.{name}"', html), name
    # grouped parameters (``k, v: ...``) are listed one per name
    html = (out / "reference" / "attention" / "index.html").read_text()
    varlen = html[html.index('id="ttt_flash.flash_attention_varlen"'):]
    assert "<code>k</code>" in varlen and "<code>cu_seqlens_k</code>" in varlen and "<code>k, v</code>" not in varlen


def _load(tmp_path, source, *extensions):
    (tmp_path / "sample_mod.py").write_text(source)
    module = griffe.load("sample_mod", search_paths=[tmp_path], docstring_parser="google",
                         extensions=griffe.load_extensions(*extensions))
    return module


def test_grouped_parameters_are_split_and_still_checked(tmp_path, caplog):
    ext = _extensions()
    source = '''
def f(a: int, b: int, c: int, d: int) -> int:
    """Sum.

    Args:
        a, b: the first two, described
            on two lines.
        c,
            d: wrapped names.

    Returns:
        a number.
    """

def g(a: int, b: int):
    """One misspelt name.

    Args:
        a, x: the second name is not in the signature.
    """

def h(a: int, b: int):
    """One name twice.

    Args:
        a, b: both.
        b: again.
    """
'''
    module = _load(tmp_path, source, ext.LibraryDocstrings)
    with caplog.at_level(logging.WARNING, logger="griffe"):
        params = {p.name: p.description for p in module["f"].docstring.parsed[1].value}
        module["g"].docstring.parsed
    assert params == {"a": "the first two, described\non two lines.", "b": "the first two, described\non two lines.",
                      "c": "wrapped names.", "d": "wrapped names."}
    assert "Parameter 'x' does not appear in the function signature" in caplog.text
    assert "documents b more than once" in caplog.text
    # without the extension, the Google parser reads one parameter called "a, b"
    plain = _load(tmp_path, source)
    assert [p.name for p in plain["f"].docstring.parsed[1].value][0] == "a, b"


def test_undocumented_instance_attributes_are_dropped(tmp_path):
    ext = _extensions()
    source = '''
class C:
    """A class.

    Args:
        n: a size.
    """

    LIMIT = 3

    def __init__(self, n: int):
        self.n = n
        """The size."""
        self.cache = {}

    def run(self):
        pass
'''
    cls = _load(tmp_path, source, ext.LibraryDocstrings)["C"]
    assert {"n", "LIMIT", "run"} <= set(cls.members) and "cache" not in cls.members
    assert "cache" in _load(tmp_path, source)["C"].members


def test_sphinx_roles_become_linked_code(tmp_path, caplog):
    ext = _extensions()
    assert ext.literal_blocks("see::\n\n    x = 1\n\n::\n\n    y") == "see:\n\n    x = 1\n\n\n\n    y"
    assert ext.link_roles("a :func:`torch.func.grad` and :class:`~a.b.C`") == "a `torch.func.grad` and `C`"
    source = '''
"""Module: :func:`f`, :class:`~sample_mod.C`, :func:`torch.func.grad`."""


def f():
    """Calls :meth:`C.run`."""


class C:
    """Its own :meth:`run`, and :func:`sample_mod.missing`."""

    def run(self):
        """Back to :func:`f`."""
'''
    with caplog.at_level(logging.WARNING, logger="griffe"):
        module = _load(tmp_path, source, ext.LibraryDocstrings)

    def link(path, shown):
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    assert module.docstring.value == (f"Module: {link('sample_mod.f', 'f')}, {link('sample_mod.C', 'C')}, "
                                      "`torch.func.grad`.")
    assert module["f"].docstring.value == f"Calls {link('sample_mod.C.run', 'C.run')}."
    assert module["C"].docstring.value.startswith(f"Its own {link('sample_mod.C.run', 'run')}, and `sample_mod.missing`")
    assert module["C.run"].docstring.value == f"Back to {link('sample_mod.f', 'f')}."
    assert "names sample_mod.missing, which does not exist" in caplog.text
    assert caplog.text.count("does not exist") == 1


def test_roles_link_across_pages(site):
    _, _, out = site
    assert 'href="#ttt_flash.meta.inner_loop"' in (out / "reference" / "meta" / "index.html").read_text()
    assert 'href="../models/#ttt_flash.models.GPT"' in (out / "reference" / "memory" / "index.html").read_text()


def test_relocated_subpackages_load_under_their_installed_names():
    ext = _extensions()
    dirs = ext.package_dirs()
    relocated = ext.relocated(dirs, "ttt_flash")
    # the package-dir entries whose folder is not their parent package's folder plus their name
    assert relocated and all(dirs[name] == folder for name, folder in relocated.items())
    for name, folder in dirs.items():
        parent, _, last = name.rpartition(".")
        assert (name in relocated) == (name.startswith("ttt_flash.") and folder != dirs[parent] / last), name
    package = griffe.load("ttt_flash", search_paths=[ROOT], docstring_parser="google",
                          extensions=griffe.load_extensions(ext.PackageDirs))
    for name in relocated:
        module = package[name.split(".", 1)[1]]
        assert module.is_module and module.path == name and module.filepath == dirs[name] / "__init__.py"
    assert package["kernels.bob.attn_bob"].is_function
    assert package["models.GPT"].final_target.path == "ttt_flash.models.gpt.GPT"
