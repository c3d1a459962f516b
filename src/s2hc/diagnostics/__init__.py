"""Diagnostics: what the residual matrices of a hyper-connection model do (docs/design.md section 2).

Three layers, each usable alone (see ``docs/diagnostics.md``):

- :mod:`~s2hc.diagnostics.measures`: one function per measurement on tensors — :func:`row_col_sum_error`,
  :func:`spectral_norm`, :func:`deviation_singular_values`, :func:`spectrum_slope`, :func:`rotation_angle`,
  :func:`identity_distance`, :func:`negative_share`, :func:`composite_product`, :func:`amax_gain`,
  :func:`cumulative_column_sums`, :func:`stream_similarity`; stream usage: :func:`stream_shares`,
  :func:`mean_shares`, :func:`effective_streams`, :func:`dominant_stream`, :func:`stream_norms`.
- :mod:`~s2hc.diagnostics.inert`: which connections of a model cannot change its output whatever their
  ``H_res`` (:func:`inert_connections`); the summaries report them apart.
- :mod:`~s2hc.diagnostics.collect`: run a model on real tokens and capture every connection's streams and
  matrices (:class:`Recorder`, :func:`collect`), gradient norms per layer, the compact training record;
  :mod:`~s2hc.diagnostics.summary` turns the tensors into per-layer statistics (:func:`summarize`).
- :mod:`~s2hc.diagnostics.report`: ``s2hc diagnose`` for a checkpoint (:func:`diagnose_checkpoint`) or for
  synthetic matrices (:func:`diagnose_synthetic`), writing ``diagnostics.json``, figures and ``report.md``; the
  same for your own model and token ids (:func:`diagnose_model`, which returns the report's path).

>>> import torch
>>> from s2hc.diagnostics import synthetic_matrices, composite_product, spectral_norm
>>> Hs = synthetic_matrices("s2hc", n_streams=4, layers=28, tokens=64, logit_scale=8.0)
>>> bool((spectral_norm(composite_product(Hs)[-1]) - 1).abs().max() < 1e-4)
True
"""

from .collect import Capture, Recorder, collect, gradient_norms, mixing_connections, training_diagnostics
from .inert import inert_connections, model_inert_connections
from .measures import (
    NEGATIVE_TOLERANCE,
    AmaxGain,
    Dominant,
    SumError,
    amax_gain,
    column_sums,
    composite_product,
    cumulative_column_sums,
    deviation_block,
    deviation_singular_values,
    dominant_stream,
    effective_streams,
    identity_distance,
    mean_shares,
    negative_share,
    rotation_angle,
    row_col_sum_error,
    row_sums,
    spectral_norm,
    spectrum_slope,
    stream_norms,
    stream_shares,
    stream_similarity,
)
from .report import diagnose_checkpoint, diagnose_model, diagnose_synthetic
from .summary import guarantee_checks, summarize
from .synthetic import logit_scale_sweep, scaled_mixer, synthetic_matrices, synthetic_summaries

__all__ = [
    "NEGATIVE_TOLERANCE",
    "AmaxGain",
    "Capture",
    "Dominant",
    "Recorder",
    "SumError",
    "amax_gain",
    "collect",
    "column_sums",
    "composite_product",
    "cumulative_column_sums",
    "deviation_block",
    "deviation_singular_values",
    "diagnose_checkpoint",
    "diagnose_model",
    "diagnose_synthetic",
    "dominant_stream",
    "effective_streams",
    "gradient_norms",
    "guarantee_checks",
    "identity_distance",
    "inert_connections",
    "logit_scale_sweep",
    "mean_shares",
    "mixing_connections",
    "model_inert_connections",
    "negative_share",
    "rotation_angle",
    "row_col_sum_error",
    "row_sums",
    "scaled_mixer",
    "spectral_norm",
    "spectrum_slope",
    "stream_norms",
    "stream_shares",
    "stream_similarity",
    "summarize",
    "synthetic_matrices",
    "synthetic_summaries",
    "training_diagnostics",
]
