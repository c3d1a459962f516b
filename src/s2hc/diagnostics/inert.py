"""Which connections of a model cannot change its output, whatever their ``H_res`` is.

Two places in a model built like :class:`s2hc.models.Transformer` (``expand_streams`` → blocks →
``reduce_streams``), each from what the family guarantees of the matrix the connection applies
(``Mixer.guarantees``, rows and columns swapped for ``transpose_res``):

- **the first connection** (depth order), when rows sum to 1: the streams enter it as identical copies of the
  embedding, ``X = 1 xᵀ``, and ``H 1 = 1`` gives ``H X = X``, whatever else ``H`` does;
- **the last connection**, when columns sum to 1 and the model's output reads the sum or the mean of the
  streams (``stream_reduce`` "sum" or "mean"): ``1ᵀ H = 1ᵀ`` gives ``1ᵀ H X = 1ᵀ X``. A learned head
  (``stream_reduce="head"``) weighs the streams, so there ``H_res`` does matter.

(The read and write gates of those connections still matter; only ``H_res`` is idle.) So the parameters that
only feed these ``H_res`` get no gradient in exact arithmetic, and what the matrices show is their initialisation
plus the steps float32 rounding noise took (:func:`s2hc.study.measure.rotation_probe` measures the gradients).
:func:`s2hc.diagnostics.summary.summarize` reports their measures apart from the other ("interior") connections'.

>>> inert_connections(["s2hc"] * 4, stream_reduce="sum")
[0, 3]
>>> inert_connections(["s2hc"] * 4, stream_reduce="head"), inert_connections(["mhc"] * 4, stream_reduce="sum")
([0], [0])
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..connection import forms
from ..models import Transformer
from ..models.model_config import STREAM_REDUCTIONS

__all__ = ["SUM_KEEPING_REDUCTIONS", "inert_connections", "model_inert_connections"]

#: The ``stream_reduce`` values whose output reads ``1ᵀ X`` (or ``1ᵀ X / n``): unit column sums keep it.
SUM_KEEPING_REDUCTIONS = ("sum", "mean")


def _applied_sums(family: str, transposed: bool) -> tuple[bool, bool]:
    """(rows sum to 1, columns sum to 1) guaranteed of the matrix a connection applies (the gated residual's is I)."""
    flags = forms.get(family).res_guarantees()
    return (flags.col_sums_one, flags.row_sums_one) if transposed else (flags.row_sums_one, flags.col_sums_one)


def inert_connections(families: Sequence[str], transposed: Sequence[bool] | None = None,
                      stream_reduce: str | None = None, copies_in: bool = True) -> list[int]:
    """Indices (depth order) of the connections whose ``H_res`` cannot change the model's output.

    Args:
        families: each mixing connection's family, in depth order (the order the model calls them).
        transposed: each connection's ``transpose_res`` (default: none transposed).
        stream_reduce: how the model turns the streams into its output (``"sum"``, ``"mean"``, ``"head"``), or
            None when that is not known (then the last connection is not called inert).
        copies_in: whether the first connection's input streams are identical copies (as ``expand_streams``
            makes them); False: the first connection is not called inert.

    Returns a sorted list without repeats (``[0]`` for a single connection that is both first and last).
    """
    families = list(families)
    transposed = [False] * len(families) if transposed is None else list(transposed)
    if len(transposed) != len(families):
        raise ValueError(f"transposed must have one entry per connection ({len(families)}), got {len(transposed)}")
    if stream_reduce is not None and stream_reduce not in STREAM_REDUCTIONS:
        raise ValueError(f"stream_reduce must be one of {list(STREAM_REDUCTIONS)} or None, got {stream_reduce!r}")
    if not families:
        return []
    inert = set()
    if copies_in and _applied_sums(families[0], transposed[0])[0]:
        inert.add(0)
    if stream_reduce in SUM_KEEPING_REDUCTIONS and _applied_sums(families[-1], transposed[-1])[1]:
        inert.add(len(families) - 1)
    return sorted(inert)


def model_inert_connections(model: nn.Module, families: Sequence[str],
                            transposed: Sequence[bool] | None = None) -> list[int]:
    """:func:`inert_connections` for ``model``'s mixing connections (``families`` in call order): an
    :class:`s2hc.models.Transformer` expands its embedding into copies (unless a learned stream scaling makes them
    differ) and reduces by its ``stream_reduce``; of any other module the wiring is unknown, so no connection is
    called inert."""
    if not isinstance(model, Transformer):
        return []
    return inert_connections(families, transposed, stream_reduce=model.config.stream_reduce,
                             copies_in=model.stream_scale is None)
