"""Benchmarks of what the residual families cost: training-step time and peak memory as ratios to
``residual`` measured in the same run, the coefficient path alone, a peer implementation, parameters.

The command is ``s2hc bench`` (:mod:`s2hc.cli.bench`): it builds a :class:`BenchSettings`
(:mod:`s2hc.bench.settings`) and runs :func:`run_bench` (:mod:`s2hc.bench.run`: what is timed beside the variants
named, the baseline and the peer); the measurements are in :mod:`s2hc.bench.measure`.
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
from .run import run_bench
from .settings import BenchSettings

__all__ = [
    "PEER",
    "BenchSettings",
    "Variant",
    "benchmark_coefficients",
    "benchmark_steps",
    "format_coefficient_table",
    "format_step_table",
    "parse_variant",
    "peak_step_bytes",
    "peer_available",
    "run_bench",
]
