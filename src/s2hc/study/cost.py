"""The verdict at equal cost: each configuration against its baseline in validation loss, tokens, training seconds
and MFU (docs/study.md, "Verdicts at equal cost"), read from ``results.json`` alone.

Per seed, the configuration (its final validation loss ``L``, after ``T`` tokens and ``S`` measured training
seconds) is set against the baseline trained with the same seed:

- **token speedup**: the tokens the baseline needs to reach ``L``, divided by ``T``. Read from the baseline's
  validation curve (its evaluations, ``step × tokens per step``), taken as its running minimum (the best loss
  it had reached by then, so that a noisy rise does not make it reach ``L`` twice) and linearly interpolated
  between evaluations. Where ``L`` lies outside that curve nothing is extrapolated: below the baseline's best
  (``beyond: "below"``) the baseline never reached ``L``, and the speedup is only known to exceed its last
  evaluation's tokens over ``T`` (``> x``); above its first evaluation (``beyond: "above"``) the baseline was
  there before it was first measured, and the speedup is below its first evaluation's tokens over ``T`` (``< x``).
- **wall-clock speedup**: the same in measured training seconds (each validation record's cumulative step time,
  ``train_seconds``; evaluation and checkpoints left out). Unavailable for runs whose records lack them (written
  before runs recorded them). Measured on the run's device: a CPU figure on a CPU, labelled so.
- **MFU**: the model's training FLOPs per token (:func:`s2hc.flops.model_flops`, 3 × forward) × tokens/s (the
  median step's) ÷ the device's peak (:func:`s2hc.flops.peak_flops`: the table for known GPUs, the float32 matmul
  the run measured on a CPU). Unavailable, with the reason, where the peak or the count is unknown.

A speedup that cannot be read is said so in words, never given as a bound (``"unreadable"``, the reason): where a
baseline was evaluated once (no curve to read, only a bound that says nothing: a short run evaluated only at its
end), and, for the wall-clock speedup on a CPU, where the machine was not the same for both (the float32 matmul
peak the runs measured at their starts differs by more than :data:`BUSY_PEAK_RATIO` between them: a machine busy
with other work, or other thread counts, so their seconds are not comparable).

Over seeds, a speedup (a ratio) is analysed on the log scale: the mean log ratio with its Student-t interval and
the paired t-test of log(configuration) against log(baseline) (:func:`.stats.paired`, the two-sided test that the
ratio's geometric mean is 1), reported back as a geometric mean ratio and interval. MFU, itself a ratio (achieved
over peak), is summarised per configuration the same way (geometric mean, interval on the log scale: a linear
interval over a few seeds reaches below 0 %) and compared as a ratio. A seed beyond the curve gives a bound, not a
value: the summary is then a bound on the geometric mean (all such seeds on one side: ``"beyond"`` and
``"bound"``), or none (``"mixed"``), and has no interval or test.

Holm's correction runs per measure over each baseline's **family**, fixed by the study's config before anything
ran (:func:`family`: every configuration it pairs with that baseline), whatever the runs give: a member whose
measure has no test (a bound, an unreadable speedup, one seed) stays in it counted as p = 1 (``"p_counted"``), the
most conservative value it could take, so that a configuration beating the baseline's best cannot shrink the
others' adjustment by leaving the family. Each summary says the family's size (``"holm_m"``); where it is more
than one, ``"ci95_simultaneous"`` is the interval at the Bonferroni level 1 − 0.05/m, the intervals that hold
together, to read beside the Holm verdicts (``"ci95"`` holds for one comparison alone).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from ..flops import MEASURED_PEAK, peak_flops
from ..reports import p_value
from . import stats
from .rows import by_configuration
from .stats import describe, paired

VERDICTS = "verdicts.json"
FORMAT = "s2hc-verdicts"
#: The version of ``verdicts.json``'s schema. 2: MFU over seeds as a geometric mean with its interval on the log
#: scale; Holm over each baseline's declared family (``holm_families``, ``holm_m``, ``p_counted``), simultaneous
#: intervals (``ci95_simultaneous``).
VERSION = 2
BELOW, ABOVE, MIXED = "below", "above", "mixed"
#: The most the CPU matmul peaks measured at the starts of a configuration's and its baseline's runs may differ
#: (largest over smallest) for their training seconds to be compared: more is a machine busy with other work.
BUSY_PEAK_RATIO = 1.5


def has_cost(results: dict[str, Any]) -> bool:
    """Whether any row carries what the verdicts read (rows measured before they existed do not)."""
    return any(row.get("cost") for row in results["rows"])


# ------------------------------------------------------------------------------------------- one curve


def running_minimum(losses: list[float]) -> list[float]:
    """The best loss reached by each evaluation."""
    best, out = math.inf, []
    for loss in losses:
        best = min(best, loss)
        out.append(best)
    return out


def cost_to_reach(curve: list[tuple[float, float]], target: float) -> dict[str, Any]:
    """What a curve ``[(cost, loss), ...]`` (evaluations in training order, cost increasing) spends to reach
    ``target``: its running minimum, linearly interpolated between the evaluation before it first reaches
    ``target`` and the one where it does. ``{"value": cost}``; outside the curve no value but a bound:
    ``{"beyond": "below", "bound": last cost}`` for a target below the curve's best (never reached: more than
    that), ``{"beyond": "above", "bound": first cost}`` for one above its first evaluation (reached before it:
    less than that). ValueError for an empty curve."""
    if not curve:
        raise ValueError("an empty curve reaches nothing")
    costs = [float(c) for c, _ in curve]
    best = running_minimum([float(loss) for _, loss in curve])
    if target < best[-1]:
        return {"value": None, "beyond": BELOW, "bound": costs[-1]}
    if target > best[0]:
        return {"value": None, "beyond": ABOVE, "bound": costs[0]}
    if target == best[0]:
        return {"value": costs[0]}
    for i in range(1, len(best)):
        if best[i] <= target:  # best[i - 1] > target >= best[i], so best[i] < best[i - 1]
            fraction = (best[i - 1] - target) / (best[i - 1] - best[i])
            return {"value": costs[i - 1] + fraction * (costs[i] - costs[i - 1])}
    raise AssertionError("unreachable: the target is within the curve's range")  # pragma: no cover


def speedup(baseline: list[tuple[float, float]], target: float, own_cost: float) -> dict[str, Any]:
    """:func:`cost_to_reach` on the ``baseline`` curve over ``own_cost`` (what the configuration spent to reach
    ``target``): ``{"value"}``, or ``{"beyond", "bound"}`` (the bound over ``own_cost`` likewise)."""
    reach = cost_to_reach(baseline, target)
    if "beyond" in reach:
        return {"value": None, "beyond": reach["beyond"], "bound": reach["bound"] / own_cost}
    return {"value": reach["value"] / own_cost}


# ------------------------------------------------------------------------------------------- one run


def _val_curve(row: dict[str, Any], key: str) -> list[tuple[float, float]] | None:
    """A finished row's validation curve against ``"tokens"`` or ``"seconds"``; None without what it needs."""
    if row["status"] != "finished" or not row.get("cost") or not row["curves"]["val"]:
        return None
    points = row["curves"]["val"]
    if key == "tokens":
        per_step = row["cost"]["tokens_per_step"]
        return [(step * per_step, loss) for step, loss in points]
    seconds = (row.get("timing") or {}).get("val_seconds")
    if not seconds or len(seconds) != len(points):
        return None
    return [(s, loss) for s, (_, loss) in zip(seconds, points)]


def _run_speedup(row: dict[str, Any], base: dict[str, Any], key: str) -> dict[str, Any] | None:
    mine, theirs = _val_curve(row, key), _val_curve(base, key)
    if mine is None or theirs is None or mine[-1][0] <= 0:
        return None
    return speedup(theirs, mine[-1][1], mine[-1][0])


def _devices(row: dict[str, Any]) -> list[str]:
    return sorted({str(p.get("device")) for p in row.get("platform") or []})


def run_mfu(row: dict[str, Any]) -> dict[str, Any]:
    """``{"value", "peak"}`` (MFU as a fraction, the peak's label) of a finished row, or ``{"value": None,
    "reason"}``."""
    cost = row.get("cost") or {}
    flops = cost.get("flops")
    if not flops:
        return {"value": None, "reason": cost.get("flops_reason") or "no FLOP count in the row"}
    speed = (row.get("timing") or {}).get("tokens_per_s")
    if not speed:
        return {"value": None, "reason": "no tokens/s in the row"}
    devices = _devices(row)
    if len(devices) != 1:
        return {"value": None, "reason": "no platform record" if not devices else
                f"trained on several devices ({', '.join(devices)})"}
    peak = peak_flops(row["platform"][0], cost.get("precision", "float32"))
    if not peak["flops_per_s"]:
        return {"value": None, "reason": peak["reason"]}
    return {"value": flops["train_per_token"] * speed / peak["flops_per_s"], "peak": peak["label"]}


def device_label(rows: list[dict[str, Any]]) -> tuple[str, bool]:
    """Where ``rows`` trained, in words, and whether all on a CPU (``"CPU: Intel …"``: a CPU figure)."""
    cpus = sorted({str(p.get("cpu")) for r in rows for p in r.get("platform") or []})
    devices = sorted({d for r in rows for d in _devices(r)})
    if devices == ["cpu"]:
        return f"CPU: {'; '.join(cpus)}", True
    return ("; ".join(devices) or "unknown device"), False


# ------------------------------------------------------------------------------------------- over seeds


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def summarize_ratios(per_seed: dict[int, dict[str, Any]], tests: bool) -> dict[str, Any]:
    """Per-seed ratios (``{seed: {"value"} or {"beyond", "bound"}}``) over seeds, on the log scale: ``n``,
    ``geometric_mean``, its ``ci95`` and the paired t-test's ``p`` (``tests``: SciPy, two seeds or more), or,
    where some seed is beyond its curve, ``beyond`` (``"below"``, ``"above"`` or ``"mixed"``) and ``bound`` (the
    geometric mean of values and bounds: a bound on the geometric mean; None when mixed)."""
    out: dict[str, Any] = {"n": len(per_seed), "geometric_mean": None, "ci95": None, "p": None, "beyond": None,
                           "bound": None}
    if not per_seed:
        return out
    sides = {entry["beyond"] for entry in per_seed.values() if entry.get("beyond")}
    logs = {seed: _log(entry["value"] if entry.get("value") is not None else entry["bound"])
            for seed, entry in per_seed.items()}
    mean = statistics.fmean(logs.values()) if all(math.isfinite(v) for v in logs.values()) else -math.inf
    if sides:
        out["beyond"] = MIXED if len(sides) > 1 else sides.pop()
        out["bound"] = None if out["beyond"] == MIXED else math.exp(mean)
        return out
    out["geometric_mean"] = math.exp(mean)
    if tests and len(logs) >= 2 and math.isfinite(mean):
        test = paired(logs, dict.fromkeys(logs, 0.0))
        out["ci95"], out["p"] = [math.exp(v) for v in test["ci95"]], test["p"]
    return out


def _loss(row_values: dict[int, float], base_values: dict[int, float], tests: bool) -> dict[str, Any]:
    seeds = sorted(set(row_values) & set(base_values))
    diffs = {seed: row_values[seed] - base_values[seed] for seed in seeds}
    out = {"per_seed": diffs, "mean": statistics.fmean(diffs.values()) if diffs else None, "ci95": None, "p": None}
    if tests and len(seeds) >= 2:
        test = paired(row_values, base_values)
        out.update(mean=test["mean"], ci95=test["ci95"], p=test["p"])
    return out


def _speedup_measure(pairs: dict[int, tuple[dict, dict]], key: str, tests: bool) -> dict[str, Any]:
    per_seed = {seed: s for seed, (row, base) in pairs.items() if (s := _run_speedup(row, base, key)) is not None}
    out = {"per_seed": per_seed, **summarize_ratios(per_seed, tests), "unreadable": _unreadable(pairs, key)}
    if key == "seconds":
        label, cpu = device_label([r for pair in pairs.values() for r in pair])
        out.update(unit="measured training seconds", device=label, cpu=cpu)
        if not per_seed:
            out["reason"] = "the runs' validation records hold no training seconds (recorded since runs log them)"
    out["available"] = bool(per_seed)
    return out


def _unreadable(pairs: dict[int, tuple[dict, dict]], key: str) -> str | None:
    """Why the speedup of ``pairs`` over ``key`` (``"tokens"``, ``"seconds"``) cannot be read (see the module),
    in words; None where it can."""
    once = [seed for seed, (_, base) in pairs.items() if len(base["curves"]["val"]) < 2]
    if once:
        return ("the baseline was evaluated once (seed " + ", ".join(map(str, once)) + "): no curve to read it "
                "from; evaluate several times (--eval-every)")
    if key == "seconds":
        for seed, pair in pairs.items():
            peaks = [p[MEASURED_PEAK]["flops_per_s"] for row in pair for p in row.get("platform") or []
                     if str(p.get("device")) == "cpu" and (p.get(MEASURED_PEAK) or {}).get("flops_per_s")]
            if peaks and max(peaks) > BUSY_PEAK_RATIO * min(peaks):
                return (f"a busy machine: the CPU's matmul peak measured at the runs' starts differs "
                        f"{max(peaks) / min(peaks):.1f}× between them (seed {seed}; other work on the machine, or "
                        "other thread counts), so their seconds are not comparable")
    return None


def _mfu_measure(pairs: dict[int, tuple[dict, dict]], tests: bool) -> dict[str, Any]:
    mine = {seed: run_mfu(row) for seed, (row, _) in pairs.items()}
    theirs = {seed: run_mfu(base) for seed, (_, base) in pairs.items()}
    values = {seed: m["value"] for seed, m in mine.items() if m["value"] is not None}
    base_values = {seed: m["value"] for seed, m in theirs.items() if m["value"] is not None}
    out: dict[str, Any] = {"per_seed": values, "baseline_per_seed": base_values, "available": bool(values)}
    if not values:
        out["reason"] = next(iter(mine.values()))["reason"] if mine else "no seed"
        return out
    # MFU is a ratio (achieved over peak): over seeds its geometric mean with the interval on the log scale,
    # exponentiated (a linear interval over two seeds reaches below 0 %)
    summary = describe([math.log(v) for v in values.values()], interval=tests)
    out.update(mean=math.exp(summary["mean"]), ci95=[math.exp(v) for v in summary["ci95"]] if summary["ci95"] else None,
               baseline_mean=math.exp(statistics.fmean(math.log(v) for v in base_values.values()))
               if base_values else None,
               peak=sorted({m["peak"] for m in mine.values() if m["value"] is not None}))
    ratios = {seed: {"value": values[seed] / base_values[seed]} for seed in values if seed in base_values}
    out["ratio"] = {"per_seed": ratios, **summarize_ratios(ratios, tests)}
    return out


def _step_time_ratio(pairs: dict[int, tuple[dict, dict]]) -> float | None:
    """The median over seeds of the configuration's median step time over the baseline's (same seed)."""
    ratios = [row["timing"]["median_step_s"] / base["timing"]["median_step_s"] for row, base in pairs.values()
              if (row.get("timing") or {}).get("median_step_s") and (base.get("timing") or {}).get("median_step_s")]
    return statistics.median(ratios) if ratios else None


def _train_seconds(pairs: dict[int, tuple[dict, dict]]) -> dict[str, float | None]:
    """The mean over seeds of the training seconds each side spent in all (its last validation record's)."""
    def mean(rows):
        values = [(r.get("timing") or {}).get("val_seconds") for r in rows]
        values = [v[-1] for v in values if v]
        return statistics.fmean(values) if values else None
    return {"configuration": mean([row for row, _ in pairs.values()]),
            "baseline": mean([base for _, base in pairs.values()])}


def verdicts(results: dict[str, Any], baselines, baseline_label: Callable[..., str | None]) -> dict[str, Any]:
    """The verdicts of every configuration against each of ``baselines`` (``baseline_label(baseline, runs,
    groups)`` names the configuration it is paired with): the ``verdicts.json`` object (see the module)."""
    groups = by_configuration(results["rows"])
    tests = stats.available()
    out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "level": stats.LEVEL, "speedup_scale": "log",
                           "mfu_scale": "log", "curve": "running minimum, linearly interpolated between evaluations",
                           "holm": "over each baseline's family (holm_families: every configuration the config pairs "
                                   "with it), per measure; a member without a test counts as p = 1",
                           "baselines": {}, "holm_families": {}}
    for baseline in baselines:
        entries = []
        for label, runs in groups.items():
            base = baseline_label(baseline, runs, groups)
            if base is None or base == label:
                continue
            mine = {r["seed"]: r for r in runs if r["status"] == "finished" and r.get("cost")}
            theirs = {r["seed"]: r for r in groups[base] if r["status"] == "finished" and r.get("cost")}
            pairs = {seed: (mine[seed], theirs[seed]) for seed in sorted(set(mine) & set(theirs))}
            if not pairs:
                continue
            entries.append({
                "configuration": label, "against": base, "seeds": list(pairs),
                "loss": _loss({s: r["val_loss"] for s, r in mine.items()},
                              {s: r["val_loss"] for s, r in theirs.items()}, tests),
                "val_loss": {"configuration": statistics.fmean(row["val_loss"] for row, _ in pairs.values()),
                             "baseline": statistics.fmean(base["val_loss"] for _, base in pairs.values())},
                "token_speedup": _speedup_measure(pairs, "tokens", tests),
                "wall_clock_speedup": _speedup_measure(pairs, "seconds", tests),
                "mfu": _mfu_measure(pairs, tests),
                "step_time_ratio": _step_time_ratio(pairs),
                "train_seconds": _train_seconds(pairs),
            })
        members = family(results, baseline, baseline_label)
        untested: dict[str, list[str]] = {}
        for measure, part in MEASURES:
            found = {e["configuration"]: (e[measure] if part is None else e[measure].get(part)) for e in entries}
            found = {label: m for label, m in found.items() if m is not None}
            adjusted = stats.holm_family(members, {label: m.get("p") for label, m in found.items()})
            untested[measure] = [label for label in members if (found.get(label) or {}).get("p") is None]
            for label, m in found.items():
                m.update(holm_m=len(members), p_holm=adjusted.get(label))
                if adjusted and m.get("p") is None:
                    m["p_counted"] = 1.0  # no test (a bound, one seed): Holm counts it as p = 1
                _simultaneous(m, len(members), log=measure != "loss")
        if entries:
            out["baselines"][baseline] = entries
            out["holm_families"][baseline] = {"members": members, "untested": untested}
    return out


#: The measures Holm's correction runs over, each over one baseline's family: (key, part of the entry).
MEASURES = (("loss", None), ("token_speedup", None), ("wall_clock_speedup", None), ("mfu", "ratio"))


def family(results: dict[str, Any], baseline: str, baseline_label: Callable[..., str | None]) -> list[str]:
    """The configurations paired with ``baseline``: those the study's config declares (``study.configurations``)
    whose baseline configuration it also declares, and any other the rows hold, in grid order. Holm's family,
    fixed by the config before anything ran: a configuration whose runs gave no test (a bound beyond the
    baseline's curve, a seed too few, a diverged run) stays in it (:func:`.stats.holm_family`)."""
    declared = {c["label"]: [c] for c in results["study"].get("configurations") or []
                if isinstance(c, dict) and "label" in c}
    groups = {**declared, **by_configuration(results["rows"])}
    members = []
    for label, runs in groups.items():
        source = declared if label in declared else groups
        base = baseline_label(baseline, runs, source)
        if base is not None and base != label:
            members.append(label)
    return members


def _simultaneous(summary: dict[str, Any], m: int, log: bool) -> None:
    """Add ``ci95_simultaneous`` to a summary over a Holm family of ``m`` (more than one): the interval at the
    Bonferroni level ``1 − 0.05 / m``, of the per-seed differences or (``log``) of the log ratios, exponentiated; the
    intervals that hold together, to read beside the Holm verdicts (the ``ci95`` beside it holds for one alone)."""
    if m < 2 or not summary.get("ci95"):
        return
    per_seed = summary.get("per_seed") or {}
    values = [_log(v["value"]) for v in per_seed.values()] if log else list(per_seed.values())
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return
    bounds = stats.interval(values, stats.simultaneous_level(m))
    if bounds is not None:
        summary["ci95_simultaneous"] = [math.exp(v) for v in bounds] if log else bounds


# ------------------------------------------------------------------------------------------- the report


def _ratio_text(summary: dict[str, Any]) -> str:
    """``1.21× [1.05, 1.39], Holm p 0.031`` (``p`` where the family is one test), ``> 1.42× (…)``, or why it
    cannot be read: the short form (:func:`_measure_text` is the report's, every p labelled)."""
    bound = _beyond_text(summary)
    if bound is not None:
        return bound
    if summary.get("geometric_mean") is None:
        return "–"
    text = f"{summary['geometric_mean']:.2f}×"
    if summary.get("ci95"):
        low, high = summary["ci95"]
        text += f" [{low:.2f}, {high:.2f}]"
    if summary.get("p_holm") is not None:
        text += f", {'p' if summary.get('holm_m') == 1 else 'Holm p'} {p_value(summary['p_holm'])}"
    return text


def _beyond_text(summary: dict[str, Any]) -> str | None:
    """What a summary without a value says instead: why it cannot be read, or its bound; None when it has one."""
    if summary.get("unreadable"):
        return f"cannot be read ({summary['unreadable']})"
    if summary.get("beyond") == MIXED:
        return "seeds beyond the baseline's curve on both sides (no summary)"
    if summary.get("beyond") == BELOW:
        return f"> {summary['bound']:.2f}× (below the baseline's best: it never reached this loss)"
    if summary.get("beyond") == ABOVE:
        return f"< {summary['bound']:.2f}× (above the baseline's first evaluation)"
    return None


def _p_text(summary: dict[str, Any], baseline: str | None) -> str:
    """Each p labelled by what it is: ``p 0.010 (unadjusted), Holm p 0.062 (over 6 against `residual`)``; ``p 0.010
    (two-sided)`` where the family is this one test; for a member without a test, that Holm counted it as p = 1."""
    m, against = summary.get("holm_m") or 1, f" against `{baseline}`" if baseline else ""
    if summary.get("p") is None:
        return f"no test: Holm counts it as p = 1 over {m}{against}" if summary.get("p_counted") else ""
    if m == 1 or summary.get("p_holm") is None:
        return f"p {p_value(summary['p'])} (two-sided)"
    return f"p {p_value(summary['p'])} (unadjusted), Holm p {p_value(summary['p_holm'])} (over {m}{against})"


def _interval_text(summary: dict[str, Any], form: str) -> str:
    """`` [95 % CI a, b; simultaneous c, d]`` (the simultaneous interval where the family has more than one), or
    nothing without an interval; ``form`` formats each bound."""
    if not summary.get("ci95"):
        return ""
    text = " [95 % CI " + ", ".join(form.format(v) for v in summary["ci95"])
    if summary.get("ci95_simultaneous"):
        text += "; simultaneous " + ", ".join(form.format(v) for v in summary["ci95_simultaneous"])
    return text + "]"


def _measure_text(summary: dict[str, Any], baseline: str | None) -> str:
    """A speedup (or the MFU ratio) in the report: the geometric mean with its intervals and labelled p, or its bound
    (or why it cannot be read) with how Holm counted it."""
    bound = _beyond_text(summary)
    if bound is None:
        if summary.get("geometric_mean") is None:
            return "–"
        bound = f"{summary['geometric_mean']:.2f}×" + _interval_text(summary, "{:.2f}")
    tested = _p_text(summary, baseline)
    return f"{bound}, {tested}" if tested else bound


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.3g} %"


def verdict_line(entry: dict[str, Any], baseline: str | None = None) -> str:
    """One line: loss difference, token speedup, wall-clock speedup (its device), MFU; ``baseline``: the family
    its Holm p are adjusted over (the configurations against that baseline)."""
    loss = entry["loss"]
    loss_text = "–" if loss["mean"] is None else f"{loss['mean']:+.4f}" + _interval_text(loss, "{:+.4f}")
    tested = _p_text(loss, baseline)
    loss_text += f", {tested}" if tested else ""
    wall = entry["wall_clock_speedup"]
    if wall["available"]:
        wall_text = f"{_measure_text(wall, baseline)} ({wall['device']})"
    else:
        wall_text = f"unavailable ({wall.get('reason')})"
    mfu = entry["mfu"]
    if mfu["available"]:
        mfu_text = _percent(mfu["mean"])
        if mfu.get("ci95"):
            mfu_text += f" [95 % CI {_percent(mfu['ci95'][0])}, {_percent(mfu['ci95'][1])}]"
        mfu_text += f" against {_percent(mfu.get('baseline_mean'))}"
        if mfu.get("ratio") and mfu["ratio"]["n"]:
            mfu_text += f" (ratio {_measure_text(mfu['ratio'], baseline)})"
        mfu_text += f"; peak: {'; '.join(mfu['peak'])}"
    else:
        mfu_text = f"unavailable ({mfu.get('reason')})"
    seeds = ", ".join(str(s) for s in entry["seeds"])
    cost_text = ""
    if entry.get("step_time_ratio") is not None:
        cost_text += f"; step time {entry['step_time_ratio']:.2f}× the baseline's"
    seconds = entry.get("train_seconds") or {}
    if seconds.get("configuration") is not None and seconds.get("baseline") is not None:
        cost_text += f", trained {seconds['configuration']:.0f} s against {seconds['baseline']:.0f} s"
    return (f"- **{entry['configuration']}** against `{entry['against']}` (seeds {seeds}): Δ validation loss "
            f"{loss_text}{cost_text}; token speedup {_measure_text(entry['token_speedup'], baseline)}; wall-clock "
            f"speedup {wall_text}; MFU {mfu_text}.")


def _headline_ratio(summary: dict[str, Any]) -> str:
    """A speedup in a headline: the value (or bound), or in two words why it cannot be read."""
    if summary.get("unreadable"):
        return "not readable (" + ("one evaluation" if "evaluated once" in summary["unreadable"] else
                                   "busy machine") + ")"
    if summary.get("available") is False:
        return "unavailable"
    if summary.get("beyond") == MIXED:
        return "mixed"
    if summary.get("beyond") in (BELOW, ABOVE):
        return f"{'>' if summary['beyond'] == BELOW else '<'} {summary['bound']:.2f}×"
    return "–" if summary.get("geometric_mean") is None else f"{summary['geometric_mean']:.2f}×"


def headline_lines(found: dict[str, Any]) -> list[str]:
    """One line per configuration, before the detailed verdicts: its final validation loss, and against its first
    baseline (the baseline's own line has its loss alone) the token and wall-clock speedups, means over seeds."""
    first: dict[str, dict[str, Any]] = {}
    baselines: dict[str, float] = {}
    for entries in found["baselines"].values():
        for entry in entries:
            first.setdefault(entry["configuration"], entry)
            baselines.setdefault(entry["against"], entry["val_loss"]["baseline"])
    lines = []
    for label, loss in baselines.items():
        if label not in first:
            lines.append(f"- **{label}**: final validation loss {loss:.4f} (the baseline)")
    for label, entry in first.items():
        lines.append(f"- **{label}**: final validation loss {entry['val_loss']['configuration']:.4f}; token speedup "
                     f"{_headline_ratio(entry['token_speedup'])}, wall-clock speedup "
                     f"{_headline_ratio(entry['wall_clock_speedup'])} vs `{entry['against']}` "
                     f"({entry['val_loss']['baseline']:.4f})")
    return ["In one line each (means over seeds; the detail below):", "", *lines, ""] if lines else []


def verdict_lines(found: dict[str, Any]) -> list[str]:
    """The report's section (empty when no configuration has a verdict)."""
    if not found["baselines"]:
        return []
    lines = ["## Verdicts at equal cost", "",
             "Each configuration against its baseline, per seed (the same seed, the same data order): the difference "
             "of final validation loss; its median step time over the baseline's and the training seconds both spent "
             "(means over seeds, step times only); the token speedup, the tokens the baseline needs to reach the "
             "configuration's final validation loss over the configuration's tokens (the baseline's validation curve "
             "as its running minimum, linearly interpolated between evaluations; `> x` where the configuration's loss "
             "is below the baseline's best, `< x` where it is above the baseline's first evaluation: a bound, never an"
             " extrapolation); the wall-clock speedup, the same in measured training seconds (step times only, on the "
             "device named: a CPU figure on a CPU); MFU, the model's training FLOPs per token (analytic, 3 × forward) "
             "× tokens/s over the device's peak. Speedups, MFU and the MFU ratio over seeds: geometric mean with "
             "its intervals on the log scale, exponentiated; paired t-test of the logs. Beside each: `[95 % CI a, b; "
             "simultaneous c, d]`, the 95 % Student-t interval of that comparison alone, then the one at the "
             "Bonferroni level 1 − 0.05/m that holds over its Holm family of m together (read it with the Holm p); "
             "p (unadjusted): the two-sided paired t-test; Holm p (over m against `B`): adjusted over every "
             "configuration the config pairs with baseline B, per measure (the family is fixed by the config, not "
             "by what the runs gave: a configuration without a test there, a bound beyond the baseline's curve, "
             "stays in it counted as p = 1, the conservative value); with one configuration in the family, its p "
             "alone (two-sided). `verdicts.json` holds every value and bound per seed.", ""]
    lines += headline_lines(found)
    if not stats.available():
        lines += [stats.NO_STATISTICS, ""]
    for baseline, entries in found["baselines"].items():
        lines += [f"Against `{baseline}`:", ""] + [verdict_line(entry, baseline) for entry in entries] + [""]
    return lines
