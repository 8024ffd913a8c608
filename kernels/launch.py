"""Cached launches: re-launch a compiled Triton kernel without Triton's per-call Python.

``launch(kernel, grid, *args, **meta)`` does what ``kernel[grid](*args, **meta)`` does. With
:data:`ENABLED` on, the first call of each specialization still goes through Triton, which
compiles or finds the kernel and returns it; its launcher is kept under a key made of what
Triton specializes on: the device, every keyword (constexprs and options such as
``num_warps``) with its type, and Triton's own specialization of the positional arguments
(tensor dtype and 16-byte alignment, integer width, equality to 1 and divisibility by 16,
float, bool, None, tuples element by element). A later call with the same key hands the
compiled kernel's launcher
(``CompiledKernel.run``, the object ``JITFunction.run`` ends in on Triton 3.6 to 3.9) the
grid, torch's current stream and the arguments in signature order, skipping argument
binding, the cache-key string, the launch metadata and the hooks' dispatch.

Everything else goes through ``kernel[grid]``: the switch off, a launch while torch's current
stream is being captured into a CUDA graph (a graph's replays cost no host time, so capture
takes Triton's route), the interpreter, a Triton version outside 3.6 to 3.9, an autotuned or
heuristics-wrapped kernel (anything but a plain ``JITFunction``), a pre-run hook on the
kernel or a launch hook in ``triton.knobs``, an argument of another kind (a callable grid, a
runtime argument passed by keyword), and any error on the direct path. Triton knobs that
change the compiled code (``TRITON_DEBUG``) and the globals a kernel reads are looked at when a
specialization is first launched: after changing one, call :func:`clear`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Iterator

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from . import configs

#: The switch: launch through the cache. On by default; ``TTT_FLASH_CACHED_LAUNCH=0`` in the
#: environment at import turns it off, :func:`use_cached_launch` inside a ``with`` block.
ENABLED: bool = os.environ.get("TTT_FLASH_CACHED_LAUNCH", "1") != "0"

#: Triton versions whose ``JITFunction.run`` ends in ``kernel.run(grid_0, grid_1, grid_2,
#: stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook,
#: *bound_args)``, the call a hit makes.
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))

#: Most specializations kept per kernel; past it, new ones go through Triton every call.
MAX_ENTRIES = 64

_TABLES: dict = {}  # id(kernel) -> _Table, or None where the kernel always goes through Triton

try:  # Triton's own argument specialization (C), the one JITFunction's binder calls
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.backends.compiler import BaseBackend as _Backend
except ImportError:  # pragma: no cover - a Triton without it is not supported
    _specialize = None


def _triton_version() -> tuple:
    return tuple(int(p) for p in triton.__version__.split(".")[:2])


def args_key(args: tuple):
    """Triton's specialization of the positional arguments, each one specialized (integers on
    equality to 1 and divisibility by 16, pointers on 16-byte alignment) as if no parameter
    were ``do_not_specialize``: at least as fine as the key Triton's binder makes for the
    CUDA backend, whose rules are ``BaseBackend``'s."""
    return _specialize(_Backend, args, False, True, True)


def _device_and_stream():
    """(current device, its current raw stream), as Triton's driver reads them."""
    active = driver.active
    device = active.get_current_device()
    return device, active.get_current_stream(device)


#: Whether torch's current CUDA stream is being captured into a CUDA graph: torch's own check,
#: called directly on the launch path (a torch without CUDA never captures)
_capturing = torch._C._cuda_isCurrentStreamCapturing if torch.cuda._is_compiled() else (lambda: False)


def _hooked(kernel) -> bool:
    """A pre-run hook on the kernel or a launch hook in ``triton.knobs``: Triton must run
    them."""
    if kernel.pre_run_hooks:
        return True
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return getattr(rt, "add_stages_inspection_hook", None) is not None


def _compiled_type():
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


class _Table:
    """One kernel's launchers, by key."""

    __slots__ = ("kernel", "params", "n_runtime", "entries")

    def __init__(self, kernel):
        self.kernel = kernel
        self.params = kernel.params
        # the leading parameters that are not constexprs
        self.n_runtime = next((i for i, p in enumerate(kernel.params) if p.is_constexpr),
                              len(kernel.params))
        self.entries: dict = {}

    def key(self, device, args, meta):
        """The cache key of a call: the device, the keywords with their types (True, 1 and 1.0
        are equal in Python, not to Triton), the positional arguments' specialization, and by
        value any positional argument of a constexpr parameter."""
        n = self.n_runtime
        parts = (device, tuple(meta.items()), tuple(map(type, meta.values())), args_key(args[:n]))
        if len(args) > n:
            parts += tuple((x.__class__, x) for x in args[n:])
        return parts

    def bind(self, key, compiled, n_args, meta):
        """Keep ``compiled``'s launcher under ``key``, with the values of the parameters after
        the positional ones (constexprs and defaults: fixed by the key)."""
        if not isinstance(compiled, _compiled_type()) or len(self.entries) >= MAX_ENTRIES:
            return
        if compiled.metadata.target.backend != "cuda":  # other backends specialize otherwise
            return
        if not all(p.is_constexpr for p in self.params[self.n_runtime:n_args]):
            return  # a runtime argument after a constexpr: the key holds it by value
        tail = []
        for p in self.params[n_args:]:
            if not p.is_constexpr:
                return  # a runtime argument by keyword: its value is not in the key
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                return
        self.entries[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                             tuple(tail), compiled)


def _table(kernel):
    """The kernel's table, made on its first launch; None where it always goes through
    Triton."""
    key = id(kernel)
    if key in _TABLES:
        return _TABLES[key]
    ok = (type(kernel) is JITFunction and not configs.interpreting()
          and _triton_version() in SUPPORTED_TRITON and _specialize is not None)
    table = _Table(kernel) if ok else None
    _TABLES[key] = table
    return table


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, through the cache where :data:`ENABLED` allows (module
    docstring). Returns what ``kernel[grid]`` returns (the compiled kernel on a GPU)."""
    if not ENABLED:
        return kernel[grid](*args, **meta)
    table = _TABLES.get(id(kernel), False)
    if table is False:
        table = _table(kernel)
    if table is None or callable(grid) or _capturing():
        # during capture the host cost is paid once, and the replays have none: Triton's route
        return kernel[grid](*args, **meta)
    try:
        device, stream = _device_and_stream()
        key = table.key(device, args, meta)
        entry = table.entries.get(key)
    except Exception:  # an argument Triton cannot specialize, an unhashable keyword
        return kernel[grid](*args, **meta)
    if entry is not None and not _hooked(kernel):
        run, function, packed, tail, compiled = entry
        n = len(grid)
        try:
            run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function,
                packed, None, None, None, *args, *tail)
            return compiled
        except Exception:  # the launcher parses every argument before it launches
            _TABLES[id(kernel)] = None  # this kernel goes through Triton from now on
            return kernel[grid](*args, **meta)
    compiled = kernel[grid](*args, **meta)
    table.bind(key, compiled, len(args), meta)
    return compiled


def clear() -> None:
    """Forget every kept launcher (the next call of each specialization goes through Triton)."""
    _TABLES.clear()


@contextlib.contextmanager
def use_cached_launch(enabled: bool) -> Iterator[None]:
    """Turn cached launches on or off inside the ``with`` block (A/B timings, tests); the
    previous setting comes back on exit."""
    global ENABLED
    saved = ENABLED
    ENABLED = bool(enabled)
    try:
        yield
    finally:
        ENABLED = saved
