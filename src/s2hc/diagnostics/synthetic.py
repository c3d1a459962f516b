"""Synthetic mode: the measurements on matrices each family generates from random inputs, no model needed.

What the logit scale ``S`` is. Every family maps its raw inputs ``d_res`` through a learnable scale ``α``
(0.01 at initialisation) before anything else: Sinkhorn logits ``α·d + b`` (mhc), permutation weights
``softmax(α·d + b)`` (mhc-lite, kromhc), rotations ``γ·tanh(α·d + b)`` and the spectrum ``tanh(α·d + 4)``
(s2hc, orthogonal, isometric), and HC's dynamic term ``α·tanh(d)``. ``S`` is the standard deviation of the
scaled input ``α·d_res``: the synthetic mode sets every ``α`` of the family to ``S``, keeps every other
parameter at its initial value (biases, ``γ = 1``, HC's static ``B = I``) and draws ``d_res ~ N(0, 1)``
independently per layer, token and component.

For every family but hc, the map only sees the product ``α·d_res``, so this is the same as feeding an
initialised family (α = 0.01) raw inputs of standard deviation ``S / 0.01 = 100·S``. For hc it is not:
``α·tanh(d)`` saturates, so with α = 0.01 its matrices could never move more than 0.01 per entry, however
large ``d_res`` — and HC's instability in the papers comes exactly from its learned scales and static matrix
growing. With α = S the dynamic term has amplitude up to ``S``, which is what reproduces the explosion.
Defining ``S`` as the standard deviation of ``d_res`` itself would make every family look like the identity
(0.01·S is tiny for any sensible S), so neither mHC's drift nor HC's explosion would show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import mixers
from . import measures
from .collect import Capture
from .summary import summarize

__all__ = [
    "DEFAULT_SWEEP",
    "headline_numbers",
    "logit_scale_sweep",
    "scaled_mixer",
    "synthetic_matrices",
    "synthetic_summaries",
]

DEFAULT_SWEEP = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def _check_scale(logit_scale: float) -> float:
    if not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool) or not math.isfinite(logit_scale) \
            or logit_scale < 0:
        raise ValueError(f"logit_scale must be a finite number >= 0, got {logit_scale!r}")
    return float(logit_scale)


def scaled_mixer(family: str, n_streams: int, logit_scale: float, **family_options: Any) -> mixers.Mixer:
    """Family ``family`` for ``n_streams`` built as in a fresh model, with every scale ``α`` set to ``logit_scale``.

    The scales are the parameters whose name ends in ``alpha`` (``alpha``, ``spectrum_alpha``, the rotations'
    ``alpha``); everything else keeps its initial value.
    """
    scale = _check_scale(logit_scale)
    module = mixers.build(family, n_streams, **family_options)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.split(".")[-1].endswith("alpha"):
                parameter.fill_(scale)
    return module


def synthetic_matrices(
    family: str,
    n_streams: int = 4,
    layers: int = 28,
    tokens: int = 1024,
    logit_scale: float = 1.0,
    seed: int = 0,
    **family_options: Any,
) -> torch.Tensor:
    """``H_res`` ``(layers, tokens, n, n)`` float32 from :func:`scaled_mixer` on ``d_res ~ N(0, 1)``.

    The inputs come from a private generator seeded with ``seed`` (the global RNG is untouched), so with the
    same seed, families with the same number of inputs ``K`` (mhc and hc: n²) see identical ``d_res``.
    """
    for name, value in (("layers", layers), ("tokens", tokens), ("n_streams", n_streams)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    module = scaled_mixer(family, n_streams, logit_scale, **family_options)
    generator = torch.Generator().manual_seed(seed)
    d_res = torch.randn(layers, tokens, module.num_inputs, generator=generator)
    with torch.no_grad():
        return module(d_res)


def synthetic_summaries(
    families: Sequence[str],
    n_streams: int = 4,
    layers: int = 28,
    tokens: int = 1024,
    logit_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """``{family: summarize(...)}`` for each mixing family in ``families`` (the others have no constraint map to
    draw from: left out)."""
    out = {}
    for family in families:
        if family not in mixers.REGISTRY:
            continue
        res = synthetic_matrices(family, n_streams, layers, tokens, logit_scale, seed)
        capture = Capture([str(i) for i in range(layers)], [family] * layers, res, pre=None, post=None, similarity=None)
        out[family] = summarize(capture)
    return out


def logit_scale_sweep(
    families: Sequence[str],
    scales: Sequence[float] = DEFAULT_SWEEP,
    n_streams: int = 4,
    layers: int = 28,
    tokens: int = 1024,
    seed: int = 0,
) -> dict[str, list[dict[str, float]]]:
    """Headline numbers per family at each logit scale: ``{family: [{"logit_scale": S, ...}, ...]}``.

    Each entry has ``col_sum_error`` (worst single-layer column-sum error), ``column_sum_max`` (largest single-layer
    column sum), ``cumulative_column_sum_max``, ``composite_col_sum_error`` and ``composite_spectral_norm_at_depth``
    (worst over tokens, after all ``layers``), ``composite_forward_amax`` and ``composite_backward_amax`` (worst
    over depth and tokens), ``spectral_norm`` (worst single layer).
    """
    out: dict[str, list[dict[str, float]]] = {}
    for family in families:
        if family not in mixers.REGISTRY:
            continue
        for scale in scales:
            row = {"logit_scale": float(scale)}
            row.update(headline_numbers(synthetic_matrices(family, n_streams, layers, tokens, scale, seed)))
            out.setdefault(family, []).append(row)
    return out


def headline_numbers(res: torch.Tensor) -> dict[str, float]:
    """The numbers of one :func:`logit_scale_sweep` entry for ``res`` ``(L, N, n, n)``, without the full summary."""
    res = measures._matrices(res, "res")
    composite = measures.composite_product(res)
    gain = measures.amax_gain(composite)
    return {
        "col_sum_error": measures.row_col_sum_error(res).col.max().item(),
        "column_sum_max": res.sum(-2).max().item(),
        "spectral_norm": measures.spectral_norm(res).max().item(),
        "cumulative_column_sum_max": composite.sum(-2).max().item(),
        "composite_col_sum_error": measures.row_col_sum_error(composite).col.max().item(),
        "composite_spectral_norm_at_depth": measures.spectral_norm(composite[-1]).max().item(),
        "composite_forward_amax": gain.forward.max().item(),
        "composite_backward_amax": gain.backward.max().item(),
    }
