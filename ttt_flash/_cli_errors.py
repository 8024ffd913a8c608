"""Short errors of ``ttt-flash fit|validate|test`` for what a recipe or a command line gets
wrong: an unknown key (named in full, with where it was given and the closest valid keys), a
config file that is missing, empty or not YAML, duplicate keys, a value a class refuses, and
GPU-only settings on a machine without CUDA."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
from typing import List, Optional, Sequence

# --------------------------------------------------------------------------- unknown keys

# jsonargparse's wordings: a subclass's init_args key, a nested group's key, a key of a plain
# group / the root, a wrong value, and the parser key (group) a message is about
_NOT_ACCEPTED = re.compile(r"Option '([\w.\-]+)' is not accepted")
_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")
_NESTED = re.compile(r"Group '([\w.\-]+)' does not accept option '([\w.\-]+)'")
_UNEXPECTED = re.compile(r"does not accept option '([\w.\-]+)'|[Uu]nrecognized arguments: (\S+)")
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')
_EXPECTED = re.compile(r"Expected a (.+?)\. Got value: (.*)")
_BAD_CLASS = re.compile(r"Problem with given class_path '([\w.]+)':\s*\n\s*(module '[\w.]+' has no attribute "
                        r"'\w+'|No module named '[\w.]+'|[^\n]*is not a subclass[^\n]*|[^\n]*[Ii]mport[^\n]*)")
_BASE_CLASSES = ("lightning.LightningModule", "lightning.LightningDataModule",
                 "lightning.pytorch.LightningModule", "lightning.pytorch.LightningDataModule")


def config_files(argv: Sequence[str]) -> List[str]:
    files = []
    for i, a in enumerate(argv):
        if a in ("-c", "--config") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif a.startswith("--config="):
            files.append(a.split("=", 1)[1])
    return files


def _on_command_line(key: str, argv: Sequence[str]) -> bool:
    """Whether ``--key`` (or ``--key=...``; ``init_args`` levels optional) is in ``argv``."""
    def short(k: str) -> str:
        return ".".join(part for part in k.split(".") if part != "init_args")

    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            if name == key or short(name) == short(key):
                return True
    return False


def _yaml_line(path: str, key: str) -> Optional[int]:
    """The line (1-based) of the dotted ``key`` in the YAML file ``path``, or None. A list on
    the way (``trainer.callbacks``) is searched item by item."""
    import yaml

    try:
        with open(path) as f:
            node = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return None
    return _node_line(node, key.split("."))


def _node_line(node, parts: Sequence[str]) -> Optional[int]:
    import yaml

    if not parts:
        return None
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            line = _node_line(item, parts)
            if line is not None:
                return line
        return None
    if not isinstance(node, yaml.MappingNode):
        return None
    found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == parts[0]]
    if not found:
        return None
    key_node, value = found[-1]
    if len(parts) == 1:
        return key_node.start_mark.line + 1
    return _node_line(value, parts[1:])


def _where(key: str, files: Sequence[str], argv: Sequence[str] = ()) -> str:
    """Where ``key`` was given: "the command line" (which overrides the recipe files), else the
    recipe file and line that hold it, else "the command line"."""
    if _on_command_line(key, argv):
        return "the command line"
    for path in reversed(list(files)):  # a later file overrides an earlier one
        line = _yaml_line(path, key)
        if line is not None:
            return f"{path}:{line}"
    return "the command line"


def _import(class_path: str):
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_keys(class_path: str) -> List[str]:
    """The keyword arguments of ``class_path``'s ``__init__``."""
    try:
        params = inspect.signature(_import(class_path).__init__).parameters.values()
    except (AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _nested_keys(class_path: str, group: str) -> List[str]:
    """The keys of ``class_path``'s ``__init__`` argument ``group`` (a dataclass or a class,
    e.g. ``net``: NetConfig's fields), or []."""
    try:
        param = inspect.signature(_import(class_path).__init__).parameters[group.split(".")[0]]
    except (AttributeError, KeyError, ValueError, TypeError):
        return []
    kind = param.annotation if param.annotation is not inspect.Parameter.empty else type(param.default)
    if isinstance(kind, str):
        kind = type(param.default)
    options = [t for t in getattr(kind, "__args__", ()) if dataclasses.is_dataclass(t)]
    if options:  # a union such as NetConfig | nn.Module: the keys of its dataclass
        kind = options[0]
    if dataclasses.is_dataclass(kind):
        return [f.name for f in dataclasses.fields(kind)]
    try:
        return [n for n in inspect.signature(kind.__init__).parameters if n != "self"]
    except (ValueError, TypeError):
        return []


def _group_keys(parser, key: str) -> List[str]:
    """Valid keys next to a dotted ``key`` in ``parser`` (the root or a subcommand's)."""
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    keys = set()
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", "")
        if dest.startswith(prefix) and dest != "help":
            rest = dest[len(prefix):]
            if rest:
                keys.add(rest.split(".", 1)[0])
    return sorted(keys)


def _first_unknown(parser, key: str) -> str:
    """The shortest leading part of the dotted ``key`` that no option of ``parser`` starts with
    (``modle`` of ``modle.init_args.net.kind``); ``key`` itself when every part is known."""
    dests = [getattr(a, "dest", "") for a in getattr(parser, "_actions", [])]
    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if not any(d == prefix or d.startswith(prefix + ".") for d in dests):
            return prefix
    return key


def _class_path_message(class_path: str, why: str, group: str, files: Sequence[str], argv: Sequence[str],
                        prog: str) -> str:
    """A class that cannot be imported: where it was named and the closest importable names."""
    module, _, name = class_path.rpartition(".")
    close: List[str] = []
    try:
        names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        close = [f"{module}.{n}" for n in difflib.get_close_matches(name, names, n=3, cutoff=0.6)]
    except (ImportError, ValueError):
        pass
    key = f"{group}.class_path" if group.split(".")[0] in ("model", "data") else group
    lines = [f"{prog}: error: cannot import class_path '{class_path}' ({why.strip()}) in {_where(key, files, argv)}"]
    if close:
        lines.append("  closest: " + ", ".join(close))
    lines.append(f"  (the options of a class: {prog} --{group}.help CLASS)")
    return "\n".join(lines)


def _indent(line: str) -> int:
    """The column where a line of a jsonargparse message starts (after a list item's "- ")."""
    return len(line) - len(line.lstrip(" -"))


def _nested_unknown(message: str):
    """For a key refused inside a class argument of a class (``net: {class_path, init_args}``
    and deeper): ``(key, class_path, valid)``, the key's full dotted path from the group of the
    message, the class that refused it and that class's keys. None for a message without
    such nesting. The path is read from the message's tree of "Parser key" and "Problem with
    given class_path" lines above the refusal (a dataclass takes its fields without
    ``init_args``)."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        refused = _NOT_ACCEPTED.search(line) or _NESTED.search(line)
        if not refused:
            continue
        chain, level = [], _indent(line)
        for above in reversed(lines[:i]):
            if _indent(above) < level:
                level = _indent(above)
                key, cls = _PARSER_KEY.search(above), _CLASS_PATH.search(above)
                if key or cls:
                    chain.append(("key", key.group(1)) if key else ("class", cls.group(1)))
        chain.reverse()
        classes = [v for k, v in chain if k == "class"]
        if len(classes) < 2 or not chain or chain[0][0] != "key":
            return None
        parts = list(refused.groups()[-2:]) if refused.re is _NESTED else [refused.group(1)]
        path, after_class = [], False
        for kind, value in chain + [("key", ".".join(parts))]:
            if kind == "class":
                after_class = not dataclasses.is_dataclass(_import(value))
                continue
            path += (["init_args"] if after_class else []) + [value]
            after_class = False
        owner = _import(classes[-1])
        valid = ([f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner)
                 else _init_keys(classes[-1]))
        return ".".join(path), classes[-1], valid
    return None


def _given_keys(message: str) -> List[str]:
    """The keys of the dict in jsonargparse's "Given value: {...}" line, or []."""
    import ast

    m = re.search(r"Given value: (\{.*\})\s*$", message, re.S)
    if not m:
        return []
    try:
        value = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return []
    return list(value) if isinstance(value, dict) else []


def _expected(text: str) -> str:
    """``<class 'int'>`` -> ``int``; other type texts as they are."""
    return re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", text.strip()).replace("NoneType", "None")


def unknown_key_message(message: str, argv: Sequence[str], parser=None, prog: str = "ttt-flash") -> Optional[str]:
    """A short error for a jsonargparse ``message`` about a key no class accepts or a value of
    the wrong type: the full key, where it was given (recipe file and line, or the command
    line) and the valid keys closest to it / the type expected. None when ``message`` is about
    something else."""
    files = config_files(argv)
    cp = _CLASS_PATH.search(message)
    groups = _PARSER_KEY.findall(message)
    group = groups[0] if groups else None
    class_path = cp.group(1) if cp else None
    owner = f" of {class_path}" if cp else ""
    help_hint = f"{prog} --{group}.help {class_path}" if cp and group else f"{prog} --help-all"

    bad_class = _BAD_CLASS.search(message)
    if bad_class and group:
        return _class_path_message(bad_class.group(1), bad_class.group(2), group, files, argv, prog)

    wrong = _EXPECTED.search(message)
    if wrong and group:
        inner = groups[-1] if len(groups) > 1 else None
        key = f"{group}.init_args.{inner}" if cp and inner else (f"{group}.{inner}" if inner else group)
        return "\n".join([
            f"{prog}: error: wrong value for '{key}'{owner} in {_where(key, files, argv)}: expected "
            f"{_expected(wrong.group(1))}, got {wrong.group(2).strip()!r}",
            f"  (every option: {help_hint})"])

    subtypes = re.search(r"Subtypes: \[(.*?)\]", message)
    given = re.search(r"Given value: (.*)$", message)
    if not cp and group and subtypes and given and "Given value type: <class 'str'>" in message:
        # a plain option of a union type (trainer.max_epochs: int or None) given a string
        types = " or ".join(_expected(t) for t in subtypes.group(1).split(","))
        return "\n".join([
            f"{prog}: error: wrong value for '{group}' in {_where(group, files, argv)}: expected {types}, "
            f"got {given.group(1).strip()!r}", f"  (every option: {prog} --help-all)"])

    deep = _nested_unknown(message) if cp and group else None
    if deep:
        key, inner, valid = deep
        return _unknown_lines(prog, key, f" of {inner}", files, argv, valid, f"{prog} --{group}.help {class_path}")

    nested = _NESTED.search(message)
    m = _NOT_ACCEPTED.search(message)
    unrecognized = re.search(r"unrecognized arguments: --([\w.\-]+)", message)
    if cp and group and not nested and unrecognized and "." in unrecognized.group(1).split("=")[0]:
        sub, _, leaf = unrecognized.group(1).split("=")[0].rpartition(".")
        nested = re.match(r"(.*)\|(.*)", f"{sub}|{leaf}")
    if cp and group and nested:
        sub, leaf = nested.group(1), nested.group(2)
        key = f"{group}.init_args.{sub}.{leaf}"
        valid = _nested_keys(class_path, sub)
        owner = f" of {class_path} (its {sub})"
    elif cp and group and m and len(groups) > 1:  # a key of an argument of the class (net: NetConfig | Module)
        sub = groups[1]
        key = f"{group}.init_args.{sub}.{m.group(1)}"
        valid = _nested_keys(class_path, sub)
        owner = f" of {class_path} (its {sub})"
    elif cp and group and m and class_path in _BASE_CLASSES:  # a misspelt init_args / a stray key
        key = f"{group}.{m.group(1).split('.')[0]}"
        valid, owner = ["class_path", "init_args"], ""
        help_hint = f"{prog} --{group}.help CLASS"
    elif m:
        key = m.group(1)
        valid = _init_keys(class_path) if cp else []
        if cp and group:
            key = f"{group}.init_args.{key}"
    elif "Not a valid subclass" in message and group:  # a stray key next to class_path / init_args
        stray = [k for k in _given_keys(message) if k not in ("class_path", "init_args", "dict_kwargs")]
        if not stray:
            return None
        key, valid, owner, help_hint = f"{group}.{stray[0]}", ["class_path", "init_args"], "", f"{prog} --help-all"
    else:
        m = _UNEXPECTED.search(message)
        if not m:
            return None
        key = (m.group(1) or m.group(2)).lstrip("-").split("=", 1)[0]
        if parser is not None:
            key = _first_unknown(parser, key)
        valid = _group_keys(parser, key) if parser is not None else []
        owner = ""
        help_hint = f"{prog} --help-all"
    return _unknown_lines(prog, key, owner, files, argv, valid, help_hint)


def _unknown_lines(prog: str, key: str, owner: str, files: Sequence[str], argv: Sequence[str], valid: List[str],
                   help_hint: str) -> str:
    """The error for an unknown ``key``: where it was given, the closest of ``valid``, the help."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, valid, n=3, cutoff=0.6)
    lines = [f"{prog}: error: unknown key '{key}'{owner} in {_where(key, files, argv)}"]
    if close:
        lines.append("  closest valid keys: " + ", ".join(close))
    elif valid:
        lines.append("  valid keys: " + ", ".join(valid))
    lines.append(f"  (every option: {help_hint})")
    return "\n".join(lines)


def _duplicate_key(node, path: str) -> Optional[str]:
    """``"KEY" at line L (first at line F)`` for the first mapping key given twice under
    ``node`` (YAML keeps the last silently), or None."""
    import yaml

    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _duplicate_key(item, path)
            if found:
                return found
    elif isinstance(node, yaml.MappingNode):
        seen = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            if name is not None:
                full = f"{path}.{name}" if path else name
                if name in seen:
                    return f"'{full}' at line {k.start_mark.line + 1} (first at line {seen[name]})"
                seen[name] = k.start_mark.line + 1
                found = _duplicate_key(v, full)
                if found:
                    return found
    return None


def config_file_error(path: str, prog: str = "ttt-flash") -> Optional[str]:
    """A one-line error for a ``--config`` file that cannot be a recipe (missing, a folder,
    empty, not YAML, not a mapping, a key given twice), or None when it reads as one."""
    import yaml

    head = f"{prog}: error: --config {path}"
    if not os.path.exists(path):
        hint = " (the shipped recipes are in the ttt-flash folder's recipes/)" if not os.path.isabs(path) else ""
        return f"{head}: no such file{hint}"
    if os.path.isdir(path):
        return f"{head}: is a folder; give a recipe file in it, e.g. {os.path.join(path, 'NAME.yaml')}"
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return f"{head}: cannot be read ({e})"
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return f"{prog}: error: --config {path}{where}: not valid YAML: {problem}"
    if node is None:
        return f"{head}: is empty; a recipe names at least model: (see the recipes in recipes/)"
    if not isinstance(node, yaml.MappingNode):
        return f"{head}: is not a recipe (its top level must be keys such as model:, data:, trainer:)"
    duplicate = _duplicate_key(node, "")
    if duplicate:
        return f"{head}: key {duplicate}: give each key once (YAML would silently keep the last)"
    return None


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return e


def _find(tree, found, path: str = "") -> Optional[str]:
    """The dotted path of the first place in the plain config ``tree`` (depth first, list items
    in order) for which ``found(node, path)`` returns a path."""
    if isinstance(tree, dict):
        hit = found(tree, path)
        if hit is not None:
            return hit
        for k, v in tree.items():
            hit = _find(v, found, f"{path}.{k}" if path else str(k))
            if hit is not None:
                return hit
    elif isinstance(tree, list):
        for v in tree:
            hit = _find(v, found, path)
            if hit is not None:
                return hit
    return None


def _find_class(tree, class_path: str) -> Optional[str]:
    """The dotted path of the (first) dict in the plain config ``tree`` naming ``class_path``."""
    return _find(tree, lambda node, path: path if node.get("class_path") == class_path else None)


def _find_key(tree, leaf: str) -> Optional[str]:
    """The dotted path of the first key ``leaf`` in the plain config ``tree``."""
    return _find(tree, lambda node, path: (f"{path}.{leaf}" if path else leaf) if leaf in node else None)


def refused_message(error: BaseException, config: dict, argv: Sequence[str], prog: str = "ttt-flash") -> Optional[str]:
    """A short error for a value that a class's ``__init__`` refused while the recipe was
    instantiated (``inner_lr: -0.5``): the class, the key and where it was given, and the
    class's own message. None when ``error`` is not such a refusal."""
    root = _root_cause(error)
    if root is error and "class_path" not in str(error):
        return None
    reason = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    named = re.findall(r"class_path='([\w.]+)'", str(error)) or re.findall(r"class_path': '([\w.]+)'", str(error))
    class_path = named[0] if named else None
    owner = _find_class(config, class_path) if class_path else None
    if owner is None:
        return None
    subtree = config
    for part in owner.split("."):
        subtree = subtree.get(part, {}) if isinstance(subtree, dict) else {}
    key = None
    for word in re.findall(r"[A-Za-z_][\w]*", reason):
        found = _find_key(subtree.get("init_args") if isinstance(subtree, dict) else None, word)
        if found is not None:
            key = f"{owner}.init_args.{found}"
            break
    files = config_files(argv)
    where = f"'{key}' in {_where(key, files, argv)}" if key else f"'{owner}' in {_where(owner + '.class_path', files, argv)}"
    return "\n".join([f"{prog}: error: {class_path} refused {where}: {reason}",
                      f"  (the options of {class_path}: {prog} --{owner}.help {class_path})"])


def gpu_only_message(config, argv: Sequence[str], prog: str = "ttt-flash") -> Optional[str]:
    """On a machine without CUDA, a one-line error for settings that need a GPU
    (``trainer.accelerator: gpu``, ``cuda_graph: true``) naming the fix; None otherwise."""
    import torch

    if torch.cuda.is_available():
        return None
    files = config_files(argv)
    accelerator = str(config.get("trainer.accelerator") or "").lower()
    if accelerator in ("gpu", "cuda"):
        return (f"{prog}: error: trainer.accelerator is {accelerator} ({_where('trainer.accelerator', files, argv)}) "
                "but this machine has no CUDA GPU: try the recipe with --smoke (tiny, seconds on the CPU), or run "
                "it at full size on the CPU with --trainer.accelerator=cpu --trainer.precision=32-true (slow)")
    if config.get("model.init_args.cuda_graph") is True:
        return (f"{prog}: error: model.init_args.cuda_graph is true "
                f"({_where('model.init_args.cuda_graph', files, argv)}) but this machine has no CUDA GPU: "
                "CUDA graphs need one; drop it or give --model.init_args.cuda_graph=false")
    return None
