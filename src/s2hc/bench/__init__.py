"""Benchmarks of what the residual families cost: training-step time and peak memory as ratios to
``residual`` measured in the same run, the coefficient path alone, a peer implementation, parameters.

The command is ``s2hc bench`` (:mod:`s2hc.cli.bench`); the functions are in :mod:`s2hc.bench.measure`.
Results and method: ``docs/benchmarks.md``. Benchmarks report; they never fail on a time.
"""

from .measure import (
    PEER,
    Variant,
    benchmark_coefficients,
    benchmark_steps,
    format_coefficient_table,
    format_step_table,
    parse_variant,
    peak_step_bytes,
    peer_available,
)

__all__ = [
    "PEER",
    "Variant",
    "benchmark_coefficients",
    "benchmark_steps",
    "format_coefficient_table",
    "format_step_table",
    "parse_variant",
    "peak_step_bytes",
    "peer_available",
]
