"""What ``ttt-flash fit|validate|test`` adds to LightningCLI: a quiet start, short errors
for unknown recipe keys, and one CPU thread by default.

* LightningCLI runs on ``sys.argv = [<the ttt-flash script>, *argv]``, as it is meant to from a
  console script (its ``args=`` parameter is for calls from Python, and warns when a command
  line is present too). ``sys.argv[0]`` is the absolute path of the installed ``ttt-flash``
  script: Lightning's DDP launcher starts the other ranks by re-running ``sys.argv[0]``, so a
  bare name would be looked up in the working directory and fail.
* Lightning's "💡 Tip" adverts and torch's ``isinstance(treespec, LeafSpec)`` deprecation
  warning (raised inside Lightning) are filtered.
* A key that no class accepts (``inner_stepz``, ``net.hiddn``, a misspelt ``init_args``) or a
  value of the wrong type (``inner_steps: two``) fails in a few lines that name the full key,
  where it was given (the recipe file and line, or the command line) and the closest valid
  keys or the type expected, instead of the full usage text.
* ``trainer.enable_progress_bar: true`` (every shipped recipe) shows Lightning's
  ``RichProgressBar`` (steps, speed, logged metrics) unless the recipe names its own progress
  bar callback; the CSV logs are unchanged.
* One run per run folder: ``fit``, ``validate`` and ``test`` hold
  :class:`~ttt_flash.lightning.checkpoint_io.RunFolderLock` on the logger's folder while they
  run (a second run on the same folder, by whatever path, stops at start with an error naming
  the running process), and ``fit`` without ``--ckpt_path`` into a folder that holds an
  earlier run stops with a one-line error. ``config.yaml`` is written once training starts
  (:class:`~ttt_flash.lightning.checkpoint_io.SaveConfigOnStart`).
* On a machine without CUDA, unless ``OMP_NUM_THREADS`` is set, torch runs one thread:
  the recipes' steps are small, and several threads spinning on a few cores make a MAML
  step many times slower (README, "Speed on the CPU").
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from typing import Iterator, List, Optional, Sequence

__all__ = ["recipe_cli", "script_path", "quiet_lightning", "rich_progress_bar", "thread_default", "unknown_key_message"]

_TIP = "💡 Tip"
_LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


def quiet_lightning() -> None:
    """Filter Lightning's adverts and the known third-party deprecation (idempotent)."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts())


@contextlib.contextmanager
def thread_default() -> Iterator[Optional[int]]:
    """One torch thread while the block runs, on a machine without CUDA where
    ``OMP_NUM_THREADS`` is unset (that variable, when set, decides). Yields the thread count
    set, or None when it was left alone."""
    import torch

    if os.environ.get("OMP_NUM_THREADS") or torch.cuda.is_available():
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def rich_progress_bar(trainer_config: dict):
    """A ``RichProgressBar`` (without ``v_num``: :class:`~ttt_flash.lightning.outputs.RecipeProgressBar`)
    for a trainer config that enables the progress bar (Lightning's default) and names no
    progress bar callback; None otherwise, or without ``rich``."""
    from lightning.pytorch.callbacks import ProgressBar

    if trainer_config.get("enable_progress_bar") is False:
        return None
    callbacks = trainer_config.get("callbacks") or []
    if any(isinstance(c, ProgressBar) for c in (callbacks if isinstance(callbacks, list) else [callbacks])):
        return None
    try:
        from .lightning.outputs import RecipeProgressBar

        return RecipeProgressBar()
    except (ImportError, ModuleNotFoundError):  # rich not installed: Lightning's default bar
        return None


def _terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def line_progress(trainer_config: dict):
    """For output that is not a terminal: a :class:`~ttt_flash.lightning.outputs.LineProgress`
    (a plain line every 30 s) where the progress bar is enabled and the config names no
    progress bar callback; None otherwise."""
    from lightning.pytorch.callbacks import ProgressBar

    from .lightning.outputs import LineProgress

    if trainer_config.get("enable_progress_bar") is False:
        return None
    if any(isinstance(c, ProgressBar) for c in _listed(trainer_config.get("callbacks"))):
        return None
    return LineProgress()


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


def _find_class(tree, class_path: str, path: str = "") -> Optional[str]:
    """The dotted path of the (first) dict in the plain config ``tree`` naming ``class_path``."""
    if isinstance(tree, dict):
        if tree.get("class_path") == class_path:
            return path
        for k, v in tree.items():
            found = _find_class(v, class_path, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(tree, list):
        for v in tree:
            found = _find_class(v, class_path, path)
            if found is not None:
                return found
    return None


def _find_key(tree, leaf: str, path: str = "") -> Optional[str]:
    """The dotted path of the first key ``leaf`` in the plain config ``tree``."""
    if isinstance(tree, dict):
        if leaf in tree:
            return f"{path}.{leaf}" if path else leaf
        for k, v in tree.items():
            found = _find_key(v, leaf, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(tree, list):
        for v in tree:
            found = _find_key(v, leaf, path)
            if found is not None:
                return found
    return None


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


def script_path() -> str:
    """The absolute path of the ``ttt-flash`` console script that is running, or of the one
    installed next to this Python, or on ``PATH``; ``"ttt-flash"`` when there is none.

    Lightning's DDP launcher starts ranks 1.. as ``python <sys.argv[0]> <args>`` (resolved
    against the working directory) when the program was not started with ``python -m``."""
    import shutil

    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started).startswith("ttt-flash") and os.path.isfile(started):
        return os.path.abspath(started)
    beside = os.path.join(os.path.dirname(sys.executable), "ttt-flash")
    if os.path.isfile(beside):
        return beside
    return shutil.which("ttt-flash") or "ttt-flash"


def _plain(value):
    """A jsonargparse Namespace (nested) as plain dicts."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return value


def run_folder(trainer) -> Optional[str]:
    """The folder a run writes its logs (and, by default, checkpoints) to: the first logger's
    ``log_dir``; None without a logger."""
    logger = trainer.logger
    if logger is None:
        return None
    try:
        folder = logger.log_dir
    except (AttributeError, TypeError):
        return None
    return folder if isinstance(folder, str) and "://" not in folder else None


#: the checkpoints whose differing settings this process listed (in a warning)
SETTINGS_LISTED: List[str] = []


def _last_checkpoint(trainer, folder: str) -> Optional[str]:
    """The ``last.ckpt`` that ``--ckpt_path last`` loads: in a checkpoint callback's folder, or
    ``<run folder>/checkpoints``; None if there is none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    for place in [*folders, os.path.join(folder, "checkpoints")]:
        path = os.path.join(str(place), "last.ckpt")
        if os.path.isfile(path):
            return path
    return None


TENSORBOARD_MISSING = ("--tensorboard needs the tensorboard package, which is not installed: "
                       "pip install 'ttt-flash[tensorboard]'")


def _listed(callbacks) -> list:
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else ([callbacks] if callbacks else [])


def recipe_callbacks(trainer_config: dict, model) -> list:
    """Callbacks the ``ttt-flash`` command adds to a recipe's trainer (docs in
    :mod:`ttt_flash.lightning.outputs`): the progress bar and model summary (when enabled and
    not named by the recipe), the best-k checkpoints by the model's ``val_metric`` (when
    checkpointing is on and no callback of the recipe monitors a metric) and the
    validation-curve PNG at the end of ``fit``."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

    from .lightning.outputs import BestCheckpoints, RecipeModelSummary, ValidationCurves, val_metric_of

    callbacks = _listed(trainer_config.get("callbacks"))
    added = []
    bar = rich_progress_bar(trainer_config) if _terminal() else line_progress(trainer_config)
    if bar is not None:
        added.append(bar)
    if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks):
        added.append(RecipeModelSummary())
    metric = val_metric_of(model) if model is not None else None
    if (metric is not None and trainer_config.get("enable_checkpointing") is not False
            and not any(isinstance(c, ModelCheckpoint) and c.monitor for c in callbacks)):
        added.append(BestCheckpoints(monitor=metric[0], mode=metric[1]))
    added.append(ValidationCurves())
    return added


def tensorboard_logger(logger):
    """A TensorBoard logger writing into the same run folder as ``logger`` (the recipe's CSV
    logger): its ``save_dir``, ``name`` and ``version``. Raises ``SystemExit`` with the
    install line without the tensorboard package."""
    from lightning.pytorch import loggers

    if logger is None:
        raise SystemExit("ttt-flash: error: --tensorboard needs the recipe's trainer.logger (it writes beside it)")
    try:
        return loggers.TensorBoardLogger(save_dir=logger.save_dir, name=logger.name or "", version=logger.version,
                                         default_hp_metric=False)
    except ModuleNotFoundError:
        raise SystemExit("ttt-flash: error: " + TENSORBOARD_MISSING) from None


#: The trainer of the last run started by :func:`recipe_cli` (for the line printed at its end).
LAST_RUN: dict = {}


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def run_report(stopped: Optional[str] = None) -> Optional[str]:
    """One line about the run :func:`recipe_cli` last ran: its folder, its ``last.ckpt`` and
    the validation-curve plot (or how to get one); ``stopped`` names a signal that ended it.
    None without a run, off rank zero, or without a run folder."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from .lightning.outputs import ValidationCurves

    trainer = LAST_RUN.get("trainer")
    if trainer is None or not trainer.is_global_zero:
        return None
    folder = run_folder(trainer)
    if folder is None:
        return None
    sub = LAST_RUN.get("subcommand") or "run"
    parts = [f"run folder {_shown(folder)}"]
    if sub == "fit":
        dirs = [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        last = next((os.path.join(str(d), "last.ckpt") for d in [*dirs, os.path.join(folder, "checkpoints")]
                     if os.path.isfile(os.path.join(str(d), "last.ckpt"))), None)
        if LAST_RUN.get("smoke"):
            parts.append("no checkpoint (--smoke)")
        elif last:
            parts.append(f"checkpoint {_shown(last)}" + (" (resume: --ckpt_path last)" if stopped else ""))
        else:
            parts.append("no checkpoint written")
        curves = next((c for c in trainer.callbacks if isinstance(c, ValidationCurves)), None)
        if curves is not None and curves.written:
            parts.append(f"curves {_shown(curves.written)}")
        elif curves is not None and curves.missing:
            parts.append('no val_curves.png: pip install -e ".[plot]" (matplotlib)')
    head = f"ttt-flash {sub}: stopped by {stopped} at step {trainer.global_step}" if stopped else f"ttt-flash {sub}: done"
    return head + "; " + ", ".join(parts)


def recipe_cli(argv: Sequence[str], smoke: bool = False):
    """A LightningCLI subclass that runs on ``ttt-flash <argv>`` as described in the module
    docstring; construct it with LightningCLI's own arguments (no ``args=``). ``smoke``: a
    ``--smoke`` run (``argv`` holds its overrides already): no checkpoints are written, and its
    run folder is emptied first."""
    import lightning.pytorch
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    argv = list(argv)
    prog = "ttt-flash " + argv[0] if argv else "ttt-flash"

    class _Parser(LightningArgumentParser):
        def error(self, message: str, ex: Optional[Exception] = None):
            if self.exit_on_error:
                short = unknown_key_message(message, argv, getattr(ex, "subcommand_parser", None) or self, prog)
                if short is not None:
                    sys.stderr.write(short + "\n")
                    sys.exit(2)
            super().error(message, ex)

    class RecipeCLI(LightningCLI):
        def __init__(self, *args, **kwargs):
            quiet_lightning()
            saved = sys.argv
            sys.argv = [script_path(), *argv]
            try:
                with thread_default():
                    super().__init__(*args, **kwargs)
            finally:
                sys.argv = saved

        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            if self.subcommand:
                message = gpu_only_message(self.config[self.subcommand], argv, prog)
                if message:
                    sys.stderr.write(message + "\n")
                    sys.exit(2)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except (ValueError, TypeError, AssertionError) as e:
                config = _plain(self.config[self.subcommand]) if self.subcommand else _plain(self.config)
                short = refused_message(e, config, argv, prog)
                if short is None:
                    raise
                sys.stderr.write(short + "\n")
                sys.exit(2)

        def _parse_ckpt_path(self) -> None:
            # LightningCLI's own version replaces the command line's model settings with the
            # checkpoint's for a --ckpt_path FILE (not for "last"); here the recipe and the
            # command line always decide, and the checkpoint's differing settings are listed.
            if not self.config.get("subcommand"):
                return
            path = self.config[self.config.subcommand].get("ckpt_path")
            if path and os.path.isfile(str(path)):
                self._report_settings(str(path))

        def _report_settings(self, path: str) -> None:
            from .lightning.resume import checkpoint_settings, read_checkpoint

            config = self.config[self.config.subcommand]
            plain = {g: _plain(config.get(g)) for g in ("model", "data")}
            differences = checkpoint_settings(path, read_checkpoint(path), plain)
            if differences:
                SETTINGS_LISTED.append(path)
                sys.stderr.write(
                    f"ttt-flash: warning: --ckpt_path {path} was written with other settings; this run keeps its "
                    "own (the recipe and the command line decide, as with --ckpt_path last) and loads the "
                    "checkpoint's weights and training state:\n  " + "\n  ".join(differences) + "\n")

        def _run_subcommand(self, subcommand: str) -> None:
            from .lightning.checkpoint_io import RunFolderLock, run_in_folder

            folder = run_folder(self.trainer)
            if folder is None or not self.trainer.is_global_zero:
                return super()._run_subcommand(subcommand)
            with RunFolderLock(folder, command=f"ttt-flash {subcommand}"):
                ckpt_path = self._prepare_subcommand_kwargs(subcommand).get("ckpt_path")
                if subcommand == "fit" and ckpt_path is None:
                    used = run_in_folder(folder)
                    if used:
                        raise SystemExit(
                            f"ttt-flash: error: the run folder {folder} holds an earlier run ({', '.join(used[:4])}"
                            f"{', ...' if len(used) > 4 else ''}); continue it with --ckpt_path last, give this "
                            "run another folder (--trainer.logger.init_args.version=NAME), or remove the folder")
                if ckpt_path == "last":
                    last = _last_checkpoint(self.trainer, folder)
                    if last is not None:
                        self._report_settings(last)
                super()._run_subcommand(subcommand)

        def instantiate_trainer(self, **kwargs):
            from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

            config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
            if smoke:  # no checkpoints: the smoke run only shows that the recipe runs
                config["callbacks"] = [c for c in _listed(config.get("callbacks")) if not isinstance(c, ModelCheckpoint)]
                kwargs["callbacks"] = config["callbacks"]
                kwargs["enable_checkpointing"] = config["enable_checkpointing"] = False
            added = recipe_callbacks(config, getattr(self, "model", None))
            if added:
                kwargs["callbacks"] = [*_listed(config.get("callbacks")), *added]
            if any(isinstance(c, ModelSummary) for c in _listed(kwargs.get("callbacks", config.get("callbacks")))):
                kwargs["enable_model_summary"] = False  # the summary is in the callbacks: no default one to add
            if self._get(self.config, "tensorboard", default=False):
                logger = config.get("logger")
                first = logger[0] if isinstance(logger, (list, tuple)) and logger else logger
                kwargs["logger"] = [*(_listed(logger) if first is not None else []), tensorboard_logger(first)]
            trainer = super().instantiate_trainer(**kwargs)
            LAST_RUN.clear()
            LAST_RUN.update(trainer=trainer, subcommand=self.subcommand, smoke=smoke)
            if smoke and trainer.is_global_zero:
                folder = run_folder(trainer)
                if folder and os.path.basename(os.path.normpath(folder)).startswith("smoke-") and os.path.isdir(folder):
                    import shutil

                    shutil.rmtree(folder)
            return trainer

        def init_parser(self, **kwargs) -> LightningArgumentParser:
            kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.pytorch.__version__}"])
            parser = _Parser(**kwargs)
            parser.add_argument(
                "-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format."
            )
            parser.add_argument(
                "--tensorboard", type=bool, default=False,
                help="also log to TensorBoard, into the run folder beside the CSV log (needs the tensorboard "
                     "extra: pip install 'ttt-flash[tensorboard]'); view with: tensorboard --logdir runs")
            return parser

    return RecipeCLI
