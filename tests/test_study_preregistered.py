"""A study's own seeds per setting, and its pre-registered test (``s2hc.study.preregistered``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from scipy import stats as scipy_stats

from s2hc.config import config_path
from s2hc.study import parse_spec
from s2hc.study.preregistered import evaluate, report_lines
from s2hc.study.report import build_report
from s2hc.study.runner import _grows, prepare

DOCS = Path(__file__).resolve().parents[1] / "docs"

# ------------------------------------------------------------------------------------------- seeds per setting


def test_a_setting_with_its_own_seeds_trains_only_those():
    spec = parse_spec({"families": ["residual", "mhc"], "seeds": 1,
                       "settings": [{"lr": 1e-3}, {"lr": 2e-3, "seeds": [0, 3]}]})
    assert [c.run_name(s) for c, s in spec.runs()] == [
        "residual-lr-0.001-seed0", "mhc-n4-lr-0.001-seed0", "residual-lr-0.002-seed0", "mhc-n4-lr-0.002-seed0",
        "residual-lr-0.002-seed3", "mhc-n4-lr-0.002-seed3"]
    assert spec.configurations[2].slug == "residual-lr-0.002"  # the seeds name no run: the names stay
    recorded = spec.to_dict()["configurations"]
    assert "seeds" not in recorded[0] and recorded[2]["seeds"] == [0, 3]


def test_a_study_grows_by_the_seeds_of_one_setting(tmp_path):
    base = {"families": ["residual", "mhc"], "seeds": 1, "settings": [{"lr": 1e-3}, {"lr": 2e-3}]}
    prepare(parse_spec(base), tmp_path)
    grown = {**base, "settings": [{"lr": 1e-3}, {"lr": 2e-3, "seeds": 3}]}
    runs = prepare(parse_spec(grown), tmp_path)
    assert len(runs) == 2 + 2 * 3
    shrunk = {**base, "seeds": [1], "settings": [{"lr": 1e-3}, {"lr": 2e-3, "seeds": 3}]}  # drops lr 1e-3 seed 0
    with pytest.raises(ValueError, match="a study may only grow"):
        prepare(parse_spec(shrunk), tmp_path)


def test_the_shipped_depth_study_grows_from_the_committed_one():
    """The committed docs/depth grid is kept whole by the shipped config (a study may only grow), whose 32-layer
    cells have their own seeds, more than the grid's default."""
    committed = json.loads((DOCS / "depth" / "study.json").read_text())["grid"]
    spec = parse_spec(yaml.safe_load(config_path("study-depth").read_text()))
    assert _grows(committed, json.loads(json.dumps(spec.grid())))
    deep = [c for c in spec.configurations if dict(c.settings).get("model_overrides.n_layers") == 32]
    assert deep and all(len(spec.seeds_of(c)) > len(spec.seeds) for c in deep)  # their own seeds


@pytest.mark.parametrize("seeds, message", [
    ([], "settings[0] seeds is empty"),
    ([1, 1], "settings[0] seeds lists a seed twice"),
    (0, "settings[0] seeds"),
    ("x", "settings[0] seeds"),
])
def test_bad_seeds_of_a_setting_are_refused_naming_it(seeds, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec({"families": ["residual"], "settings": [{"lr": 1e-3, "seeds": seeds}]})


# --------------------------------------------------------------------------------------------- pre-registration

REGISTERED = {
    "registered": "2026-12-04",
    "hypothesis": "the residual start lowers the loss",
    "contrasts": [["mhc:gate_init=residual", "mhc"], ["s2hc:gate_init=residual", "s2hc"]],
    "alternative": "less",
    "alpha": 0.05,
}
STUDY = {"train": {"model_overrides": {"stream_reduce": "mean"}},
         "families": ["mhc", "mhc:gate_init=residual", "s2hc", "s2hc:gate_init=residual"], "seeds": 5,
         "preregistered": REGISTERED}


def test_the_registration_is_checked_and_resolved_to_labels():
    spec = parse_spec(STUDY)
    assert spec.preregistered["contrasts"] == [["mhc (gate_init=residual) n=4", "mhc n=4"],
                                               ["s2hc (gate_init=residual) n=4", "s2hc n=4"]]
    assert (spec.preregistered["primary"], spec.preregistered["secondary"]) == ("mean", "holm")  # the defaults
    assert spec.to_dict()["preregistered"] == spec.preregistered
    assert "preregistered" not in parse_spec({"families": ["mhc"]}).to_dict()


@pytest.mark.parametrize("change, message", [
    ({"registered": None}, "'registered' is required"),
    ({"hypothesis": ""}, "'hypothesis' is required"),
    ({"contrasts": []}, "'contrasts' is required"),
    ({"alpha": 0.5}, "alpha must be a number in (0, 0.5)"),
    ({"alpha": True}, "alpha must be a number"),
    ({"alternative": "lower"},
     "alternative must be one of ['less', 'greater', 'two-sided', 'equivalence'], got 'lower'"),
    ({"measure": "loss"}, "measure must be one of"),
    ({"tests": 3}, "unknown key(s) ['tests']"),
    ({"contrasts": [["hc", "mhc"]]}, "'hc' matches none of the study's configurations"),
    ({"contrasts": [["mhc", "mhc"]]}, "compares 'mhc n=4' with itself"),
    ({"contrasts": [["mhc"]]}, "contrasts[0] must be a [first, second] pair"),
    ({"contrasts": [["mhc", "s2hc"], ["mhc", "s2hc"]]}, "a contrast is listed twice"),
])
def test_a_bad_registration_is_refused_in_one_line(change, message):
    registered = {k: v for k, v in {**REGISTERED, **change}.items() if v is not None}
    with pytest.raises(ValueError) as error:
        parse_spec({**STUDY, "preregistered": registered})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_contrast_that_matches_one_configuration_per_setting_is_ambiguous():
    with pytest.raises(ValueError, match="matches 2"):
        parse_spec({**STUDY, "settings": [{"lr": 1e-3}, {"lr": 2e-3}]})


def _results(values: dict[str, dict[int, float]]) -> dict:
    spec = parse_spec(STUDY)
    rows = [{"label": label, "seed": seed, "status": "finished", "val_loss": value, "diagnostics": None}
            for label, per_seed in values.items() for seed, value in per_seed.items()]
    return {"study": spec.to_dict(), "rows": rows}


def test_the_tests_match_scipy_on_the_per_seed_differences():
    rng = random.Random(3)
    labels = ["mhc n=4", "mhc (gate_init=residual) n=4", "s2hc n=4", "s2hc (gate_init=residual) n=4"]
    values = {label: {s: 5 + rng.gauss(0, 0.05) - 0.03 * ("residual" in label) for s in range(5)} for label in labels}
    del values["s2hc n=4"][4]  # one run missing: the primary test keeps the seeds every configuration has
    test = evaluate(_results(values))
    d_mhc = [values[labels[1]][s] - values[labels[0]][s] for s in range(5)]
    d_s2hc = [values[labels[3]][s] - values[labels[2]][s] for s in range(4)]
    pooled = [(a + b) / 2 for a, b in zip(d_mhc, d_s2hc)]
    primary = test["primary"]
    assert primary["seeds"] == [0, 1, 2, 3] and primary["mean"] == pytest.approx(sum(pooled) / 4)
    assert primary["p"] == pytest.approx(scipy_stats.ttest_1samp(pooled, 0, alternative="less").pvalue)
    assert primary["rejected"] == (primary["p"] < 0.05)
    ps = [scipy_stats.ttest_1samp(d, 0, alternative="less").pvalue for d in (d_mhc, d_s2hc)]
    holm = sorted(ps)
    holm = [min(1, 2 * holm[0]), min(1, max(2 * holm[0], holm[1]))]
    assert sorted(t["p_holm"] for t in test["secondary"]) == pytest.approx(holm)
    assert [len(t["seeds"]) for t in test["secondary"]] == [5, 4]


def test_the_report_gives_the_registered_test_first_with_its_decision():
    labels = ["mhc n=4", "mhc (gate_init=residual) n=4", "s2hc n=4", "s2hc (gate_init=residual) n=4"]
    # a clear effect (the residual start 0.05 lower, the seeds' spread shared): rejected
    values = {label: {s: 5 + 0.01 * s + 0.001 * (s % 2) * i - 0.05 * ("residual" in label) for s in range(5)}
              for i, label in enumerate(labels)}
    results = _results(values)
    lines = report_lines(results)
    assert lines[0] == "## Pre-registered test (confirmatory)"
    primary = next(line for line in lines if line.startswith("| primary"))
    assert "H0 rejected" in primary and "| 5 |" in primary
    # in a whole report (the committed start study's rows, given this registration): first, before the tables
    committed = json.loads((DOCS / "start" / "results.json").read_text())
    committed["study"]["preregistered"] = results["study"]["preregistered"]
    text = build_report(committed, {}, None)
    assert text.index("Pre-registered test") < text.index("Paired differences")
    # no effect: not rejected, and said so
    flat = {label: {s: 5 + 0.01 * s + 0.002 * ((s + i) % 2) for s in range(5)} for i, label in enumerate(labels)}
    assert "not rejected" in next(line for line in report_lines(_results(flat)) if line.startswith("| primary"))


def test_without_a_registration_there_is_no_section_and_too_few_seeds_say_so():
    assert report_lines({"study": {}, "rows": []}) == []
    one_seed = _results({label: {0: 5.0} for label in ["mhc n=4", "mhc (gate_init=residual) n=4", "s2hc n=4",
                                                          "s2hc (gate_init=residual) n=4"]})
    assert "Not enough seeds" in "\n".join(report_lines(one_seed))
