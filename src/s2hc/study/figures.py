"""A study's figures, drawn from ``results.json`` alone (matplotlib, the study extra): the loss curves, the
final losses, the paired differences, what the trained matrices do per layer (the first seed's), their
trajectory over training, and the measures against a numeric setting (a depth sweep)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..connection import forms
from ..diagnostics import plots
from .rows import by_configuration, finished_values
from .stats import describe

FIGURES = "figures"



#: Line styles and markers cycled over configurations, and widths that shrink with the drawing order, so that two
#: configurations whose curves lie on top of each other both stay visible (a thick line under a thin dashed one).
_LINE_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "x", "P", "*")


def _style(index: int, count: int) -> dict[str, Any]:
    """The ``ax.plot`` keywords of configuration ``index`` of ``count``."""
    return {"color": f"C{index % 10}", "linestyle": _LINE_STYLES[index % len(_LINE_STYLES)],
            "linewidth": 1.0 + 1.6 * (count - 1 - index) / max(1, count - 1), "marker": _MARKERS[index % len(_MARKERS)],
            "markersize": 3, "markevery": 0.1, "zorder": 2 + index}


def _bands(ax, groups: dict[str, list[dict]], key: str, title: str) -> None:
    for index, (label, runs) in enumerate(groups.items()):
        curves = [dict(map(tuple, r["curves"][key])) for r in runs if r["status"] == "finished"]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        means = [statistics.fmean(c[s] for c in curves) for s in steps]
        low = [min(c[s] for c in curves) for s in steps]
        high = [max(c[s] for c in curves) for s in steps]
        style = _style(index, len(groups))
        ax.plot(steps, means, label=label, **style)
        ax.fill_between(steps, low, high, color=style["color"], alpha=0.15)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


CURVES = {"val": "validation loss", "train": "train loss"}


def _has_curve(results: dict[str, Any], key: str) -> bool:
    return any(r["curves"][key] for r in results["rows"] if r["status"] == "finished")


def plot_curves(results: dict[str, Any], path: Path, key: str = "val") -> Path:
    """Validation (``key="val"``) or train loss against step, mean over seeds with the seeds' range as a band; the
    last steps enlarged."""
    plt = plots._pyplot()
    groups = by_configuration(results["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    _bands(axes[0], groups, key, f"{CURVES[key]} (mean over seeds, band: min–max)")
    _bands(axes[1], groups, key, "the last half, enlarged")
    last = max(s for runs in groups.values() for r in runs for s, _ in r["curves"][key])
    finals = [v for runs in groups.values() for r in runs if r["status"] == "finished"
              for s, v in r["curves"][key] if s >= last / 2]
    if finals and last > 0:
        axes[1].set_xlim(last / 2, last * 1.01)
        spread = max(finals) - min(finals)
        if spread > 0:
            axes[1].set_ylim(min(finals) - 0.05 * spread, max(finals) + 0.05 * spread)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    axes[1].legend(fontsize=7, ncol=1, loc="upper right")
    return plots._save(fig, path)


def plot_final(results: dict[str, Any], path: Path) -> Path:
    """Final validation loss per configuration: each seed (dots), mean and 95 % interval (bar)."""
    plt = plots._pyplot()
    groups = by_configuration(results["rows"])
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(groups) + 1.4), layout="constrained")
    for y, runs in enumerate(groups.values()):
        values = list(finished_values(runs, "val_loss").values())
        if not values:
            continue
        summary = describe(values)
        ax.scatter(values, [y] * len(values), color="C0", s=14, alpha=0.7, zorder=3)
        if summary["ci95"]:
            low, high = summary["ci95"]
            ax.plot([low, high], [y, y], color="black", linewidth=1.5)
        ax.plot([summary["mean"]], [y], marker="|", color="black", markersize=12)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels(list(groups), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("final validation loss (dots: seeds; bar: mean and 95 % interval)")
    ax.grid(alpha=0.3, axis="x")
    return plots._save(fig, path)


def plot_paired(results: dict[str, Any], baseline_of, path: Path) -> Path:
    """Per configuration, each seed's validation loss minus its baseline's with the same seed (dots), their mean
    and 95 % interval (bar): the spread that is left once the seed is paired away. ``baseline_of(label, runs)``:
    the baseline configuration's label, or None."""
    plt = plots._pyplot()
    groups = by_configuration(results["rows"])
    entries = []
    for label, runs in groups.items():
        base = baseline_of(label, runs)
        if base is None or base == label:
            continue
        mine, theirs = finished_values(runs, "val_loss"), finished_values(groups[base], "val_loss")
        diffs = [mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))]
        if diffs:
            entries.append((f"{label} − {base}", diffs))
    fig, ax = plt.subplots(figsize=(8, 0.38 * max(1, len(entries)) + 1.4), layout="constrained")
    for y, (_, diffs) in enumerate(entries):
        ax.scatter(diffs, [y] * len(diffs), color="C1", s=14, alpha=0.8, zorder=3)
        summary = describe(diffs, interval=len(diffs) > 1)
        if summary["ci95"]:
            ax.plot(summary["ci95"], [y, y], color="black", linewidth=1.5)
        ax.plot([summary["mean"]], [y], marker="|", color="black", markersize=12)
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(entries)))
    ax.set_yticklabels([name for name, _ in entries], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("Δ final validation loss against the baseline, same seed (dots: seeds; bar: mean, 95 % interval)")
    ax.grid(alpha=0.3, axis="x")
    return plots._save(fig, path)


#: What a trajectory figure draws: (row trajectory key, panel title, log scale when it spans a factor 10).
TRAJECTORY_PANELS = (
    ("smallest_deviation_singular_value", "smallest deviation σ (interior connections)"),
    ("rotation_angle", "largest rotation angle (°, interior)"),
    ("composite_forward_amax", "composite Amax gain (forward)"),
    ("common_mode_gain", "common-mode gain 1ᵀH1/n (mean, interior)"),
)


def has_trajectories(results: dict[str, Any]) -> bool:
    return any((r.get("trajectory") or {}).get("steps") for r in results["rows"])


def plot_trajectories(results: dict[str, Any], path: Path) -> Path:
    """What the matrices did over training (``diagnostics_every``): per configuration the mean over seeds (line)
    and the seeds' range (band) of each :data:`TRAJECTORY_PANELS` measure against the step."""
    plt = plots._pyplot()
    groups = by_configuration(results["rows"])
    # a measure only rows measured since it existed have (the common mode) gets a panel only when some row has it
    panels = [(key, title) for key, title in TRAJECTORY_PANELS
              if any(key in (r.get("trajectory") or {}) for r in results["rows"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), layout="constrained")
    for index, (label, runs) in enumerate(groups.items()):
        series = [r["trajectory"] for r in runs if r["status"] == "finished" and r.get("trajectory")]
        if not series:
            continue
        for ax, (key, _) in zip(axes, panels):
            curves = [{s: v for s, v in zip(t["steps"], t.get(key) or ()) if v is not None} for t in series]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            style = _style(index, len(groups))
            ax.plot(steps, [statistics.fmean(c[s] for c in curves) for s in steps], label=label, **style)
            ax.fill_between(steps, [min(c[s] for c in curves) for s in steps],
                            [max(c[s] for c in curves) for s in steps], color=style["color"], alpha=0.15)
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        plots._auto_log(ax, *[line.get_ydata() for line in ax.get_lines()])
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncol=min(4, max(1, len(labels))))
    return plots._save(fig, path)


def numeric_setting(results: dict[str, Any]) -> str | None:
    """The one setting every configuration sets to a number, taking two values or more (a depth sweep's
    ``model_overrides.n_layers``); None when there is no such single axis."""
    keys = {key for c in results["study"]["configurations"] for key in (c.get("settings") or {})}
    if len(keys) != 1:
        return None
    key = keys.pop()
    values = [(c.get("settings") or {}).get(key) for c in results["study"]["configurations"]]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return key if numeric and len(set(values)) >= 2 else None


#: Panels of the figure against a numeric setting: (title, the row's value, log scale).
SETTING_PANELS = (
    ("final validation loss", lambda r: r["val_loss"], False),
    ("largest gradient norm (before clipping)", lambda r: (r.get("grad_norm") or {}).get("max"), True),
    ("trained composite Amax gain (forward)",
     lambda r: ((r.get("diagnostics") or {}).get("headline") or {}).get("composite_forward_amax"), True),
)


def plot_against_setting(results: dict[str, Any], key: str, path: Path) -> Path:
    """Each configuration (its label without the setting) against the setting ``key``: every seed (dots) and the
    mean over seeds (line) of the final validation loss, the largest gradient norm and the composite Amax gain; a
    diverged run is a cross at the top of the loss panel."""
    plt = plots._pyplot()
    fig, axes = plt.subplots(1, len(SETTING_PANELS), figsize=(5.2 * len(SETTING_PANELS), 4.2), layout="constrained")
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        lines.setdefault(row["label"].split(" [", 1)[0], []).append(row)
    for index, (name, rows) in enumerate(lines.items()):
        color = f"C{index % 10}"
        for ax, (_, value, _) in zip(axes, SETTING_PANELS):
            points = [((r.get("settings") or {}).get(key), value(r)) for r in rows if r["status"] == "finished"]
            points = [(x, y) for x, y in points if x is not None and y is not None]
            if not points:
                continue
            xs = sorted({x for x, _ in points})
            ax.scatter([x for x, _ in points], [y for _, y in points], color=color, s=12, alpha=0.6)
            ax.plot(xs, [statistics.fmean(y for x2, y in points if x2 == x) for x in xs], color=color,
                    linewidth=1.3, marker="o", markersize=3, label=name)
        diverged = [(r.get("settings") or {}).get(key) for r in rows if r["status"] == "diverged"]
        if diverged:
            axes[0].scatter(diverged, [1.0] * len(diverged), marker="x", color=color, s=40,
                            transform=axes[0].get_xaxis_transform(), clip_on=False)
    values = sorted({(r.get("settings") or {}).get(key) for r in results["rows"]} - {None})
    for ax, (title, _, log) in zip(axes, SETTING_PANELS):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(key.removeprefix("model_overrides."))
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()
        if log:
            plots._auto_log(ax, *[line.get_ydata() for line in ax.get_lines()])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return plots._save(fig, path)


def _first_seed_diagnostics(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each configuration's first measured run's diagnostics (the figures draw one model per configuration)."""
    out = {}
    for label, runs in by_configuration(results["rows"]).items():
        measured = [r for r in runs if r.get("diagnostics")]
        if measured:
            out[label] = measured[0]["diagnostics"]
    return out


def _has_res(results: dict[str, Any], label: str) -> bool:
    return forms.get(by_configuration(results["rows"])[label][0]["family"]).has_res


def figures(results: dict[str, Any], out: Path, baseline_of=None) -> dict[str, Path]:
    """Every figure of the report, under ``out/figures/``; empty without matplotlib."""
    if not plots.have_matplotlib():
        return {}
    directory = out / FIGURES
    directory.mkdir(parents=True, exist_ok=True)
    made = {}
    if _has_curve(results, "val"):
        made["validation loss curves"] = plot_curves(results, directory / "validation_curves.png")
    if _has_curve(results, "train"):
        made["train loss curves"] = plot_curves(results, directory / "train_curves.png", "train")
    made["final validation loss"] = plot_final(results, directory / "final_validation_loss.png")
    if baseline_of is not None and any(len(finished_values(runs, "val_loss")) >= 2
                                       for runs in by_configuration(results["rows"]).values()):
        made["paired differences against residual, per seed"] = plot_paired(
            results, baseline_of, directory / "paired_differences.png")
    if has_trajectories(results):
        made["the matrices over training (spectrum, rotation, composite gain)"] = plot_trajectories(
            results, directory / "trajectories.png")
    setting = numeric_setting(results)
    if setting is not None:
        made[f"loss, gradient norm and composite gain against {setting.removeprefix('model_overrides.')}"] = (
            plot_against_setting(results, setting, directory / "against_setting.png"))
    everything = _first_seed_diagnostics(results)
    # the H_res figures leave out the forms without one (the gated and wide residuals); the streams' figure keeps them
    diagnostics = {label: d for label, d in everything.items() if _has_res(results, label)}
    if diagnostics:
        made["deviation singular values per layer (s²HC paper Fig. 5)"] = plots.plot_deviation_singular_values(
            diagnostics, directory / "deviation_singular_values.png")
        made["column sums, single and cumulative (Fig. 7)"] = plots.plot_column_sums(
            diagnostics, directory / "column_sums.png")
        made["Amax gain and composite norm over depth"] = plots.plot_amax_gain(diagnostics, directory / "amax_gain.png")
        with_mixing = {k: v for k, v in diagnostics.items() if plots.has_mixing(v)}  # rows of version 3 on
        if with_mixing:
            made["what each H_res does to the streams (hollow: cannot change the output)"] = plots.plot_mixing(
                with_mixing, directory / plots.FIGURES["mixing"])
    if everything:
        with_streams = {k: v for k, v in everything.items() if v.get("stream_similarity")}
        if with_streams:
            made["stream similarity"] = plots.plot_stream_similarity(with_streams, directory / "stream_similarity.png")
    return made
