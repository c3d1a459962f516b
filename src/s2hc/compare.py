"""``s2hc compare``: the same model, data, seed and token budget with each residual family, and a report."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from pathlib import Path

from .config import TrainConfig, check_seed_count
from .diagnostics import plots
from .diagnostics.report import compare_section
from .io import atomic_write_text, check_output_dir
from .mixers import RESIDUAL, default_streams
from .rundir import RunLock, check_run_directory, final_train_loss, holds_run, read_metrics
from .rundir.guard import clean_interrupted_saves, notice
from .train import RunResult, train

_PLOT_TMP = ".loss_curves.tmp.png"  # the figure before its rename (matplotlib takes the format from the suffix)


def run_name(family: str, seed: int, seeds: int) -> str:
    return family if seeds == 1 else f"{family}-seed{seed}"


def compare(base: TrainConfig, mixers: list[str], seeds: int = 1, out: str | Path = "runs/compare",
            n_streams: int | None = None, resume: bool = False, overwrite: bool = False) -> Path:
    """Train ``base`` once per family in ``mixers`` (and per seed), then write ``out/report.md``.

    ``residual`` always runs with one stream; every other family with ``n_streams`` (default 4).
    Runs go to ``out/<family>[-seed<k>]/``, each through the run directory's guard
    (:func:`s2hc.rundir.open_run_directory`), and every one is checked before the first starts: without
    ``resume`` or ``overwrite`` none may exist yet; with ``resume`` finished runs are kept, unfinished ones
    resumed and missing ones started (at least one must exist); with ``overwrite`` existing ones start again.
    ``out`` is locked while the comparison runs. Returns the report's path.
    """
    check_seed_count("--seeds", seeds)  # before a config per seed is made
    if resume and overwrite:
        raise ValueError("--resume continues the runs in --out and --overwrite replaces them: give one of them")
    if not str(out).strip():
        raise ValueError("--out is empty; name the comparison's directory, e.g. --out runs/compare")
    out = Path(out).expanduser()
    configs = [
        base.replace(
            family=family,
            n_streams=n_streams if family != RESIDUAL and n_streams else default_streams(family),
            seed=base.seed + k,
            out=str(out / run_name(family, k, seeds)),
        )
        for family in mixers
        for k in range(seeds)
    ]
    if resume and not any(holds_run(config.out) for config in configs):
        raise ValueError(
            f"--resume: {str(out)!r} holds none of these runs to resume "
            f"({', '.join(Path(c.out).name for c in configs)}); check --out, or drop --resume to start them"
        )
    for config in configs:  # all refusals before the first run starts
        check_run_directory(config.out, resume=resume and holds_run(config.out), overwrite=overwrite)
    check_output_dir(out, "--out")
    results: dict[str, list[RunResult]] = {}
    with RunLock(out) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext():
        clean_interrupted_saves(out, notice)
        (out / _PLOT_TMP).unlink(missing_ok=True)
        for config in configs:
            result = train(config, resume=resume and holds_run(config.out), overwrite=overwrite)
            results.setdefault(config.family, []).append(result)
        return write_report(out, base, results)


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def write_report(out: Path, base: TrainConfig, results: dict[str, list[RunResult]]) -> Path:
    """``report.md`` (summary table), ``loss_curves.png`` (when matplotlib is installed) and ``summary.json``."""
    reference = results.get("residual")
    ref_speed = statistics.mean(r.tokens_per_s for r in reference) if reference else None
    rows = []
    for family, runs in results.items():
        speed = statistics.mean(r.tokens_per_s for r in runs)
        rows.append({
            "family": family,
            "runs": [r.out.name for r in runs],
            "train_loss": [final_train_loss(r.out) for r in runs],
            "val_loss": [r.val_loss for r in runs],
            "tokens_per_s": speed,
            "params": runs[0].params,
            "hc_params": runs[0].hc_params,
            "step_time_vs_residual": ref_speed / speed if ref_speed else None,
        })
    lines = [
        f"# s2hc compare: preset `{base.preset}`, {base.max_steps} steps, "
        f"{base.batch_size * base.grad_accum} × {base.seq_len} tokens per step, data `{base.data}`",
        "",
        "| family | final train loss | validation loss | tokens/s | parameters | hyper-connection parameters "
        "| step time vs residual |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = "–" if row["step_time_vs_residual"] is None else f"{row['step_time_vs_residual']:.2f}×"
        lines.append(
            f"| {row['family']} | {_mean_std(row['train_loss'])} | {_mean_std(row['val_loss'])} | "
            f"{row['tokens_per_s']:,.0f} | {row['params']:,} | {row['hc_params']:,} | {ratio} |"
        )
    lines += [
        "",
        "Final train loss is the mean over the last 10 % of logged steps; validation loss is on the held-out split "
        "after the last step. "
        "Tokens/s is from the median training step (evaluation and checkpoints excluded); the step-time ratio "
        "is residual's tokens/s over the family's, measured in this run on this machine. The runs are sequential, so "
        "other load on the machine skews it; `s2hc bench` interleaves the families for speed comparisons.",
        "",
    ]
    figure = plot_loss_curves(out, results)
    if figure:
        lines += [f"![loss curves]({figure.name})", ""]
    else:
        lines += [plots.NO_FIGURES, ""]
    lines += compare_section(out, results, data=base.data, device=base.device)
    lines += [
        "Runs (config, metrics.jsonl, checkpoint): " + ", ".join(f"[`{n}`]({n}/)" for r in rows for n in r["runs"]),
        "",
    ]
    report = out / "report.md"
    atomic_write_text(out / "summary.json", json.dumps({"config": base.to_dict(), "rows": rows}, indent=2))
    atomic_write_text(report, "\n".join(lines))
    return report


def plot_loss_curves(out: Path, results: dict[str, list[RunResult]]) -> Path | None:
    """Train (thin) and validation (markers) loss against tokens for every run; None without matplotlib."""
    if not plots.have_matplotlib():
        return None
    plt = plots._pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, (family, runs) in enumerate(results.items()):
        color = f"C{index}"
        for k, run in enumerate(runs):
            records = read_metrics(run.out)
            train_points = [(r["step"], r["loss"]) for r in records if "loss" in r]
            val_points = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
            label = family if k == 0 else None
            if train_points:
                ax.plot(*zip(*train_points), color=color, alpha=0.6, linewidth=1, label=label)
            if val_points:
                ax.plot(*zip(*val_points), color=color, marker="o", linestyle="--", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("train (solid) and validation (dashed, markers) loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "loss_curves.png"
    tmp = out / _PLOT_TMP
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


__all__ = ["compare", "write_report", "plot_loss_curves"]
