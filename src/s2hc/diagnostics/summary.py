"""From per-token tensors to per-layer statistics: the JSON object ``diagnostics.json`` holds for one family.

:func:`summarize` takes the matrices of ``L`` connections over the same ``N`` tokens (and optionally the read /
write gates and the stream similarities) and returns a dict of plain Python lists, one key per measurement
of :mod:`s2hc.diagnostics.measures`, each a distribution over tokens per layer (or per depth for the
composite measures). Connections whose ``H_res`` cannot change the model's output (``inert_layers``,
:mod:`s2hc.diagnostics.inert`) are measured like the others, but the headline's measures of what the matrices
do (distance from the identity, rotation angle, spectrum slope, negative share) are taken over the other,
"interior", connections, with the inert ones' values beside them. :func:`guarantee_checks` compares what a
family claims (``Mixer.guarantees``) with what was measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import mixers
from . import measures

__all__ = ["DEFAULT_TOLERANCE", "MIXING_HEADLINES", "distribution", "guarantee_checks", "headline", "mixing_headline",
           "summarize", "vector_distribution"]

#: What "holds" means in :func:`guarantee_checks`: float32 rounding of a 4 × 4 to 8 × 8 map is ~1e-6.
DEFAULT_TOLERANCE = 1e-5
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def _floats(t: torch.Tensor) -> list:
    return t.detach().cpu().double().tolist()


def distribution(values: torch.Tensor) -> dict[str, list[float]]:
    """Per-row statistics of ``values`` ``(L, N)`` (L layers, N samples): ``max``, ``mean``, ``min``, ``p50``,
    ``p90``, ``p99``, each a list of L floats (``-inf``/``inf``/``nan`` pass through as floats)."""
    values = values.detach().double().flatten(1)
    out = {"max": values.amax(1), "mean": values.mean(1), "min": values.amin(1)}
    finite = torch.nan_to_num(values, nan=math.inf)  # quantile refuses nan; keep it visible as inf
    levels = torch.tensor(list(QUANTILES.values()), dtype=finite.dtype, device=finite.device)
    for key, q in zip(QUANTILES, torch.quantile(finite, levels, dim=1)):  # one sort for all levels
        out[key] = q
    return {key: _floats(v) for key, v in out.items()}


def vector_distribution(values: torch.Tensor) -> dict[str, list[list[float]]]:
    """Per-row statistics of ``values`` ``(L, N, k)`` for each of the k components: ``mean``, ``min``, ``max``,
    ``p10``, ``p90``, each a list (L) of lists (k); with k = 0 (one stream has no deviation) lists of empty lists,
    since a quantile of nothing is undefined."""
    values = values.detach().double()
    if values.shape[-1] == 0:
        return {key: [[] for _ in range(values.shape[0])] for key in ("mean", "min", "max", "p10", "p90")}
    out = {
        "mean": values.mean(1),
        "min": values.amin(1),
        "max": values.amax(1),
        "p10": torch.quantile(values, 0.1, dim=1),
        "p90": torch.quantile(values, 0.9, dim=1),
    }
    return {key: _floats(v) for key, v in out.items()}


def _gate_stats(gate: torch.Tensor) -> dict[str, Any]:
    """``gate`` ``(L, N, n)``: per stream mean/std/min/max over tokens, and the distribution of the sum over streams."""
    gate = gate.detach().double()
    return {
        "mean": _floats(gate.mean(1)),
        "std": _floats(gate.std(1, unbiased=False)),
        "min": _floats(gate.amin(1)),
        "max": _floats(gate.amax(1)),
        "sum": distribution(gate.sum(-1)),
    }


def _offdiagonal(sim: torch.Tensor) -> torch.Tensor:
    """``(..., n, n) -> (..., n(n−1)/2)``: the strict upper triangle (each pair of streams once)."""
    n = sim.shape[-1]
    rows, cols = torch.triu_indices(n, n, offset=1)
    return sim[..., rows, cols]


def summarize(
    res: torch.Tensor,
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    similarity: torch.Tensor | None = None,
    names: Sequence[str] | None = None,
    family: str | None = None,
    similarity_names: Sequence[str] | None = None,
    tol: float = DEFAULT_TOLERANCE,
    transposed: bool = False,
    inert_layers: Sequence[int] = (),
) -> dict[str, Any]:
    """Every measurement of docs/design.md section 2 for ``L`` connections over the same ``N`` tokens.

    Args:
        res: ``H_res`` ``(L, N, n, n)``, connection ``l`` applied after connection ``l − 1`` (depth order).
        pre, post: ``H_pre``, ``H_post`` ``(L, N, n)`` or None.
        similarity: stream cosine similarities ``(L', N, n, n)`` (e.g. each connection's input and the last
            one's output, L' = L + 1), or None.
        names: a label per connection (default ``"0"``, ``"1"``, ...); ``similarity_names`` one per entry of
            ``similarity`` (default ``names`` plus ``"output"``).
        family: the family's name, for :func:`guarantee_checks` (omitted when None or unknown);
            ``transposed``: the connections applied ``H_resᵀ`` (``transpose_res``).
        inert_layers: indices of the connections whose ``H_res`` cannot change the model's output
            (:func:`~s2hc.diagnostics.inert.inert_connections`; the collector computes them from the model):
            the headline reports them apart.

    Returns a JSON-ready dict: ``layers``, ``depth``, ``tokens``, ``n_streams``, ``inert_layers`` (sorted),
    ``negative_tolerance`` (what ``negative_share`` counts: entries below minus it), and one key per
    measurement. Per layer (distributions over tokens, see :func:`distribution`): ``row_sum_error``,
    ``col_sum_error``, ``spectral_norm``, ``identity_distance``, ``rotation_angle`` (degrees),
    ``negative_share``, ``min_entry``, ``forward_amax``, ``backward_amax``, ``column_sums`` (over tokens and
    columns), ``deviation_singular_values`` and ``spectrum_slope`` (``1 − σ²``; :func:`vector_distribution`,
    components in the order of descending σ), ``h_pre`` / ``h_post``. Across depth (composite
    ``P_l = H_l ⋯ H_0``): ``composite_spectral_norm``, ``composite_forward_amax``, ``composite_backward_amax``,
    ``composite_row_sum_error``, ``composite_col_sum_error``, ``cumulative_column_sums``. Streams:
    ``stream_similarity`` (``offdiagonal`` distribution over tokens and pairs, ``pairwise_mean`` n × n per
    entry). ``headline`` (:func:`headline`): the worst value of each, and ``guarantees`` when ``family`` is a
    known family.
    """
    res = measures._matrices(res, "res")
    if res.dim() != 4:
        raise ValueError(f"res must have shape (layers, tokens, n, n), got {tuple(res.shape)}")
    L, N, n, _ = res.shape
    names = [str(i) for i in range(L)] if names is None else list(names)
    if len(names) != L:
        raise ValueError(f"names must have one entry per layer ({L}), got {len(names)}")
    inert = sorted(set(inert_layers))
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < L for i in inert):
        raise ValueError(f"inert_layers must be indices of the {L} layers (0 to {L - 1}), got {list(inert_layers)!r}")
    sums = measures.row_col_sum_error(res)
    gain = measures.amax_gain(res)
    norms = measures.spectral_norm(res)
    composite = measures.composite_product(res)
    composite_sums = measures.row_col_sum_error(composite)
    composite_gain = measures.amax_gain(composite)
    composite_norms = measures.spectral_norm(composite)
    out: dict[str, Any] = {
        "layers": names,
        "depth": L,
        "tokens": N,
        "n_streams": n,
        "inert_layers": inert,
        "negative_tolerance": measures.NEGATIVE_TOLERANCE,
        "row_sum_error": distribution(sums.row),
        "col_sum_error": distribution(sums.col),
        "spectral_norm": distribution(norms),
        "deviation_singular_values": vector_distribution(measures.deviation_singular_values(res)),
        "spectrum_slope": vector_distribution(measures.spectrum_slope(res)),
        "identity_distance": distribution(measures.identity_distance(res)),
        "rotation_angle": distribution(measures.rotation_angle(res)),
        "negative_share": distribution(measures.negative_share(res)),
        "min_entry": distribution(res.amin(dim=(-1, -2))),
        "forward_amax": distribution(gain.forward),
        "backward_amax": distribution(gain.backward),
        "column_sums": distribution(res.sum(-2)),
        "composite_spectral_norm": distribution(composite_norms),
        "composite_forward_amax": distribution(composite_gain.forward),
        "composite_backward_amax": distribution(composite_gain.backward),
        "composite_row_sum_error": distribution(composite_sums.row),
        "composite_col_sum_error": distribution(composite_sums.col),
        "cumulative_column_sums": distribution(composite.sum(-2)),
    }
    if pre is not None:
        out["h_pre"] = _gate_stats(pre)
    if post is not None:
        out["h_post"] = _gate_stats(post)
    if similarity is not None:
        similarity = similarity.detach().double()
        labels = list(similarity_names) if similarity_names is not None else names + ["output"]
        out["stream_similarity"] = {
            "labels": labels[: similarity.shape[0]],
            "offdiagonal": distribution(_offdiagonal(similarity)) if n > 1 else None,
            "pairwise_mean": _floats(similarity.mean(1)),
        }
    out["headline"] = headline(out)
    if family in list(mixers.REGISTRY):
        measured = {"single": (res, sums, norms), "composite": (composite, composite_sums, composite_norms)}
        out["guarantees"] = guarantee_checks(family, res, composite, tol, transposed=transposed, _measured=measured)
    return out


#: The headline's measures of what the matrices do, split into interior and inert connections:
#: ``{headline name: (summary key, how the per-layer token means are combined)}``.
MIXING_HEADLINES = {
    "identity_distance": ("identity_distance", "largest"),
    "rotation_angle": ("rotation_angle", "largest"),
    "spectrum_slope": ("spectrum_slope", "mean"),
    "negative_share": ("negative_share", "largest"),
}


def _layer_means(summary: dict[str, Any], key: str, layers: list[int]) -> list[float]:
    """The token means of ``key`` at ``layers``; for a per-component measure every component of each."""
    if key not in summary:
        return []
    means = summary[key]["mean"]
    picked = [means[i] for i in layers]
    return [v for row in picked for v in row] if picked and isinstance(picked[0], list) else picked


def mixing_headline(summary: dict[str, Any]) -> dict[str, float | None]:
    """What the matrices do, over the interior connections (``<name>_mean``) and, apart, over the connections whose
    ``H_res`` cannot change the output (``<name>_inert``), from a :func:`summarize` dict.

    ``identity_distance``, ``rotation_angle``, ``negative_share``: the largest per-layer token mean;
    ``spectrum_slope``: the mean of ``1 − σ²`` over those connections and their components (one number for "can
    the spectrum still learn": a mean of 1e-3 means every component is saturated or nearly). None where there
    is no such connection (every connection inert, as in a one-block model; or none inert).
    """
    inert = set(summary.get("inert_layers", ()))
    groups = {"mean": [i for i in range(summary["depth"]) if i not in inert], "inert": sorted(inert)}
    out: dict[str, float | None] = {}
    for name, (key, how) in MIXING_HEADLINES.items():
        for suffix, layers in groups.items():
            values = _layer_means(summary, key, layers)
            if not values:
                out[f"{name}_{suffix}"] = None
            else:
                out[f"{name}_{suffix}"] = max(values) if how == "largest" else sum(values) / len(values)
    return out


def headline(summary: dict[str, Any]) -> dict[str, float | None]:
    """The worst value of each measurement over layers (and tokens), from a :func:`summarize` dict; the measures of
    what the matrices do over the interior connections, with the inert ones apart (:func:`mixing_headline`)."""

    def worst(key: str, stat: str = "max", pick=max):
        return pick(summary[key][stat]) if key in summary and summary[key][stat] else None

    sv = summary["deviation_singular_values"]["mean"]
    out = {
        "row_sum_error": worst("row_sum_error"),
        "col_sum_error": worst("col_sum_error"),
        "spectral_norm": worst("spectral_norm"),
        "column_sum_max": worst("column_sums"),
        "column_sum_min": worst("column_sums", "min", min),
        **mixing_headline(summary),
        "smallest_deviation_singular_value_mean": min((row[-1] for row in sv if row), default=None),
        "composite_spectral_norm": worst("composite_spectral_norm"),
        "composite_spectral_norm_at_depth": summary["composite_spectral_norm"]["max"][-1],
        "composite_forward_amax": worst("composite_forward_amax"),
        "composite_backward_amax": worst("composite_backward_amax"),
        "composite_col_sum_error": worst("composite_col_sum_error"),
        "cumulative_column_sum_max": worst("cumulative_column_sums"),
    }
    sim = summary.get("stream_similarity")
    if sim and sim["offdiagonal"]:
        out["stream_similarity_output_mean"] = sim["offdiagonal"]["mean"][-1]
    return out


def guarantee_checks(family: str, res: torch.Tensor, composite: torch.Tensor | None = None,
                     tol: float = DEFAULT_TOLERANCE, transposed: bool = False,
                     _measured: dict | None = None) -> list[dict[str, Any]]:
    """Each flag of ``mixers.get(family).guarantees`` that is claimed, with the measured worst case.

    ``res`` ``(L, N, n, n)``; ``composite`` (default: its :func:`~s2hc.diagnostics.measures.composite_product`)
    is checked too when the family claims ``closed_under_products``. Returns a list of
    ``{"property", "claimed", "measured", "tolerance", "holds"}``; a claim holds when the worst deviation is at
    most ``tol`` (``tol · L`` for the composite, whose rounding grows with depth). ``transposed``: ``res`` is
    the family's matrix transposed (``HyperConnection(transpose_res=True)``), so its row and column claims swap.
    """
    flags = mixers.get(family).guarantees
    if transposed:
        flags = dataclasses.replace(flags, row_sums_one=flags.col_sums_one, col_sums_one=flags.row_sums_one)
    res = measures._matrices(res, "res")
    composite = measures.composite_product(res) if composite is None else composite
    depth = res.shape[0]
    measured = _measured or {}

    def checks(H: torch.Tensor, which: str, prefix: str, limit: float) -> list[tuple[str, float, float]]:
        _, sums, norms = measured.get(which) or (H, measures.row_col_sum_error(H), None)
        found = []
        if flags.row_sums_one:
            found.append((f"{prefix}rows sum to 1", sums.row.max().item(), limit))
        if flags.col_sums_one:
            found.append((f"{prefix}columns sum to 1", sums.col.max().item(), limit))
        if flags.nonnegative:
            found.append((f"{prefix}non-negative (most negative entry)", (-H.amin()).clamp_min(0).item(), limit))
        if flags.spectral_norm_at_most_one:
            norms = measures.spectral_norm(H) if norms is None else norms
            found.append((f"{prefix}spectral norm ≤ 1 (excess)", (norms.max() - 1).clamp_min(0).item(), limit))
        if flags.orthogonal:
            eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
            found.append(
                (f"{prefix}orthogonal (max |HᵀH − I|)", (H.transpose(-1, -2) @ H - eye).abs().max().item(), limit)
            )
        return found

    rows = checks(res, "single", "", tol)
    if flags.closed_under_products and depth > 1:
        rows += checks(composite, "composite", f"composite of {depth}: ", tol * depth)
    return [
        {"property": name, "claimed": True, "measured": value, "tolerance": limit, "holds": bool(value <= limit)}
        for name, value, limit in rows
    ]
