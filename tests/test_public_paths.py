"""Every import path the documentation shows works: each ``from ttt_flash... import ...`` and
each dotted ``ttt_flash.x.y`` name in README.md and docs/*.md imports where it is (the library
keeps no aliases of old module paths)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FROM = re.compile(r"from (ttt_flash[\w.]*) import (\([^)]*\)|[^\n#`]*)")
_DOTTED = re.compile(r"\bttt_flash(?:\.[A-Za-z_]\w*)+")


def _documented():
    """(doc, module, name or None) of every documented import: ``name`` None for a dotted path."""
    out = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in _FROM.findall(text):
            for name in re.split(r"[,\s()]+", names):
                name = name.strip()
                if name and name != "as" and re.fullmatch(r"\w+", name) and not name.startswith("\\"):
                    out.add((doc.name, module, name))
        for match in _DOTTED.finditer(text):
            out.add((doc.name, match.group(0), None))
    # `from x import a as b`: the word after `as` is no name of x
    return sorted((x for x in out if not _is_alias(x)), key=lambda x: (x[0], x[1], x[2] or ""))


def _is_alias(item):
    doc, module, name = item
    if name is None:
        return False
    text = (ROOT / ("README.md" if doc == "README.md" else f"docs/{doc}")).read_text()
    return re.search(rf"\bas {name}\b", text) is not None and not re.search(rf"import[^\n]*\b{name}\b(?! as)", text)


def _resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


DOCUMENTED = _documented()


def test_the_docs_show_imports():
    assert len(DOCUMENTED) > 50
    assert ("README.md", "ttt_flash", "flash_attention") in DOCUMENTED


@pytest.mark.parametrize("doc, module, name", DOCUMENTED,
                         ids=[f"{d}:{m}{'' if n is None else ':' + n}" for d, m, n in DOCUMENTED])
def test_documented_import_works(doc, module, name):
    if name is None:
        _resolve(module)
    else:
        assert hasattr(importlib.import_module(module), name) or importlib.import_module(f"{module}.{name}")
