"""A study's pre-registered test: written into the study config before its runs, reported apart.

A study config may fix, before anything runs, the one question it is built to answer::

    preregistered:
      registered: 2026-12-04        # when it was written (the config's commit, before the runs', shows it too)
      hypothesis: the residual-equivalent start lowers the validation loss
      measure: validation loss      # a measure of .rows.MEASURES (default: validation loss)
      contrasts:                    # each: the first configuration minus the second, per seed
        - [identity:gate_init=residual, identity]
        - [mhc:gate_init=residual, mhc]
      primary: mean                 # the one test: the contrasts' mean per seed (one contrast: that contrast)
      alternative: less             # less (the first lowers the measure), greater, or two-sided
      alpha: 0.05
      secondary: holm               # each contrast alone, Holm's correction over them at alpha; or none

The contrasts name configurations as ``families:`` does (``FAMILY:KEY=VALUE`` or a mapping); each must be one
configuration of the grid. Everything is checked when the study config is read, so a test cannot be changed
once runs exist without the study's grid saying so (the config is committed with the runs).

The **primary** test is one one-sample t-test on the per-seed values ``d_s`` (the mean over the contrasts of
``first − second`` at seed ``s``, on the seeds every configuration finished), one-sided as registered; its
decision is ``p < alpha``. The **secondary** tests take each contrast alone, Holm-adjusted over the contrasts.
The report gives this section first and calls it confirmatory; every other comparison of the study is
exploratory.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Callable
from typing import Any

from ..reports import DASH, p_value, table
from . import stats
from .rows import MEASURES, by_configuration, per_seed

KEYS = ("registered", "hypothesis", "measure", "contrasts", "primary", "alternative", "alpha", "secondary")
ALTERNATIVES = ("less", "greater", "two-sided")
PRIMARY = ("mean",)
SECONDARY = ("holm", "none")
DEFAULT_MEASURE = "validation loss"


def parse_preregistered(value: Any, configurations: tuple, resolve: Callable[[Any, str], list], source: str
                        ) -> dict[str, Any] | None:
    """The ``preregistered:`` mapping checked, its contrasts resolved to configuration labels; None when absent.

    ``resolve(entry, where)`` gives the configurations of a ``families:``-style entry (without settings); each
    contrast side must match exactly one configuration of ``configurations``. ValueError naming the key otherwise.
    """
    if value is None:
        return None
    where = f"{source}: preregistered"
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping with keys {list(KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(KEYS)}")
    for key in ("registered", "hypothesis", "contrasts"):
        if not value.get(key):
            raise ValueError(f"{where}: {key!r} is required (the test is written down before the runs)")
    if not isinstance(value["registered"], (str, datetime.date)):
        raise ValueError(f"{where}: registered must be a date (2026-12-04) or a string, got "
                         f"{_kind(value['registered'])} {value['registered']!r}")
    if not isinstance(value["hypothesis"], str):
        raise ValueError(f"{where}: hypothesis must be a string (the hypothesis in words), got "
                         f"{_kind(value['hypothesis'])} {value['hypothesis']!r}")
    choices = {"measure": (tuple(MEASURES), DEFAULT_MEASURE), "primary": (PRIMARY, "mean"),
               "alternative": (ALTERNATIVES, None), "secondary": (SECONDARY, "holm")}
    chosen = {}
    for key, (allowed, default) in choices.items():
        chosen[key] = value.get(key, default)
        if not isinstance(chosen[key], str) or chosen[key] not in allowed:  # a list or mapping: one line, no hash
            kind = "" if isinstance(chosen[key], str) else f" (a string), got {_kind(chosen[key])}"
            raise ValueError(f"{where}: {key} must be one of {list(allowed)}{kind or ', got'} {chosen[key]!r}")
    measure = chosen.pop("measure")
    alpha = value.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise ValueError(f"{where}: alpha must be a number in (0, 0.5), e.g. 0.05, got {alpha!r}")
    contrasts = value["contrasts"]
    if not isinstance(contrasts, list):
        raise ValueError(f"{where}: contrasts must be a list of [first, second] pairs, got {contrasts!r}")
    labels = []
    for index, pair in enumerate(contrasts):
        at = f"{where}: contrasts[{index}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{at} must be a [first, second] pair of configurations, got {pair!r}")
        labels.append([_label(entry, configurations, resolve, at) for entry in pair])
        if labels[-1][0] == labels[-1][1]:
            raise ValueError(f"{at} compares {labels[-1][0]!r} with itself")
    if len({tuple(pair) for pair in labels}) != len(labels):
        raise ValueError(f"{where}: a contrast is listed twice: {labels}")
    return {"registered": str(value["registered"]), "hypothesis": " ".join(str(value["hypothesis"]).split()),
            "measure": measure, "contrasts": labels, **chosen, "alpha": float(alpha)}


def changed_fields(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """``preregistered.alpha: 0.05 -> 0.1`` for each field of a registration that differs from ``old`` to ``new``
    (the whole block where one side has none)."""
    def text(value: Any) -> str:
        shown = json.dumps(value, ensure_ascii=False, default=str)
        return shown if len(shown) <= 80 else shown[:77] + "..."
    if old is None or new is None:
        return [f"preregistered: {'none' if old is None else text(old)} -> {'none' if new is None else text(new)}"]
    return [f"preregistered.{key}: {text(old.get(key))} -> {text(new.get(key))}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _kind(value: Any) -> str:
    """``a list``, ``a mapping``, ``a string``: what a YAML value is, in words."""
    kinds = {list: "a list", dict: "a mapping", str: "a string", bool: "a boolean", type(None): "nothing"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _label(entry: Any, configurations: tuple, resolve: Callable[[Any, str], list], where: str) -> str:
    wanted = [(c.family, c.options, c.n_streams) for c in resolve(entry, where)]
    found = [c.label for c in configurations if (c.family, c.options, c.n_streams) in wanted]
    if len(found) != 1:
        listed = [c.label for c in configurations]
        what = "none" if not found else f"{len(found)} ({found})"
        raise ValueError(f"{where}: {entry!r} matches {what} of the study's configurations; it must match exactly "
                         f"one of {listed}")
    return found[0]


def _ttest(values: list[float], alternative: str) -> float:
    """The one-sample t-test's p of ``values`` against 0 (SciPy); 1.0 or 0.0 when every value is the same."""
    if statistics.pstdev(values) == 0:
        mean = statistics.fmean(values)
        toward = {"less": mean < 0, "greater": mean > 0, "two-sided": mean != 0}[alternative]
        return 0.0 if toward else 1.0
    return float(stats._scipy_stats().ttest_1samp(values, 0.0, alternative=alternative).pvalue)


def evaluate(results: dict[str, Any]) -> dict[str, Any] | None:
    """The registered test on a study's results: ``primary`` and ``secondary`` entries, each with ``seeds``,
    ``per_seed``, ``mean``, ``ci95`` (two-sided Student-t), ``p`` (as registered: one- or two-sided), ``p_holm``
    (secondary) and ``rejected`` (``p < alpha``, Holm-adjusted for the secondary); None without a registration, and
    ``primary`` None when fewer than two seeds have every configuration (or SciPy is missing)."""
    registered = results["study"].get("preregistered")
    if not registered:
        return None
    groups = by_configuration(results["rows"])
    measure, alpha, alternative = registered["measure"], registered["alpha"], registered["alternative"]
    differences = []
    for first, second in registered["contrasts"]:
        a, b = per_seed(groups.get(first, []), measure), per_seed(groups.get(second, []), measure)
        differences.append({s: a[s] - b[s] for s in sorted(set(a) & set(b))})
    out: dict[str, Any] = {**registered, "primary": None, "secondary": []}
    if not stats.available():
        return out
    common = sorted(set.intersection(*(set(d) for d in differences)))
    if len(common) >= 2:
        pooled = {s: statistics.fmean(d[s] for d in differences) for s in common}
        out["primary"] = _entry("mean of the contrasts", pooled, alternative, alpha)
    if registered["secondary"] == "holm":
        # Holm's family: every registered contrast, whatever the runs gave (one with fewer than two seeds stays in
        # it, counted as p = 1, and is listed under "untested")
        names = [f"{first} − {second}" for first, second in registered["contrasts"]]
        tests = [{**_entry(name, d, alternative, alpha), "contrast": [first, second]}
                 for name, (first, second), d in zip(names, registered["contrasts"], differences) if len(d) >= 2]
        adjusted = stats.holm_family(names, {t["name"]: t["p"] for t in tests})
        m = len(names)
        for test in tests:
            test.update(p_holm=adjusted[test["name"]], rejected=adjusted[test["name"]] < alpha, holm_m=m)
            if m > 1:  # the bound that holds over the family together (Bonferroni), beside the Holm decision
                test["bound_simultaneous"] = stats.interval(list(test["per_seed"].values()),
                                                            stats.simultaneous_level(m, 1 - alpha), alternative)
        out["secondary"] = tests
        tested = {t["name"] for t in tests}
        out["untested"] = [name for name in names if name not in tested]
    return out


def _entry(name: str, per_seed_values: dict[int, float], alternative: str, alpha: float) -> dict[str, Any]:
    """One test: ``ci95`` the two-sided 95 % interval; ``bound`` the interval at level 1 − alpha with the registered
    sides (one-sided: ``[-inf, high]`` for ``less``, ``[low, inf]`` for ``greater``), the one its decision reads."""
    values = list(per_seed_values.values())
    summary = stats.describe(values)
    p = _ttest(values, alternative)
    return {"name": name, "seeds": list(per_seed_values), "per_seed": per_seed_values, "mean": summary["mean"],
            "ci95": summary["ci95"], "bound": stats.interval(values, 1 - alpha, alternative), "p": p,
            "rejected": p < alpha}


CONFIRMATORY = "## Pre-registered test (confirmatory)"


def _when(results: dict[str, Any], date: str) -> tuple[str, str]:
    """The section's heading and what it says of when the test was registered, from the record the study keeps
    (``results["registration"]``, ``runs_existing``: how many of its runs existed when it was recorded): before the
    runs only where that record says so."""
    record = results.get("registration")
    existing = record.get("runs_existing") if isinstance(record, dict) else None
    if existing == 0:
        return CONFIRMATORY, f"Registered {date}, before these runs (study.json recorded it before any of them existed)"
    if existing is None:
        return CONFIRMATORY, (f"Registered {date} as the config dates it (these results predate the record of when a "
                              "registration was made against the runs: that it came first is not checked here)")
    earlier = len(record.get("superseded") or [])
    return ("## Registered test, made after the runs (exploratory)",
            f"Registered {date} as the config dates it, but recorded when {existing} of this study's runs already "
            "existed (" + (f"replacing {earlier} earlier registration{'s' * (earlier > 1)}; " if earlier else "")
            + "not written before the runs, so exploratory like the rest of the report)")


def _bound_text(bound: list[float] | None) -> str:
    """``[-∞, -0.0050]``, ``[+0.0010, +∞]``, ``[-0.0100, +0.0020]``; a dash without one."""
    if not bound:
        return DASH
    return "[" + ", ".join("-∞" if v == -math.inf else "+∞" if v == math.inf else f"{v:+.4f}" for v in bound) + "]"


def report_lines(results: dict[str, Any]) -> list[str]:
    """The report's confirmatory section; empty without a registration."""
    test = evaluate(results)
    if test is None:
        return []
    sided = {"less": "one-sided, H1: below 0", "greater": "one-sided, H1: above 0", "two-sided": "two-sided"}
    heading, when = _when(results, test["registered"])
    level = f"{100 * (1 - test['alpha']):g} %"
    kind = "one-sided" if test["alternative"] != "two-sided" else "two-sided"
    m = len(test["contrasts"])
    lines = [heading, "", f"{when}: *{test['hypothesis']}*", "",
             f"Measure: {test['measure']}; per seed, the first configuration minus the second; the primary test is "
             f"one t-test on the mean of the {m} contrasts per seed ({sided[test['alternative']]}, α = "
             f"{test['alpha']}), decided by its own p; the secondary tests take each contrast alone, Holm-adjusted "
             f"over the {m} registered contrasts (all of them, whatever the runs gave). Each Δ has its {kind} {level} "
             f"{'bound' if kind == 'one-sided' else 'interval'} (level 1 − α: for the primary test it excludes 0 "
             "exactly when p < α)" + (f"; the secondary tests also the simultaneous one at level 1 − α/{m} "
                                      "(Bonferroni), which holds over the contrasts together: the one to read beside "
                                      "their Holm decision" if m > 1 else "")
             + ". Everything else in this report is exploratory.", ""]
    if not stats.available():
        return lines + [stats.NO_STATISTICS, ""]
    entries = [("primary", test["primary"])] if test["primary"] else []
    entries += [("secondary", entry) for entry in test["secondary"]]
    if not entries:
        return lines + ["Not enough seeds with every configuration finished to test (two are needed).", ""]
    holm = test["secondary"] and m > 1
    rows = []
    for which, entry in entries:
        secondary = which == "secondary"
        family = [_bound_text(entry.get("bound_simultaneous")) if secondary else DASH] if holm else []
        adjusted = [p_value(entry["p_holm"]) if secondary else "– (one test)"] if holm else []
        rows.append([which, entry["name"], f"{entry['mean']:+.4f}", _bound_text(entry["bound"]), *family,
                     p_value(entry["p"]), *adjusted, "H0 rejected" if entry["rejected"] else "not rejected",
                     str(len(entry["seeds"]))])
    rows += [["secondary", name, DASH, "fewer than two seeds", *([DASH] if holm else []), DASH,
              *(["1 (counted)"] if holm else []), "not tested", "0–1"] for name in test.get("untested", [])]
    header = ["test", "contrast", "Δ (mean)", f"{kind} {level} {'bound' if kind == 'one-sided' else 'interval'}",
              *([f"simultaneous (Bonferroni over {m})"] if holm else []), f"p ({kind}, unadjusted)" if holm else
              f"p ({kind})", *([f"Holm p (over the {m} contrasts)"] if holm else []), "decision", "seeds"]
    return lines + table(header, rows, align="llrr" + "r" * holm + "r" + "r" * holm + "ll") + [""]
