"""What every subcommand's arguments share: argparse types and the family-list parser.

A value argparse cannot convert gets ``argparse.ArgumentTypeError`` (argparse names the argument and exits 2);
a value the library refuses raises ValueError, which a command turns into ``parser.error`` (exit 2).
"""

from __future__ import annotations

import argparse
import math

from ..mixers import check_family, families


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def parse_families(text: str | None, argument: str = "--families", extra: tuple[str, ...] = ()) -> list[str]:
    """``"mhc, s2hc"`` -> ``["mhc", "s2hc"]`` (None: every family); ValueError naming ``argument`` for an
    unknown name or an empty list. ``extra`` names accepted besides the families (the bench's peer)."""
    if text is None:
        return families()
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError(f"argument {argument}: no family named in {text!r}; allowed: {','.join(families())}")
    for name in names:
        if name not in extra:
            check_family(name, f"argument {argument}")
    return names
