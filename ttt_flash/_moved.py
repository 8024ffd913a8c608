"""Import paths of modules that moved into subpackages, kept importable.

``import ttt_flash.hessian`` (or ``from ttt_flash.hessian import hvp``) gives the module now at
``ttt_flash.second_order``: the same module object, so classes, registries and ``isinstance``
checks are shared. :data:`MOVED` is the table; the package installs :class:`MovedFinder` once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

#: Old module path → the module that holds it now.
MOVED = {
    "ttt_flash.ops": "ttt_flash.attention.ops",
    "ttt_flash.impls": "ttt_flash.attention.registry",
    "ttt_flash.reference": "ttt_flash.attention.reference",
    "ttt_flash.context_parallel": "ttt_flash.distributed.context_parallel",
    "ttt_flash.hessian": "ttt_flash.second_order",
    "ttt_flash.hessian_recompute": "ttt_flash.second_order.recomputation",
    "ttt_flash.optim": "ttt_flash.second_order.optim",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads them as the modules they name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._spec = module.__spec__  # the import system sets __spec__ to the alias's: restore it
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


def install() -> None:
    """Put one :class:`MovedFinder` on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
