"""Argument checks shared across the library."""

from __future__ import annotations

import numbers

__all__ = ["check_int"]


def check_int(name: str, value, minimum: int) -> None:
    """Raise unless ``value`` is an int (not a bool) ``>= minimum``; ``name`` is the argument's
    name as the user wrote it (e.g. ``"GPTConfig.n_head"``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
