"""A study's report, built from ``results.json`` alone (``s2hc study --report-only`` calls only this).

``report.md`` has: the setup; per configuration the validation and train loss (mean ± std, 95 % interval),
parameters, step time against residual, gradient norms and the largest loss spike; paired differences against
each baseline with the paired t-test and Holm's correction; the trained models' residual matrices; the rotation
probe (the early-training question); and figures under ``figures/`` (matplotlib). The same ``results.json``
always gives the same ``report.md``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..diagnostics import plots
from ..extras import check_available
from ..io import atomic_write_text, fsync_path
from ..mixers import RESIDUAL
from .stats import LEVEL, describe, holm, paired

RESULTS = "results.json"
#: What the report's statistics (SciPy's t distribution) and figures need: the study extra.
REPORT_PACKAGES = ("scipy", "matplotlib")
REPORT = "report.md"
FIGURES = "figures"


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _sci(value: float | None) -> str:
    return "–" if value is None else f"{value:.2g}"


def _mean_std(summary: dict[str, Any], digits: int = 4) -> str:
    if summary["n"] == 0:
        return "–"
    if summary["std"] is None:
        return _fmt(summary["mean"], digits)
    low, high = summary["ci95"]
    mean, std = _fmt(summary["mean"], digits), _fmt(summary["std"], digits)
    return f"{mean} ± {std} [{_fmt(low, digits)}, {_fmt(high, digits)}]"


def _p(value: float | None) -> str:
    if value is None:
        return "–"
    return "< 0.001" if value < 0.001 else f"{value:.3f}"


def _groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by configuration label, in grid order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["label"], []).append(row)
    return groups


def _finished(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in runs if r["status"] == "finished" and r[key] is not None}


def _baseline_label(baseline: str, runs: list[dict[str, Any]], groups: dict[str, list[dict]]) -> str | None:
    """The configuration a family is paired with: ``residual``, or the baseline family without options at the same
    stream count."""
    n = runs[0]["n_streams"]
    for label, candidates in groups.items():
        first = candidates[0]
        if first["family"] == baseline and not first["options"] and (baseline == RESIDUAL or first["n_streams"] == n):
            return label
    return None


def _step_time_ratio(runs: list[dict[str, Any]], reference: list[dict[str, Any]] | None) -> float | None:
    """Median over seeds of this configuration's step time over residual's (same seed)."""
    if not reference:
        return None
    ref = {r["seed"]: r["timing"]["median_step_s"] for r in reference if r["timing"]["median_step_s"]}
    ratios = [r["timing"]["median_step_s"] / ref[r["seed"]] for r in runs
              if r["timing"]["median_step_s"] and r["seed"] in ref]
    return statistics.median(ratios) if ratios else None


def summary_table(results: dict[str, Any]) -> list[str]:
    """The per-configuration table (the headline the README shows)."""
    groups = _groups(results["rows"])
    reference = groups.get(RESIDUAL)
    lines = [
        "| configuration | runs | validation loss | final train loss | parameters | HC parameters "
        "| step time vs residual |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, runs in groups.items():
        finished = [r for r in runs if r["status"] == "finished"]
        diverged = len(runs) - len(finished)
        count = f"{len(finished)}" + (f" (+{diverged} diverged)" if diverged else "")
        ratio = _step_time_ratio(runs, reference)
        lines.append(
            f"| {label} | {count} | {_mean_std(describe(list(_finished(runs, 'val_loss').values())))} "
            f"| {_mean_std(describe(list(_finished(runs, 'train_loss').values())))} "
            f"| {runs[0]['params'] or 0:,} | {runs[0]['hc_params'] or 0:,} "
            f"| {'–' if ratio is None else f'{ratio:.2f}×'} |"
        )
    return lines


def paired_table(results: dict[str, Any], baseline: str) -> list[str]:
    """Paired differences (validation and train loss) of every configuration against ``baseline``."""
    groups = _groups(results["rows"])
    entries = []
    for label, runs in groups.items():
        base = _baseline_label(baseline, runs, groups)
        if base is None or base == label:
            continue
        val = paired(_finished(runs, "val_loss"), _finished(groups[base], "val_loss"))
        train = paired(_finished(runs, "train_loss"), _finished(groups[base], "train_loss"))
        if val is not None:
            entries.append((label, base, val, train))
    if not entries:
        return [f"No configuration could be paired with `{baseline}` (it needs the same seeds, at least two).", ""]
    adjusted = holm([val["p"] for _, _, val, _ in entries])
    lines = [
        "| configuration | against | Δ validation loss [95 % CI] | p | p (Holm) | verdict | Δ train loss [95 % CI] "
        "| p |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for (label, base, val, train), p_holm in zip(entries, adjusted):
        verdict = "within seed noise" if p_holm >= 1 - LEVEL else ("lower" if val["mean"] < 0 else "higher")
        train_text = ("–", "–") if train is None else (_interval(train), _p(train["p"]))
        lines.append(f"| {label} | {base} | {_interval(val)} | {_p(val['p'])} | {_p(p_holm)} | {verdict} "
                     f"| {train_text[0]} | {train_text[1]} |")
    return lines


def _interval(comparison: dict[str, Any]) -> str:
    low, high = comparison["ci95"]
    return f"{comparison['mean']:+.4f} [{low:+.4f}, {high:+.4f}]"


def noise_lines(results: dict[str, Any]) -> list[str]:
    """How large the seed-to-seed spread is, measured."""
    stds = [describe(list(_finished(runs, "val_loss").values()))["std"] for runs in _groups(results["rows"]).values()]
    stds = [s for s in stds if s is not None]
    if not stds:
        return []
    return [f"Seed-to-seed spread (standard deviation of the validation loss over seeds): median "
            f"{statistics.median(stds):.4f}, range {min(stds):.4f}–{max(stds):.4f} over {len(stds)} configurations.",
            ""]


def training_table(results: dict[str, Any]) -> list[str]:
    """Stability per configuration: gradient norms, loss spikes, divergences."""
    lines = ["| configuration | grad norm median | grad norm p95 | grad norm max | largest loss spike | diverged |",
             "|---|---:|---:|---:|---:|---|"]
    for label, runs in _groups(results["rows"]).items():
        grads = [r["grad_norm"] for r in runs if r["grad_norm"]]
        diverged = [f"seed {r['seed']} at step {r['diverged_at']}" for r in runs if r["status"] == "diverged"]

        def mean(key: str, grads=grads) -> str:
            return _fmt(statistics.fmean(g[key] for g in grads), 3) if grads else "–"

        spike = max(r["loss_spike"] for r in runs)
        lines.append(f"| {label} | {mean('median')} | {mean('p95')} | "
                     f"{_fmt(max(g['max'] for g in grads), 3) if grads else '–'} | {spike:.3f} | "
                     f"{', '.join(diverged) or 'no'} |")
    return lines


def diagnostics_table(results: dict[str, Any]) -> list[str]:
    """The trained models' matrices, mean over seeds of each run's worst (or mean) over layers and tokens."""
    keys = [
        ("negative entries (share)", "negative_share_mean"),
        ("smallest deviation σ", "smallest_deviation_singular_value_mean"),
        ("max ‖H‖₂", "spectral_norm"),
        ("composite ‖P‖₂ at depth", "composite_spectral_norm_at_depth"),
        ("composite Amax (fwd)", "composite_forward_amax"),
        ("max cumulative column sum", "cumulative_column_sum_max"),
        ("stream cosine at output", "stream_similarity_output_mean"),
    ]
    lines = ["| configuration | " + " | ".join(name for name, _ in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    for label, runs in _groups(results["rows"]).items():
        heads = [r["diagnostics"]["headline"] for r in runs if r.get("diagnostics")]
        if not heads:
            continue
        cells = []
        for _, key in keys:
            values = [h[key] for h in heads if h.get(key) is not None]
            cells.append(f"{statistics.fmean(values):.3g}" if values else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def rotation_lines(results: dict[str, Any]) -> list[str]:
    """The early-training question: the rotation gradients and drift of the first and last connections (whose
    ``H_res`` cannot change the output) against the others'."""
    lines = [
        "| configuration | connection | grad at init fp32 / fp64 | grad after training fp32 / fp64 | drift |",
        "|---|---|---:|---:|---:|",
    ]
    count = 0
    for label, runs in _groups(results["rows"]).items():
        probes = [r["rotations"] for r in runs if r.get("rotations")]
        if not probes:
            continue
        count += 1
        parts = [("first", lambda v: v[0]), ("last", lambda v: v[-1]),
                 ("others (median)", lambda v: statistics.median(v[1:-1]) if len(v) > 2 else math.nan)]
        for name, pick in parts:

            def mean(key: str, pick=pick, probes=probes) -> str:
                return _sci(statistics.fmean(pick(p[key]) for p in probes))

            lines.append(f"| {label if name == 'first' else ''} | {name} "
                         f"| {mean('grad_init_fp32')} / {mean('grad_init_fp64')} "
                         f"| {mean('grad_final_fp32')} / {mean('grad_final_fp64')} | {mean('drift')} |")
    return lines if count else []


# ----------------------------------------------------------------------------------------------- figures


def _bands(ax, groups: dict[str, list[dict]], key: str, title: str) -> None:
    for index, (label, runs) in enumerate(groups.items()):
        curves = [dict(map(tuple, r["curves"][key])) for r in runs if r["status"] == "finished"]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        means = [statistics.fmean(c[s] for c in curves) for s in steps]
        low = [min(c[s] for c in curves) for s in steps]
        high = [max(c[s] for c in curves) for s in steps]
        color = f"C{index % 10}"
        style = "-" if index < 10 else "--"
        ax.plot(steps, means, color=color, linestyle=style, linewidth=1.3, label=label)
        ax.fill_between(steps, low, high, color=color, alpha=0.15)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Validation loss against step, mean over seeds with the seeds' range as a band; the last steps enlarged."""
    plt = plots._pyplot()
    groups = _groups(results["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    _bands(axes[0], groups, "val", "validation loss (mean over seeds, band: min–max)")
    _bands(axes[1], groups, "val", "the last half, enlarged")
    last = max(s for runs in groups.values() for r in runs for s, _ in r["curves"]["val"])
    finals = [v for runs in groups.values() for r in runs if r["status"] == "finished"
              for s, v in r["curves"]["val"] if s >= last / 2]
    if finals:
        axes[1].set_xlim(last / 2, last * 1.01)
        spread = max(finals) - min(finals)
        axes[1].set_ylim(min(finals) - 0.05 * spread, max(finals) + 0.05 * spread)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    axes[1].legend(fontsize=7, ncol=1, loc="upper right")
    return plots._save(fig, path)


def plot_final(results: dict[str, Any], path: Path) -> Path:
    """Final validation loss per configuration: each seed (dots), mean and 95 % interval (bar)."""
    plt = plots._pyplot()
    groups = _groups(results["rows"])
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(groups) + 1.4), layout="constrained")
    for y, runs in enumerate(groups.values()):
        values = list(_finished(runs, "val_loss").values())
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


def _first_seed_diagnostics(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each configuration's first measured run's diagnostics (the figures draw one model per configuration)."""
    out = {}
    for label, runs in _groups(results["rows"]).items():
        measured = [r for r in runs if r.get("diagnostics")]
        if measured:
            out[label] = measured[0]["diagnostics"]
    return out


def figures(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Every figure of the report, under ``out/figures/``; empty without matplotlib."""
    if not plots.have_matplotlib():
        return {}
    directory = out / FIGURES
    directory.mkdir(parents=True, exist_ok=True)
    made = {
        "validation loss curves": plot_curves(results, directory / "validation_curves.png"),
        "final validation loss": plot_final(results, directory / "final_validation_loss.png"),
    }
    diagnostics = _first_seed_diagnostics(results)
    if diagnostics:
        made["deviation singular values per layer (s²HC paper Fig. 5)"] = plots.plot_deviation_singular_values(
            diagnostics, directory / "deviation_singular_values.png")
        made["column sums, single and cumulative (Fig. 7)"] = plots.plot_column_sums(
            diagnostics, directory / "column_sums.png")
        made["Amax gain and composite norm over depth"] = plots.plot_amax_gain(diagnostics, directory / "amax_gain.png")
        with_streams = {k: v for k, v in diagnostics.items() if v.get("stream_similarity")}
        if with_streams:
            made["stream similarity"] = plots.plot_stream_similarity(with_streams, directory / "stream_similarity.png")
    return made


# ------------------------------------------------------------------------------------------------ report


def _setup_lines(results: dict[str, Any]) -> list[str]:
    study, env = results["study"], results.get("environment", {})
    train = study["train"]
    tokens = train.get("batch_size", 8) * train.get("grad_accum", 1) * train.get("seq_len", 256)
    lines = []
    if study.get("description"):
        lines += [study["description"], ""]
    lines += [
        f"- Grid: {len(study['configurations'])} configurations × seeds {study['seeds']} "
        f"= {len(results['rows'])} runs; same seed = same initialisation seed and data order.",
        f"- Training: preset `{train.get('preset', 'tiny')}`, {train.get('max_steps')} steps of {tokens:,} tokens, "
        f"data `{train.get('data', 'embedded')}`; settings: "
        + ", ".join(f"`{k}: {v}`" for k, v in sorted(train.items())) + ".",
        f"- Machine: {env.get('machine', '?')}; {env.get('jobs', 1)} run(s) at a time; s2hc {env.get('s2hc', '?')}"
        f" (commit `{env.get('commit') or '?'}`), torch {env.get('torch', '?')}; wall time of the last call "
        f"{env.get('wall_s', 0) / 60:.0f} min.",
        "",
    ]
    return lines


def build_report(results: dict[str, Any], figure_paths: dict[str, Path], out: Path) -> str:
    """The text of ``report.md``."""
    baselines = results["study"].get("baselines", [RESIDUAL, "mhc"])
    lines = ["# s2hc study", ""] + _setup_lines(results)
    lines += ["## Loss per configuration", "",
              "Validation loss after the last step on the held-out split, and the train loss averaged over the last "
              "10 % of logged steps: mean ± standard deviation over seeds [95 % Student-t interval of the mean]. "
              "Step time is the median over seeds of each run's median step time over residual's with the same "
              "seed (runs on a shared machine: a rough measure; `s2hc bench` is the careful one).", ""]
    lines += summary_table(results) + [""] + noise_lines(results)
    for baseline in baselines:
        lines += [f"## Paired differences against `{baseline}`", "",
                  "Per seed, configuration minus baseline (same seed, same data order); a negative Δ is a lower loss. "
                  "p: two-sided paired t-test; Holm: adjusted over the table; the verdict says whether the "
                  "difference is distinguishable from seed noise at the 5 % level after the adjustment.", ""]
        lines += paired_table(results, baseline) + [""]
    lines += ["## Training stability", "",
              "Gradient norms before clipping (mean over seeds of each run's statistic over logged steps); the "
              "largest loss spike is the largest rise of the logged train loss above its running minimum.", ""]
    lines += training_table(results) + [""]
    table = diagnostics_table(results)
    if len(table) > 2:
        lines += ["## The trained residual matrices", "",
                  "Measured after training on validation tokens (`s2hc diagnose`), mean over seeds of each run's "
                  "worst value over layers and tokens (negative share: mean). Figures: each configuration's first "
                  "seed.", ""]
        lines += table + [""]
    rotations = rotation_lines(results)
    if rotations:
        lines += ["## Early training: the rotations of the first and last connections", "",
                  "The streams enter the first connection as identical copies, and an `H_res` whose rows sum to 1 "
                  "maps identical copies to themselves; the last connection's streams are summed, and an `H_res` "
                  "whose columns sum to 1 keeps that sum. So in exact arithmetic the rotation parameters of these two "
                  "connections get no gradient, ever, and what float32 computes is rounding noise. Gradient norms of "
                  "each connection's rotation parameters (projection columns and α, b, γ) on one validation batch, "
                  "the model in float32 and float64, at initialisation and after training; drift: norm of trained − "
                  "initial parameters. Mean over seeds; 'others': median over the connections in between.", ""]
        lines += rotations + [""]
    if figure_paths:
        lines += ["## Figures", ""]
        for title, path in figure_paths.items():
            lines += [f"**{title}**", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(out: str | Path) -> Path:
    """``out/report.md`` and ``out/figures/`` from ``out/results.json``; ValueError when it is missing or not a
    study's results; MissingExtra without the study extra."""
    check_available(REPORT_PACKAGES, "the study's report")
    out = Path(out).expanduser()
    path = out / RESULTS
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: run the study first (without --report-only)")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(results, dict) or not {"study", "rows"} <= set(results) or None in results["rows"]:
        raise ValueError(f"{str(path)!r} is not the results of a finished study (it needs 'study' and 'rows')")
    report = out / REPORT
    _remove_durably(report)  # complete or absent, see below
    made = figures(results, out)
    _sync([*made.values(), *([out / FIGURES] if made else [])])  # the figures and their names
    atomic_write_text(report, build_report(results, made, out))  # last: it names the figures
    return report


def _remove_durably(report: Path) -> None:
    """Remove the previous ``report.md`` before its figures are redrawn: a kill while they are drawn would
    otherwise leave it beside figures of other results (or half of them redrawn). Absent instead, and
    ``results.json`` is still there, so ``s2hc study --report-only`` builds it again."""
    if report.exists():
        report.unlink()
        _sync([report.parent])


def _sync(paths) -> None:
    """fsync each file or directory in ``paths``: the figures are on disk before the report that names them."""
    for path in paths:
        fsync_path(path)
