"""Argument checks shared by the library: a bad value gets a message naming it and what is allowed.

One helper per kind of value: :func:`check_int`, :func:`check_float`, :func:`check_bool`, :func:`check_str`,
:func:`check_streams`. (Output paths are checked by :func:`s2hc.io.check_output_dir`.)
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from typing import Any

#: The most streams a connection is built with: the papers use 4 to 8; s²HC's map has (n−1)² inputs per token
#: and every family an n × n matrix per token, so n in the thousands would ask for terabytes before any check.
MAX_STREAMS = 64
#: The most transformer layers a model is built (or counted) with: the largest published models have about 100;
#: every layer is built as modules, even on the meta device, so 10**12 from a config would never finish.
MAX_LAYERS = 10_000


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (Python or NumPy, not a bool) >= ``minimum`` (and <= ``maximum``);
    ValueError naming ``name``, the value and what is allowed otherwise."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return int(value)


def check_streams(name: str, value: Any) -> int:
    """A number of streams: an integer in ``[1, MAX_STREAMS]``, refused before anything n-sized is built."""
    n = check_int(name, value)
    if n > MAX_STREAMS:
        raise ValueError(
            f"{name} must be at most {MAX_STREAMS} (the limit of s2hc; the papers use 4 to 8), got {n}: every "
            f"connection holds n x n matrices per token and up to n**2 inputs per token"
        )
    return n


def _range_text(minimum, maximum, positive: bool, open_maximum: bool) -> str:
    low = "(0" if positive else (f"[{minimum:g}" if minimum is not None else None)
    high = None if maximum is None else f"{maximum:g}" + (")" if open_maximum else "]")
    if low and high:
        return f" in {low}, {high}"
    if low:
        return " > 0" if positive else f" >= {minimum:g}"
    if high:
        return f" {'<' if open_maximum else '<='} {maximum:g}"
    return ""


def check_float(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    positive: bool = False,
    open_maximum: bool = False,
) -> float:
    """``value`` as a finite ``float``: a real number (not a bool), or a string that is one (YAML 1.1 reads
    ``1e-3`` as a string), ``> 0`` if ``positive``, ``>= minimum``, ``<= maximum`` (``< maximum`` with
    ``open_maximum``). ValueError naming ``name``, the value and the allowed range otherwise (NaN and
    infinities included)."""
    allowed = f"{name} must be a finite number{_range_text(minimum, maximum, positive, open_maximum)}, got {value!r}"
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(allowed) from None
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise ValueError(allowed)
    number = float(number)
    if not math.isfinite(number) or (positive and number <= 0) or (minimum is not None and number < minimum):
        raise ValueError(allowed)
    if maximum is not None and (number >= maximum if open_maximum else number > maximum):
        raise ValueError(allowed)
    return number


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not ``"yes"``); ValueError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def did_you_mean(words: str | Iterable[str], choices: Iterable[str]) -> str:
    """What a misspelt name (or each of several) was probably meant to be: ``"did you mean 'lr'?"``, or
    ``"did you mean 'lr' for 'lrr', 'seed' for 'sed'?"``; ``""`` when no choice is close (difflib's ratio)."""
    words, choices = ([words] if isinstance(words, str) else list(words)), [str(c) for c in choices]
    close = {word: match[0] for word in words if (match := difflib.get_close_matches(str(word), choices, n=1))}
    if not close:
        return ""
    if len(words) == 1:
        return f"did you mean {next(iter(close.values()))!r}?"
    return "did you mean " + ", ".join(f"{match!r} for {word!r}" for word, match in close.items()) + "?"


def check_str(name: str, value: Any, *, empty: bool = False) -> str:
    """``value`` if it is a string (non-empty unless ``empty``); ValueError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    if not empty and not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value
