"""From per-token tensors to per-layer statistics: the JSON object ``diagnostics.json`` holds for one family.

:func:`summarize` takes a :class:`~s2hc.diagnostics.collect.Capture`, the matrices of ``L`` connections over the
same ``N`` tokens (and optionally the read / write gates and the stream similarities), and returns a dict of plain
Python lists, one key per measurement of :mod:`s2hc.diagnostics.measures`, each a distribution over tokens per layer
(or per depth for the composite measures). Connections whose ``H_res`` cannot change the model's output
(``inert_layers``, :mod:`s2hc.diagnostics.inert`) are measured like the others, but the headline's measures of what
the matrices do (distance from the identity, rotation angle, spectrum slope, negative share) are taken over the
other, "interior", connections, with the inert ones' values beside them. :func:`guarantee_checks` compares what a
family claims (``Mixer.guarantees``) with what was measured.

Stream usage (:func:`stream_usage`, docs/diagnostics.md "Stream usage"): from the read and write weights each
stream's share of what a connection reads and writes, the effective number of streams and the dominant stream, per
layer; from what the model's final read takes from each final stream, the same for the output. Its headline
(:func:`stream_usage_headline`) leaves out, the same way, the connections whose split of the read (or the write)
over the streams cannot change the output (``read_inert_layers``, ``write_inert_layers``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import mixers
from . import measures

__all__ = ["DEFAULT_TOLERANCE", "MIXING_HEADLINES", "OUTPUT_READS", "distribution", "guarantee_checks", "headline",
           "mixing_headline", "stream_usage", "stream_usage_headline", "summarize", "vector_distribution"]

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


#: What ``output_read`` says of how the output share was taken (:func:`stream_usage`), by value.
OUTPUT_READS = {
    "sum": "‖X_s‖ of the final streams, which the model sums",
    "mean": "‖X_s‖ of the final streams, which the model averages",
    "hyper-head": "‖w_s X_s‖, w the HyperHead's stream weights",
    "gated-head": "‖G_s ⊙ X̃_s‖ of the GatedHead's read (gates G, normalised streams X̃)",
    "unknown": "‖X_s‖ of the last connection's output: how this model reduces its streams is not known",
}


def _layer_indices(name: str, layers: Sequence[int], depth: int) -> list[int]:
    """``layers`` sorted without repeats; ValueError unless each is an index of the ``depth`` layers."""
    found = sorted(set(layers))
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < depth for i in found):
        raise ValueError(f"{name} must be indices of the {depth} layers (0 to {depth - 1}), got {list(layers)!r}")
    return found


def _check_per_stream(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must have shape {shape}, got {got}")
    return value.detach().double()


def _usage(weights: torch.Tensor, prefix: str, inert: Sequence[int] | None = None) -> dict[str, Any]:
    """The share statistics of per-stream ``weights`` ``(L, N, n)`` under keys ``<prefix>_...``; with ``inert``
    (layer indices) also over depth, the mean shares of the other layers."""
    per_token = measures.stream_shares(weights)  # (L, N, n)
    shares = measures.mean_shares(per_token)  # (L, n)
    dominant = measures.dominant_stream(shares)
    out = {
        f"{prefix}_share": _floats(shares),
        f"{prefix}_effective_streams": _floats(measures.effective_streams(shares)),
        f"{prefix}_dominant_share": _floats(dominant.share),
        f"{prefix}_dominant_stream": dominant.stream.tolist(),
        f"{prefix}_token_effective_streams": distribution(measures.effective_streams(per_token)),
    }
    if inert is not None:
        interior = [i for i in range(shares.shape[0]) if i not in set(inert)]
        depth = measures.mean_shares(shares[interior]) if interior else None  # every interior layer counts the same
        out[f"{prefix}_depth_share"] = _floats(depth) if depth is not None else None
        out[f"{prefix}_depth_effective_streams"] = _floats(measures.effective_streams(depth)) if interior else None
        out[f"{prefix}_depth_dominant_stream"] = measures.dominant_stream(depth).stream.item() if interior else None
    return out


def stream_usage(
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    output_read: str | None = None,
    read_spread: torch.Tensor | None = None,
    read_inert_layers: Sequence[int] = (),
    write_inert_layers: Sequence[int] = (),
) -> dict[str, Any]:
    """Each stream's share of what the connections read and write and of what the output takes, per layer.

    Args:
        pre, post: the read and write weights ``H_pre``, ``H_post`` ``(L, N, n)`` (L connections, N tokens, n
            streams), or None. For Qwen's gated residual, ``pre`` is each stream's gate mean over channels / n and
            ``post`` its write gate (:meth:`s2hc.GatedResidual.matrices`).
        output: ``(N, n)``, the size of what the model's final read takes from each final stream per token
            (non-negative; see :data:`OUTPUT_READS`), or None when the final streams are not known.
        output_read: how ``output`` was taken, a key of :data:`OUTPUT_READS` (default ``"unknown"``).
        read_spread: ``(L, N, n)``, the gated residual's read gates' standard deviation over channels / n, or None.
        read_inert_layers, write_inert_layers: the connections whose split of the read (the write) over the
            streams cannot change the output (the collector's ``read_inert`` / ``write_inert``): kept per layer,
            left out of :func:`stream_usage_headline`'s interior values.

    The definitions (per token ``t``, stream ``s``; :mod:`s2hc.diagnostics.measures`): the token's share
    ``p_ts = |w_ts| / Σ_u |w_tu|`` (:func:`~s2hc.diagnostics.measures.stream_shares`), the layer's share the mean
    over tokens ``p_s = mean_t p_ts`` (every token counts the same; :func:`~.measures.mean_shares`), its effective
    number of streams ``exp(−Σ_s p_s log p_s)`` in ``[1, n]`` and its dominant stream ``argmax_s p_s`` with that
    share. Beside them, the effective number of each token's own shares (a distribution over tokens): it is below
    the layer's when different tokens use different streams. Over depth: the mean of the layers' shares over the
    interior connections (all but the ``..._inert_layers``), its effective number and dominant stream: a layer may
    read one stream (effective number 1) while the layers together read them all (n).

    Returns (each key only when its input is given): ``read_share`` (L lists of n), ``read_effective_streams``
    (L), ``read_dominant_share`` (L), ``read_dominant_stream`` (L ints; −1 where no token has shares),
    ``read_token_effective_streams`` (:func:`distribution`), ``read_inert_layers``, ``read_depth_share`` (n),
    ``read_depth_effective_streams``, ``read_depth_dominant_stream`` (None without interior connections); the same
    with ``write_``; for
    the output ``output_share`` (n), ``output_effective_streams``, ``output_dominant_share``,
    ``output_dominant_stream``, ``output_token_effective_streams`` (``max``, ``mean``, ``min``, ``p50``, ``p90``,
    ``p99`` over tokens) and ``output_read``; ``read_spread`` (``mean``: L lists of n token means; ``relative``: the
    token mean of spread / read weight, the gates' coefficient of variation over channels).
    """
    out: dict[str, Any] = {}
    shape = None
    for prefix, weights, inert in (("read", pre, read_inert_layers), ("write", post, write_inert_layers)):
        if weights is None:
            continue
        if not isinstance(weights, torch.Tensor) or weights.dim() != 3:
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"{'pre' if prefix == 'read' else 'post'} must have shape (layers, tokens, n), got {got}")
        shape = tuple(weights.shape) if shape is None else shape
        _check_per_stream("pre" if prefix == "read" else "post", weights, shape)
        inert = _layer_indices(f"{prefix}_inert_layers", inert, weights.shape[0])
        out.update(_usage(weights, prefix, inert))
        out[f"{prefix}_inert_layers"] = inert
    if read_spread is not None:
        if pre is None:
            raise ValueError("read_spread needs pre (the read weights it is relative to), got pre=None")
        spread = _check_per_stream("read_spread", read_spread, shape)
        relative = spread / pre.detach().double().abs().clamp_min(torch.finfo(torch.float64).tiny)
        out["read_spread"] = {"mean": _floats(spread.mean(1)), "relative": _floats(relative.mean(1))}
    if output is not None:
        if not isinstance(output, torch.Tensor) or output.dim() != 2 or (shape and output.shape[-1] != shape[-1]):
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"output must have shape (tokens, n) with the n of pre and post, got {got}")
        read = "unknown" if output_read is None else output_read
        if read not in OUTPUT_READS:
            raise ValueError(f"output_read must be one of {list(OUTPUT_READS)} or None, got {output_read!r}")
        usage = _usage(output[None], "output")
        out.update({key: value[0] if isinstance(value, list) else {k: v[0] for k, v in value.items()}
                    for key, value in usage.items()})
        out["output_read"] = read
    return out


def summarize(capture: Any, *, tol: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Every measurement of docs/design.md section 2 for the ``L`` connections of ``capture`` over the same ``N``
    tokens.

    Args:
        capture: a :class:`~s2hc.diagnostics.collect.Capture`, what :func:`~s2hc.diagnostics.collect.collect`
            records (:meth:`Capture.summary <s2hc.diagnostics.collect.Capture.summary>` calls this), or one made
            from tensors:
            ``res``: ``H_res`` ``(L, N, n, n)``, connection ``l`` applied after connection ``l − 1`` (depth order).
            ``pre``, ``post``: ``H_pre``, ``H_post`` ``(L, N, n)`` or None.
            ``similarity``: stream cosine similarities ``(L', N, n, n)`` (e.g. each connection's input and the
            last one's output, L' = L + 1), or None; labelled ``names`` then ``"output"``.
            ``names``: a label per connection (None: ``"0"``, ``"1"``, ...).
            ``families`` / ``transposed``: each connection's family and whether it applied ``H_resᵀ``
            (``transpose_res``); when the families agree (``Capture.family``) and so do the ``transposed``, the
            family's guarantees are checked (:func:`guarantee_checks`; omitted for None or an unknown family).
            ``inert``: indices of the connections whose ``H_res`` cannot change the model's output
            (:func:`~s2hc.diagnostics.inert.inert_connections`; the collector computes them from the model): the
            headline reports them apart.
            ``output``, ``output_read``, ``read_spread``, ``read_inert``, ``write_inert``: for the stream usage,
            see :func:`stream_usage` (``output`` ``(N, n)``: what the final read takes from each final stream;
            None when the final streams are unknown, as for static matrices).
        tol: what "holds" means in :func:`guarantee_checks`.

    Returns a JSON-ready dict: ``layers``, ``depth``, ``tokens``, ``n_streams``, ``inert_layers`` (sorted),
    ``negative_tolerance`` (what ``negative_share`` counts: entries below minus it), and one key per
    measurement. Per layer (distributions over tokens, see :func:`distribution`): ``row_sum_error``,
    ``col_sum_error``, ``spectral_norm``, ``identity_distance``, ``rotation_angle`` (degrees),
    ``negative_share``, ``min_entry``, ``forward_amax``, ``backward_amax``, ``column_sums`` and ``row_sums`` (over
    tokens and columns, rows), ``common_mode_gain`` (``1ᵀH1/n``), ``deviation_singular_values`` and
    ``spectrum_slope`` (``1 − σ²``; :func:`vector_distribution`, components in the order of descending σ),
    ``h_pre`` / ``h_post``. Across depth (composite
    ``P_l = H_l ⋯ H_0``): ``composite_spectral_norm``, ``composite_forward_amax``, ``composite_backward_amax``,
    ``composite_row_sum_error``, ``composite_col_sum_error``, ``cumulative_column_sums``,
    ``composite_common_mode_gain``. Streams:
    ``stream_similarity`` (``offdiagonal`` distribution over tokens and pairs, ``pairwise_mean`` n × n per
    entry). Stream usage, whenever ``pre`` / ``post`` are given (:func:`stream_usage`): ``read_share``,
    ``read_effective_streams``, ``read_dominant_share``, ``read_dominant_stream``, ``read_token_effective_streams``,
    ``read_inert_layers``, the same for ``write_``, and with ``output`` the ``output_`` keys. ``headline``
    (:func:`headline`): the worst value of each, and ``guarantees`` when the family is a known family.
    """
    res, pre, post, similarity = capture.res, capture.pre, capture.post, capture.similarity
    transposed = list(capture.transposed)
    family = capture.family if len(set(transposed)) <= 1 else None
    res = measures._matrices(res, "res")
    if res.dim() != 4:
        raise ValueError(f"res must have shape (layers, tokens, n, n), got {tuple(res.shape)}")
    L, N, n, _ = res.shape
    names = [str(i) for i in range(L)] if capture.names is None else list(capture.names)
    if len(names) != L:
        raise ValueError(f"names must have one entry per layer ({L}), got {len(names)}")
    inert = _layer_indices("inert_layers", capture.inert, L)
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
        "row_sums": distribution(res.sum(-1)),
        "common_mode_gain": distribution(measures.common_mode_gain(res)),
        "composite_spectral_norm": distribution(composite_norms),
        "composite_forward_amax": distribution(composite_gain.forward),
        "composite_backward_amax": distribution(composite_gain.backward),
        "composite_row_sum_error": distribution(composite_sums.row),
        "composite_col_sum_error": distribution(composite_sums.col),
        "cumulative_column_sums": distribution(composite.sum(-2)),
        "composite_common_mode_gain": distribution(measures.common_mode_gain(composite)),
    }
    if pre is not None:
        out["h_pre"] = _gate_stats(pre)
    if post is not None:
        out["h_post"] = _gate_stats(post)
    for name, value in (("pre", pre), ("post", post), ("read_spread", capture.read_spread)):
        if value is not None:
            _check_per_stream(name, value, (L, N, n))
    if capture.output is not None:
        _check_per_stream("output", capture.output, (N, n))
    out.update(stream_usage(pre, post, capture.output, capture.output_read, capture.read_spread, capture.read_inert,
                            capture.write_inert))
    if similarity is not None:
        similarity = similarity.detach().double()
        labels = names + ["output"]
        out["stream_similarity"] = {
            "labels": labels[: similarity.shape[0]],
            "offdiagonal": distribution(_offdiagonal(similarity)) if n > 1 else None,
            "pairwise_mean": _floats(similarity.mean(1)),
        }
    out["headline"] = headline(out)
    if family in list(mixers.REGISTRY):
        measured = {"single": (res, sums, norms), "composite": (composite, composite_sums, composite_norms)}
        out["guarantees"] = guarantee_checks(family, res, composite, tol, transposed=any(transposed),
                                             _measured=measured)
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


def _last_mean(summary: dict[str, Any], key: str) -> float | None:
    """The token mean of ``key`` at the last layer (a composite measure: over the whole depth); None without it
    (a summary written before the measure existed)."""
    return summary[key]["mean"][-1] if key in summary and summary[key]["mean"] else None


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
        "common_mode_gain_max": worst("common_mode_gain"),
        "common_mode_gain_min": worst("common_mode_gain", "min", min),
        "composite_common_mode_gain_at_depth": _last_mean(summary, "composite_common_mode_gain"),
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
    out.update(stream_usage_headline(summary))
    return out


def _finite_values(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def stream_usage_headline(summary: dict[str, Any]) -> dict[str, float | None]:
    """Stream usage across depth, from a :func:`summarize` (or :func:`stream_usage`) dict; keys only for what it
    measured.

    For ``read`` and ``write``, over the interior connections (all but ``<read|write>_inert_layers``, whose split
    cannot change the output): ``<read|write>_effective_streams_mean`` (the mean over them of each connection's
    effective number of streams), ``..._min`` (the smallest), ``<read|write>_dominant_share_max`` (the largest
    dominant share); ``<read|write>_effective_streams_inert``: the mean over the others (None where there is no
    such connection); ``<read|write>_depth_effective_streams`` and ``..._depth_dominant_share``, of the
    interior connections' mean shares (:func:`stream_usage`). For the output: ``output_effective_streams``,
    ``output_dominant_share``.
    """
    out: dict[str, float | None] = {}
    for prefix in ("read", "write"):
        if f"{prefix}_effective_streams" not in summary:
            continue
        effective, dominant = summary[f"{prefix}_effective_streams"], summary[f"{prefix}_dominant_share"]
        inert = set(summary.get(f"{prefix}_inert_layers", ()))
        interior = [i for i in range(len(effective)) if i not in inert]
        values = _finite_values([effective[i] for i in interior])
        apart = _finite_values([effective[i] for i in sorted(inert)])
        shares = _finite_values([dominant[i] for i in interior])
        out[f"{prefix}_effective_streams_mean"] = sum(values) / len(values) if values else None
        out[f"{prefix}_effective_streams_min"] = min(values) if values else None
        out[f"{prefix}_dominant_share_max"] = max(shares) if shares else None
        out[f"{prefix}_effective_streams_inert"] = sum(apart) / len(apart) if apart else None
        depth = summary.get(f"{prefix}_depth_share")
        out[f"{prefix}_depth_effective_streams"] = summary.get(f"{prefix}_depth_effective_streams")
        out[f"{prefix}_depth_dominant_share"] = max(depth) if depth and not any(map(math.isnan, depth)) else None
    if "output_effective_streams" in summary:
        out["output_effective_streams"] = summary["output_effective_streams"]
        out["output_dominant_share"] = summary["output_dominant_share"]
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
