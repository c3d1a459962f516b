"""Findings pages rendered from committed study JSON: no number in a finding is typed by hand.

The repository's own tooling (scripts/render_findings.py renders with it); not part of the installed package.

A findings template is Markdown rendered by Jinja2 over the committed studies::

    From the papers' start s²HC ends {{ start.diff("s2hc n=4", "residual") }} above residual ...

renders ``+0.028 [−0.011, +0.066]``. The names a template sees (:func:`namespace`): one :class:`Study` per
directory of ``docs/`` that holds a ``results.json`` (``start``, ``recipe``, ``gated_lss``, ...; ``-`` becomes
``_``), :data:`LEVEL` as ``level`` (95), ``num`` (a literal number that is not a measurement, e.g. a count of
configurations, rendered as it is given), ``cite`` (a number quoted from a paper, with its source), the formatting
helpers of :class:`Number` and Python's ``min``, ``max``, ``all``, ``any``, ``len``, ``abs``, ``round`` and
``sorted``. Jinja's statements bind names and loop (``{% set gap = study.diff(...) %}``, ``{% for label in ... %}``);
a line holding only statements leaves nothing in the page. A statement ``{% do claim(condition, "...") %}`` guards
the words beside it: when the JSON no longer makes the condition true (a study grew, a row changed), rendering
stops and names the line. A claim about a difference tests its interval or its test, not only its mean:
``claim(cond, "...", interval=c)`` requires each interval to exclude 0, ``clears=c`` each test to clear its
adjustment, ``short=c`` each not to; a verdict sentence is otherwise produced from a test's outcome
(:attr:`Comparison.outcome`, :func:`tests_that_clear`). A study whose seeds grew after looking
(``docs/STUDY/seed_history.json``, scripts/seed_history.py) has its planned comparisons labelled exploratory.

Two kinds of comparison (:meth:`Study.diff`):

- **confirmatory**: a configuration against the baseline its study's config named before the runs (the paired
  tables of its report), with the report's Holm adjustment over that table;
- **exploratory**: any other pair, Holm-adjusted over every exploratory comparison of that study the page cites
  (two passes: the first collects them, the second renders with the adjusted p).

:func:`check_template` refuses a template whose prose holds a digit outside a Jinja tag (``{{ }}``, ``{% %}``,
``{# #}``), a code span, a link target or a comment, so that a figure cannot enter a finding by hand.
:func:`render_pages` renders every page of :data:`PAGES`; the test suite fails when a committed page differs from
what its template and JSON give.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from s2hc.io import atomic_write_text
from s2hc.study import cost, stats
from s2hc.study.factorial import effects
from s2hc.study.preregistered import evaluate as evaluate_registered
from s2hc.study.report import _baseline_label, _headline_value, _step_time_ratio, _stream_reduce
from s2hc.study.report import verdicts as report_verdicts
from s2hc.study.rows import by_configuration, finished_values, per_seed, smallest_deviation_sigma, stream_usage

__all__ = ["PAGES", "Comparison", "Number", "Study", "check_template", "namespace", "render", "render_pages"]

MINUS = "\u2212"
LEVEL = round(stats.LEVEL * 100)
#: Template -> page (relative to the repository root); ``README.md`` is rendered between its markers only.
PAGES = {"docs/findings/results.md": "docs/results.md", "docs/findings/readme.md": "README.md"}
README_START, README_END = "<!-- findings: rendered from docs/findings/readme.md -->", "<!-- /findings -->"
# Jinja's tags: an expression, a statement, a comment.
_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", re.S)
# A digit that starts a number, not one inside a name (s2hc, gpt2, bf16, H200, sm_90).
_LOOSE_DIGIT = re.compile(r"(?<![A-Za-z_0-9])[0-9]")
# Code, link targets, comments, table separator rows, and seeds named by number (a seed is a run's name, not a value).
_EXEMPT = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)]*\)|<!--.*?-->|^\|?[\s:|-]+\|[\s:|-]*$"
                     r"|\bseeds?[ -][0-9]+(?:(?:, | and |–|-| to )[0-9]+)*", re.S | re.M)


# ---- numbers -------------------------------------------------------------------------------------------------


def _minus(text: str) -> str:
    """Typographic minus signs (an exponent's stays ASCII: ``8e-11``)."""
    return re.sub(r"(?<!e)-", MINUS, text)


@dataclass(frozen=True)
class Number:
    """A value from the JSON, with the formats a page needs; ``str()`` gives 4 significant digits."""

    value: float

    def f(self, digits: int = 3) -> str:
        """Fixed decimals: ``0.028``."""
        return _minus(f"{self.value:.{digits}f}")

    def s(self, digits: int = 3) -> str:
        """Signed fixed decimals: ``+0.028``, ``−0.016``."""
        return _minus(f"{self.value:+.{digits}f}")

    def g(self, digits: int = 2) -> str:
        """Significant digits: ``3.9``, ``8e-11``."""
        return _minus(f"{self.value:.{digits}g}")

    def n(self) -> str:
        """A count or a large value, thousands grouped by a space: ``8 121``."""
        return f"{round(self.value):,}".replace(",", " ")

    def __float__(self) -> float:
        return float(self.value)

    def __str__(self) -> str:
        return self.g(4)

    def __truediv__(self, other):  # a ratio of two measured values stays a Number
        return Number(self.value / float(other))

    def __lt__(self, other):
        return self.value < float(other)

    def __gt__(self, other):
        return self.value > float(other)


def _num(value: Any) -> Number:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError("the JSON has no value here")
    return Number(float(value))


@dataclass
class Comparison:
    """A paired difference over seeds: ``mean [low, high]`` (Student-t), p, Holm p and its kind."""

    study: str
    label: str
    against: str
    mean: float
    low: float
    high: float
    p: float
    seeds: list[int]
    per_seed: dict[int, float]
    kind: str  # "confirmatory", "exploratory", "pre-registered" (or one of them with why, "exploratory: ...")
    holm: float | None = None
    digits: int = 3
    #: a pre-registered test's own decision (``p < alpha``, one-sided where registered so), its alpha and sides
    rejected: bool | None = None
    alpha: float = 1 - stats.LEVEL
    alternative: str = "two-sided"
    #: a pre-registered test's own interval (the one its decision reads: one-sided for a one-sided test, 1 − 2α for
    #: an equivalence test) and the size of its Holm family (None: a single test, nothing adjusted)
    bound: list[float] | None = None
    family: int | None = None

    def d(self, digits: int) -> Comparison:
        """The same comparison printed with ``digits`` decimals."""
        return Comparison(**{**self.__dict__, "digits": digits})

    def __str__(self) -> str:
        k = self.digits
        return _minus(f"{self.mean:+.{k}f} [{self.low:+.{k}f}, {self.high:+.{k}f}]")

    @property
    def p_holm(self) -> str:
        return _p(self.holm)

    @property
    def p_raw(self) -> str:
        """The unadjusted p as a page writes it."""
        return _p(self.p)

    @property
    def clears(self) -> bool:
        """Whether the test clears its adjustment: a pre-registered test's own decision, else the adjusted p below
        ``alpha`` (1 − level). An exploratory comparison's adjustment is over the page's exploratory comparisons."""
        if self.rejected is not None:
            return bool(self.rejected)
        return self.holm is not None and self.holm < self.alpha

    @property
    def excludes_zero(self) -> bool:
        """The {level} % interval lies on one side of 0 (unadjusted: it holds for this comparison alone)."""
        return self.low > 0 or self.high < 0

    def beyond(self, value: float) -> bool:
        """The whole interval lies further from 0 than ``|value|``, on the side of its mean."""
        return self.low > abs(float(value)) if self.mean > 0 else self.high < -abs(float(value))

    @property
    def outcome(self) -> str:
        """The test's outcome in its kind's words: ``confirmed by its pre-registered one-sided test (p 0.032 < α
        0.05)`` / ``not supported: ...``; ``distinguishable`` / ``indistinguishable`` after its adjustment
        (confirmatory); for an exploratory comparison, that it is one."""
        alpha = f"{self.alpha:.2f}"
        if self.kind == "pre-registered":
            sides = {"less": "one-sided", "greater": "one-sided", "equivalence": "equivalence (TOST)"}.get(
                self.alternative, "two-sided")
            if self.clears:
                p = _p(self.p)  # "< 0.001" reads "p < 0.001, below α 0.05", not "p < 0.001 < α 0.05"
                below = f"p {p}, below α {alpha}" if p.startswith("<") else f"p {p} < α {alpha}"
                return f"confirmed by its pre-registered {sides} test ({below})"
            return f"not supported: its pre-registered {sides} test does not reject H0 (p {_p(self.p)} ≥ α {alpha})"
        if self.kind == "confirmatory":
            return (f"distinguishable after its adjustment (Holm p {self.p_holm} < {alpha})" if self.clears else
                    f"indistinguishable after its adjustment (Holm p {self.p_holm} ≥ {alpha})")
        return f"{self.kind}: a question for the next study, not an answer"

    @property
    def verdict(self) -> str:
        """``indistinguishable`` (Holm p ≥ 1 − level), else ``lower`` / ``higher``."""
        if self.holm is None or self.holm >= 1 - stats.LEVEL:
            return "indistinguishable"
        return "lower" if self.mean < 0 else "higher"

    def cite(self) -> str:
        """The interval with its seeds, adjusted p and kind: ``+0.003 [−0.014, +0.020] (5 seeds, Holm p 1.000,
        confirmatory)``. A pre-registered test gives the interval and the p its decision reads: ``−0.015
        [−∞, −0.002] (one-sided 95 % bound; 5 seeds, p 0.032 one-sided, pre-registered)``, with ``Holm p … over m``
        where it is one of m registered tests."""
        if self.kind != "pre-registered" or self.bound is None:
            return f"{self} ({_seed_count(self.seeds)}, Holm p {self.p_holm}, {self.kind})"
        k, (low, high) = self.digits, self.bound
        ends = [("−∞" if v == -math.inf else "+∞") if math.isinf(v) else _minus(f"{v:+.{k}f}") for v in (low, high)]
        if self.alternative == "equivalence":
            what, sides = f"{100 * (1 - 2 * self.alpha):.0f} % interval of the equivalence test", "TOST"
        else:
            sided = "two-sided" if self.alternative == "two-sided" else "one-sided"
            what, sides = f"{sided} {100 * (1 - self.alpha):.0f} % bound", sided
        p = f"p {_p(self.p)} {sides}" if not self.family or self.family == 1 else (
            f"Holm p {self.p_holm} over {self.family}, {sides}")
        mean = _minus(f"{self.mean:+.{k}f}")
        return f"{mean} [{ends[0]}, {ends[1]}] ({what}; {_seed_count(self.seeds)}, {p}, pre-registered)"

    def seed_values(self, digits: int = 3) -> str:
        """The per-seed differences: ``+0.074, +0.004, ...`` in seed order."""
        return ", ".join(_minus(f"{self.per_seed[s]:+.{digits}f}") for s in self.seeds)

    @property
    def sd(self) -> Number:
        """The standard deviation of the per-seed differences: what a paired test's interval scales with."""
        return Number(statistics.stdev(self.per_seed[s] for s in self.seeds))

    @property
    def lower_on(self) -> int:
        """On how many seeds the difference is below 0."""
        return sum(self.per_seed[s] < 0 for s in self.seeds)

    @property
    def higher_on(self) -> int:
        """On how many seeds the difference is above 0."""
        return sum(self.per_seed[s] > 0 for s in self.seeds)


@dataclass
class Verdict:
    """A configuration's verdict at equal cost against its baseline, as the study's report computes it
    (:func:`s2hc.study.cost.verdicts`: speedups as geometric means over seeds with their intervals and Holm p over
    the report's configurations, per measure and baseline)."""

    entry: dict[str, Any]

    @property
    def token(self) -> str:
        """The token speedup: ``1.21× [1.05, 1.39], Holm p 0.031``, or a bound beyond the baseline's curve."""
        return _minus(cost._ratio_text(self.entry["token_speedup"]))

    @property
    def wall(self) -> str:
        """The wall-clock speedup with the device it was measured on."""
        wall = self.entry["wall_clock_speedup"]
        if not wall["available"]:
            return f"unavailable ({wall.get('reason')})"
        return _minus(cost._ratio_text(wall)) + f" ({wall['device']})"

    @staticmethod
    def _short(summary: dict[str, Any]) -> str:
        """A speedup in a table's cell: ``0.73× [0.67, 0.80], Holm p 0.013``, or a bound ``> 1.00×`` (``< x``)."""
        if summary.get("beyond") in (cost.BELOW, cost.ABOVE) and summary.get("bound") is not None:
            return f"{'>' if summary['beyond'] == cost.BELOW else '<'} {summary['bound']:.2f}×"
        return _minus(cost._ratio_text(summary))

    @property
    def token_short(self) -> str:
        return self._short(self.entry["token_speedup"])

    @property
    def wall_short(self) -> str:
        wall = self.entry["wall_clock_speedup"]
        return self._short(wall) if wall["available"] else "unavailable"

    def _speedup(self, measure: str) -> Number:
        summary = self.entry[measure]
        value = summary.get("geometric_mean") if summary.get("geometric_mean") is not None else summary.get("bound")
        if value is None:
            raise ValueError(f"{self.entry['configuration']}: no {measure} summary ({summary.get('beyond')})")
        return Number(value)

    @property
    def token_value(self) -> Number:
        """The token speedup's geometric mean over seeds (or its bound), as a number."""
        return self._speedup("token_speedup")

    @property
    def wall_value(self) -> Number:
        return self._speedup("wall_clock_speedup")

    @property
    def mfu(self) -> str:
        """MFU over seeds with its interval: ``1.9 % [1.7 %, 2.1 %]``."""
        mfu = self.entry["mfu"]
        if not mfu["available"]:
            return f"unavailable ({mfu.get('reason')})"
        text = cost._percent(mfu["mean"])
        if mfu.get("ci95"):
            text += f" [{cost._percent(mfu['ci95'][0])}, {cost._percent(mfu['ci95'][1])}]"
        return text

    @property
    def mfu_value(self) -> Number:
        return Number(100 * self.entry["mfu"]["mean"])

    @property
    def loss(self) -> str:
        """The loss difference with its interval and Holm p (over the verdicts of this baseline)."""
        loss = self.entry["loss"]
        text = f"{loss['mean']:+.3f}"
        if loss.get("ci95"):
            text += f" [{loss['ci95'][0]:+.3f}, {loss['ci95'][1]:+.3f}]"
        if loss.get("p_holm") is not None:
            text += f", Holm p {_p(loss['p_holm'])}"
        return _minus(text)

    @property
    def seeds(self) -> str:
        return _seed_count(self.entry["seeds"])

    def clears(self, measure: str = "token_speedup") -> bool:
        """Whether ``measure``'s test (``token_speedup``, ``wall_clock_speedup``, ``loss``) clears its Holm
        adjustment (p_holm below 1 − level); a bound or an unavailable measure has no test and does not."""
        summary = self.entry.get(measure) or {}
        return summary.get("p") is not None and summary.get("p_holm") is not None \
            and summary["p_holm"] < 1 - stats.LEVEL


def _p(value: float | None) -> str:
    if value is None:
        return "–"
    return "< 0.001" if value < 0.001 else f"{value:.3f}"


def _seed_count(seeds: Iterable[int]) -> str:
    seeds = list(seeds)
    return "one seed" if len(seeds) == 1 else f"{len(seeds)} seeds"


# ---- a study ---------------------------------------------------------------------------------------------------


#: The studies whose invocations ran from an installed snapshot before s2hc recorded the commit there (their
#: ``environment.commit`` is null), and the commit that added their results to the repository (``git log --
#: docs/NAME/results.json``): an upper bound on the code they trained with, and the commit to check it against.
#: The depth study's rows grew over four commits (its ``growth``); this is its last.
RESULTS_COMMITTED_IN = {"start-confirm": "6a171d1", "hc-gain": "31ce66d", "depth": "51ab68c"}


@dataclass
class Study:
    """One committed study's ``results.json``, read as a findings page needs it."""

    name: str
    results: dict[str, Any]
    #: every exploratory comparison asked for, for the Holm adjustment of the second pass
    exploratory: list[Comparison] = field(default_factory=list)
    adjusted: dict[tuple[str, str], float] = field(default_factory=dict)
    #: ``docs/<study>/seed_history.json``: the seeds each committed version of its results.json held (from git's
    #: history of that file), where the study grew; None where it did not
    history: dict[str, Any] | None = None

    @property
    def grown_after_looking(self) -> bool:
        """Whether seeds were added to the study after a committed version of its results had been read (more than
        one committed stage): its planned tests are then exploratory, their p optimistic."""
        return bool(self.history) and len(self.history["stages"]) > 1

    @property
    def growth(self) -> str:
        """The most seeds any configuration had at each committed stage: ``1 → 2 → 4 → 4``, with its commits."""
        if not self.history:
            raise ValueError(f"study {self.name!r} records no seed history")
        stages = self.history["stages"]
        counts = " → ".join(str(max(len(v) for v in stage["seeds"].values())) for stage in stages)
        commits = ", ".join(f"`{stage['commit']}`" for stage in stages)
        return f"{counts} seeds per configuration, over {len(stages)} commits ({commits})"

    @property
    def planned_kind(self) -> str:
        """The kind of the comparisons its config planned: ``confirmatory``, or exploratory where its seeds grew
        after looking."""
        return "exploratory: seeds added after looking" if self.grown_after_looking else "confirmatory"

    @property
    def groups(self) -> dict[str, list[dict[str, Any]]]:
        return by_configuration(self.results["rows"])

    def runs(self, label: str) -> list[dict[str, Any]]:
        groups = self.groups
        if label not in groups:
            raise KeyError(f"study {self.name!r} has no configuration {label!r}; it has {list(groups)}")
        return groups[label]

    # what the study is
    @property
    def run_count(self) -> str:
        return str(len(self.results["rows"]))

    @property
    def commit(self) -> str:
        """The commit its last invocation trained at; for the three studies run from an installed snapshot before
        s2hc recorded one there, the commit that added their results (:data:`RESULTS_COMMITTED_IN`), said so."""
        commit = self.results["environment"].get("commit")
        if commit is None and self.name in RESULTS_COMMITTED_IN:
            added = RESULTS_COMMITTED_IN[self.name]
            return f"not recorded (run from an installed snapshot; results committed in `{added}`)"
        return "not recorded" if commit is None else f"`{commit}`"

    @property
    def minutes(self) -> str:
        return f"{self.results['environment']['wall_s'] / 60:.0f}"

    def setting(self, key: str) -> str:
        """A training setting of the study (``max_steps``, ``lr``, ``model_overrides.dim``), as its config gives it."""
        value: Any = self.results["study"]["train"]
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise KeyError(f"study {self.name!r} sets no {key!r}")
            value = value[part]
        return str(value)

    @property
    def machines(self) -> list[str]:
        """The CPU models (with their vector instructions) the rows record they trained on; empty where the rows
        predate that record."""
        found = []
        for row in self.results["rows"]:
            for entry in row.get("platform") or ():
                found.append(f"{entry.get('cpu', 'unrecorded')}, {entry.get('cpu_capability', '?')}")
        return list(dict.fromkeys(found))

    @property
    def rows_without_machine(self) -> int:
        """How many rows do not record where they trained (they predate that record)."""
        return sum(not row.get("platform") for row in self.results["rows"])

    @property
    def tokens(self) -> str:
        """Training tokens per run: ``614 k``."""
        tokens = self.results["rows"][0]["tokens"]
        return f"{tokens / 1000:.0f} k" if tokens < 10**6 else f"{tokens / 10**6:.1f} M"

    def seeds(self, label: str | None = None) -> str:
        """``5 seeds`` / ``one seed`` (of ``label``, or of the study)."""
        if label is None:
            return _seed_count(self.results["study"]["seeds"])
        return _seed_count(finished_values(self.runs(label), "val_loss"))

    # per configuration
    def loss(self, label: str, seed: int | None = None, key: str = "val_loss") -> Number:
        """The final validation loss (``key``: another row value) of one seed, or its mean over seeds."""
        values = finished_values(self.runs(label), key)
        if seed is not None:
            return _num(values[seed])
        return _num(statistics.fmean(values.values()))

    def std(self, label: str, key: str = "val_loss") -> Number:
        """The standard deviation over seeds (sample)."""
        return _num(statistics.stdev(finished_values(self.runs(label), key).values()))

    def measure(self, label: str, key: str, combine: Callable = statistics.fmean, seed: int | None = None) -> Number:
        """A trained-model measure (a diagnostics headline key, or ``smallest_sigma``, ``grad_max``, ``spike``,
        ``step_time`` against residual, ``read``/``write``/``output``/``output_dominant_share`` stream usage),
        ``combine`` over seeds (mean by default; ``max``, ``min``), or of ``seed`` alone."""
        runs = [r for r in self.runs(label) if r["status"] == "finished" and seed in (None, r["seed"])]
        if key == "step_time":
            reference = self.groups.get(_baseline_label("residual", runs, self.groups))
            return _num(_step_time_ratio(runs, reference))
        values = [self._row_measure(r, key) for r in runs]
        values = [v for v in values if v is not None and not math.isnan(v)]
        if not values:
            which = "no run" if seed is None else f"no finished run of seed {seed}"
            raise ValueError(f"study {self.name!r}, {label!r}: {which} has {key!r}")
        return _num(combine(values))

    def _row_measure(self, row: dict[str, Any], key: str) -> float | None:
        if key == "smallest_sigma":
            return smallest_deviation_sigma(row)
        if key == "grad_max":
            return (row.get("grad_norm") or {}).get("max")
        if key == "spike":
            return row.get("loss_spike")
        if key in ("read", "write", "output", "output_dominant_share"):
            usage = stream_usage(row)
            return usage[key] if usage else None
        if not row.get("diagnostics"):
            return None
        return _headline_value(row, key, _stream_reduce(self.results))

    def per_layer(self, label: str, key: str, stat: str = "mean") -> list[Number]:
        """A per-connection value of every finished seed over its interior connections (``diagnostics[key]``, its
        ``stat`` where it is a dict of statistics; the connections whose read / write / ``H_res`` cannot change the
        output left out), flattened: for ranges over connections and seeds (``max(...)``)."""
        out = []
        for row in self.runs(label):
            d = row.get("diagnostics") or {}
            values = d.get(key)
            if isinstance(values, dict):
                values = values.get(stat)
            prefix = key.split("_", 1)[0]
            inert = set(d.get(f"{prefix}_inert_layers") if prefix in ("read", "write") else d.get("inert_layers")
                        or ())
            out += [Number(float(v)) for i, v in enumerate(values or ()) if i not in inert and v is not None]
        if not out:
            raise ValueError(f"study {self.name!r}, {label!r}: no per-connection {key!r}")
        return out

    def effect(self, name: str, design: int = 0, measure: str = "validation loss") -> Comparison:
        """A factorial effect of the study config's ``design`` (its index): the effect whose name contains ``name``
        (``"projection_init:"`` a main effect, ``" × "`` the interaction), confirmatory: pre-stated by the config,
        Holm over the design's effects for that measure."""
        groups = self.groups
        for chosen in (self.results["study"].get("factorial") or ())[design:design + 1]:
            per_cell = {c["label"]: per_seed(groups.get(c["label"], []), measure) for c in chosen["cells"]}
            found = [e for e in effects(chosen, per_cell) if len(e["per_seed"]) >= 2]
            tests = [stats.paired(e["per_seed"], {seed: 0.0 for seed in e["per_seed"]}) for e in found]
            for e, test, p_holm in zip(found, tests, stats.holm([t["p"] for t in tests])):
                if name in e["effect"]:
                    return Comparison(self.name, e["effect"], "0", test["mean"], *test["ci95"], test["p"],
                                      test["seeds"], e["per_seed"], self.planned_kind, p_holm)
        raise KeyError(f"study {self.name!r} has no factorial effect matching {name!r}")

    def registered(self, contrast: str | tuple[str, ...] | list[str] = "primary") -> Comparison:
        """The study's pre-registered test (:mod:`.preregistered`), as its report gives it: ``"primary"`` (the
        contrasts' mean per seed; ``label`` says so, ``against`` is ``"0"``), or the secondary test of a contrast,
        Holm-adjusted over the contrasts: the contrast whose first configuration is ``contrast`` (KeyError when two
        registered contrasts start with it), or the whole contrast as a tuple of its labels. Kind
        ``pre-registered``; its p is the registered one (one-sided where registered so)."""
        test = evaluate_registered(self.results)
        if test is None:
            raise KeyError(f"study {self.name!r} has no pre-registered test")
        if contrast == "primary" and test["each"]:
            raise KeyError(f"study {self.name!r} registered each contrast as its own test: name the contrast's first "
                           "configuration")
        if contrast == "primary":
            entry, against = test["primary"], "0"
            if entry is None:
                raise ValueError(f"study {self.name!r}: too few seeds for its pre-registered test")
            holm = entry["p"]  # one test: nothing to adjust
        else:
            if isinstance(contrast, str):
                found = [entry for entry in test["secondary"] if entry["contrast"][0] == contrast]
            else:
                found = [entry for entry in test["secondary"] if list(entry["contrast"]) == list(contrast)]
            if len(found) != 1:
                registered = [entry["contrast"] for entry in test["secondary"]]
                why = "two registered contrasts start with" if found else "no registered contrast is or starts with"
                raise KeyError(f"study {self.name!r}: {why} {contrast!r}; name the whole contrast; registered: "
                               f"{registered}")
            entry = found[0]
            against = entry["contrast"][1]
            holm = entry["p_holm"]
        return Comparison(self.name, entry["name"], against, entry["mean"], *entry["ci95"], entry["p"],
                          entry["seeds"], entry["per_seed"], "pre-registered", holm, rejected=entry["rejected"],
                          alpha=test["alpha"], alternative=test.get("alternative") or "two-sided",
                          bound=entry.get("bound"), family=entry.get("holm_m"))

    @property
    def registered_alpha(self) -> Number:
        return _num((evaluate_registered(self.results) or {}).get("alpha"))

    def peak(self, label: str, key: str, combine: Callable = max) -> Number:
        """The largest value of ``key`` over each finished run's training trajectory (its evaluations), ``combine``
        over seeds: the peak during training, where :meth:`measure` gives the trained model's."""
        peaks = [max(v for v in r["trajectory"][key] if v is not None) for r in self.runs(label)
                 if r["status"] == "finished" and (r.get("trajectory") or {}).get(key)]
        if not peaks:
            raise ValueError(f"study {self.name!r}, {label!r}: no trajectory of {key!r}")
        return _num(combine(peaks))

    def interaction(self, a1: str, b1: str, a0: str, b0: str) -> Comparison:
        """``(a1 − b1) − (a0 − b0)`` per seed (a difference of paired differences: how a gap changes between two
        settings), tested against 0 over the seeds all four share; exploratory (no config plans it), Holm-adjusted
        with the page's other exploratory comparisons of the study."""
        values = [finished_values(self.runs(label), "val_loss") for label in (a1, b1, a0, b0)]
        seeds = sorted(set.intersection(*(set(v) for v in values)))
        per_seed = {s: (values[0][s] - values[1][s]) - (values[2][s] - values[3][s]) for s in seeds}
        test = stats.paired(per_seed, {s: 0.0 for s in seeds})
        if test is None:
            raise ValueError(f"study {self.name!r}: {a1!r}, {b1!r}, {a0!r}, {b0!r} share fewer than two seeds")
        key = (f"({a1} − {b1}) − ({a0} − {b0})", "0")
        comparison = Comparison(self.name, key[0], "0", test["mean"], *test["ci95"], test["p"], test["seeds"],
                                per_seed, "exploratory")
        if all((c.label, c.against) != key for c in self.exploratory):
            self.exploratory.append(comparison)
        comparison.holm = self.adjusted.get(key)
        return comparison

    # comparisons
    def diff(self, label: str, against: str) -> Comparison:
        """``label`` − ``against`` paired over their common seeds (see the module docstring for the two kinds)."""
        values = finished_values(self.runs(label), "val_loss")
        baseline = finished_values(self.runs(against), "val_loss")
        test = stats.paired(values, baseline)
        if test is None:
            raise ValueError(f"study {self.name!r}: {label!r} and {against!r} share fewer than two seeds")
        per_seed = {s: values[s] - baseline[s] for s in test["seeds"]}
        planned = self._planned()
        kind = self.planned_kind if (label, against) in planned else "exploratory"
        comparison = Comparison(self.name, label, against, test["mean"], *test["ci95"], test["p"], test["seeds"],
                                per_seed, kind)
        if (label, against) in planned:
            comparison.holm = planned[(label, against)]
        else:
            if all((c.label, c.against) != (label, against) for c in self.exploratory):
                self.exploratory.append(comparison)
            comparison.holm = self.adjusted.get((label, against))
        return comparison

    def verdict(self, label: str, against: str) -> Verdict:
        """``label``'s verdict at equal cost against configuration ``against`` (one of the study's baselines)."""
        for entries in report_verdicts(self.results)["baselines"].values():
            for entry in entries:
                if entry["configuration"] == label and entry["against"] == against:
                    return Verdict(entry)
        raise KeyError(f"study {self.name!r} has no verdict of {label!r} against {against!r} (its baselines: "
                       f"{list(self.results['study'].get('baselines') or ())}; runs without cost records have none)")

    def _planned(self) -> dict[tuple[str, str], float]:
        """The report's paired tables: ``(label, baseline label) -> Holm p over that table``."""
        groups, out = self.groups, {}
        for baseline in self.results["study"].get("baselines") or ():
            entries = []
            for label, runs in groups.items():
                base = _baseline_label(baseline, runs, groups)
                if base is None or base == label:
                    continue
                test = stats.paired(finished_values(runs, "val_loss"), finished_values(groups[base], "val_loss"))
                if test is not None:
                    entries.append(((label, base), test["p"]))
            for (key, _), p_holm in zip(entries, stats.holm([p for _, p in entries])):
                out[key] = p_holm
        return out

    def adjust(self) -> None:
        """Holm over the exploratory comparisons collected so far (between the two passes)."""
        adjusted = stats.holm([c.p for c in self.exploratory])
        self.adjusted = {(c.label, c.against): p for c, p in zip(self.exploratory, adjusted)}

    @property
    def exploratory_count(self) -> str:
        return str(len(self.exploratory))

    def confirmatory_table(self, floor: Number | None = None, labels: dict[str, str] | None = None,
                           digits: int = 3) -> str:
        """The study's planned comparisons as a Markdown table (configuration, against, Δ [CI], Holm p, verdict,
        seeds, and with ``floor`` whether |Δ| exceeds the rounding floor); ``labels`` renames configurations."""
        labels = labels or {}
        holm = "Holm p" if not self.grown_after_looking else "Holm p (exploratory: seeds added after looking)"
        header = f"| configuration | against | Δ validation loss [{LEVEL} % CI] | {holm} | verdict | seeds |"
        rule = "|---|---|---:|---:|---|---:|"
        if floor is not None:
            header, rule = header + f" beyond the rounding floor ({floor.f(4)}) |", rule + "---|"
        rows = [header, rule]
        for label, against in self._planned():
            c = self.diff(label, against).d(digits)
            row = (f"| {labels.get(label, label)} | {labels.get(against, against)} | {c} | {c.p_holm} | {c.verdict} "
                   f"| {len(c.seeds)} |")
            if floor is not None:
                row += " yes |" if abs(c.mean) > float(floor) else " no |"
            rows.append(row)
        return "\n".join(rows)

    def verdict_table(self, against: str, labels: dict[str, str] | None = None) -> str:
        """Every configuration's verdict at equal cost against configuration ``against``, as a Markdown table:
        Δ validation loss, step time, token speedup, wall-clock speedup (its device) and MFU (:meth:`verdict`);
        ``labels`` renames configurations."""
        labels = labels or {}
        rows = ["| configuration | Δ validation loss [95 % CI], Holm p | step time | token speedup [95 % CI], Holm p | "
                "wall-clock speedup [95 % CI], Holm p | MFU [95 % CI] |", "|---|---:|---:|---:|---:|---:|"]
        devices: list[str] = []
        baseline = next((entries for entries in report_verdicts(self.results)["baselines"].values()
                         if entries and entries[0]["against"] == against), None)
        if baseline is None:
            raise KeyError(f"study {self.name!r} has no verdicts against {against!r}")
        for entry in baseline:
            verdict = Verdict(entry)
            step = entry.get("step_time_ratio")
            name = labels.get(entry["configuration"], entry["configuration"])
            rows.append(f"| {name} | {verdict.loss} | {'–' if step is None else f'{step:.2f}×'} | "
                        f"{verdict.token_short} | {verdict.wall_short} | {verdict.mfu} |")
            if entry["wall_clock_speedup"].get("device") not in (None, *devices):
                devices.append(entry["wall_clock_speedup"]["device"])
        notes = ["`>` a bound: the baseline never reached the configuration's final loss in its run."]
        if devices:
            notes.append(f"Wall clock measured on {'; '.join(devices)}.")
        return "\n".join(rows + ["", " ".join(notes)])


# ---- the tests that clear their adjustment -----------------------------------------------------------------------


@dataclass
class Cleared:
    """A test of a study that clears its adjustment: where it is from, what it compares, the interval and p."""

    study: str
    what: str
    text: str
    kind: str

    def __str__(self) -> str:
        return f"{self.study}: {self.what} {self.text}"


def tests_that_clear(studies: Iterable[Study]) -> list[Cleared]:
    """Every planned test of every study that clears its adjustment, in study order: its config's paired
    comparisons against its baselines (:meth:`Study.diff`), the effects of its factorial designs on each measure
    (:meth:`Study.effect`), its pre-registered tests (:meth:`Study.registered`, by their own decision) and its
    verdicts at equal cost (token and wall-clock speedups, their Holm p). A study whose seeds grew after looking
    (:attr:`Study.grown_after_looking`) is left out: its tests are exploratory."""
    from s2hc.study.rows import MEASURES

    out = []
    for study in studies:
        if study.grown_after_looking:
            continue
        for label, against in study._planned():
            c = study.diff(label, against)
            if c.clears:
                out.append(Cleared(study.name, f"{label} − {against}", c.cite(), c.kind))
        for index, design in enumerate(study.results["study"].get("factorial") or ()):
            for measure in MEASURES:
                for e in effects(design, {}):
                    c = study.effect(e["effect"], design=index, measure=measure)
                    if c.clears:
                        out.append(Cleared(study.name, f"{measure}, {e['effect']} ({design.get('name', index)})",
                                           c.cite(), c.kind))
        if evaluate_registered(study.results) is not None:
            test = evaluate_registered(study.results)
            each = test["each"]
            contrasts = [tuple(entry["contrast"]) for entry in test["secondary"]]
            for contrast in [*([] if each else ["primary"]), *contrasts]:
                c = study.registered(contrast)
                if c.clears:
                    what = "the registered primary test" if contrast == "primary" else f"registered, {c.label}"
                    out.append(Cleared(study.name, what, c.cite(), c.kind))
        if study.results["study"].get("baselines") and any(r.get("cost") for r in study.results["rows"]):
            for entries in report_verdicts(study.results)["baselines"].values():
                for entry in entries:
                    verdict = Verdict(entry)
                    for measure, words in (("token_speedup", "token speedup"), ("wall_clock_speedup",
                                                                                  "wall-clock speedup")):
                        if verdict.clears(measure):
                            text = verdict.token if measure == "token_speedup" else verdict.wall
                            out.append(Cleared(study.name, f"{entry['configuration']}'s {words} against "
                                               f"{entry['against']}", text, "confirmatory"))
    return out


# ---- the same runs trained twice -------------------------------------------------------------------------------


@dataclass
class Differences:
    """Per seed, one configuration's final validation loss in one study minus the same run's in another (the same
    config and seed trained again: on another CPU, thread count or commit)."""

    values: dict[int, float]

    @property
    def largest(self) -> Number:
        return Number(max(abs(v) for v in self.values.values()))

    @property
    def median(self) -> Number:
        return Number(statistics.median(abs(v) for v in self.values.values()))

    @property
    def seeds(self) -> str:
        return _seed_count(self.values)

    def __str__(self) -> str:
        return ", ".join(_minus(f"{self.values[s]:+.4f}") for s in sorted(self.values))


def same_runs(a: Study, label_a: str, b: Study, label_b: str) -> Differences:
    """``a``'s ``label_a`` minus ``b``'s ``label_b``, seed by seed, on the seeds both finished."""
    va, vb = finished_values(a.runs(label_a), "val_loss"), finished_values(b.runs(label_b), "val_loss")
    common = sorted(set(va) & set(vb))
    if not common:
        raise ValueError(f"{a.name!r} {label_a!r} and {b.name!r} {label_b!r} share no finished seed")
    return Differences({s: va[s] - vb[s] for s in common})


@dataclass
class Reruns:
    """Cells of ``docs/reruns/cells.json`` (scripts/rerun_cells.py): one committed cell per study trained again (a
    round of them: the pages hold the earlier rounds as ``reruns`` and the final one as ``final_reruns``)."""

    cells: list[dict[str, Any]]

    @property
    def largest(self) -> Number:
        return Number(max(abs(c["difference"]) for c in self.cells))

    @property
    def largest_cell(self) -> dict[str, Any]:
        """The cell that moved furthest from its row."""
        return max(self.cells, key=lambda c: abs(c["difference"]))

    def without(self, study: str) -> Reruns:
        """The cells of every other study."""
        return Reruns([c for c in self.cells if c["study"] != study])

    @property
    def studies(self) -> list[str]:
        """The studies one of whose cells was re-run, in the file's order."""
        return list(dict.fromkeys(c["study"] for c in self.cells))

    @property
    def commits(self) -> list[str]:
        """The commits the re-runs trained at (``commit`` of each cell), in order of first appearance."""
        return list(dict.fromkeys(c["commit"] for c in self.cells))

    @property
    def codes(self) -> list[str]:
        """The git trees of ``src/`` the re-runs trained with (``code``, recorded by the final round)."""
        return list(dict.fromkeys(c.get("code", "unrecorded") for c in self.cells))

    @property
    def machines(self) -> list[str]:
        """The CPU models (with their vector instructions) the re-runs trained on."""
        return list(dict.fromkeys(self._cpu(c.get("platform")) for c in self.cells))

    def cell(self, study: str) -> dict[str, Any] | None:
        """The cell of ``study`` (the last one, should a round hold two), or None."""
        found = [c for c in self.cells if c["study"] == study]
        return found[-1] if found else None

    @staticmethod
    def _cpu(platform: dict[str, Any] | None) -> str:
        """A platform record's CPU model and vector instructions."""
        where = platform or {}
        return f"{where.get('cpu', 'unrecorded')}, {where.get('cpu_capability', '?')}"

    @classmethod
    def place(cls, platform: dict[str, Any] | None) -> str:
        """The CPU and the thread count."""
        return f"{cls._cpu(platform)}, {(platform or {}).get('threads', '?')} thread(s)"

    @staticmethod
    def same_place(cell: dict[str, Any]) -> bool:
        """The re-run trained on the committed row's CPU model with its thread count (the final round records both)."""
        ran, committed = cell.get("platform") or {}, cell.get("committed_platform") or {}
        return bool(committed) and all(ran.get(k) == committed.get(k) for k in ("cpu", "threads"))

    @staticmethod
    def at_row_commit(cell: dict[str, Any]) -> bool:
        """The cell trained at the commit its row records (for a study run from a snapshot before commits were
        recorded, the commit that added its results)."""
        return cell["commit"] in (cell.get("committed_at"), RESULTS_COMMITTED_IN.get(cell["study"]))

    def where(self, same: bool) -> Reruns:
        """The cells re-run where their committed rows trained (``same``), or elsewhere."""
        return Reruns([c for c in self.cells if self.same_place(c) == same])

    def table(self) -> str:
        """One row per cell; with a column for where the committed row trained when the cells record it."""
        committed_where = any("committed_platform" in c for c in self.cells)
        head = "| study | run | committed (at) | re-run | difference | where the re-run trained |"
        rule = "|---|---|---:|---:|---:|---|"
        if committed_where:
            head, rule = head + " where the committed row trained |", rule + "---|"
        rows = [head, rule]
        for c in self.cells:
            difference = _minus(f"{c['difference']:+.5f}")
            committed_at = c["committed_at"] or RESULTS_COMMITTED_IN.get(c["study"], "not recorded")
            row = (f"| {c['study']} | `{c['name']}` | {c['committed']:.5f} (`{committed_at}`) | "
                   f"{c['rerun']:.5f} | {difference} | {self.place(c.get('platform'))}, `{c['commit']}` |")
            if committed_where:
                committed_on = c.get("committed_platform")
                row += f" {self.place(committed_on) if committed_on else 'not recorded'} |"
            rows.append(row)
        return "\n".join(rows)


# ---- rendering -------------------------------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    """The JSON of ``path``; ValueError in one line naming the file and where it is damaged."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
                         "restore it from git (git checkout -- FILE) or rerun its study") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot be read ({error})") from None


def load_studies(docs: Path) -> dict[str, Study]:
    """Every ``docs/*/results.json`` as a :class:`Study`, by directory name (``-`` as ``_``); ValueError naming a
    damaged file."""
    studies = {}
    for path in sorted(Path(docs).glob("*/results.json")):
        history = path.parent / "seed_history.json"
        studies[path.parent.name.replace("-", "_")] = Study(
            path.parent.name, read_json(path), history=read_json(history) if history.is_file() else None)
    return studies


def cite(value: str, source: str) -> str:
    """A number quoted from elsewhere (a paper): rendered as given; ``source`` says where it is from (kept in the
    template, where a reviewer reads it)."""
    if not source:
        raise ValueError("cite() needs the source of the number")
    return str(value)


def num(value: Any) -> str:
    """A literal number that is not a measurement (a layer count named by a config, a section's number)."""
    return str(value)


def _each(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def claim(condition: Any, statement: str, *, interval: Any = None, clears: Any = None, short: Any = None) -> str:
    """``{% do claim(condition, "what the prose says") %}``: stops the rendering when the condition is false (the data
    no longer say what the words beside it do). A claim about a difference tests its interval or its test, not
    only its mean:

    - ``interval=c`` (a :class:`Comparison` or a list of them): each {level} % interval excludes 0;
    - ``clears=c``: each test clears its adjustment (:attr:`Comparison.clears`: adjusted p below alpha, a
      pre-registered test by its own decision);
    - ``short=c``: each does not (what "indistinguishable", "short of its adjustment" say).
    """
    failed = [f"{c.label} − {c.against} {c} does not exclude 0" for c in _each(interval) if not c.excludes_zero]
    failed += [f"{c.label} − {c.against} {c.cite()} does not clear its adjustment" for c in _each(clears)
               if not c.clears]
    failed += [f"{c.label} − {c.against} {c.cite()} clears its adjustment" for c in _each(short) if c.clears]
    if not condition or failed:
        why = f" ({'; '.join(failed)})" if failed else ""
        raise ValueError(f"the data no longer say what the prose does: {statement!r}{why}; rewrite the prose")
    return ""


def params_at(study: Study, families: list[str]) -> dict[str, dict[str, Any]]:
    """``s2hc params``'s rows (:func:`s2hc.params.param_table`) for ``families`` at the study's model shape (its
    preset and overrides) and its rows' stream count: ``hc_params`` (the connections), ``head_params``,
    ``with_head`` (what a study row's ``hc_params`` counts), ``vs_mhc``, ``vs_mhc_with_head``."""
    from s2hc.models import get_preset
    from s2hc.params import param_table

    train = study.results["study"]["train"]
    config = get_preset(train["preset"], **{k: v for k, v in (train.get("model_overrides") or {}).items()
                                             if k in ("dim", "n_layers")})
    n_streams = max(row["n_streams"] for row in study.results["rows"])
    rows = param_table(families, layers=config.n_layers, dim=config.dim, n_streams=n_streams)
    return {row["label"]: row for row in rows}


def namespace(studies: dict[str, Study], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a template's expressions may name: besides the studies, ``studies`` (all of them, in order) and
    ``tests_that_clear()`` (:func:`tests_that_clear` over them)."""
    return {**studies, "studies": list(studies.values()),
            "tests_that_clear": lambda: tests_that_clear(studies.values()),
            "level": LEVEL, "cite": cite, "num": num, "claim": claim, "Number": Number, "mean": statistics.fmean,
            "same_runs": same_runs, "params_at": params_at,
            "min": min, "max": max, "all": all, "any": any, "len": len, "abs": abs,
            "round": round, "sorted": sorted, **(extra or {})}


def check_template(text: str, where: str) -> None:
    """ValueError naming ``where`` and the line when a digit stands in the prose outside a Jinja tag, code, a link
    target, a comment or a table's separator row: every figure in a finding comes from an expression."""
    literal = _TAG.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    literal = _EXEMPT.sub(lambda m: re.sub(r"\S", " ", m.group(0)), literal)
    for number, line in enumerate(literal.splitlines(), 1):
        match = _LOOSE_DIGIT.search(line)
        if match:
            raise ValueError(f"{where}:{number}: a number typed into the prose ({text.splitlines()[number - 1]!r}); "
                             "write it as an expression over the committed JSON ({{ ... }}), or in code")


def _environment(texts: dict[str, str], names: dict[str, Any]) -> jinja2.Environment:
    """Jinja2 over ``texts`` (``{where: text}``): Markdown out (no escaping), a name a template does not have is an
    error, and a line holding only statements (``{% set %}``, ``{% for %}``, ``{% do %}``) leaves no line."""
    environment = jinja2.Environment(loader=jinja2.FunctionLoader(lambda where: (texts[where], where, lambda: True)),
                                     undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
                                     trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.do"])
    environment.globals.update(names)
    return environment


def _evaluate(environment: jinja2.Environment, where: str) -> str:
    """The template ``where`` rendered; ValueError naming it, the line and what failed there."""
    try:
        return environment.get_template(where).render()
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"{where}:{error.lineno}: {error.message}") from None
    except Exception as error:
        number, trace = None, error.__traceback__
        while trace is not None:  # Jinja gives the template's frames its name and lines
            if trace.tb_frame.f_code.co_filename == where:
                number = trace.tb_lineno
            trace = trace.tb_next
        line = environment.loader.get_source(environment, where)[0].splitlines()[number - 1].strip() if number else ""
        raise ValueError(f"{where}:{number}: {line}: {type(error).__name__}: {error}") from None


def render(texts: dict[str, str], studies: dict[str, Study], extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Every template of ``texts`` (``{where: text}``) rendered by Jinja2: a first pass over all of them collects the
    exploratory comparisons, a second renders them Holm-adjusted over every page. ValueError for a typed number
    (:func:`check_template`) or a failing expression, statement or claim, naming the template and line."""
    for where, text in texts.items():
        check_template(text, where)
    environment = _environment(texts, namespace(studies, extra))
    for where in texts:
        _evaluate(environment, where)
    for study in studies.values():
        study.adjust()
    return {where: _evaluate(environment, where) for where in texts}


def render_pages(root: Path, write: bool = False) -> dict[str, str]:
    """Every page of :data:`PAGES` as its template renders it over ``root/docs``'s studies: ``{page: text}``;
    with ``write``, written (atomically) where it differs."""
    root = Path(root)
    reruns = root / "docs" / "reruns" / "cells.json"
    cells = read_json(reruns)["cells"] if reruns.is_file() else None
    # the earlier rounds (no "round": older commits, another CPU) and the final one (scripts/rerun_cells.py today)
    extra = {} if cells is None else {"reruns": Reruns([c for c in cells if "round" not in c]),
                                      "final_reruns": Reruns([c for c in cells if c.get("round") == "final"]),
                                      "control_reruns": Reruns([c for c in cells if c.get("round") == "control"])}
    rendered = render({template: (root / template).read_text() for template in PAGES}, load_studies(root / "docs"),
                      extra)
    pages = {}
    for template, page in PAGES.items():
        body = rendered[template]
        if page == "README.md":
            current = (root / page).read_text()
            start, end = current.index(README_START) + len(README_START), current.index(README_END)
            body = current[:start] + "\n" + body.strip("\n") + "\n" + current[end:]
        pages[page] = body
        if write and (not (root / page).is_file() or (root / page).read_text() != body):
            atomic_write_text(root / page, body)
    return pages
