"""Figures of the diagnostics (matplotlib, the ``plot`` extra), each from ``{family: summary}`` dicts.

Every function writes one PNG atomically (temporary file, then rename) and returns its path. The figures:

- ``deviation_singular_values.png``: the singular values of ``U_Zᵀ H_res U_Z`` per layer (s²HC paper, Fig. 5);
- ``amax_gain.png``: single-layer and composite forward / backward Amax gain and the composite spectral norm
  against depth (mHC paper, Fig. 3);
- ``column_sums.png``: single-layer and cumulative (composite) column sums against depth (s²HC paper, Fig. 7);
- ``mixing.png``: what each ``H_res`` does to the streams against depth (distance from the identity, rotation
  angle, spectrum slope, negative share), the connections that cannot change the output drawn hollow;
- ``stream_similarity.png``: cosine similarity of the streams per layer (model runs only);
- ``stream_usage.png``: each stream's share of what each connection reads and writes (and of the output) and the
  effective number of streams against depth (whenever the summaries have read or write weights);
- ``logit_scale_sweep.png``: headline numbers against the logit scale (synthetic mode);
- ``training_history.png``: diagnostics records of ``metrics.jsonl`` against the training step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..extras import MissingExtra, is_available, require

__all__ = [
    "NO_FIGURES",
    "FIGURES",
    "has_stream_usage",
    "have_matplotlib",
    "plot_amax_gain",
    "plot_column_sums",
    "plot_deviation_singular_values",
    "plot_logit_scale_sweep",
    "plot_mixing",
    "plot_stream_similarity",
    "plot_stream_usage",
    "plot_training_history",
]

FIGURES = {
    "deviation_singular_values": "deviation_singular_values.png",
    "amax_gain": "amax_gain.png",
    "column_sums": "column_sums.png",
    "mixing": "mixing.png",
    "stream_similarity": "stream_similarity.png",
    "stream_usage": "stream_usage.png",
    "logit_scale_sweep": "logit_scale_sweep.png",
    "training_history": "training_history.png",
}
LOG_FLOOR = 1e-9  # log axes cannot show 0 (an exact guarantee): such values are drawn at this floor


#: What a report says in place of its figures without matplotlib (the plot extra): the reports degrade, not fail.
NO_FIGURES = f"(No figures: {MissingExtra('matplotlib', 'figures')}.)"


def have_matplotlib() -> bool:
    return is_available("matplotlib")


def _pyplot():
    matplotlib = require("matplotlib", "figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _finite(values: list[float]) -> list[float]:
    return [v if v is not None and math.isfinite(v) else math.nan for v in values]


def _floored(values: list[float]) -> list[float]:
    return [max(v, LOG_FLOOR) if not math.isnan(v) else v for v in _finite(values)]


def _auto_log(ax, *series: list[float]) -> None:
    """Log y-axis when the values span more than a factor 10 above 1 (exploding gains), else linear."""
    top = max((v for s in series for v in _finite(s) if not math.isnan(v)), default=1.0)
    if top > 10:
        ax.set_yscale("log")


def _grid(count: int, width: float = 4.2, height: float = 3.3, max_cols: int = 4):
    plt = _pyplot()
    cols = min(count, max_cols)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout="constrained")
    flat = list(axes.flat)
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def plot_deviation_singular_values(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """One panel per family: each singular value of the deviation block against the layer, mean over tokens
    (line) with the 10–90 % band (s²HC paper, Fig. 5); the connections whose ``H_res`` cannot change the output
    (``inert_layers``, where the summary has them) shaded grey."""
    fig, axes = _grid(len(summaries))
    for ax, (family, s) in zip(axes, summaries.items()):
        sv = s["deviation_singular_values"]
        layers = list(range(len(sv["mean"])))
        m = len(sv["mean"][0]) if sv["mean"] else 0
        for k in range(m):
            mean = [row[k] for row in sv["mean"]]
            ax.plot(layers, mean, marker="o", markersize=2.5, linewidth=1.2, label=f"σ{k + 1}")
            ax.fill_between(layers, [r[k] for r in sv["p10"]], [r[k] for r in sv["p90"]], alpha=0.15)
        ax.axhline(1.0, color="grey", linewidth=0.7, linestyle=":")
        for layer in s.get("inert_layers", []):
            ax.axvspan(layer - 0.5, layer + 0.5, color="grey", alpha=0.12, linewidth=0)
        top = max((v for row in sv["p90"] for v in row), default=1.0)
        ax.set_ylim(0.0, max(1.05, 1.05 * top))  # 0 to 1 at least: near-1 values must not be magnified
        ax.set_title(family)
        ax.set_xlabel("connection (depth)")
        ax.set_ylabel("singular value of U_Zᵀ H U_Z")
        ax.grid(alpha=0.3)
        if m:
            ax.legend(fontsize=7)
    fig.suptitle("Deviation singular values per layer (mean over tokens, 10–90 % band)")
    return _save(fig, path)


def plot_amax_gain(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """Three panels against depth, one colour per family (mHC paper, Fig. 3): (a) single-layer forward (solid)
    and backward (dashed) Amax gain, (b) the same for the composite ``H_l ⋯ H_0``, (c) the composite's spectral
    norm. Each is the worst over tokens."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    panels = [
        ("(a) single layer: Amax gain (solid forward, dashed backward)", "forward_amax", "backward_amax"),
        (
            "(b) composite: Amax gain (solid forward, dashed backward)",
            "composite_forward_amax",
            "composite_backward_amax",
        ),
        ("(c) composite: spectral norm", "composite_spectral_norm", None),
    ]
    for ax, (title, key, backward_key) in zip(axes, panels):
        plotted = []
        for index, (family, s) in enumerate(summaries.items()):
            color = f"C{index}"
            forward = _finite(s[key]["max"])
            depth = list(range(len(forward)))
            ax.plot(depth, forward, color=color, linewidth=1.4, label=family)
            plotted.append(forward)
            if backward_key:
                backward = _finite(s[backward_key]["max"])
                ax.plot(depth, backward, color=color, linewidth=1.4, linestyle="--")
                plotted.append(backward)
        _auto_log(ax, *plotted)
        ax.axhline(1.0, color="grey", linewidth=0.7, linestyle=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("connection (depth)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("max over tokens")
    fig.suptitle("Amax gain (forward: max |row sum|, backward: max |column sum|) and composite spectral norm")
    return _save(fig, path)


def plot_column_sums(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """Two panels against depth (s²HC paper, Fig. 7): the column sums of each single ``H_res`` and of the composite
    ``H_l ⋯ H_0``, per family the range over tokens and columns (band), its maximum (solid) and minimum (dashed).

    The scale is linear, as in the paper; a family whose sums leave ``[−10, 10]`` (hc) would flatten everything
    else, so the axis is cut above the others and that family's legend entry gives its true extremes.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    panels = [("single layer", "column_sums"), ("composite (cumulative)", "cumulative_column_sums")]
    for ax, (title, key) in zip(axes, panels):
        tame_top, tame_bottom = [1.0], [1.0]
        for index, (family, s) in enumerate(summaries.items()):
            color = f"C{index}"
            top, bottom = _finite(s[key]["max"]), _finite(s[key]["min"])
            depth = list(range(len(top)))
            high = max((v for v in top if not math.isnan(v)), default=math.nan)
            low = min((v for v in bottom if not math.isnan(v)), default=math.nan)
            wild = not (abs(high) <= 10 and abs(low) <= 10)
            label = f"{family} (off scale: {low:.3g} to {high:.3g})" if wild else family
            if not wild:
                tame_top.append(high)
                tame_bottom.append(low)
            if not wild:  # a band from −1e21 to 1e21 would cover the panel
                ax.fill_between(depth, bottom, top, color=color, alpha=0.12)
            ax.plot(depth, top, color=color, linewidth=1.4, label=label)
            ax.plot(depth, bottom, color=color, linewidth=1.0, linestyle="--")
        upper, lower = max(tame_top), min(tame_bottom)
        margin = max(0.05, 0.1 * (upper - lower))
        ax.set_ylim(min(0.0, lower - margin), upper + margin)
        ax.axhline(1.0, color="grey", linewidth=0.7, linestyle=":")
        ax.set_title(f"column sums, {title} (solid max, dashed min)", fontsize=10)
        ax.set_xlabel("connection (depth)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("column sum (1 = mean preserved)")
    return _save(fig, path)


#: The panels of :func:`plot_mixing`: (summary key, title, log scale when every value is positive).
MIXING_PANELS = (
    ("identity_distance", "‖H − I‖_F (mean over tokens)", False),
    ("rotation_angle", "rotation angle of the deviations, degrees (mean)", False),
    ("spectrum_slope", "spectrum slope 1 − σ² (mean over tokens and components)", True),
    ("negative_share", "share of entries below −{tolerance:g} (mean)", False),
)


def _per_layer(summary: dict[str, Any], key: str) -> list[float]:
    """The token means of ``key`` per layer; a per-component measure averaged over its components."""
    means = summary[key]["mean"]
    return [sum(row) / len(row) if row else math.nan for row in means] if means and isinstance(means[0], list) \
        else _finite(means)


def has_mixing(summary: dict[str, Any]) -> bool:
    """Whether ``summary`` holds every measure :func:`plot_mixing` draws (study rows before version 3 do not)."""
    return all(key in summary for key, _, _ in MIXING_PANELS)


def plot_mixing(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """Four panels against the connection (depth), one colour per family: ``‖H − I‖_F``, the rotation angle, the
    spectrum slope ``1 − σ²`` and the negative share, each the mean over tokens. The connections whose ``H_res``
    cannot change the output (``inert_layers``) are drawn as hollow circles: their values are not learnt."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2), layout="constrained")
    tolerance = next(iter(summaries.values())).get("negative_tolerance", 0.0)
    any_inert = False
    for ax, (key, title, log) in zip(axes, MIXING_PANELS):
        drawn = []
        for index, (family, s) in enumerate(summaries.items()):
            color = f"C{index % 10}"
            values = _per_layer(s, key)
            depth = list(range(len(values)))
            ax.plot(depth, values, color=color, marker="o", markersize=3, linewidth=1.2, label=family)
            inert = [i for i in s.get("inert_layers", []) if i < len(values)]
            if inert:
                any_inert = True
                ax.scatter(inert, [values[i] for i in inert], s=70, facecolors="white", edgecolors=color, zorder=3)
            drawn += [v for v in values if not math.isnan(v)]
        if log and drawn and min(drawn) > 0:  # from far below to 1, so a saturated 1e-3 is not magnified
            ax.set_yscale("log")
            ax.set_ylim(min(1e-4, min(drawn) / 3), 1.5)
        elif drawn and min(drawn) >= 0:
            ax.set_ylim(bottom=0)
        ax.locator_params(axis="x", integer=True)
        ax.set_title(title.format(tolerance=tolerance), fontsize=10)
        ax.set_xlabel("connection (depth)")
        ax.grid(alpha=0.3)
    if any_inert:  # an empty scatter: the legend's key for the hollow circles
        axes[0].scatter([], [], s=70, facecolors="white", edgecolors="grey", label="cannot change the output")
    axes[0].legend(fontsize=7)
    fig.suptitle("What each H_res does to the streams (hollow: a connection whose H_res cannot change the output)")
    return _save(fig, path)


def plot_stream_similarity(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """Left: mean pairwise cosine similarity of the streams (off-diagonal) at each connection's input and the
    output, range over tokens and pairs shaded; right, one per family: the mean cosine of each pair per layer."""
    plt = _pyplot()
    families = {f: s for f, s in summaries.items() if s.get("stream_similarity", {}).get("offdiagonal")}
    if not families:
        raise ValueError("no summary has stream similarities (they need a model run, not the synthetic mode)")
    fig, axes = plt.subplots(1, 1 + len(families), figsize=(5.5 + 3.6 * len(families), 4.2), squeeze=False,
                             layout="constrained")
    axes = list(axes.flat)
    for index, (family, s) in enumerate(families.items()):
        off = s["stream_similarity"]["offdiagonal"]
        depth = list(range(len(off["mean"])))
        axes[0].fill_between(depth, off["min"], off["max"], color=f"C{index}", alpha=0.12)
        axes[0].plot(depth, off["mean"], color=f"C{index}", marker="o", markersize=2.5, label=family)
        pairwise = s["stream_similarity"]["pairwise_mean"]
        n = len(pairwise[0])
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        grid = [[layer[i][j] for (i, j) in pairs] for layer in pairwise]
        ax = axes[1 + index]
        image = ax.imshow(grid, aspect="auto", vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([f"{i}{j}" for i, j in pairs], fontsize=7)
        if len(grid) <= 30:  # deeper models keep matplotlib's sparser ticks
            ax.set_yticks(range(len(grid)))
            ax.set_yticklabels([str(i) for i in range(len(grid) - 1)] + ["out"], fontsize=7)
        ax.set_xlabel("stream pair")
        ax.set_ylabel("connection input (last row: output)")
        ax.set_title(f"{family}: mean cosine per pair")
        fig.colorbar(image, ax=ax, fraction=0.05)
    axes[0].axhline(1.0, color="grey", linewidth=0.7, linestyle=":")
    axes[0].set_ylim(min(-0.05, axes[0].get_ylim()[0]), 1.05)
    axes[0].set_xlabel("connection input (last point: output)")
    axes[0].set_ylabel("cosine similarity between streams")
    axes[0].set_title("mean over tokens and pairs (range shaded)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def has_stream_usage(summary: dict[str, Any]) -> bool:
    """Whether ``summary`` holds the read or write shares :func:`plot_stream_usage` draws."""
    return "read_share" in summary or "write_share" in summary


def _stacked_shares(ax, shares: list[list[float]], inert: list[int], labels: list[str]) -> None:
    """One stacked bar per entry of ``shares`` (each n shares), stream s in colour Cs; ``inert`` bars hatched."""
    n = len(shares[0]) if shares else 0
    bottom = [0.0] * len(shares)
    for stream in range(n):
        heights = [0.0 if row[stream] is None or math.isnan(row[stream]) else row[stream] for row in shares]
        bars = ax.bar(range(len(shares)), heights, bottom=bottom, color=f"C{stream % 10}", width=0.85)
        for i in inert:
            if i < len(bars):
                bars[i].set_hatch("//")
                bars[i].set_alpha(0.55)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylim(0, 1)
    ax.set_xticks(range(len(shares)))
    ax.set_xticklabels(labels, fontsize=6 if len(shares) > 16 else 7)


def plot_stream_usage(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """One row of three panels per family: each stream's read share per connection (stacked bars, the token mean
    of ``|H_pre[s]| / Σ_t |H_pre[t]|``; the last bar, "out", the output's shares when measured), the same for the
    write shares (``H_post``), and the effective number of streams ``exp(−Σ p log p)`` of the read and write shares
    against depth (dotted: 1 and n; a star: the output's). Connections whose split of the read or write cannot
    change the output are hatched (shares) and hollow (effective number)."""
    plt = _pyplot()
    families = {f: s for f, s in summaries.items() if has_stream_usage(s)}
    if not families:
        raise ValueError("no summary has read or write shares (they need H_pre / H_post)")
    fig, grid = plt.subplots(len(families), 3, figsize=(17, 3.8 * len(families)), squeeze=False, layout="constrained")
    for axes, (family, s) in zip(grid, families.items()):
        n, depth = s["n_streams"], s["depth"]
        for ax, prefix in zip(axes[:2], ("read", "write")):
            if f"{prefix}_share" not in s:
                ax.set_visible(False)
                continue
            shares, labels = list(s[f"{prefix}_share"]), [str(i) for i in range(depth)]
            if prefix == "read" and s.get("output_share"):
                shares, labels = shares + [s["output_share"]], labels + ["out"]
            _stacked_shares(ax, shares, s.get(f"{prefix}_inert_layers", []), labels)
            ax.set_title(f"{family}: {prefix} shares per stream" + (" (last bar: output)" if "out" in labels else ""),
                         fontsize=10)
            ax.set_xlabel("connection (depth)")
            ax.set_ylabel(f"token mean of |H_{'pre' if prefix == 'read' else 'post'}[s]| / sum")
        from matplotlib.patches import Patch  # matplotlib is there: _pyplot() imported it

        handles = [Patch(color=f"C{stream % 10}", label=f"stream {stream}") for stream in range(n)]
        axes[0 if axes[0].get_visible() else 1].legend(handles=handles, fontsize=7, loc="upper center",
                                                       bbox_to_anchor=(0.5, -0.16), ncol=min(n, 8))
        ax = axes[2]
        for index, prefix in enumerate(("read", "write")):
            if f"{prefix}_effective_streams" not in s:
                continue
            values = _finite(s[f"{prefix}_effective_streams"])
            layers = list(range(len(values)))
            ax.plot(layers, values, color=f"C{index}", marker="o", markersize=3, linewidth=1.2, label=prefix)
            inert = [i for i in s.get(f"{prefix}_inert_layers", []) if i < len(values)]
            if inert:
                ax.scatter(inert, [values[i] for i in inert], s=70, facecolors="white", edgecolors=f"C{index}",
                           zorder=3)
        if s.get("output_effective_streams") is not None:
            ax.scatter([depth], _finite([s["output_effective_streams"]]), marker="*", s=120, color="C2", zorder=3,
                       label="output")
        for level in (1, n):
            ax.axhline(level, color="grey", linewidth=0.7, linestyle=":")
        ax.set_ylim(0.9, n + 0.1)
        ax.locator_params(axis="x", integer=True)
        ax.set_title(f"{family}: effective number of streams, exp(entropy of the shares)", fontsize=10)
        ax.set_xlabel("connection (depth; star: output)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Stream usage: each stream's share of what is read, written and output (hatched / hollow: a split "
                 "that cannot change the output)")
    return _save(fig, path)


def plot_logit_scale_sweep(sweep: dict[str, list[dict[str, float]]], path: Path) -> Path:
    """Headline numbers of :func:`~s2hc.diagnostics.synthetic.logit_scale_sweep` against the logit scale ``S``:
    worst single-layer column-sum error, worst composite column-sum error and composite backward Amax gain."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    panels = [
        ("worst single-layer column-sum error", "col_sum_error", True),
        ("worst composite column-sum error (all depths)", "composite_col_sum_error", True),
        ("composite backward Amax gain (worst)", "composite_backward_amax", False),
    ]
    for ax, (title, key, floor) in zip(axes, panels):
        for index, (family, rows) in enumerate(sweep.items()):
            scales = [r["logit_scale"] for r in rows]
            values = [r[key] for r in rows]
            ax.plot(scales, _floored(values) if floor else _finite(values), marker="o", color=f"C{index}", label=family)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("logit scale S (std of α·d_res)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"Synthetic matrices: how the families respond to the spread of their inputs (floor {LOG_FLOOR:g})")
    return _save(fig, path)


def plot_training_history(records: list[dict[str, Any]], path: Path) -> Path:
    """From ``metrics.jsonl`` records with a ``diagnostics`` key: per-layer gradient norms, the composite spectral
    norm and backward Amax gain after the last connection, the worst column-sum error and the output streams'
    mean cosine similarity, against the step."""
    plt = _pyplot()
    records = [r for r in records if "diagnostics" in r]
    if not records:
        raise ValueError("no diagnostics records (train with diagnostics_every > 0)")
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2), layout="constrained")
    groups = list(dict.fromkeys(k for r in records for k in r["diagnostics"].get("grad_norm", {}).get("layers", {})))
    for index, group in enumerate(groups):
        values = [r["diagnostics"].get("grad_norm", {}).get("layers", {}).get(group, math.nan) for r in records]
        axes[0].plot(steps, _floored(values), label=group, color=f"C{index % 10}", linewidth=1.2)
    axes[0].set_yscale("log")
    axes[0].set_title("gradient norm per layer (before clipping)")
    if groups:
        axes[0].legend(fontsize=6, ncol=2)
    has_matrices = any("composite_spectral_norm_max" in r["diagnostics"] for r in records)
    if has_matrices:
        d = [r["diagnostics"] for r in records]
        axes[1].plot(steps, [x["composite_spectral_norm_max"][-1] for x in d], label="spectral norm")
        axes[1].plot(steps, [x["composite_backward_amax_max"][-1] for x in d], label="backward Amax", linestyle="--")
        axes[1].legend(fontsize=7)
        axes[2].plot(steps, _floored([max(x["col_sum_error_max"]) for x in d]))
        axes[2].set_yscale("log")
        if all(x.get("stream_similarity_mean") for x in d):
            axes[3].plot(steps, [x["stream_similarity_mean"][-1] for x in d])
    axes[1].set_title("composite after the last connection (worst token)")
    axes[2].set_title(f"worst column-sum error over layers (floor {LOG_FLOOR:g})")
    axes[3].set_title("mean cosine between output streams")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save(fig, path)
