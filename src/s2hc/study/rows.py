"""A study's rows, grouped as its report and figures read them."""

from __future__ import annotations

import math
from typing import Any


def by_configuration(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by configuration label, in grid order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["label"], []).append(row)
    return groups


def finished_values(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in runs if r["status"] == "finished" and r[key] is not None}


def smallest_deviation_sigma(row: dict[str, Any]) -> float | None:
    """The smallest token-mean deviation singular value of ``row``'s trained model over its interior connections
    (those whose ``H_res`` can change the output, as the row records them); None for a row without diagnostics or
    measured before the rows recorded which connections are inert."""
    diagnostics = row.get("diagnostics") or {}
    inert = diagnostics.get("inert_layers")
    per_layer = (diagnostics.get("deviation_singular_values") or {}).get("mean")
    if inert is None or not per_layer:
        return None
    values = [components[-1] for i, components in enumerate(per_layer) if i not in set(inert) and components]
    return min(values) if values else None


def _interior_mean(values: list | None, inert: list | None) -> float | None:
    """The mean of ``values`` (one per connection) over the connections not in ``inert``, leaving out missing ones."""
    if not values:
        return None
    kept = [v for i, v in enumerate(values) if i not in set(inert or ()) and v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def stream_usage(row: dict[str, Any]) -> dict[str, float | None] | None:
    """The stream usage of ``row``'s trained model: ``read`` / ``write``, the mean over its interior connections
    (those whose split of the read / write over the streams can change the output) of each connection's effective
    number of streams; ``output``, the output's effective number of streams, and ``output_dominant_share``. None
    for a row without diagnostics or measured before the diagnostics had the stream usage."""
    d = row.get("diagnostics") or {}
    if "read_effective_streams" not in d and "write_effective_streams" not in d:
        return None
    return {
        "read": _interior_mean(d.get("read_effective_streams"), d.get("read_inert_layers")),
        "write": _interior_mean(d.get("write_effective_streams"), d.get("write_inert_layers")),
        "output": d.get("output_effective_streams"),
        "output_dominant_share": d.get("output_dominant_share"),
    }


#: The measures a study compares per seed beside the losses: name -> the row's value (None where it has none).
MEASURES = {
    "validation loss": lambda row: row["val_loss"],
    "smallest deviation σ (interior)": smallest_deviation_sigma,
}


def per_seed(runs: list[dict[str, Any]], measure: str) -> dict[int, float]:
    """``{seed: value}`` of :data:`MEASURES` ``[measure]`` over the finished runs that have it."""
    values = {r["seed"]: MEASURES[measure](r) for r in runs if r["status"] == "finished"}
    return {seed: value for seed, value in values.items() if value is not None}
