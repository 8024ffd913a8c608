"""Choosing parameters by name, shared by :mod:`ttt_flash.meta` (which parameters an inner loop
adapts) and :mod:`ttt_flash.hessian` (which parameters a Hessian is taken over).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Sequence, Union

__all__ = ["Selector", "select_names", "preview"]

#: A choice of parameters: None (all), a predicate ``name -> bool``, or a name / iterable of
#: names, each the exact name of a parameter or a module prefix of several.
Selector = Union[None, str, Iterable[str], Callable[[str], bool]]


def preview(names: Sequence[str], limit: int = 8) -> str:
    """``[a, b, ...] (N in all)``: the first ``limit`` names, for error messages."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)} in all)"


def _hit(name: str, wanted: str) -> bool:
    return name == wanted or name.startswith(wanted + ".")


def select_names(names: Sequence[str], selector: Selector = None, *, arg: str = "names",
                 pool: str = "parameter") -> List[str]:
    """The names of ``names`` that ``selector`` chooses, in the order of ``names``.

    Args:
        names: all candidate parameter names.
        selector: ``None`` (all), a predicate ``name -> bool``, or a name / iterable of names.
            A name selects the parameter of that exact name, or every parameter under that
            module prefix (``"head"`` selects ``"head.weight"`` and ``"head.bias"``).
        arg: the caller's argument name, for error messages.
        pool: what ``names`` holds, for error messages (``"parameter requiring grad"``).

    Raises:
        TypeError: an entry of ``selector`` is not a str.
        ValueError: an entry of ``selector`` matches no name, or nothing is selected.
    """
    names = list(names)
    if selector is None:
        chosen = names
    elif callable(selector):
        chosen = [n for n in names if selector(n)]
    else:
        wanted = [selector] if isinstance(selector, str) else list(selector)
        for w in wanted:
            if not isinstance(w, str):
                raise TypeError(f"{arg} entries must be parameter names (str), got {type(w).__name__}")
        unknown = [w for w in wanted if not any(_hit(n, w) for n in names)]
        if unknown:
            raise ValueError(
                f"{arg} names {unknown} match no {pool} (exact name or module prefix); "
                f"parameters are {preview(names)}"
            )
        chosen = [n for n in names if any(_hit(n, w) for w in wanted)]
    if not chosen:
        raise ValueError(f"{arg}={selector!r} selects no parameter; parameters are {preview(names)}")
    return chosen
