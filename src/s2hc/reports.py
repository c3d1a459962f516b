"""The Markdown tables and number formats every report uses (diagnose, study, compare, static, bench, params).

One place decides how a loss, a ratio, a count or a missing value looks, so that the same quantity reads the
same in every report: a missing value is :data:`DASH` (``–``), a ratio ends in ``×``, counts carry thousands
separators. Leaf utility: imports nothing from s2hc.

    >>> table(["family", "loss"], [["s2hc", loss(2.5)], ["a|b", None]])
    ['| family | loss |', '|---|---:|', '| s2hc | 2.5000 |', '| a\\\\|b | – |']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

DASH = "–"  # a value that is missing (not measured, not applicable)
_RULES = {"l": "---", "r": "---:", "c": ":---:"}


def escape(text: str) -> str:
    """``text`` safe in one table cell: a ``|`` would end the cell, a newline the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def number(value: Any) -> str:
    """A measurement: counts with thousands separators, ``yes`` / ``**no**`` for a check, 4 significant digits,
    scientific notation outside [1e-3, 1e5), and a value a rounding above 1 as ``1 + 2.0e-07`` (how far a norm,
    gain or sum exceeds 1 is what matters)."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if 0 < value - 1 < 1e-4:
        return f"1 + {value - 1:.1e}"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4g}"


def fixed(value: float | None, digits: int = 4) -> str:
    """``value`` with ``digits`` decimals; :data:`DASH` for None or NaN."""
    return DASH if _missing(value) else f"{value:.{digits}f}"


def loss(value: float | None) -> str:
    """A loss (nats per token): 4 decimals."""
    return fixed(value, 4)


def mean_std(mean: float | None, std: float | None = None, interval: Sequence[float] | None = None,
             digits: int = 4) -> str:
    """``mean ± std [low, high]``, leaving out what is None (``std`` of one value, an interval not computed)."""
    if _missing(mean):
        return DASH
    text = fixed(mean, digits)
    if std is not None:
        text += f" ± {fixed(std, digits)}"
    if interval is not None:
        text += f" [{fixed(interval[0], digits)}, {fixed(interval[1], digits)}]"
    return text


def ratio(value: float | None, digits: int = 2) -> str:
    """A ratio to a reference: ``1.69×``."""
    return DASH if _missing(value) else f"{value:.{digits}f}×"


def count(value: float | None) -> str:
    """A count or rate: thousands separators, no decimals (``11,461``)."""
    return DASH if _missing(value) else f"{value:,.0f}"


def human(value: float) -> str:
    """``25693808 -> '25.7 M'``, ``2029400632 -> '2.03 B'``: three significant digits, K/M/B/T."""
    if value < 1000:
        return f"{value:g}"
    for scale, unit in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = f"{value / scale:.3g}"
        if float(text) < 1000 or unit == "T":
            return f"{text} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def sci(value: float | None, digits: int = 2) -> str:
    """Two significant digits (``3.1e-08``, ``0.5``): a magnitude, not a precise value."""
    return DASH if _missing(value) else f"{value:.{digits}g}"


def p_value(value: float | None) -> str:
    """A test's p-value: 3 decimals, ``< 0.001`` below."""
    if _missing(value):
        return DASH
    return "< 0.001" if value < 0.001 else f"{value:.3f}"


def mib(value: float | None) -> str:
    """Bytes in MiB (``1,234 MiB``)."""
    return DASH if _missing(value) else f"{value / 2**20:,.0f} MiB"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> list[str]:
    """A Markdown table as lines: the header, the alignment row, one line per row.

    ``align``: one letter per column, ``l`` (left), ``r`` (right) or ``c`` (centred); default: the first column
    left, the others right (names, then numbers). A string cell is kept as it is (``|`` escaped), any other
    value goes through :func:`number` (None is :data:`DASH`).
    """
    align = align if align is not None else "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - set(_RULES):
        raise ValueError(f"align must give one of l, r, c for each of the {len(header)} columns, got {align!r}")
    for index, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"rows[{index}] has {len(row)} cells for {len(header)} columns: {list(row)!r}")
    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "|" + "|".join(_RULES[a] for a in align) + "|"]
    lines += ["| " + " | ".join(escape(c) if isinstance(c, str) else number(c) for c in row) + " |" for row in rows]
    return lines


__all__ = ["DASH", "count", "escape", "fixed", "human", "loss", "mean_std", "mib", "number", "p_value", "ratio",
           "sci", "table"]
