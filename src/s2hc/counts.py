"""FLOP counts as ``{"matmul", "elementwise"}`` dicts, and their arithmetic: what every connection form's and mixing
family's own count (:meth:`~s2hc.connection.forms.ConnectionForm.flops`, :meth:`~s2hc.mixers.Mixer.flops`) and
:mod:`s2hc.flops` build on. ``matmul`` holds the products (``2·m·k·n`` for an ``(m, k) @ (k, n)`` product, what
``torch.utils.flop_counter.FlopCounterMode`` counts), ``elementwise`` an approximate count of the rest (one per
element and operation)."""

from __future__ import annotations

Count = dict[str, int]


def count(matmul: float = 0, elementwise: float = 0) -> Count:
    """A count of ``matmul`` product FLOPs and ``elementwise`` other FLOPs (rounded to integers)."""
    return {"matmul": int(round(matmul)), "elementwise": int(round(elementwise))}


def add(*counts: Count) -> Count:
    """The sum of ``counts``."""
    return {"matmul": sum(c["matmul"] for c in counts), "elementwise": sum(c["elementwise"] for c in counts)}


def scale(counted: Count, factor: int) -> Count:
    """``counted`` times ``factor``."""
    return {key: value * factor for key, value in counted.items()}


__all__ = ["Count", "add", "count", "scale"]
