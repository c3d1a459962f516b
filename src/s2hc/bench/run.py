"""One ``s2hc bench`` run: what is timed beside the variants asked for, the three tables, and their text.

What a run holds besides the variants named (:func:`run_bench`), decided here once:

- the baseline of the step table: a plain ``residual``, added first when absent (:func:`~.measure.benchmark_steps`);
- the peer (:func:`with_peer`): the ``hyper-connections`` package's mHC (:data:`~.measure.PEER`) at n = 4 when it is
  importable, unless :attr:`BenchSettings.peer <s2hc.bench.settings.BenchSettings.peer>` is off; required (a
  :class:`~s2hc.extras.MissingExtra`) when it is named among the variants;
- the reference of the coefficient-path and parameter tables, whose ratios are to it: ``mhc``
  (:data:`s2hc.mixers.REFERENCE_FAMILY`), added when absent (:func:`coefficient_families`, :func:`param_rows`),
  and the parameter table's first row, the residual model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..connection import forms
from ..extras import MissingExtra, check_available
from ..mixers import REFERENCE_FAMILY
from ..params import format_table, param_table
from . import measure
from .measure import PEER, Variant
from .settings import BenchSettings


def with_peer(settings: BenchSettings, variants: list[Variant]) -> tuple[list[Variant], str | None]:
    """``(variants, note)``: ``variants`` with the peer (``PEER`` at n = 4) appended when ``settings.peer`` and it is
    not named but importable; ``note`` says why it is absent (None when it runs or ``settings.peer`` is off).
    :class:`~s2hc.extras.MissingExtra` when the peer is named and the package is not installed."""
    if any(v.family == PEER for v in variants):  # named: required, before anything is built
        check_available(("hyper_connections",), f"--families {PEER}")
        return list(variants), None
    if not settings.peer:
        return list(variants), None
    if measure.peer_available():
        return [*variants, Variant(PEER, 4)], None
    return list(variants), f"{PEER}: absent ({MissingExtra('hyper_connections', 'the peer')})"


def coefficient_families(variants: list[Variant]) -> list[str]:
    """The families of the coefficient-path table: each variant's family once, in order, the peer left out, and
    the reference (``mhc``) its ratios are to when absent (:func:`~.measure.benchmark_coefficients` leaves out
    the families without a coefficient path)."""
    families = list(dict.fromkeys(v.family for v in variants if v.family != PEER))
    return families if REFERENCE_FAMILY in families else [*families, REFERENCE_FAMILY]


def param_rows(settings: BenchSettings, variants: list[Variant]) -> list[dict[str, Any]]:
    """The parameter table (:func:`s2hc.params.param_table`) of the residual model, each variant's family with its
    family options (the peer and the residual itself left out), and the reference (``mhc``) when absent, at the
    settings' model and ``n_streams``."""
    config = settings.model_config()
    counted = [(v.family, v.family_options) for v in variants
               if v.family != PEER and forms.get(v.family) is not forms.RESIDUAL]
    counted += [(REFERENCE_FAMILY, {})] * (REFERENCE_FAMILY not in {family for family, _ in counted})
    return param_table([(forms.RESIDUAL.name, {}), *counted], layers=config.n_layers, dim=config.dim,
                       n_streams=settings.n_streams)


def run_bench(
    settings: BenchSettings,
    variants: list[Variant],
    *,
    log: Callable[[str], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The bench of ``variants`` as ``settings`` say: the step table (:func:`~.measure.benchmark_steps`, with
    the peer of :func:`with_peer`), the coefficient-path table unless ``settings.coefficients`` is off
    (:func:`~.measure.benchmark_coefficients` of :func:`coefficient_families`, at least three repetitions) and the
    parameter table (:func:`param_rows`).

    Returns the JSON object ``s2hc bench --json`` prints: ``machine``, ``device``, ``dtype`` (the precision),
    ``steps``, ``coefficients``, ``params`` (lists of rows) and ``peer`` (``"present"``, or why it is absent).
    ``log`` gets the progress lines, ``on_event`` the events as they happen: ``{"event": "start", ...}`` with
    the settings first, then those of the measurements, ``{"event": "done"}`` last. Errors: those of
    :func:`with_peer` and of the measurements (a ValueError for a variant that cannot run)."""
    log = log or (lambda _: None)
    emit = on_event or (lambda _: None)
    variants, peer_note = with_peer(settings, variants)
    config, device = settings.model_config(), settings.device
    machine = measure.machine_description(device)
    precision = measure.precision_name(settings.dtype, device)
    log(f"machine: {machine}")
    emit({"event": "start", "machine": machine, "device": device.type, "dtype": precision, "preset": settings.preset,
          "layers": config.n_layers, "n_streams": settings.n_streams, "compiled": settings.compile,
          "batch_size": settings.batch_size, "seq_len": settings.seq_len, "repeats": settings.repeats,
          "steps": settings.steps, "variants": [v.label for v in variants],
          "peer": peer_note or "present"})  # fmt: skip
    steps = measure.benchmark_steps(settings, variants, log=log, on_event=emit)
    coefficients = [] if not settings.coefficients else measure.benchmark_coefficients(
        coefficient_families(variants), n_streams=settings.n_streams, dim=config.dim,
        repeats=max(3, settings.repeats), device=device, dtype=settings.dtype, log=log, on_event=emit)  # fmt: skip
    params = param_rows(settings, variants)
    emit({"event": "done"})
    log("done")
    return {"machine": machine, "device": device.type, "dtype": precision, "steps": steps,
            "coefficients": coefficients, "params": params, "peer": peer_note or "present"}  # fmt: skip


def format_report(result: dict[str, Any]) -> str:
    """The text ``s2hc bench`` prints for :func:`run_bench`'s ``result``: the machine, the step table (with why
    the peer is absent), the coefficient-path table when it ran, and the parameter table."""
    peer_note = None if result["peer"] == "present" else result["peer"]
    parts = [f"Machine: {result['machine']}\n", measure.format_step_table(result["steps"], peer_note)]
    if result["coefficients"]:
        parts += ["", measure.format_coefficient_table(result["coefficients"])]
    parts += ["", format_table(result["params"])]
    return "\n".join(parts)
