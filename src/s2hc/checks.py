"""Argument checks shared by the library: a bad value gets a message naming it and what is allowed."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
