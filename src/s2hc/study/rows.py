"""A study's rows, grouped as its report and figures read them."""

from __future__ import annotations

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


#: The measures a study compares per seed beside the losses: name -> the row's value (None where it has none).
MEASURES = {
    "validation loss": lambda row: row["val_loss"],
    "smallest deviation σ (interior)": smallest_deviation_sigma,
}


def per_seed(runs: list[dict[str, Any]], measure: str) -> dict[int, float]:
    """``{seed: value}`` of :data:`MEASURES` ``[measure]`` over the finished runs that have it."""
    values = {r["seed"]: MEASURES[measure](r) for r in runs if r["status"] == "finished"}
    return {seed: value for seed, value in values.items() if value is not None}
