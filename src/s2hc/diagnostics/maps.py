"""What a form's own learned maps do, for the forms without a residual matrix to measure: the wide residual's read
and write maps (:meth:`s2hc.connection.Connection.measures`), in place of the ``H_res`` measures it does not have.

Token-independent: read from the weights, no data needed. Per connection (the wide residual's keys; a form declares
its own): ``read_share`` / ``write_share``, each block's share of the map's Frobenius norm (the n blocks of ``R`` ``(C
× nC)`` and of ``W`` ``(nC × C)``); ``read_effective_blocks`` / ``write_effective_blocks``, ``exp`` of those shares'
entropy (1 when one block has everything, n when all have the same; a wide residual starts reading one block and
writing all n); ``read_sv_max`` / ``read_sv_min`` and the same for the write, the largest and smallest singular
values (all 1 for the read at the start, all √n for the write); ``read_start_distance`` / ``write_start_distance``,
‖M − M₀‖_F / ‖M₀‖_F from the residual start.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..connection import Connection

#: The per-connection scalars a training-diagnostics record and the loggers carry (lists in depth order).
RECORDED = ("read_effective_blocks", "write_effective_blocks", "read_start_distance", "write_start_distance",
            "read_sv_max", "write_sv_max")


def map_modules(model: nn.Module) -> list[tuple[str, Connection]]:
    """``(name, connection)`` of every connection in ``model`` that measures learned maps of its own, in module
    order."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Connection) and module.measures()]


def learned_maps(model: nn.Module) -> dict[str, Any]:
    """``{"connections": [{"name", **measures}, ...]}`` for every connection of :func:`map_modules`; ValueError when
    there is none."""
    modules = map_modules(model)
    if not modules:
        raise ValueError("the model has no connection with learned maps of its own (family 'wide-residual'): "
                         "nothing to measure")
    return {"connections": [{"name": name, **module.measures()} for name, module in modules]}


def training_record(model: nn.Module) -> dict[str, Any]:
    """The compact ``metrics.jsonl`` record: ``layers`` (the connections' names) and ``map_KEY`` per
    :data:`RECORDED` key, a list in depth order (the loggers' ``hc/map_KEY/CONNECTION``)."""
    connections = learned_maps(model)["connections"]
    record: dict[str, Any] = {"layers": [c["name"] for c in connections]}
    for key in RECORDED:
        record[f"map_{key}"] = [round(float(c[key]), 6) for c in connections]
    return record


def maps_lines(result: dict[str, Any]) -> list[str]:
    """The report's section: one row per connection."""
    from ..reports import table

    rows = [[f"`{c['name']}`", f"{c['read_effective_blocks']:.2f}", f"{c['read_sv_max']:.3g} / {c['read_sv_min']:.3g}",
             f"{c['read_start_distance']:.3g}", f"{c['write_effective_blocks']:.2f}",
             f"{c['write_sv_max']:.3g} / {c['write_sv_min']:.3g}", f"{c['write_start_distance']:.3g}"]
            for c in result["connections"]]
    lines = ["## Read and write maps", "",
             "A wide residual has no residual matrix: it reads its branch's input from the n blocks of one wide "
             "stream by a dense map R (C × nC) and writes the output back by W (nC × C). Effective blocks: exp of the "
             "entropy of each block's share of the map's norm (1: one block, n: all alike; it starts reading one "
             "block and writing all n). σ: the largest and smallest singular values (1 for R and √n for W at the "
             "start). From start: ‖M − M₀‖_F / ‖M₀‖_F.", ""]
    return lines + table(["connection", "read: effective blocks", "read: σ max / min", "read: from start",
                          "write: effective blocks", "write: σ max / min", "write: from start"], rows,
                         align="lrrrrrr")


__all__ = ["RECORDED", "learned_maps", "map_modules", "maps_lines", "training_record"]
