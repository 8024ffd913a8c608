"""Griffe extensions of the reference site (``mkdocs.yml``); griffe reads the source, it never imports it.

* :class:`PackageDirs`: ``pyproject.toml`` installs ``kernels/`` as ``ttt_flash.kernels`` and
  ``models/`` as ``ttt_flash.models`` (``[tool.setuptools.package-dir]``). Griffe walks
  ``ttt_flash/`` only and so never sees them; once the ``ttt_flash`` package is loaded, this
  extension reads each such folder with griffe's own static visitor under its installed name,
  so that ``::: ttt_flash.kernels`` and the library's imports of ``ttt_flash.models`` resolve
  as they do at run time.
* :class:`LibraryDocstrings`: the library's docstrings are Google style with two habits of
  reStructuredText, rewritten before griffe parses them:

  - several parameters that share a description on one line (``k, v: keys and values.``),
    which the Google parser reads as one parameter named ``"k, v"``: each name gets its own
    entry with the shared description, so every name is still checked against the signature
    (a misspelt or removed parameter fails the strict build); a parameter documented twice in
    one docstring is a warning too;
  - Sphinx roles (``:func:`name```, ``:class:`~a.b.C```) become inline code linked to the
    target's entry in the reference, resolved as Sphinx does (relative to the object's class
    and module, then absolute); a role naming a ``ttt_flash.`` path that does not exist is a
    warning, one naming an object no page shows (private, or of torch) stays plain code;
  - a paragraph ending in ``::`` before a literal block ends in ``:`` (a ``::`` line alone is
    dropped);

  and a class's instance attributes without a docstring (state its methods set on ``self``)
  are left out of the reference, which otherwise lists public names with or without one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import griffe

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> Dict[str, Path]:
    """``{installed name: folder}`` from ``[tool.setuptools.package-dir]`` of ``pyproject``."""
    text = pyproject.read_text()
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S)
    if section is None:
        raise ValueError(f"{pyproject} has no [tool.setuptools.package-dir] table")
    pairs = re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), flags=re.M)
    return {name: pyproject.parent / folder for name, folder in pairs}


def relocated(dirs: Dict[str, Path], top: str) -> Dict[str, Path]:
    """The subpackages of ``top`` that a walk of ``top``'s folder does not reach: those whose
    folder is not their parent package's folder plus their own name."""
    out = {}
    for name, folder in sorted(dirs.items()):
        parent, _, last = name.rpartition(".")
        if name.startswith(top + ".") and (parent not in dirs or folder != dirs[parent] / last):
            out[name] = folder
    return out


class PackageDirs(griffe.Extension):
    """Attach the subpackages of ``package`` installed from other folders to the loaded package."""

    def __init__(self, package: str = "ttt_flash") -> None:
        super().__init__()
        self.package = package

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != self.package:
            return
        for name, folder in relocated(package_dirs(), self.package).items():
            parent = pkg
            for part in name.split(".")[1:-1]:
                parent = parent.members[part]
            module = self._visit_folder(name.rpartition(".")[2], folder, parent, loader)
            parent.set_member(module.name, module)
            loader.expand_exports(module)

    def _visit_folder(self, name: str, folder: Path, parent: griffe.Module, loader: griffe.GriffeLoader) -> griffe.Module:
        """``folder/__init__.py`` as the module ``name`` under ``parent``, then its modules and
        subpackages (folders with an ``__init__.py``)."""
        module = self._visit_file(name, folder / "__init__.py", parent, loader)
        for path in sorted(folder.iterdir()):
            if path.suffix == ".py" and path.stem != "__init__":
                module.set_member(path.stem, self._visit_file(path.stem, path, module, loader))
            elif path.is_dir() and (path / "__init__.py").is_file():
                module.set_member(path.name, self._visit_folder(path.name, path, module, loader))
        return module

    @staticmethod
    def _visit_file(name: str, path: Path, parent: griffe.Module, loader: griffe.GriffeLoader) -> griffe.Module:
        code = path.read_text(encoding="utf-8")
        loader.lines_collection[path] = code.splitlines(keepends=False)
        return griffe.visit(name, filepath=path, code=code, parent=parent, extensions=loader.extensions,
                            docstring_parser=loader.docstring_parser, docstring_options=loader.docstring_options,
                            lines_collection=loader.lines_collection, modules_collection=loader.modules_collection)


_PARAM_SECTION = re.compile(r"^(\s*)(?:Other )?(?:Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments):\s*$")
_GROUPED = re.compile(r"^([\w*]+(?:\s*,\s*[\w*]+)+)\s*(\([^)]*\))?\s*:(.*)$")


def split_grouped_args(text: str) -> str:
    """``text`` (a Google-style docstring) with each ``a, b: description`` item of a parameter
    section written as one item per name, each with the whole description (and type, if any).
    A list of names may wrap: ``a, b,`` then ``c: description`` on the next, deeper line."""
    lines = text.split("\n")
    out: List[str] = []
    i = 0
    while i < len(lines):
        header = _PARAM_SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if header is None:
            continue
        base, item = len(header.group(1)), None
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                nxt = next((ln for ln in lines[i + 1:] if ln.strip()), "")
                if len(nxt) - len(nxt.lstrip()) <= base:
                    break
                out.append(line)
                i += 1
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= base:
                break
            item = indent if item is None else item
            j, names = i + 1, line.strip()
            while names.endswith(",") and ":" not in names and j < len(lines) and lines[j].strip():
                names += " " + lines[j].strip()
                j += 1
            grouped = _GROUPED.match(names) if indent == item else None
            if grouped is None:
                out.append(line)
                i += 1
                continue
            body = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > item):
                if not lines[j].strip():
                    nxt = next((ln for ln in lines[j + 1:] if ln.strip()), "")
                    if len(nxt) - len(nxt.lstrip()) <= item:
                        break
                body.append(lines[j])
                j += 1
            annotation = f" {grouped.group(2)}" if grouped.group(2) else ""
            for name in re.split(r"\s*,\s*", grouped.group(1)):
                out.append(f"{' ' * item}{name}{annotation}:{grouped.group(3)}")
                out.extend(body)
            i = j
    return "\n".join(out)


def documented_twice(text: str) -> List[str]:
    """Names that head more than one item of the parameter sections of ``text`` (a docstring
    already passed through :func:`split_grouped_args`)."""
    seen: Dict[str, int] = {}
    section, item = None, None
    for line in text.split("\n"):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        header = _PARAM_SECTION.match(line)
        if header is not None:
            section, item = indent, None
        elif section is not None and indent <= section:
            section = None
        elif section is not None:
            item = indent if item is None else item
            name = re.match(r"^([\w*]+)\s*(?:\([^)]*\))?\s*:", line.strip())
            if indent == item and name is not None:
                seen[name.group(1)] = seen.get(name.group(1), 0) + 1
    return sorted(name for name, n in seen.items() if n > 1)


_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|data|attr|obj|exc|const|term):`(~?)\.?([^`]+)`")
_LITERAL_MARK = re.compile(r"(?m)(?<=[^\s:])::$(?=\n[ \t]*\n)")
_LITERAL_LINE = re.compile(r"(?m)^[ \t]*::[ \t]*$(?=\n[ \t]*\n)")


def literal_blocks(text: str) -> str:
    """``text`` with the ``::`` that ends a paragraph before a literal block written as ``:``
    (a ``::`` line alone is dropped): the block itself is already Markdown's indented code."""
    return _LITERAL_LINE.sub("", _LITERAL_MARK.sub(":", text))


def link_roles(text: str, resolve: Callable[[str], Optional[str]] = lambda name: None) -> str:
    """``text`` with each Sphinx role as inline code (``~a.b.c`` shown as ``c``), linked to the
    reference page of its target where ``resolve(name)`` gives the target's path (an optional
    cross-reference: plain code if no page documents that object)."""
    def one(m: re.Match) -> str:
        name = m.group(2)
        shown = name.rsplit(".", 1)[-1] if m.group(1) else name
        path = resolve(name)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    return _ROLE.sub(one, text)


def lookup(root: griffe.Module, path: str) -> Optional[Any]:
    """The object at ``path`` (dotted, starting with ``root``'s name) in ``root``'s tree,
    inherited class members included; None if there is none."""
    parts = path.split(".")
    if parts[0] != root.name:
        return None
    obj: Any = root
    try:
        for part in parts[1:]:
            obj = (obj.all_members if obj.is_class else obj.members)[part]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return obj


class LibraryDocstrings(griffe.Extension):
    """Every docstring through :func:`split_grouped_args` and :func:`literal_blocks` when it is
    read, and :func:`link_roles` once its package is loaded; warnings name a parameter
    documented twice and a role naming a path of the package that does not exist.
    Undocumented instance attributes are dropped."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, member in list(cls.members.items()):
            if (not member.is_alias and member.is_attribute and member.docstring is None
                    and "instance-attribute" in member.labels and "class-attribute" not in member.labels):
                cls.del_member(name)

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = literal_blocks(split_grouped_args(obj.docstring.value))
        twice = documented_twice(obj.docstring.value)
        if twice:
            griffe.logger.warning("%s: %s documents %s more than once", _where(obj), obj.path, ", ".join(twice))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._link(pkg, pkg)

    def _link(self, obj: Any, root: griffe.Module) -> None:
        if obj.is_alias:
            return
        if obj.docstring is not None:
            obj.docstring.value = link_roles(obj.docstring.value, lambda name: self._resolve(name, obj, root))
        for member in list(obj.members.values()):
            self._link(member, root)

    @staticmethod
    def _resolve(name: str, obj: Any, root: griffe.Module) -> Optional[str]:
        """Sphinx's order: the name as written relative to the object's class or module and
        each enclosing one, then as an absolute path; a path into ``root``'s package that
        names nothing is a warning."""
        scope = obj if (obj.is_module or obj.is_class) else obj.parent
        for path in [*(f"{s.path}.{name}" for s in _enclosing(scope)), name]:
            found = lookup(root, path)
            if found is not None:
                # an imported name links to where its object is defined (a page's entry
                # answers to its own path and to that canonical one)
                return _canonical(found) or path
        if name.split(".", 1)[0] == root.name:
            griffe.logger.warning("%s: %s names %s, which does not exist", _where(obj), obj.path, name)
        return None


def _enclosing(scope: Any) -> List[Any]:
    out = []
    while scope is not None:
        out.append(scope)
        scope = scope.parent
    return out


def _canonical(obj: Any) -> Optional[str]:
    if not obj.is_alias:
        return None
    try:
        return obj.final_target.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _where(obj: Any) -> str:
    return f"{obj.relative_filepath}:{obj.docstring.lineno}"
