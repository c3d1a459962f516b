"""A study's axes beyond the families (``settings``), its two-level factorial designs (main effects and
interactions per seed, against an independent least-squares fit), the matrices' trajectory over training, and the
figures a sweep draws."""

from __future__ import annotations

import copy
import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2hc.cli import main
from s2hc.study import parse_spec
from s2hc.study.factorial import design_lines, effects
from s2hc.study.figures import numeric_setting
from s2hc.study.measure import trajectory
from s2hc.study.report import _baseline_label
from s2hc.study.rows import by_configuration, smallest_deviation_sigma
from s2hc.study.runner import prepare

RECIPE = {
    "train": {"max_steps": 5},
    "families": ["residual", "mhc", "s2hc", "s2hc:projection_init=normal"],
    "settings": [{"weight_decay_on": "matrices"}, {"weight_decay_on": "all", "weight_decay": 1.43}],
    "factorial": [{"name": "recipe", "factors": {"projection_init": ["zero", "normal"],
                                                  "weight_decay_on": ["matrices", "all"]},
                   "where": {"family": "s2hc"}},
                  {"factors": {"family": ["mhc", "s2hc"], "weight_decay_on": ["matrices", "all"]},
                   "where": {"projection_init": "zero"}}],
    "seeds": 2,
}


# ------------------------------------------------------------------------------------------------ settings


def test_settings_cross_every_family_and_reach_the_runs():
    spec = parse_spec(RECIPE)
    assert [c.label for c in spec.configurations] == [
        "residual [weight_decay_on=matrices]", "mhc n=4 [weight_decay_on=matrices]",
        "s2hc n=4 [weight_decay_on=matrices]", "s2hc (projection_init=normal) n=4 [weight_decay_on=matrices]",
        "residual [weight_decay_on=all, weight_decay=1.43]", "mhc n=4 [weight_decay_on=all, weight_decay=1.43]",
        "s2hc n=4 [weight_decay_on=all, weight_decay=1.43]",
        "s2hc (projection_init=normal) n=4 [weight_decay_on=all, weight_decay=1.43]"]
    last = spec.configurations[-1]
    assert last.run_name(1) == "s2hc-n4-projection_init-normal-weight_decay_on-all-weight_decay-1.43-seed1"
    config = spec.run_config(last, 1, "unused")
    assert (config.weight_decay_on, config.weight_decay, config.max_steps) == ("all", 1.43, 5)
    assert spec.run_config(spec.configurations[0], 0, "unused").weight_decay == 0.1  # the default, untouched


def test_model_override_settings_merge_into_the_trains_and_name_the_depth():
    spec = parse_spec({"train": {"model_overrides": {"dim": 64, "stream_reduce": "mean"}},
                       "families": ["residual", "hc"],
                       "settings": [{"model_overrides": {"n_layers": 2}}, {"model_overrides": {"n_layers": 3}}]})
    assert [c.label for c in spec.configurations] == [
        "residual [n_layers=2]", "hc n=4 [n_layers=2]", "residual [n_layers=3]", "hc n=4 [n_layers=3]"]
    model = spec.run_config(spec.configurations[3], 0, "unused").model_config()
    assert (model.n_layers, model.dim, model.stream_reduce) == (3, 64, "mean")
    assert spec.train["model_overrides"] == {"dim": 64, "stream_reduce": "mean"}  # the shared settings kept
    assert spec.configurations[3].slug == "hc-n4-n_layers-3"


def test_a_grid_without_settings_records_what_it_always_did(tmp_path):
    spec = parse_spec({"families": ["residual", "mhc"], "seeds": 2})
    assert all(c.settings == () for c in spec.configurations)
    assert "settings" not in spec.to_dict()["configurations"][0] and "factorial" not in spec.to_dict()
    prepare(spec, tmp_path)  # a study recorded before settings existed grows into the same grid
    grown = prepare(parse_spec({"families": ["residual", "mhc", "s2hc"], "seeds": 2}), tmp_path)
    assert len(grown) == 6


def test_a_study_grows_by_a_setting(tmp_path):
    base = {"families": ["residual", "mhc"], "settings": [{"lr": 1e-3}], "seeds": 2}
    prepare(parse_spec(base), tmp_path)
    grown = prepare(parse_spec({**base, "settings": [{"lr": 1e-3}, {"lr": 2e-3}]}), tmp_path)
    assert [r.name for r in grown][:4] == ["residual-lr-0.001-seed0", "mhc-n4-lr-0.001-seed0",
                                           "residual-lr-0.002-seed0", "mhc-n4-lr-0.002-seed0"]


@pytest.mark.parametrize("settings_value, message", [
    ({"lr": 1e-3}, "'settings' must be a non-empty list of mappings"),
    ([], "'settings' must be a non-empty list of mappings"),
    (["lr=1e-3"], "settings[0]: expected a mapping of TrainConfig keys, got 'lr=1e-3'"),
    ([{"seed": 3}], "settings[0] sets ['seed'], which the grid sets"),
    ([{"family": "mhc"}], "settings[0] sets ['family'], which the grid sets"),
    ([{"lr": 1e-3}, {"lr": 1e-3}], "settings[1] repeats settings[0]"),
    ([{"model_overrides": 8}], "model_overrides must be a non-empty mapping of ModelConfig keys, got 8"),
    ([{"lr": -1}], "residual [lr=-1]: lr must be"),
    ([{"model_overrides": {"n_layer": 3}}], "residual [n_layer=3]: "),
])
def test_bad_settings_are_refused_naming_the_entry(settings_value, message):
    with pytest.raises(ValueError) as error:
        parse_spec({"families": ["residual", "mhc"], "settings": settings_value})
    assert message in str(error.value)


# Two settings entries that train the same runs are refused, naming both entries: written alike, in another key
# order, as a YAML 1.1 string, as the value train: or the default already gives, or as the model's own size.
DUPLICATE_SETTINGS = [  # (train:, settings:, the indices named)
    ({}, [{"lr": 1e-3, "weight_decay": 0.1}, {"weight_decay": 0.1, "lr": 1e-3}], "settings[1] repeats settings[0]"),
    ({}, [{"model_overrides": {"n_layers": 2}}, {"model_overrides.n_layers": 2}], "settings[1] repeats settings[0]"),
    ({}, [{"weight_decay_on": "all"}, {"lr": 1e-3}, {"weight_decay_on": "all"}], "settings[2] repeats settings[0]"),
    ({}, [{"lr": 1e-3}, {"lr": "1e-3"}], "settings[0] and settings[1] train the same runs"),
    ({"lr": 1e-3}, [{"lr": 1e-3}, {}], "settings[0] and settings[1] train the same runs"),
    ({}, [{"weight_decay_on": "all"}, {"weight_decay_on": "matrices"}, {}], "settings[1] and settings[2] train"),
    ({}, [{"model_overrides": {"n_layers": 4}}, {}], "settings[0] and settings[1] train the same runs"),  # tiny's 4
]


@pytest.mark.parametrize("train, settings_value, message", DUPLICATE_SETTINGS)
def test_duplicate_settings_are_refused_naming_each_index(train, settings_value, message):
    with pytest.raises(ValueError) as error:
        parse_spec({"train": {"preset": "tiny", **train}, "families": ["residual", "mhc"], "settings": settings_value})
    assert message in str(error.value) and "list each setting once" in str(error.value)
    assert "\n" not in str(error.value)


def test_settings_that_differ_only_for_some_families_are_kept():
    """A setting that changes every run is no duplicate, whatever the order of the entries."""
    spec = parse_spec({"families": ["residual", "mhc"], "settings": [{}, {"lr": 1e-3}, {"weight_decay_on": "all"}]})
    assert len(spec.configurations) == 6


def test_a_configuration_is_paired_with_the_baseline_of_its_own_settings():
    spec = parse_spec(RECIPE)
    rows = [{"label": c.label, "family": c.family, "options": dict(c.options), "n_streams": c.n_streams,
             "settings": dict(c.settings)} for c in spec.configurations]
    groups = by_configuration(rows)
    decayed = groups["s2hc (projection_init=normal) n=4 [weight_decay_on=all, weight_decay=1.43]"]
    assert _baseline_label("residual", decayed, groups) == "residual [weight_decay_on=all, weight_decay=1.43]"
    assert _baseline_label("mhc", decayed, groups) == "mhc n=4 [weight_decay_on=all, weight_decay=1.43]"
    plain = {"label": "mhc n=4", "family": "mhc", "options": {}, "n_streams": 4}  # a row of an older study
    assert _baseline_label("mhc", [plain], {"mhc n=4": [plain]}) == "mhc n=4"


# ----------------------------------------------------------------------------------------------- factorial


def test_designs_resolve_their_cells_with_the_families_defaults():
    spec = parse_spec(RECIPE)
    recipe, constraint = spec.factorial
    assert recipe["name"] == "recipe" and constraint["name"] == "family × weight_decay_on"
    assert [(c["levels"], c["label"]) for c in recipe["cells"]] == [
        ([0, 0], "s2hc n=4 [weight_decay_on=matrices]"),
        ([0, 1], "s2hc n=4 [weight_decay_on=all, weight_decay=1.43]"),
        ([1, 0], "s2hc (projection_init=normal) n=4 [weight_decay_on=matrices]"),
        ([1, 1], "s2hc (projection_init=normal) n=4 [weight_decay_on=all, weight_decay=1.43]")]
    # mhc has no projection_init of its own: the connection's default (zero) puts it in the cells
    assert constraint["cells"][1]["label"] == "mhc n=4 [weight_decay_on=all, weight_decay=1.43]"


@pytest.mark.parametrize("design, message", [
    ({"factors": {"projection_init": ["zero", "normal"]}}, "must match exactly one configuration; it matches 4 (mhc"),
    ({"factors": {"projection_init": ["zero", "uniform"], "weight_decay_on": ["matrices", "all"]},
      "where": {"family": "s2hc"}}, "weight_decay_on': 'matrices'} (with {'family': 's2hc'}) must match exactly one "
     "configuration; it matches none"),
    ({"factors": {"projection_init": ["zero"]}}, "factor 'projection_init' needs two different levels"),
    ({"factors": {"colour": ["red", "blue"]}}, "'colour' is not a family, option, TrainConfig key"),
    ({"factors": {}}, "'factors' must map 1 to 4 keys"),
    ({"levels": {}}, "a design is a mapping with 'factors'"),
    ({"factors": {"family": ["mhc", "s2hc"]}, "where": ["s2hc"]}, "'where' must be a mapping"),
])
def test_bad_designs_are_refused_naming_the_design(design, message):
    with pytest.raises(ValueError) as error:
        parse_spec({**RECIPE, "factorial": [design]})
    assert "factorial[0]" in str(error.value) and message in str(error.value)


def _ols_effects(design: dict, per_cell: dict[str, dict[int, float]], seed: int) -> dict[str, float]:
    """An independent reference: least squares on the ±1-coded factors and their pairwise products; with that
    coding a main effect is twice its coefficient and a (not halved) interaction four times its coefficient."""
    factors = list(design["factors"])
    pairs = list(itertools.combinations(range(len(factors)), 2))
    rows, targets = [], []
    for cell in design["cells"]:
        x = [2 * level - 1 for level in cell["levels"]]
        rows.append([1.0, *x, *(x[i] * x[j] for i, j in pairs)])
        targets.append(per_cell[cell["label"]][seed])
    beta = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)[0]
    out = {}
    for i, key in enumerate(factors):
        low, high = design["factors"][key]
        out[f"{key}: {low} → {high}"] = 2 * beta[1 + i]
    for k, (i, j) in enumerate(pairs):
        out[f"{factors[i]} × {factors[j]}"] = 4 * beta[1 + len(factors) + k]
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_effects_match_a_least_squares_fit(n_factors, seed):
    """Saturated 2^k designs (k ≤ 2) give exact effects; for k = 3 the two-way model is not saturated, but with
    orthogonal ±1 columns its coefficients are still the averaged contrasts."""
    rng = random.Random(seed)
    design = {"factors": {f"f{i}": ["a", "b"] for i in range(n_factors)},
              "cells": [{"levels": list(levels), "label": f"cell{index}"}
                        for index, levels in enumerate(itertools.product(range(2), repeat=n_factors))]}
    seeds = [0, 1, 2]
    per_cell = {c["label"]: {s: rng.gauss(5, 1) for s in seeds} for c in design["cells"]}
    found = effects(design, per_cell)
    assert [e["kind"] for e in found] == ["main"] * n_factors + ["interaction"] * (n_factors * (n_factors - 1) // 2)
    for s in seeds:
        reference = _ols_effects(design, per_cell, s)
        for e in found:
            assert e["per_seed"][s] == pytest.approx(reference[e["effect"]], abs=1e-9)


def test_effects_use_only_the_seeds_every_cell_finished():
    design = {"factors": {"a": [0, 1]}, "cells": [{"levels": [0], "label": "x"}, {"levels": [1], "label": "y"}]}
    found = effects(design, {"x": {0: 1.0, 1: 2.0, 2: 3.0}, "y": {0: 1.5, 2: 2.0}})
    assert found == [{"effect": "a: 0 → 1", "kind": "main", "per_seed": {0: 0.5, 2: -1.0}}]


def _row(label: str, seed: int, val_loss: float, sigma: float | None = None, **extra) -> dict:
    diagnostics = None if sigma is None else {
        "inert_layers": [0], "deviation_singular_values": {"mean": [[1.0, 0.2], [1.0, sigma], [0.9, sigma + 0.1]]}}
    return {"label": label, "seed": seed, "status": "finished", "val_loss": val_loss, "diagnostics": diagnostics,
            **extra}


def test_the_report_section_gives_cells_effects_and_holm():
    design = {"name": "recipe", "factors": {"init": ["zero", "normal"], "decay": ["ours", "theirs"]}, "where": {},
              "cells": [{"levels": [a, b], "label": f"c{a}{b}"} for a in range(2) for b in range(2)]}
    rows = []
    for seed in range(4):
        noise = 0.01 * seed  # shared by every cell of a seed: pairing removes it
        for a, b in itertools.product(range(2), repeat=2):
            rows.append(_row(f"c{a}{b}", seed, 5.0 + 0.1 * a + noise + 0.001 * (seed % 2) * b, sigma=0.9 - 0.2 * a))
    lines = design_lines({"study": {"factorial": [design]}, "rows": rows})
    text = "\n".join(lines)
    assert "### recipe" in text and "| c11 | 5.1155 ± 0.0132 | 0.7000 ± 0.0000 |" in text
    effect = next(line for line in lines if "| validation loss | init: zero → normal |" in line)
    assert "+0.1000 [+0.1000, +0.1000]" in effect and "distinguishable" in effect  # the shared noise cancelled
    sigma = next(line for line in lines if "| smallest deviation σ (interior) | init: zero → normal |" in line)
    assert "-0.2000" in sigma
    decay = next(line for line in lines if "| validation loss | decay: ours → theirs |" in line)
    assert "within seed noise" in decay and decay.endswith("| 4 |")


def test_no_designs_no_section():
    assert design_lines({"study": {}, "rows": []}) == []


def test_smallest_sigma_leaves_out_the_connections_that_cannot_change_the_output():
    assert smallest_deviation_sigma(_row("x", 0, 5.0, sigma=0.5)) == 0.5  # layer 0's 0.2 is inert
    assert smallest_deviation_sigma(_row("x", 0, 5.0)) is None
    older = _row("x", 0, 5.0, sigma=0.5)
    del older["diagnostics"]["inert_layers"]
    assert smallest_deviation_sigma(older) is None


# ---------------------------------------------------------------------------------------------- trajectory


def test_the_trajectory_reads_the_diagnostics_records_over_the_interior_connections():
    record = {"deviation_singular_values_mean": [[1.0, 0.1], [0.99, 0.8], [0.95, 0.7]], "inert_layers": [0],
              "rotation_angle_mean": [170.0, 20.0, 35.0], "composite_forward_amax_max": [1.0, 1.5, 1.2],
              "stream_similarity_mean": [1.0, 0.9, 0.8, 0.6]}
    records = [{"step": 0, "weight_decay": {}}, {"step": 5, "loss": 3.0},
               {"step": 10, "diagnostics": record}, {"step": 20, "diagnostics": {"grad_norm": {}}}]
    assert trajectory(records) == {"steps": [10], "smallest_deviation_singular_value": [0.7],
                                   "rotation_angle": [35.0], "composite_forward_amax": [1.5],
                                   "stream_similarity_output": [0.6]}
    assert trajectory(records[:2]) is None


# ------------------------------------------------------------------------------------------------- figures


def _sweep_results() -> dict:
    spec = parse_spec({"families": ["residual", "hc"], "seeds": 2,
                       "settings": [{"model_overrides": {"n_layers": 2}}, {"model_overrides": {"n_layers": 4}}]})
    rows = []
    for seed in spec.seeds:
        for c in spec.configurations:
            depth = dict(c.settings)["model_overrides.n_layers"]
            rows.append({
                "name": c.run_name(seed), "label": c.label, "family": c.family, "options": dict(c.options),
                "n_streams": c.n_streams, "seed": seed, "settings": dict(c.settings), "status": "finished",
                "val_loss": 5.0 - 0.1 * depth + 0.01 * seed, "train_loss": 5.0, "steps": 4, "tokens": 10,
                "grad_norm": {"mean": 1.0, "median": 1.0, "p95": 2.0, "max": 3.0 * depth}, "loss_spike": 0.0,
                "curves": {"train": [[2, 5.5], [4, 5.0]], "val": [[4, 5.0]]}, "params": 10, "hc_params": 0,
                "diagnostics": None, "rotations": None, "trajectory": None, "version": 3,
                "timing": {"tokens_per_s": 100.0, "median_step_s": 0.1}})
    return {"study": spec.to_dict(), "rows": rows, "environment": {}}


def test_a_sweep_over_one_numeric_setting_draws_against_it(tmp_path):
    results = _sweep_results()
    assert numeric_setting(results) == "model_overrides.n_layers"
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["study", "--report-only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "![loss, gradient norm and composite gain against n_layers](figures/against_setting.png)" in report
    assert "![paired differences against residual, per seed](figures/paired_differences.png)" in report
    assert "| hc n=4 [n_layers=4] | residual [n_layers=4] |" in report  # paired within the depth
    assert (tmp_path / "figures" / "against_setting.png").stat().st_size > 0


def test_no_sweep_figure_without_one_numeric_axis():
    results = _sweep_results()
    two_keys = copy.deepcopy(results)
    two_keys["study"]["configurations"][0]["settings"] = {"lr": 1e-3}
    words = copy.deepcopy(results)
    for c in words["study"]["configurations"]:
        c["settings"] = {"weight_decay_on": "all"}
    assert numeric_setting(two_keys) is None and numeric_setting(words) is None
    assert numeric_setting({"study": {"configurations": [{"label": "mhc n=4"}]}}) is None
