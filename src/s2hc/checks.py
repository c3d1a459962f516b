"""Argument checks shared by the library: a bad value gets a message naming it and what is allowed."""

from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an ``int`` if it is an integer (Python or NumPy, not a bool) >= ``minimum``; ValueError
    naming ``name``, the value and what is allowed otherwise."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
