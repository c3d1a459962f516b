"""Two-level factorial designs inside a study: main effects and interactions, per seed, with intervals.

A study config may name designs over its configurations::

    factorial:
      - name: the recipe, within s²HC                      # optional; the report's heading
        factors: {projection_init: [zero, normal], weight_decay_on: [matrices, all]}
        where: {family: s2hc}                               # optional: which configurations make the cells

A factor (and a ``where`` key) is ``family``, ``n_streams``, a family or connection option (its default filled
in: ``projection_init`` is ``zero`` for a configuration that does not set it), a TrainConfig key or
``model_overrides.KEY`` (the value the run trains with, the study's ``train:`` and the configuration's settings
applied). Each factor has two levels, low then high; every combination of levels must match exactly one
configuration (the cells, resolved here from :func:`.spec.configuration_value`, so that the report needs only
``results.json``).

Effects are computed per seed, on the seeds every cell finished (same seed = same data order and the same
initial weights wherever the models share them), so that the seed-to-seed spread cancels as in a paired test:

- the **main effect** of a factor: the mean over the cells at its high level minus the mean over those at its
  low level;
- the **interaction** of two factors: how much the effect of the first changes from the low to the high level of
  the second, ``(y₁₁ − y₀₁) − (y₁₀ − y₀₀)`` (averaged over any other factors), a difference of differences, not
  halved.

Each effect's mean over seeds gets a Student-t 95 % interval and a one-sample t-test against 0; Holm's correction
runs over the effects of one design and measure.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

from ..reports import mean_std, p_value, table
from . import stats
from .rows import MEASURES, by_configuration, per_seed

DESIGN_KEYS = ("name", "factors", "where")
MAX_FACTORS = 4  # 16 cells; a larger design is a study of its own


def _word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


#: What a configuration has for a factor's key: ``value_of(configuration, key)``, KeyError for a key it lacks.
ValueOf = Callable[[Any, str], Any]


def _design(entry: Any, configurations: tuple, value_of: ValueOf, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or "factors" not in entry or set(entry) - set(DESIGN_KEYS):
        raise ValueError(f"{where}: a design is a mapping with 'factors' (required), 'name' and 'where'; got {entry!r}")
    factors, condition = entry["factors"], entry.get("where") or {}
    if not isinstance(factors, dict) or not 1 <= len(factors) <= MAX_FACTORS:
        raise ValueError(f"{where}: 'factors' must map 1 to {MAX_FACTORS} keys to their two levels, got {factors!r}")
    if not isinstance(condition, dict):
        raise ValueError(f"{where}: 'where' must be a mapping of key to value, got {condition!r}")
    for key, levels in factors.items():
        if not isinstance(levels, list) or len(levels) != 2 or _word(levels[0]) == _word(levels[1]):
            raise ValueError(f"{where}: factor {key!r} needs two different levels [low, high], got {levels!r}")
    values: dict[str, list[str | None]] = {}
    for key in [*factors, *condition]:
        column = []
        for configuration in configurations:
            try:
                column.append(_word(value_of(configuration, key)))
            except (KeyError, AttributeError):
                column.append(None)
        if all(v is None for v in column):
            raise ValueError(f"{where}: {key!r} is not a family, option, TrainConfig key or model_overrides.KEY of "
                             "any configuration")
        values[key] = column
    chosen = [i for i in range(len(configurations))
              if all(values[k][i] == _word(v) for k, v in condition.items())]
    cells = []
    for combination in itertools.product(*(range(2) for _ in factors)):
        levels = {key: factors[key][level] for key, level in zip(factors, combination)}
        matches = [configurations[i].label for i in chosen
                   if all(values[k][i] == _word(v) for k, v in levels.items())]
        if len(matches) != 1:
            found = f"{len(matches)} ({', '.join(matches)})" if matches else "none"
            raise ValueError(f"{where}: the cell {levels} (with {condition or 'no condition'}) must match exactly one "
                             f"configuration; it matches {found}")
        cells.append({"levels": list(combination), "label": matches[0]})
    name = str(entry.get("name") or " × ".join(factors))
    return {"name": name, "factors": {k: list(v) for k, v in factors.items()}, "where": dict(condition),
            "cells": cells}


def parse_designs(value: Any, configurations: tuple, value_of: ValueOf, source: str) -> tuple[dict[str, Any], ...]:
    """The ``factorial:`` list over ``configurations`` (a study's, each with a ``label``), each design with its
    cells resolved to configuration labels; ValueError naming the design otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise ValueError(f"{source}: 'factorial' must be a non-empty list of designs, got {value!r}")
    designs = tuple(_design(entry, configurations, value_of, f"{source}: factorial[{index}]")
                    for index, entry in enumerate(value))
    names = [d["name"] for d in designs]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: factorial designs share a name ({names}); name each one")
    return designs


def effects(design: dict[str, Any], per_cell: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """Per-seed effects of ``design`` from ``per_cell`` (``{label: {seed: value}}``): for each main effect and
    each pairwise interaction ``{"effect", "kind", "per_seed": {seed: value}}``, on the seeds every cell has."""
    factors = list(design["factors"])
    cells = design["cells"]
    seeds = sorted(set.intersection(*(set(per_cell.get(c["label"], {})) for c in cells)))

    def mean_where(seed: int, fixed: dict[int, int]) -> float:
        return statistics.fmean(per_cell[c["label"]][seed] for c in cells
                                if all(c["levels"][i] == level for i, level in fixed.items()))

    out = []
    for i, key in enumerate(factors):
        low, high = design["factors"][key]
        out.append({"effect": f"{key}: {_word(low)} → {_word(high)}", "kind": "main",
                    "per_seed": {s: mean_where(s, {i: 1}) - mean_where(s, {i: 0}) for s in seeds}})
    for i, j in itertools.combinations(range(len(factors)), 2):
        out.append({"effect": f"{factors[i]} × {factors[j]}", "kind": "interaction", "per_seed": {
            s: (mean_where(s, {i: 1, j: 1}) - mean_where(s, {i: 0, j: 1}))
               - (mean_where(s, {i: 1, j: 0}) - mean_where(s, {i: 0, j: 0})) for s in seeds}})
    return out


def design_lines(results: dict[str, Any]) -> list[str]:
    """The report's section on the study's factorial designs: per design the cell means, then per measure the
    effects with their intervals and tests (Holm over the design's effects). Empty when the study has none."""
    designs = results["study"].get("factorial") or []
    if not designs:
        return []
    lines = ["## Factorial designs", "",
             "Effects per seed, on the seeds every cell finished (the spread between seeds cancels as in a paired "
             "test). Main effect: mean over the cells at the factor's second level minus the mean at its first. "
             "Interaction: the first factor's effect at the second factor's second level minus its effect at the "
             "first level (a difference of differences). 95 % Student-t intervals over seeds; p: the two-sided "
             "one-sample t-test against 0, unadjusted; Holm p: adjusted over the design's m effects for that measure "
             "(all of them, whatever the runs gave); the simultaneous interval, at the Bonferroni level 1 − 0.05/m, "
             "holds over those effects together: read it with the verdict.", ""]
    if not stats.available():
        return lines + [stats.NO_STATISTICS, ""]
    groups = by_configuration(results["rows"])
    for design in designs:
        where = ", ".join(f"{k}={_word(v)}" for k, v in design["where"].items())
        lines += [f"### {design['name']}", "", "Factors: " + "; ".join(
            f"`{k}` {_word(a)} → {_word(b)}" for k, (a, b) in design["factors"].items())
            + (f" (configurations with {where})" if where else "") + ".", ""]
        cells = []
        for cell in design["cells"]:
            runs = groups.get(cell["label"], [])
            cells.append([cell["label"], *(_mean_cell(per_seed(runs, m)) for m in MEASURES)])
        lines += table(["cell", *(f"{m} (mean ± std)" for m in MEASURES)], cells) + [""]
        rows = []
        m = len(effects(design, {}))  # the design's effects: Holm's family per measure, whatever the runs gave
        for measure in MEASURES:
            per_cell = {c["label"]: per_seed(groups.get(c["label"], []), measure) for c in design["cells"]}
            every = effects(design, per_cell)
            found = [e for e in every if len(e["per_seed"]) >= 2]
            tests = {e["effect"]: stats.paired(e["per_seed"], {s: 0.0 for s in e["per_seed"]}) for e in found}
            adjusted = stats.holm_family([e["effect"] for e in every], {k: t["p"] for k, t in tests.items()})
            for e in found:
                test, p_family = tests[e["effect"]], adjusted.get(e["effect"], tests[e["effect"]]["p"])
                verdict = "within seed noise" if p_family >= 1 - stats.LEVEL else "distinguishable"
                simultaneous = stats.interval(test["differences"], stats.simultaneous_level(m))
                rows.append([measure, e["effect"], _signed_interval(test["mean"], *test["ci95"]),
                             *([_signed_interval(test["mean"], *simultaneous).split(" ", 1)[1]] if m > 1 else []),
                             p_value(test["p"]), *([p_value(p_family)] if m > 1 else []), verdict,
                             str(len(test["seeds"]))])
        if rows:
            header = ["measure", "effect", "Δ [95 % CI]", *([f"[simultaneous 95 % CI, Bonferroni over {m}]"] * (m > 1)),
                      "p (two-sided, unadjusted)" if m > 1 else "p (two-sided)",
                      *([f"Holm p (over the {m} effects)"] * (m > 1)), "verdict", "seeds"]
            lines += table(header, rows, align="llr" + "r" * (m > 1) + "r" + "r" * (m > 1) + "lr") + [""]
        else:
            lines += ["Fewer than two seeds finished in every cell: no effects.", ""]
    return lines


def _signed_interval(mean: float, low: float, high: float) -> str:
    """``+0.0123 [-0.0050, +0.0296]``; in scientific notation when every value is below 1e-3 (a spectrum that moved
    by 1e-5 is not +0.0000)."""
    small = 0 < max(abs(mean), abs(low), abs(high)) < 1e-3
    form = "{:+.2e}" if small else "{:+.4f}"
    return f"{form.format(mean)} [{form.format(low)}, {form.format(high)}]"


def _mean_cell(values: dict[int, float]) -> str:
    summary = stats.describe(list(values.values()), interval=False)
    return mean_std(summary["mean"], summary["std"], None, 4)


__all__ = ["design_lines", "effects", "parse_designs"]
