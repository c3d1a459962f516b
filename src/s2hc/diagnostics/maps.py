"""What a form's own learned maps do, for the forms without a residual matrix to measure: the wide residual's read
and write maps, the variance-preserving gates, the affine residual's scales (each connection's
:meth:`s2hc.connection.Connection.measures`), in place of the ``H_res`` measures they do not have.

Token-independent: read from the weights, no data needed. Each connection says what it measures (its ``measures``
docstring); the wide residual, for one: ``read_share`` / ``write_share``, each block's share of the map's
Frobenius norm (the n blocks of ``R`` ``(C × nC)`` and of ``W`` ``(nC × C)``); ``read_effective_blocks`` /
``write_effective_blocks``, ``exp`` of those shares' entropy (1 when one block has everything, n when all have the
same; a wide residual starts reading one block and writing all n); ``read_sv_max`` / ``read_sv_min`` and the same
for the write, the largest and smallest singular values (all 1 for the read at the start, all √n for the write);
``read_start_distance`` / ``write_start_distance``, ‖M − M₀‖_F / ‖M₀‖_F from the residual start.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..connection import Connection


def map_modules(model: nn.Module) -> list[tuple[str, Connection]]:
    """``(name, connection)`` of every connection in ``model`` that measures learned maps of its own, in module
    order."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Connection) and module.measures()]


def learned_maps(model: nn.Module) -> dict[str, Any]:
    """``{"note", "connections": [{"name", **measures}, ...]}`` for every connection of :func:`map_modules`
    (``note``: what the first one's measures are, from its ``measures`` docstring); ValueError when there is none."""
    modules = map_modules(model)
    if not modules:
        raise ValueError("the model has no connection with learned maps of its own (family 'wide-residual', "
                         "'vp-residual', ...): nothing to measure")
    note = " ".join((inspect.getdoc(type(modules[0][1]).measures) or "").split())
    return {"note": note, "connections": [{"name": name, **module.measures()} for name, module in modules]}


def _scalars(connection: dict[str, Any]) -> list[str]:
    return [key for key, value in connection.items() if key != "name" and isinstance(value, (int, float))]


def training_record(model: nn.Module) -> dict[str, Any]:
    """The compact ``metrics.jsonl`` record: ``layers`` (the connections' names) and ``map_KEY`` for each number
    the connections measure, a list in depth order (the loggers' ``hc/map_KEY/CONNECTION``)."""
    connections = learned_maps(model)["connections"]
    record: dict[str, Any] = {"layers": [c["name"] for c in connections]}
    for key in _scalars(connections[0]):
        record[f"map_{key}"] = [round(float(c[key]), 6) if key in c else None for c in connections]
    return record


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(f"{v:.2f}" for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def maps_lines(result: dict[str, Any]) -> list[str]:
    """The report's section: what the measures are, then one row per connection and one column per measure."""
    from ..reports import table

    connections = result["connections"]
    keys = [key for key in connections[0] if key != "name"]
    rows = [[f"`{c['name']}`", *(_cell(c[key]) if key in c else "–" for key in keys)] for c in connections]
    lines = ["## Learned maps", "",
             "No residual matrix: what each connection's own learned maps do, read from the weights (they do not "
             "depend on the tokens). " + result.get("note", ""), ""]
    return lines + table(["connection", *keys], rows, align="l" + "r" * len(keys))


__all__ = ["learned_maps", "map_modules", "maps_lines", "training_record"]
