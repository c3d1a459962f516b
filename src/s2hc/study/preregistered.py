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
      alternative: less             # less (the first lowers the measure), greater, two-sided, or equivalence
      alpha: 0.05
      secondary: holm               # each contrast alone, Holm's correction over them at alpha; or none

A contrast of four configurations ``[a, b, c, d]`` is an interaction, ``(a − b) − (c − d)`` per seed (how much
the difference of ``a`` and ``b`` changes from the setting of ``c`` and ``d``). ``primary: each`` registers every
contrast as a test of its own, Holm-adjusted over them (several hypotheses registered together, one decision
each; ``secondary`` is then ``none``). ``alternative: equivalence`` with ``margin: 0.01`` registers an equivalence
test (two one-sided tests, TOST): its p is the larger of the two one-sided p against ``−margin`` and ``+margin``,
so H0 (a difference at least ``margin`` in size) is rejected exactly when the ``1 − 2α`` interval lies within
``±margin``.

The contrasts name configurations as ``families:`` does (``FAMILY:KEY=VALUE`` or a mapping), or by their label
(``"hc n=4 [lr=0.004, n_layers=32]"``: how one setting's configuration is named); each must be one configuration
of the grid. Everything is checked when the study config is read, so a test cannot be changed
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

KEYS = ("registered", "hypothesis", "measure", "contrasts", "primary", "alternative", "alpha", "secondary", "margin")
ALTERNATIVES = ("less", "greater", "two-sided", "equivalence")
PRIMARY = ("mean", "each")
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
    margin = value.get("margin")
    if chosen["alternative"] == "equivalence":
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin < math.inf:
            raise ValueError(f"{where}: margin must be a positive number (the equivalence bound, e.g. 0.01) with "
                             f"alternative equivalence, got {margin!r}")
    elif margin is not None:
        raise ValueError(f"{where}: margin is the bound of an equivalence test; it needs alternative: equivalence, "
                         f"got alternative {chosen['alternative']!r}")
    if chosen["primary"] == "each" and "secondary" in value and value["secondary"] != "none":
        raise ValueError(f"{where}: primary each makes every contrast a test of its own, Holm-adjusted over them; "
                         f"secondary must be none (or left out), got {value['secondary']!r}")
    if chosen["primary"] == "each":
        chosen["secondary"] = "none"
    contrasts = value["contrasts"]
    if not isinstance(contrasts, list):
        raise ValueError(f"{where}: contrasts must be a list of [first, second] pairs, got {contrasts!r}")
    labels = []
    for index, pair in enumerate(contrasts):
        at = f"{where}: contrasts[{index}]"
        if not isinstance(pair, list) or len(pair) not in (2, 4):
            raise ValueError(f"{at} must be a [first, second] pair of configurations (or four, [a, b, c, d]: the "
                             f"interaction (a − b) − (c − d)), got {pair!r}")
        labels.append([_label(entry, configurations, resolve, at) for entry in pair])
        for first, second in zip(labels[-1][::2], labels[-1][1::2]):
            if first == second:
                raise ValueError(f"{at} compares {first!r} with itself")
        if len(pair) == 4 and labels[-1][:2] == labels[-1][2:]:
            raise ValueError(f"{at} is the interaction of one difference with itself: {labels[-1]}")
    if len({tuple(pair) for pair in labels}) != len(labels):
        raise ValueError(f"{where}: a contrast is listed twice: {labels}")
    return {"registered": str(value["registered"]), "hypothesis": " ".join(str(value["hypothesis"]).split()),
            "measure": measure, "contrasts": labels, **chosen, "alpha": float(alpha),
            **({"margin": float(margin)} if chosen["alternative"] == "equivalence" else {})}


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
    """The label of the one configuration ``entry`` names: its label itself (``"hc n=4 [n_layers=32]"``, the way
    to name one setting's configuration), or a ``families:`` entry that matches one configuration."""
    if isinstance(entry, str) and entry in {c.label for c in configurations}:
        return entry
    wanted = [(c.family, c.options, c.n_streams) for c in resolve(entry, where)]
    found = [c.label for c in configurations if (c.family, c.options, c.n_streams) in wanted]
    if len(found) != 1:
        listed = [c.label for c in configurations]
        what = "none" if not found else f"{len(found)} ({found})"
        raise ValueError(f"{where}: {entry!r} matches {what} of the study's configurations; it must match exactly "
                         f"one of {listed}")
    return found[0]


def contrast_name(labels: list[str]) -> str:
    """``a − b``, or ``(a − b) − (c − d)`` for an interaction."""
    if len(labels) == 2:
        return f"{labels[0]} − {labels[1]}"
    return f"({labels[0]} − {labels[1]}) − ({labels[2]} − {labels[3]})"


def _ttest(values: list[float], alternative: str, margin: float | None = None) -> float:
    """The one-sample t-test's p of ``values`` against 0 (SciPy); 1.0 or 0.0 when every value is the same. With
    ``alternative="equivalence"``: the two one-sided tests' larger p, against ``−margin`` (greater) and
    ``+margin`` (less)."""
    if alternative == "equivalence":
        return max(_ttest([v + margin for v in values], "greater"), _ttest([v - margin for v in values], "less"))
    if statistics.pstdev(values) == 0:
        mean = statistics.fmean(values)
        toward = {"less": mean < 0, "greater": mean > 0, "two-sided": mean != 0}[alternative]
        return 0.0 if toward else 1.0
    return float(stats._scipy_stats().ttest_1samp(values, 0.0, alternative=alternative).pvalue)


def evaluate(results: dict[str, Any]) -> dict[str, Any] | None:
    """The registered test on a study's results: ``primary`` and ``secondary`` entries, each with ``seeds``,
    ``per_seed``, ``mean``, ``ci95`` (two-sided Student-t), ``p`` (as registered: one- or two-sided), ``p_holm``
    (secondary) and ``rejected`` (``p < alpha``, Holm-adjusted for the secondary); None without a registration, and
    ``primary`` None when fewer than two seeds have every configuration (or SciPy is missing) or when every contrast
    is its own test (``each``: then the ``secondary`` entries are those tests, Holm-adjusted over them)."""
    registered = results["study"].get("preregistered")
    if not registered:
        return None
    groups = by_configuration(results["rows"])
    measure, alpha, alternative = registered["measure"], registered["alpha"], registered["alternative"]
    margin = registered.get("margin")
    differences = []
    for labels in registered["contrasts"]:
        values = [per_seed(groups.get(label, []), measure) for label in labels]
        seeds = sorted(set.intersection(*(set(v) for v in values)))
        signs = (1, -1, -1, 1)  # (a − b) − (c − d)
        differences.append({s: sum(sign * v[s] for sign, v in zip(signs, values)) for s in seeds})
    each = registered["primary"] == "each"
    # "primary" becomes the primary test's entry; "each" keeps whether every contrast is a primary test
    out: dict[str, Any] = {**registered, "primary": None, "secondary": [], "each": each}
    if not stats.available():
        return out
    common = sorted(set.intersection(*(set(d) for d in differences)))
    if len(common) >= 2 and not each:
        pooled = {s: statistics.fmean(d[s] for d in differences) for s in common}
        out["primary"] = _entry("mean of the contrasts", pooled, alternative, alpha, margin)
    if registered["secondary"] == "holm" or each:
        # Holm's family: every registered contrast, whatever the runs gave (one with fewer than two seeds stays in
        # it, counted as p = 1, and is listed under "untested"); with primary each, these are the primary tests
        names = [contrast_name(labels) for labels in registered["contrasts"]]
        tests = [{**_entry(name, d, alternative, alpha, margin), "contrast": labels}
                 for name, labels, d in zip(names, registered["contrasts"], differences) if len(d) >= 2]
        adjusted = stats.holm_family(names, {t["name"]: t["p"] for t in tests})
        m = len(names)
        for test in tests:
            test.update(p_holm=adjusted[test["name"]], rejected=adjusted[test["name"]] < alpha, holm_m=m)
            if m > 1:  # the bound that holds over the family together (Bonferroni), beside the Holm decision
                test["bound_simultaneous"] = _bound(list(test["per_seed"].values()),
                                                    stats.simultaneous_level(m, 1 - alpha), alternative)
        out["secondary"] = tests
        tested = {t["name"] for t in tests}
        out["untested"] = [name for name in names if name not in tested]
    return out


def _bound(values: list[float], level: float, alternative: str) -> list[float] | None:
    """The interval a decision at ``level`` reads: one-sided for ``less`` / ``greater``, and for ``equivalence``
    the two-sided interval at ``1 − 2(1 − level)`` (TOST: within ``±margin`` exactly when both one-sided tests
    reject)."""
    if alternative == "equivalence":
        return stats.interval(values, 1 - 2 * (1 - level), "two-sided")
    return stats.interval(values, level, alternative)


def _entry(name: str, per_seed_values: dict[int, float], alternative: str, alpha: float,
           margin: float | None = None) -> dict[str, Any]:
    """One test: ``ci95`` the two-sided 95 % interval; ``bound`` the interval at level 1 − alpha with the registered
    sides (one-sided: ``[-inf, high]`` for ``less``, ``[low, inf]`` for ``greater``; the 1 − 2α interval for an
    equivalence test), the one its decision reads."""
    values = list(per_seed_values.values())
    summary = stats.describe(values)
    p = _ttest(values, alternative, margin)
    return {"name": name, "seeds": list(per_seed_values), "per_seed": per_seed_values, "mean": summary["mean"],
            "ci95": summary["ci95"], "bound": _bound(values, 1 - alpha, alternative), "p": p,
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
    alternative, alpha, margin = test["alternative"], test["alpha"], test.get("margin")
    sided = {"less": "one-sided, H1: below 0", "greater": "one-sided, H1: above 0", "two-sided": "two-sided",
             "equivalence": f"equivalence, H1: within ±{margin or 0:g}, two one-sided tests"}
    heading, when = _when(results, test["registered"])
    equivalence = alternative == "equivalence"
    kind = {"two-sided": "two-sided", "equivalence": "TOST"}.get(alternative, "one-sided")
    level = f"{100 * (1 - 2 * alpha if equivalence else 1 - alpha):g} %"
    bound_name = "interval" if kind != "one-sided" else "bound"
    m = len(test["contrasts"])
    each = test["each"]
    contrast_words = ("per seed, the first configuration minus the second (an interaction of four, (a − b) − "
                      "(c − d))" if any(len(c) == 4 for c in test["contrasts"]) else
                      "per seed, the first configuration minus the second")
    design = (f"every one of the {m} contrasts is a primary test of its own ({sided[alternative]}, α = {alpha}), "
              f"Holm-adjusted over the {m}" if each else
              f"the primary test is one t-test on the mean of the {m} contrasts per seed ({sided[alternative]}, "
              f"α = {alpha}), decided by its own p; the secondary tests take each contrast alone, Holm-adjusted "
              f"over the {m} registered contrasts (all of them, whatever the runs gave)")
    reading = (f"Each Δ has its {level} interval (level 1 − 2α: it lies within ±{margin:g} exactly when p < α)"
               if equivalence else
               f"Each Δ has its {kind} {level} {bound_name} (level 1 − α: for "
               f"{'each test before its adjustment' if each else 'the primary test'} it excludes 0 exactly when "
               "p < α)")
    lines = [heading, "", f"{when}: *{test['hypothesis']}*", "",
             f"Measure: {test['measure']}; {contrast_words}; {design}. {reading}"
             + (f"; {'each' if each else 'the secondary tests'} also the simultaneous one at level 1 − α/{m} "
                "(Bonferroni), which holds over the contrasts together: the one to read beside "
                "their Holm decision" if m > 1 and (each or test["secondary"]) else "")
             + ". Everything else in this report is exploratory.", ""]
    if not stats.available():
        return lines + [stats.NO_STATISTICS, ""]
    entries = [("primary", test["primary"])] if test["primary"] else []
    entries += [("primary" if each else "secondary", entry) for entry in test["secondary"]]
    if not entries:
        return lines + ["Not enough seeds with every configuration finished to test (two are needed).", ""]
    holm = bool(test["secondary"]) and m > 1
    rows = []
    for which, entry in entries:
        adjusted_test = "p_holm" in entry
        family = [_bound_text(entry.get("bound_simultaneous")) if adjusted_test else DASH] if holm else []
        adjusted = [p_value(entry["p_holm"]) if adjusted_test else "– (one test)"] if holm else []
        rows.append([which, entry["name"], f"{entry['mean']:+.4f}", _bound_text(entry["bound"]), *family,
                     p_value(entry["p"]), *adjusted, "H0 rejected" if entry["rejected"] else "not rejected",
                     str(len(entry["seeds"]))])
    rows += [["primary" if each else "secondary", name, DASH, "fewer than two seeds", *([DASH] if holm else []),
              DASH, *(["1 (counted)"] if holm else []), "not tested", "0–1"] for name in test.get("untested", [])]
    header = ["test", "contrast", "Δ (mean)", f"{kind} {level} {bound_name}",
              *([f"simultaneous (Bonferroni over {m})"] if holm else []), f"p ({kind}, unadjusted)" if holm else
              f"p ({kind})", *([f"Holm p (over the {m} contrasts)"] if holm else []), "decision", "seeds"]
    return lines + table(header, rows, align="llrr" + "r" * holm + "r" + "r" * holm + "ll") + [""]
