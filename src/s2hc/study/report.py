"""A study's report, built from ``results.json`` alone (``s2hc study --report-only`` calls only this).

``report.md`` has: the setup; per configuration the validation and train loss (mean ± std, 95 % interval),
tokens/s, parameters, step time against residual, gradient norms and the largest loss spike; paired differences
against each baseline trained under the same settings, with the paired t-test and Holm's correction (two seeds or
more, SciPy); the verdicts at equal cost, loss, token and wall-clock speedups and MFU (:mod:`.cost`, for rows
that carry them; also written to ``verdicts.json``); the factorial designs' effects (:mod:`.factorial`); the
trained models' residual matrices; the rotation probe (the early-training question); figures under ``figures/``
(:mod:`.figures`, matplotlib); and every run's directory and diagnostics report. ``s2hc compare`` writes the
same report (one axis, families). The same ``results.json`` always gives the same ``report.md``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..connection import forms
from ..diagnostics import plots
from ..diagnostics.inert import inert_connections
from ..extras import check_available
from ..io import atomic_write_text, fsync_path, json_loads
from ..models.model_config import ModelConfig, default_stream_reduce
from ..reports import DASH, count, fixed, mean_std, p_value, ratio, sci, table
from . import cost, preregistered, stats
from .factorial import design_lines
from .figures import FIGURES, figures
from .measure import MIXING_VERSION
from .rows import by_configuration, finished_values, stream_usage
from .spec import DEFAULT_BASELINES
from .stats import LEVEL, describe, paired

RESULTS = "results.json"
#: What the report's statistics (SciPy's t distribution) and figures need: the study extra.
REPORT_PACKAGES = ("scipy", "matplotlib")
REPORT = "report.md"
STUDY_FILE = "study.json"  # the study's record of its grid and invocations (:mod:`.runner`)
RUNS = "runs"  # each run's directory is RUNS/NAME under the study's


def _summary_cell(summary: dict[str, Any], digits: int = 4) -> str:
    """``mean ± std [95 % interval]`` of a :func:`~.stats.describe` dict (what it holds of them)."""
    if summary["n"] == 0:
        return DASH
    return mean_std(summary["mean"], summary["std"], summary["ci95"], digits)


def repeated(results: dict[str, Any]) -> bool:
    """Whether some configuration has two finished seeds or more (what intervals and paired tests need)."""
    return any(len(finished_values(runs, "val_loss")) >= 2 for runs in by_configuration(results["rows"]).values())


def _baseline_label(baseline: str, runs: list[dict[str, Any]], groups: dict[str, list[dict]]) -> str | None:
    """The configuration a family is paired with: ``residual``, or the baseline family without options at the same
    stream count, trained under the same settings."""
    n, settings = runs[0]["n_streams"], runs[0].get("settings") or {}
    for label, candidates in groups.items():
        first = candidates[0]
        if (first["family"] == baseline and not first["options"] and (first.get("settings") or {}) == settings
                and (forms.get(baseline).max_streams == 1 or first["n_streams"] == n)):
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


def _tokens_per_s(runs: list[dict[str, Any]]) -> float | None:
    """Mean over seeds of each run's tokens/s (from its median step)."""
    speeds = [r["timing"]["tokens_per_s"] for r in runs if r["timing"].get("tokens_per_s")]
    return statistics.fmean(speeds) if speeds else None


def summary_table(results: dict[str, Any]) -> list[str]:
    """The per-configuration table (the headline the README shows)."""
    groups = by_configuration(results["rows"])
    intervals = stats.available()
    rows = []
    for label, runs in groups.items():
        reference = groups.get(_baseline_label(forms.RESIDUAL.name, runs, groups))  # residual under the same settings
        finished = [r for r in runs if r["status"] == "finished"]
        diverged = len(runs) - len(finished)
        runs_text = f"{len(finished)}" + (f" (+{diverged} diverged)" if diverged else "")
        rows.append([
            label, runs_text,
            _summary_cell(describe(list(finished_values(runs, "val_loss").values()), intervals)),
            _summary_cell(describe(list(finished_values(runs, "train_loss").values()), intervals)),
            count(_tokens_per_s(runs)), count(runs[0]["params"] or 0), count(runs[0]["hc_params"] or 0),
            ratio(_step_time_ratio(runs, reference)),
        ])
    header = ["configuration", "runs", "validation loss", "final train loss", "tokens/s", "parameters",
              "HC parameters", "step time vs residual"]
    return table(header, rows)


def paired_table(results: dict[str, Any], baseline: str) -> list[str]:
    """Paired differences (validation and train loss) of every configuration against ``baseline`` (SciPy), with
    Holm's adjustment over the family the config declares (:func:`.cost.family`: a configuration without two paired
    seeds stays in it, counted as p = 1) and, beside it, the simultaneous intervals (Bonferroni over the family)."""
    groups = by_configuration(results["rows"])
    members = cost.family(results, baseline, _baseline_label)
    entries = []
    for label, runs in groups.items():
        base = _baseline_label(baseline, runs, groups)
        if base is None or base == label:
            continue
        val = paired(finished_values(runs, "val_loss"), finished_values(groups[base], "val_loss"))
        train = paired(finished_values(runs, "train_loss"), finished_values(groups[base], "train_loss"))
        entries.append((label, base, val, train))
    if not any(val is not None for _, _, val, _ in entries):
        return [f"No configuration could be paired with `{baseline}` (it needs the same seeds, at least two).", ""]
    m = len(members)
    adjusted = stats.holm_family(members, {label: val["p"] for label, _, val, _ in entries if val is not None})
    rows = []
    for label, base, val, train in entries:
        if val is None:
            rows.append([label, base, "fewer than two paired seeds", *([DASH] if m > 1 else []), DASH,
                         *(["– (counted as 1)"] if m > 1 else []), "no test", DASH, DASH])
            continue
        p_family = adjusted.get(label, val["p"])
        verdict = "within seed noise" if p_family >= 1 - LEVEL else ("lower" if val["mean"] < 0 else "higher")
        train_text = (DASH, DASH) if train is None else (_interval(train), p_value(train["p"]))
        simultaneous = [_bounds(stats.interval(val["differences"], stats.simultaneous_level(m)))] if m > 1 else []
        rows.append([label, base, _interval(val), *simultaneous, p_value(val["p"]),
                     *([p_value(p_family)] if m > 1 else []), verdict, *train_text])
    header = ["configuration", "against", "Δ validation loss [95 % CI]",
              *([f"[simultaneous 95 % CI, Bonferroni over {m}]"] if m > 1 else []),
              "p (two-sided, unadjusted)" if m > 1 else "p (two-sided)", *([f"Holm p (over {m})"] if m > 1 else []),
              "verdict", "Δ train loss [95 % CI]", "p (two-sided, unadjusted)"]
    return table(header, rows, align="llr" + "r" * (m > 1) + "r" + "r" * (m > 1) + "lrr")


def _interval(comparison: dict[str, Any]) -> str:
    """``+0.0123 [-0.0050, +0.0296]``: a paired comparison's mean difference and 95 % interval."""
    return f"{comparison['mean']:+.4f} {_bounds(comparison['ci95'])}"


def _bounds(bounds: list[float]) -> str:
    """``[-0.0050, +0.0296]``."""
    return f"[{bounds[0]:+.4f}, {bounds[1]:+.4f}]"


def noise_lines(results: dict[str, Any]) -> list[str]:
    """How large the seed-to-seed spread is, measured."""
    stds = [describe(list(finished_values(runs, "val_loss").values()), interval=False)["std"]
            for runs in by_configuration(results["rows"]).values()]
    stds = [s for s in stds if s is not None]
    if not stds:
        return []
    return [f"Seed-to-seed spread (standard deviation of the validation loss over seeds): median "
            f"{statistics.median(stds):.4f}, range {min(stds):.4f}–{max(stds):.4f} over {len(stds)} configurations.",
            ""]


def training_table(results: dict[str, Any]) -> list[str]:
    """Stability per configuration: gradient norms, loss spikes, divergences."""
    rows = []
    for label, runs in by_configuration(results["rows"]).items():
        grads = [r["grad_norm"] for r in runs if r["grad_norm"]]
        diverged = [f"seed {r['seed']} at step {r['diverged_at']}" for r in runs if r["status"] == "diverged"]

        def mean(key: str, grads=grads) -> str:
            return fixed(statistics.fmean(g[key] for g in grads), 3) if grads else DASH

        rows.append([label, mean("median"), mean("p95"), fixed(max(g["max"] for g in grads), 3) if grads else DASH,
                     fixed(max(r["loss_spike"] for r in runs), 3), ", ".join(diverged) or "no"])
    header = ["configuration", "grad norm median", "grad norm p95", "grad norm max", "largest loss spike", "diverged"]
    return table(header, rows, align="lrrrrl")


#: The trained matrices' columns, two tables: (title, headline key, first row version that measured it, what the
#: column is, in one line). Values of rows older than that version are shown as a dash: such a row either lacks
#: the key or held another measure under it.
MIXING_COLUMNS = (
    ("‖H − I‖_F", "identity_distance_mean", 1,
     "how far the matrices are from no mixing at all: the largest per-connection token mean of ‖H − I‖_F over the "
     "interior connections (those whose H_res can change the output)"),
    ("rotation angle (°)", "rotation_angle_mean", MIXING_VERSION,
     "the largest angle by which H_res turns a difference between streams (the eigenvalues of the orthogonal polar "
     "factor of U_Zᵀ H U_Z), largest token mean over interior connections: a rotation leaves every singular value "
     "at 1, so the angle column shows what the σ column cannot"),
    ("spectrum slope 1 − σ²", "spectrum_slope_mean", MIXING_VERSION,
     "1 − σ² of the deviation singular values, mean over interior connections and components: for s²HC exactly "
     "tanh's slope at its spectrum's pre-activation (1.3e-3 at its initial bias 4: saturated, the spectrum cannot "
     "learn), for the others how far the deviations are from an isometry (0: kept, 1: erased)"),
    ("smallest deviation σ", "smallest_deviation_singular_value_mean", 1,
     "the smallest token-mean singular value of U_Zᵀ H U_Z over all connections: below 1 a difference between "
     "streams is attenuated; a rotation leaves it at 1"),
    ("negative entries (interior)", "negative_share_mean", MIXING_VERSION,
     "the largest per-connection token-mean share of entries below −1e-3 over interior connections (an entry "
     "closer to 0 subtracts less than 0.1 % of a stream)"),
    ("most negative entry (interior)", "min_entry_interior", 1,
     "the most negative entry of any H_res at an interior connection, over every token: how much of one stream "
     "another can subtract (mHC's, mHC-lite's and KromHC's are ≥ 0 by construction)"),
    ("negative entries (cannot change the output)", "negative_share_inert", MIXING_VERSION,
     "the same at the connections whose H_res cannot change the output (the first when rows sum to 1: it sees "
     "identical copies; the last when columns sum to 1 and the streams are summed): not learnt, since what feeds "
     "only their H_res gets no gradient but rounding noise (– for a family with neither)"),
)
GUARANTEE_COLUMNS = (
    ("column-sum error (1 layer)", "col_sum_error", 1,
     "the largest |column sum − 1| of one H_res: what Sinkhorn leaves inexact (s²HC Fig. 7)"),
    ("max ‖H‖₂", "spectral_norm", 1, "the largest spectral norm of one H_res: above 1 a direction is amplified"),
    ("composite ‖P‖₂ at depth", "composite_spectral_norm_at_depth", 1,
     "the spectral norm of the product of all the connections' H_res (worst token)"),
    ("composite Amax (fwd)", "composite_forward_amax", 1,
     "mHC's forward gain of the product over depth, the largest |row sum| at any depth"),
    ("max cumulative column sum", "cumulative_column_sum_max", 1,
     "the largest column sum of the product at any depth (1: the mean over streams is kept)"),
    ("stream cosine at output", "stream_similarity_output_mean", 1,
     "the mean cosine between the output streams (1: collapsed into one)"),
)


#: Columns computed from a row's per-layer statistics over its interior connections, not read from its headline,
#: so that rows of every version have them: column key -> (per-layer key, statistic, how the layers combine).
PER_LAYER_COLUMNS = {
    "identity_distance_mean": ("identity_distance", "mean", max),
    "min_entry_interior": ("min_entry", "min", min),
}


def _interior_layers(row: dict[str, Any], stream_reduce: str | None) -> list[int]:
    """The connections of ``row`` whose ``H_res`` can change the output: every one but the row's recorded
    ``inert_layers`` (version 3 on), or, for an older row, but those its family and the study's ``stream_reduce``
    make inert (:func:`s2hc.diagnostics.inert.inert_connections`, what the collector computes since)."""
    diagnostics = row["diagnostics"]
    depth = len(diagnostics["layers"])
    inert = diagnostics.get("inert_layers")
    if inert is None:
        transposed = bool(dict(row.get("options") or {}).get("transpose_res", False))
        if stream_reduce is None:  # ModelConfig's default, which depends on the family
            stream_reduce = default_stream_reduce(row["family"])
        inert = inert_connections([row["family"]] * depth, [transposed] * depth, stream_reduce=stream_reduce)
    return [i for i in range(depth) if i not in set(inert)]


def _headline_value(row: dict[str, Any], key: str, stream_reduce: str) -> float | None:
    """The value of column ``key`` for ``row``: from its per-layer statistics (:data:`PER_LAYER_COLUMNS`) or its
    headline."""
    if key not in PER_LAYER_COLUMNS:
        return row["diagnostics"]["headline"].get(key)
    source, stat, combine = PER_LAYER_COLUMNS[key]
    per_layer = row["diagnostics"].get(source, {}).get(stat)
    interior = _interior_layers(row, stream_reduce)
    return combine(per_layer[i] for i in interior) if per_layer and interior else None


def _column_cells(runs: list[dict[str, Any]], columns, stream_reduce: str) -> list[str]:
    """Mean over the measured runs (of a version that has the measure) of each column's value."""
    cells = []
    for _, key, since, _ in columns:
        values = [_headline_value(r, key, stream_reduce) for r in runs if r.get("version", 1) >= since]
        values = [v for v in values if v is not None]
        cells.append(sci(statistics.fmean(values), 3) if values else DASH)
    return cells


def _stream_reduce(results: dict[str, Any]) -> str | None:
    """How the study's models reduce their streams (its ``train.model_overrides``, else ModelConfig's default:
    None, which a model resolves by its family, :func:`_interior_layers` the same way)."""
    overrides = results.get("study", {}).get("train", {}).get("model_overrides") or {}
    return overrides.get("stream_reduce", ModelConfig.__dataclass_fields__["stream_reduce"].default)


def _older_rows_line(measured: list[dict[str, Any]]) -> list[str]:
    """Which rows predate the measures of :data:`MIXING_VERSION` (shown as a dash); nothing when none does."""
    older = [r for r in measured if r.get("version", 1) < MIXING_VERSION]
    if not older:
        return []
    which = (f"all {len(older)} measured rows" if len(older) == len(measured) else
             f"{len(older)} of {len(measured)} measured rows: " + ", ".join(f"`{r['name']}`" for r in older))
    return [f"Rows measured before version {MIXING_VERSION} ({which}) lack the rotation angle, the spectrum slope "
            "and the negative entries below −1e-3, interior and apart (shown –; their old negative share counted "
            "every entry below 0 over all connections and is not shown); re-run the study to measure them. Their "
            "‖H − I‖_F and most negative entry come from their per-layer statistics, the connections that cannot "
            "change the output left out as the collector leaves them out now.", ""]


def diagnostics_table(results: dict[str, Any]) -> list[str]:
    """The trained models' matrices, mean over seeds of each run's headline values: what the matrices do to the
    streams (interior connections, and apart those that cannot change the output), then the guarantees and gains,
    a line on rows that predate a measure, and one line per column saying what it is. Empty when no run was
    measured."""
    groups = {label: [r for r in runs if r.get("diagnostics")]
              for label, runs in by_configuration(results["rows"]).items()}
    groups = {label: runs for label, runs in groups.items() if runs}
    # a form without a residual matrix (the gated and wide residuals) is never given H_res numbers
    without = [label for label, runs in groups.items() if not forms.get(runs[0]["family"]).has_res]
    groups = {label: runs for label, runs in groups.items() if label not in without}
    if not groups:
        return []
    lines = []
    for columns in (MIXING_COLUMNS, GUARANTEE_COLUMNS):
        rows = [[label, *_column_cells(runs, columns, _stream_reduce(results))] for label, runs in groups.items()]
        lines += table(["configuration", *(name for name, *_ in columns)], rows) + [""]
    if without:
        lines += [f"Not in these tables: {', '.join(without)}, which have no residual matrix (their streams are "
                  "never mixed); what their own maps do is in each run's diagnostics report.", ""]
    lines += _older_rows_line([r for runs in groups.values() for r in runs])
    lines += [f"- **{name}**: {meaning}." for name, _, _, meaning in (*MIXING_COLUMNS, *GUARANTEE_COLUMNS)] + [""]
    return lines


#: The stream usage table's columns: (title, key of :func:`.rows.stream_usage`).
STREAM_USAGE_COLUMNS = (
    ("effective read streams (interior mean)", "read"),
    ("effective write streams (interior mean)", "write"),
    ("output effective streams", "output"),
    ("output dominant share", "output_dominant_share"),
)


def stream_usage_table(results: dict[str, Any]) -> list[str]:
    """Per configuration, the mean over its measured seeds of each run's stream usage (:func:`.rows.stream_usage`),
    the streams' count and how many seeds had it; empty when no row has it (rows measured before the diagnostics
    had it lack it, so a study of such rows has no such section)."""
    rows = []
    for label, runs in by_configuration(results["rows"]).items():
        usage = [u for u in (stream_usage(r) for r in runs) if u is not None]
        if not usage:
            continue
        cells = []
        for _, key in STREAM_USAGE_COLUMNS:
            values = [u[key] for u in usage if u[key] is not None and not math.isnan(u[key])]
            cells.append(fixed(statistics.fmean(values), 2 if key != "output_dominant_share" else 3) if values
                         else DASH)
        rows.append([label, str(runs[0]["n_streams"]), *cells, str(len(usage))])
    if not rows:
        return []
    header = ["configuration", "n", *(name for name, _ in STREAM_USAGE_COLUMNS), "seeds"]
    return table(header, rows)


def rotation_lines(results: dict[str, Any]) -> list[str]:
    """The early-training question: the rotation gradients and drift of the first and last connections (whose
    ``H_res`` cannot change the output) against the others'."""
    rows = []
    for label, runs in by_configuration(results["rows"]).items():
        probes = [r["rotations"] for r in runs if r.get("rotations")]
        if not probes:
            continue
        parts = [("first", lambda v: v[0]), ("last", lambda v: v[-1]),
                 ("others (median)", lambda v: statistics.median(v[1:-1]) if len(v) > 2 else math.nan)]
        for name, pick in parts:

            def mean(key: str, pick=pick, probes=probes) -> str:
                return sci(statistics.fmean(pick(p[key]) for p in probes))

            rows.append([label if name == "first" else "", name,
                         f"{mean('grad_init_fp32')} / {mean('grad_init_fp64')}",
                         f"{mean('grad_final_fp32')} / {mean('grad_final_fp64')}", mean("drift")])
    if not rows:
        return []
    header = ["configuration", "connection", "grad at init fp32 / fp64", "grad after training fp32 / fp64", "drift"]
    return table(header, rows, align="llrrr")


def runs_table(results: dict[str, Any]) -> list[str]:
    """Each configuration's run directories (config, metrics, checkpoint: ``s2hc eval``, ``diagnose`` and
    ``export`` read them), relative to the study's directory, and which hold a diagnostics report. Paths, not
    links: the report is a function of results.json alone, and a committed study keeps no run directories."""
    rows = []
    for label, runs in by_configuration(results["rows"]).items():
        directories = ", ".join(f"`{RUNS}/{r['name']}/`" + ("" if r["status"] == "finished" else f" ({r['status']})")
                                for r in runs)
        measured = [r for r in runs if r.get("diagnostics") or r.get("depth_attention") or r.get("learned_maps")]
        if len(measured) == len(runs):
            reports = f"`diagnostics/{REPORT}` in each"
        elif measured:
            reports = ", ".join(f"`{RUNS}/{r['name']}/diagnostics/{REPORT}`" for r in measured)
        else:
            reports = DASH if forms.get(runs[0]["family"]).mixes_streams else "nothing to measure"
        rows.append([label, directories, reports])
    return table(["configuration", "run directories", "diagnostics reports"], rows, align="lll")


# ------------------------------------------------------------------------------------------------ report


def _setup_lines(results: dict[str, Any]) -> list[str]:
    study, env = results["study"], results.get("environment", {})
    train = study["train"]
    tokens = train.get("batch_size", 8) * train.get("grad_accum", 1) * train.get("seq_len", 256)
    lines = []
    if study.get("description"):
        lines += [study["description"], ""]
    lines += [
        f"- Grid: {_grid_text(study)} = {len(results['rows'])} runs; same seed = same initialisation seed and "
        "data order.",
        f"- Training: preset `{train.get('preset', 'tiny')}`, {train.get('max_steps')} steps of {tokens:,} tokens, "
        f"data `{train.get('data', 'embedded')}`; settings: "
        + ", ".join(f"`{k}: {v}`" for k, v in sorted(train.items())) + ".",
        f"- Machine: {env.get('machine', '?')}; {env.get('jobs', 1)} run(s) at a time; s2hc {env.get('s2hc', '?')}"
        f" ({_commit_text(env)}), torch {env.get('torch', '?')}; wall time of the last call "
        f"{env.get('wall_s', 0) / 60:.0f} min.",
        *_invocation_lines(results),
        "",
    ]
    return lines


def _grid_text(study: dict[str, Any]) -> str:
    """``5 configurations × seeds [0, 1]``, or with settings that have their own seeds, each group of
    configurations with its seeds."""
    groups: dict[str, int] = {}
    for configuration in study["configurations"]:
        seeds = str(configuration.get("seeds", study["seeds"]))
        groups[seeds] = groups.get(seeds, 0) + 1
    return " + ".join(f"{count} configurations × seeds {seeds}" for seeds, count in groups.items())


#: Where a commit that is not s2hc's own checkout's came from (``commit_source``, :func:`.runner.provenance`).
COMMIT_SOURCES = {"S2HC_COMMIT": " (as S2HC_COMMIT gave it: an installed snapshot)",
                  "the config's checkout": " of the config's checkout (s2hc ran from an installed package)"}


def _commit_text(env: dict[str, Any]) -> str:
    """``commit `abc1234```, with ``and uncommitted changes`` when the sources differ from it (``, clean or not
    unknown`` where nothing said) and where it came from when not s2hc's own checkout; where s2hc did not run from a
    git checkout (a pip install) and nothing else gave it, the commit is unknown and said so."""
    if not env.get("commit"):
        return "commit unknown: s2hc did not run from a git checkout"
    dirty = {True: " and uncommitted changes", False: "", None: ", clean or not unknown"}[env.get("dirty", False)]
    return f"commit `{env['commit']}`{COMMIT_SOURCES.get(env.get('commit_source'), '')}{dirty}"


def _invocation_lines(results: dict[str, Any]) -> list[str]:
    """One line on every invocation of the study in its directory (``study.json``'s ``invocations``, copied into
    the results' environment): how many, with which commits; none for results written before they were recorded."""
    invocations = results.get("environment", {}).get("invocations")
    if not isinstance(invocations, list) or not invocations:
        return []
    codes: dict[str, int] = {}
    for entry in invocations:
        entry = entry if isinstance(entry, dict) else {}
        codes[_commit_text(entry)] = codes.get(_commit_text(entry), 0) + 1
    listed = "; ".join(f"{text} ({count}×)" if len(codes) > 1 else text for text, count in codes.items())
    return [f"- Invocations in this directory ({STUDY_FILE} lists them): {len(invocations)}, {listed}."]


def _paired_lines(results: dict[str, Any]) -> list[str]:
    """The paired differences against each baseline; one line instead where they cannot be computed (one seed
    per configuration, or SciPy missing)."""
    if not repeated(results):
        return ["One seed per configuration: no intervals or paired tests (they need two seeds or more).", ""]
    if not stats.available():
        return [stats.NO_STATISTICS, ""]
    lines = []
    for baseline in results["study"].get("baselines", DEFAULT_BASELINES):
        lines += [f"## Paired differences against `{baseline}`", "",
                  "Per seed, configuration minus baseline (same seed, same data order); a negative Δ is a lower loss. "
                  "p: the two-sided paired t-test, unadjusted. Holm p (over m): adjusted over the family of the m "
                  "configurations the study's config pairs with this baseline, fixed before the runs (one without "
                  "two paired seeds stays in it, counted as p = 1). The 95 % CI holds for one comparison alone; the "
                  "simultaneous one, at the Bonferroni level 1 − 0.05/m, holds over the family together: read it with "
                  "the verdict, which says whether the difference is distinguishable from seed noise at the 5 % level "
                  "after Holm's adjustment. With one configuration in the family, its p alone.", ""]
        lines += paired_table(results, baseline) + [""]
    return lines


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """The verdicts at equal cost (:func:`.cost.verdicts`) against each of the study's baselines."""
    return cost.verdicts(results, results["study"].get("baselines", DEFAULT_BASELINES), _baseline_label)


def _write_verdicts(results: dict[str, Any], out: Path) -> None:
    """``verdicts.json`` (:mod:`.cost`) when the rows carry what it reads; an older one is removed otherwise (it
    would be of other results)."""
    path = out / cost.VERDICTS
    if cost.has_cost(results):
        atomic_write_text(path, json.dumps(verdicts(results), indent=1) + "\n")
    elif path.exists():
        path.unlink()


def build_report(results: dict[str, Any], figure_paths: dict[str, Path], out: Path) -> str:
    """The text of ``report.md``."""
    lines = [f"# {results['study'].get('title', 's2hc study')}", ""] + _setup_lines(results)
    lines += preregistered.report_lines(results)  # the confirmatory test before anything exploratory
    # the verdict first: each configuration's loss, cost and speedups against its baseline (where rows carry them)
    lines += cost.verdict_lines(verdicts(results)) if cost.has_cost(results) else []
    lines += ["## Loss per configuration", "",
              "Validation loss after the last step on the held-out split, and the train loss averaged over the last "
              "10 % of logged steps: mean ± standard deviation over seeds [95 % Student-t interval of the mean]. "
              "Tokens/s is from each run's median training step (evaluation and checkpoints excluded), mean over "
              "seeds. Step time is the median over seeds of each run's median step time over residual's with the "
              "same seed (runs on a shared machine: a rough measure; `s2hc bench` is the careful one).", ""]
    lines += summary_table(results) + [""] + noise_lines(results)
    lines += _paired_lines(results)
    lines += design_lines(results)
    lines += ["## Training stability", "",
              "Gradient norms before clipping (mean over seeds of each run's statistic over logged steps); the "
              "largest loss spike is the largest rise of the logged train loss above its running minimum.", ""]
    lines += training_table(results) + [""]
    matrices = diagnostics_table(results)
    if matrices:
        lines += ["## The trained residual matrices", "",
                  "Measured after training on validation tokens (`s2hc diagnose`), mean over seeds of each run's "
                  "headline value: the worst over layers and tokens, or, for what the matrices do to the streams, "
                  "over the interior connections (a connection whose H_res cannot change the model's output is "
                  "reported apart). Figures: each configuration's first seed.", ""]
        lines += matrices
    usage = stream_usage_table(results)
    if usage:
        lines += ["## Stream usage", "",
                  "Measured with the trained matrices (`s2hc diagnose`, its report's \"Stream usage\"), mean over "
                  "seeds. Per connection, each stream's share of the read is the token mean of |H_pre[s]| / Σ_t "
                  "|H_pre[t]| (of the write, the same of H_post), and its effective number of streams exp(−Σ p log p) "
                  "of those shares: 1 when one stream has everything, n when all have the same. The interior mean "
                  "leaves out the first connection's read (its streams are identical copies) and the last one's write "
                  "when the streams are summed or averaged: their split over the streams cannot change the output. "
                  "The output's shares are of what the final read takes from each final stream (‖X_s‖ for a sum or "
                  "mean, ‖w_s X_s‖ for a HyperHead, ‖G_s ⊙ X̃_s‖ for a GatedHead); its dominant share is the largest. "
                  "Rows measured before the diagnostics had the stream usage are left out (seeds: those that have "
                  "it).", ""]
        lines += usage + [""]
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
    lines += ["## Figures", ""]
    for title, path in figure_paths.items():
        lines += [f"**{title}**", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    if not figure_paths:
        lines += [plots.NO_FIGURES, ""]
    lines += ["## Runs", "",
              "Each run is an ordinary run directory (config, metrics.jsonl, checkpoint: `s2hc eval`, `diagnose` and "
              "`export` read it); its diagnostics report is the trained model's, measured on validation tokens.", ""]
    lines += runs_table(results) + [""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(out: str | Path, strict: bool = True) -> Path:
    """``out/report.md`` and ``out/figures/`` from ``out/results.json``; ValueError when it is missing or not a
    study's results. Without the study extra: MissingExtra, or with ``strict=False`` (``s2hc compare``) the report
    without what is missing (figures: matplotlib; intervals and paired tests: SciPy), each said in one line."""
    if strict:
        check_available(REPORT_PACKAGES, "the study's report")
    out = Path(out).expanduser()
    path = out / RESULTS
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: run the study first (without --report-only)")
    try:
        results = json_loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(results, dict) or not {"study", "rows"} <= set(results) or None in results["rows"]:
        raise ValueError(f"{str(path)!r} is not the results of a finished study (it needs 'study' and 'rows')")
    check_results(results, path)
    report = out / REPORT
    _remove_durably(report)  # complete or absent, see below
    groups = by_configuration(results["rows"])
    made = figures(results, out, baseline_of=lambda label, runs: _baseline_label(forms.RESIDUAL.name, runs, groups))
    _sync([*made.values(), *([out / FIGURES] if made else [])])  # the figures and their names
    _write_verdicts(results, out)
    atomic_write_text(report, build_report(results, made, out))  # last: it names the figures
    return report


# ------------------------------------------------------------------------------------------ reading results.json


def _number(value: Any, finite: bool = True) -> bool:
    """Whether ``value`` is a number (not a boolean), finite unless ``finite`` is False."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (not finite or math.isfinite(value)))


def _what(value: Any) -> str:
    """A value as a one-line message shows it: ``'abc' (a string)``, ``NaN``, ``nothing`` (absent)."""
    if value is _ABSENT:
        return "absent"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("nan", "NaN")
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = {str: "a string", list: "a list", dict: "a mapping", bool: "a boolean", type(None): "null"}.get(type(value))
    return f"{text} ({kind})" if kind else text


_ABSENT = object()
#: What the report reads of each row, checked before anything is drawn: field -> (what it must be, the check).
_ROW_FIELDS = {
    "name": ("a string", lambda v: isinstance(v, str)),
    "label": ("a string", lambda v: isinstance(v, str)),
    "family": ("a family's name", lambda v: isinstance(v, str) and v in forms.families()),
    "options": ("a mapping", lambda v: isinstance(v, dict)),
    "n_streams": ("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "seed": ("an integer >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "status": ("'finished' or 'diverged'", lambda v: v in ("finished", "diverged")),
    "loss_spike": ("a finite number", _number),
    "curves": ("a mapping with 'train' and 'val', lists of [step, loss]",
               lambda v: isinstance(v, dict) and all(isinstance(v.get(k), list) for k in ("train", "val"))),
    "timing": ("a mapping", lambda v: isinstance(v, dict)),
    "params": ("an integer or null", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool))),
    "hc_params": ("an integer or null", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool))),
    "grad_norm": ("null or a mapping of finite numbers (mean, median, p95, max)",
                  lambda v: v is None or (isinstance(v, dict)
                                          and all(_number(v.get(k)) for k in ("mean", "median", "p95", "max")))),
    "diagnostics": ("null or a mapping with 'headline' (a mapping) and 'layers' (a list)",
                    lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("headline"), dict)
                                            and isinstance(v.get("layers"), list))),
}
#: Fields older rows may lack: field -> (what it must be where present, the check).
_OPTIONAL_ROW_FIELDS = {
    "settings": ("a mapping", lambda v: isinstance(v, dict)),
    "version": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "diverged_at": ("an integer or null", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool))),
    "trajectory": ("null or a mapping with 'steps'", lambda v: v is None or (isinstance(v, dict)
                                                                           and isinstance(v.get("steps"), list))),
    "platform": ("null or a list of mappings", lambda v: v is None or (isinstance(v, list)
                                                                     and all(isinstance(p, dict) for p in v))),
    "rotations": ("null or a mapping", lambda v: v is None or isinstance(v, dict)),
    "cost": ("null or a mapping with 'tokens_per_step' (a number > 0)",
             lambda v: v is None or (isinstance(v, dict) and _number(v.get("tokens_per_step"))
                                     and v["tokens_per_step"] > 0)),
}
_TIMING_FIELDS = ("median_step_s", "tokens_per_s")


def check_results(results: dict[str, Any], path: Path) -> None:
    """Whether what the report reads of ``results`` (``path``'s) has the types it reads: each row's fields, its
    losses finite numbers (null where it has none), its curves ``[step, loss]`` pairs. ValueError in one line naming
    the file, the row and the field otherwise (a hand-edited file: a NaN or a string loss, a row without curves)."""
    where = str(path)
    study = results["study"]
    if not isinstance(study, dict) or not isinstance(study.get("train"), dict) or not isinstance(
            study.get("configurations"), list):
        raise ValueError(f"{where!r}: 'study' must be a mapping with 'train' (a mapping) and 'configurations' (a "
                         "list), as the study writes it")
    if not isinstance(results["rows"], list):
        raise ValueError(f"{where!r}: 'rows' is {_what(results['rows'])}, not a list of rows")
    record = results.get("registration", _ABSENT)
    if record is not _ABSENT:  # the test the report decides must be the one recorded against the runs
        recorded = record.get("preregistered") if isinstance(record, dict) else _ABSENT
        if recorded is _ABSENT or recorded != study.get("preregistered"):
            changed = ("'registration' is not a record" if recorded is _ABSENT else
                       "; ".join(preregistered.changed_fields(recorded, study.get("preregistered"))))
            raise ValueError(f"{where!r}: study.preregistered differs from the registration recorded against the "
                             f"runs ({changed}); the report decides the recorded test only: restore it")
    for index, row in enumerate(results["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"{where!r}: rows[{index}] is {_what(row)}, not a row (a mapping)")
        name = row.get("name")
        at = f"{where!r}: rows[{index}]" + (f" ({name!r})" if isinstance(name, str) else "")

        def refuse(field: str, value: Any, wanted: str, at=at) -> None:
            raise ValueError(f"{at}: {field} is {_what(value)}; it must be {wanted}")

        for field, (wanted, check) in _ROW_FIELDS.items():
            value = row.get(field, _ABSENT)
            if value is _ABSENT or not check(value):
                refuse(field, value, wanted)
        for field, (wanted, check) in _OPTIONAL_ROW_FIELDS.items():
            if field in row and not check(row[field]):
                refuse(field, row[field], wanted)
        finished = row["status"] == "finished"
        for field in ("val_loss", "train_loss"):  # finite on a finished row; null where there is none
            value = row.get(field, _ABSENT)
            if not (value is None or _number(value)):
                refuse(field, value, "a finite number, or null" + (" (a diverged row)" if not finished else ""))
        for key in ("train", "val"):
            for point_index, point in enumerate(row["curves"][key]):
                if not (isinstance(point, list) and len(point) == 2 and _number(point[0])
                        and _number(point[1], finite=finished)):
                    refuse(f"curves.{key}[{point_index}]", point, "a [step, loss] pair of numbers"
                           + (" (finite on a finished row)" if finished else ""))
        for field in _TIMING_FIELDS:
            value = row["timing"].get(field, _ABSENT)
            if value is _ABSENT or not (value is None or _number(value)):
                refuse(f"timing.{field}", value, "a finite number, or null")
        seconds = row["timing"].get("val_seconds")
        if not (seconds is None or (isinstance(seconds, list) and all(_number(s) for s in seconds))):
            refuse("timing.val_seconds", seconds, "null or a list of finite numbers")


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
