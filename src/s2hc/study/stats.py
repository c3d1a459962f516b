"""The statistics of a study: per-configuration intervals and paired tests over seeds (SciPy, the study extra).

With a handful of seeds, Student's t is the honest choice: the interval of a mean is ``mean ± t(0.975, k−1) ·
s / √k``, and two configurations trained with the same seeds (the same data order) are compared by the paired
t-test on their per-seed differences. Holm's step-down correction keeps the chance of any false "different"
in a table of comparisons below 5 %.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..extras import MissingExtra, is_available, require

LEVEL = 0.95
#: What a report says where the intervals and tests are left out (``s2hc compare`` without the study extra).
NO_STATISTICS = f"(No 95 % intervals or paired t-tests: {MissingExtra('scipy', 'the statistics')}.)"


def available() -> bool:
    """Whether the intervals and tests can be computed (SciPy installed); means and spreads need nothing."""
    return is_available("scipy")


def _scipy_stats():
    return require("scipy.stats", "the study's statistics")


def describe(values: list[float], interval: bool = True) -> dict[str, Any]:
    """``n``, ``mean``, ``std`` (sample) and ``ci95`` (Student's t interval of the mean; None for one value, and
    without ``interval``, which needs SciPy)."""
    k = len(values)
    if k == 0:
        return {"n": 0, "mean": None, "std": None, "ci95": None}
    mean = statistics.fmean(values)
    if k == 1:
        return {"n": 1, "mean": mean, "std": None, "ci95": None}
    std = statistics.stdev(values)
    if not interval:
        return {"n": k, "mean": mean, "std": std, "ci95": None}
    half = float(_scipy_stats().t.ppf(0.5 + LEVEL / 2, k - 1)) * std / math.sqrt(k)
    return {"n": k, "mean": mean, "std": std, "ci95": [mean - half, mean + half]}


def paired(values: dict[int, float], baseline: dict[int, float]) -> dict[str, Any] | None:
    """The paired comparison of ``values`` against ``baseline`` over the seeds both have (``{seed: value}``):
    ``seeds``, ``mean`` difference (values − baseline), its ``ci95``, the two-sided paired t-test's ``p`` and the
    per-seed ``differences`` (None with fewer than 2 common seeds; p 1.0 when every difference is the same zero)."""
    seeds = sorted(set(values) & set(baseline))
    if len(seeds) < 2:
        return None
    diffs = [values[s] - baseline[s] for s in seeds]
    summary = describe(diffs)
    if summary["std"] == 0:
        p = 1.0 if summary["mean"] == 0 else 0.0
    else:
        p = float(_scipy_stats().ttest_rel([values[s] for s in seeds], [baseline[s] for s in seeds]).pvalue)
    return {"seeds": seeds, "mean": summary["mean"], "ci95": summary["ci95"], "p": p, "differences": diffs}


def interval(values: list[float], level: float = LEVEL, sides: str = "two-sided") -> list[float] | None:
    """The Student-t interval of the mean of ``values`` at ``level``: ``[low, high]`` (``sides="two-sided"``), or
    a one-sided bound, ``[-inf, high]`` (``"less"``: the mean is below ``high``) or ``[low, inf]`` (``"greater"``);
    None with fewer than two values."""
    k = len(values)
    if k < 2:
        return None
    mean, std = statistics.fmean(values), statistics.stdev(values)
    tail = (1 - level) / 2 if sides == "two-sided" else 1 - level
    half = float(_scipy_stats().t.ppf(1 - tail, k - 1)) * std / math.sqrt(k)
    return [-math.inf if sides == "less" else mean - half, math.inf if sides == "greater" else mean + half]


def simultaneous_level(m: int, level: float = LEVEL) -> float:
    """The level of each of ``m`` intervals that hold together at ``level`` (Bonferroni: ``1 − (1 − level) / m``),
    the intervals to read beside Holm's verdicts over a family of ``m``."""
    return 1 - (1 - level) / max(1, m)


def holm_family(members: list[str], pvalues: dict[str, float | None]) -> dict[str, float]:
    """Holm's adjustment over the family ``members`` fixed before the outcome (every comparison the study declares),
    whatever its runs gave: a member without a p (no test: a bound beyond a curve, too few seeds) counts as p = 1,
    the most conservative value it could have, so that it can never make the others' adjustment milder. Empty when
    no member has a p (nothing was tested)."""
    if not any(pvalues.get(member) is not None for member in members):
        return {}
    counted = [1.0 if pvalues.get(member) is None else pvalues[member] for member in members]
    return dict(zip(members, holm(counted)))


def holm(pvalues: list[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the order given (monotone, capped at 1)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted
