"""What a study directory records and what it refuses: the registered test and the training settings held against
the runs they were made for, the commit of every invocation, and one line (not a traceback) for a value the study
cannot read, in its config or in a hand-edited ``results.json``."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from s2hc.cli import main
from s2hc.study import cost, parse_spec, runner
from s2hc.study.preregistered import evaluate, report_lines
from s2hc.study.report import _baseline_label, build_report, paired_table, verdicts

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGISTERED = {
    "registered": "2026-12-04",
    "hypothesis": "the residual start lowers the loss",
    "contrasts": [["mhc:gate_init=residual", "mhc"]],
    "alternative": "less",
    "alpha": 0.05,
}
STUDY = {"train": {"model_overrides": {"stream_reduce": "mean"}, "max_steps": 2},
         "families": ["mhc", "mhc:gate_init=residual"], "seeds": 2, "preregistered": REGISTERED}


def _config(tmp_path: Path, study: dict, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(study))  # JSON is YAML
    return path


# ----------------------------------------------------------------------------- values the study cannot read


@pytest.mark.parametrize("key, value, message", [
    ("measure", ["validation loss"], "measure must be one of ['validation loss', 'smallest deviation σ (interior)'] "
                                     "(a string), got a list ['validation loss']"),
    ("measure", {"validation loss": 1}, "measure must be one of"),
    ("alternative", ["less"],
     "alternative must be one of ['less', 'greater', 'two-sided', 'equivalence'] (a string), got a list"),
    ("secondary", {"holm": True}, "secondary must be one of ['holm', 'none'] (a string), got a mapping"),
    ("hypothesis", {"a": 1}, "hypothesis must be a string"),
    ("registered", [2026], "registered must be a date (2026-12-04) or a string, got a list"),
])
def test_a_registration_field_of_the_wrong_kind_is_one_line(key, value, message, tmp_path, capsys):
    config = _config(tmp_path, {**STUDY, "preregistered": {**REGISTERED, key: value}})
    assert main(["study", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(config.with_suffix("")) in err and f"preregistered: {message}" in err, err
    assert not (tmp_path / "out").exists()


def _edited(tmp_path: Path, edit) -> Path:
    results = json.loads((DOCS / "start" / "results.json").read_text())
    edit(results["rows"])
    out = tmp_path / "edited"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))  # NaN is written as NaN, as Python's json reads it
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[2].update(val_loss=math.nan), "rows[2] ('{}'): val_loss is NaN; it must be a finite number"),
    (lambda rows: rows[2].update(val_loss="3.1"), "rows[2] ('{}'): val_loss is '3.1' (a string); it must be a finite"),
    (lambda rows: rows[2].pop("curves"), "rows[2] ('{}'): curves is absent; it must be a mapping with 'train' and"),
    (lambda rows: rows[2]["curves"]["val"].__setitem__(1, [10, "x"]), "rows[2] ('{}'): curves.val[1] is [10, 'x']"),
    (lambda rows: rows[2].update(seed="0"), "rows[2] ('{}'): seed is '0' (a string); it must be an integer >= 0"),
    (lambda rows: rows[2]["timing"].pop("median_step_s"), "rows[2] ('{}'): timing.median_step_s is absent"),
    (lambda rows: rows[2].update(grad_norm={"max": 1}), "rows[2] ('{}'): grad_norm is {{'max': 1}} (a mapping)"),
    (lambda rows: rows.__setitem__(2, [1]), "rows[2] is [1] (a list), not a row"),
])
def test_report_only_over_a_hand_edited_row_is_one_line_naming_the_row_and_field(edit, message, tmp_path, capsys):
    out = _edited(tmp_path, edit)
    name = json.loads((DOCS / "start" / "results.json").read_text())["rows"][2]["name"]
    assert main(["study", "--report-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / "results.json") in err and message.format(name) in err, err
    assert not (out / "report.md").exists()


# ----------------------------------------------------------------------------------------------- provenance


def _git(directory: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _checkout(root: Path, files: dict[str, str]) -> Path:
    """A git checkout at ``root`` holding ``files``, committed."""
    root.mkdir(parents=True)
    _git(root, "init", "-q")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "initial")
    return root


SMALL = {"families": ["residual", "mhc"], "train": {"max_steps": 2}, "seeds": 1}


def _invocations(out: Path) -> list[dict]:
    return json.loads((out / "study.json").read_text())["invocations"]


def test_every_invocation_records_the_commit_of_s2hc_s_own_checkout(tmp_path, monkeypatch):
    package = _checkout(tmp_path / "checkout", {"src/s2hc/__init__.py": "", "src/s2hc/study.py": "x = 1\n"})
    monkeypatch.setattr(runner, "_package_dir", lambda: package / "src" / "s2hc")
    monkeypatch.delenv(runner.COMMIT_ENV, raising=False)
    spec, out = parse_spec(SMALL), tmp_path / "out"
    runner.prepare(spec, out, code=runner.provenance())
    (package / "src" / "s2hc" / "study.py").write_text("x = 2\n")  # the sources differ from the commit now
    runner.prepare(spec, out, code=runner.provenance(), action="print-commands")
    head = _git(package, "rev-parse", "--short", "HEAD")
    first, second = _invocations(out)
    assert (first["commit"], first["dirty"], first["commit_source"]) == (head, False, "s2hc's checkout")
    assert (second["commit"], second["dirty"], second["action"]) == (head, True, "print-commands")
    assert first["at"] and first["s2hc"]


def test_an_installed_snapshot_records_the_commit_it_is_given_or_the_config_s_checkout(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "s2hc"  # not a checkout: no commit of its own
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    monkeypatch.setattr(runner, "_package_dir", lambda: installed)
    monkeypatch.delenv(runner.COMMIT_ENV, raising=False)
    configs = _checkout(tmp_path / "configs", {"study.yaml": json.dumps(SMALL)})
    code = runner.provenance(configs / "study.yaml")
    assert code == {"commit": _git(configs, "rev-parse", "--short", "HEAD"), "dirty": False,
                    "commit_source": "the config's checkout"}
    monkeypatch.setenv(runner.COMMIT_ENV, "abc1234")  # what the snapshot was built from: it comes first
    monkeypatch.setenv(runner.DIRTY_ENV, "0")
    assert runner.provenance(configs / "study.yaml") == {"commit": "abc1234", "dirty": False,
                                                         "commit_source": "S2HC_COMMIT"}
    monkeypatch.delenv(runner.COMMIT_ENV)
    assert runner.provenance(tmp_path / "elsewhere.yaml")["commit"] is None  # nothing says: unknown, said so
    # a snapshot inside an unrelated checkout (a virtual environment in a repository) is not that checkout's code
    venv_checkout = _checkout(tmp_path / "repo", {"README": "x"})
    inside = venv_checkout / ".venv" / "s2hc"
    inside.mkdir(parents=True)
    (inside / "__init__.py").write_text("")
    monkeypatch.setattr(runner, "_package_dir", lambda: inside)
    assert runner.provenance()["commit"] is None


def test_results_and_report_say_where_the_commit_came_from():
    env = runner._environment(1.0, 1, {"commit": "abc1234", "dirty": None, "commit_source": "S2HC_COMMIT"})
    assert (env["commit"], env["dirty"], env["commit_source"]) == ("abc1234", None, "S2HC_COMMIT")
    results = json.loads((DOCS / "start" / "results.json").read_text())
    results["environment"].update(env, invocations=[{"commit": "abc1234", "dirty": False}, {"commit": None}])
    text = build_report(results, {}, None)
    assert "s2hc 0" in text and "(commit `abc1234` (as S2HC_COMMIT gave it: an installed snapshot), clean or not " \
                                "unknown)" in text
    assert ("- Invocations in this directory (study.json lists them): 2, commit `abc1234` (1×); commit unknown: s2hc "
            "did not run from a git checkout (1×).") in text


# ---------------------------------------------------------------------- a registration and settings that hold

TINY = {
    "train": {"preset": "tiny", "model_overrides": {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64,
                                                    "stream_reduce": "mean"},
              "seq_len": 32, "batch_size": 2, "max_steps": 2, "eval_every": 1, "eval_batches": 1, "log_every": 1,
              "dtype": "float32", "device": "cpu"},
    "families": ["mhc", "mhc:gate_init=residual"], "seeds": 2, "diagnostics_tokens": 64, "baselines": [],
    "preregistered": REGISTERED,
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """A pre-registered study of four tiny runs, every one measured."""
    root = tmp_path_factory.mktemp("registered")
    config = _config(root, TINY)
    assert main(["study", str(config), "--out", str(root / "out"), "--jobs", "2"]) == 0
    return root / "out"


def _copy(measured: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(measured, out)
    return out


def test_the_registration_is_recorded_before_the_runs_and_said_so(measured):
    recorded = json.loads((measured / "study.json").read_text())["registration"]
    assert recorded["runs_existing"] == 0 and recorded["preregistered"]["alpha"] == 0.05
    assert json.loads((measured / "results.json").read_text())["registration"] == recorded
    report = (measured / "report.md").read_text()
    assert "## Pre-registered test (confirmatory)" in report
    assert "Registered 2026-12-04, before these runs (study.json recorded it before any of them existed)" in report


@pytest.mark.parametrize("change, said", [
    ({"alpha": 0.1}, "preregistered.alpha: 0.05 -> 0.1"),
    ({"alternative": "greater"}, 'preregistered.alternative: "less" -> "greater"'),
    ({"hypothesis": "another"}, 'preregistered.hypothesis: "the residual start lowers the loss" -> "another"'),
    (None, "preregistered: {"),  # the registration removed
])
def test_a_registration_changed_over_measured_runs_is_refused_naming_the_field(change, said, measured, tmp_path,
                                                                               capsys):
    out = _copy(measured, tmp_path)
    study = {**TINY, "preregistered": {**REGISTERED, **change}} if change else {
        k: v for k, v in TINY.items() if k != "preregistered"}
    before = (out / "report.md").read_text()
    assert main(["study", str(_config(tmp_path, study)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and "4 of its runs exist" in err and "--new-registration" in err
    assert (out / "report.md").read_text() == before


def test_a_new_registration_over_the_runs_is_labelled_as_made_after_them(measured, tmp_path):
    out = _copy(measured, tmp_path)
    config = _config(tmp_path, {**TINY, "preregistered": {**REGISTERED, "alternative": "greater"}})
    assert main(["study", str(config), "--out", str(out), "--new-registration"]) == 0
    recorded = json.loads((out / "study.json").read_text())["registration"]
    assert recorded["runs_existing"] == 4 and recorded["preregistered"]["alternative"] == "greater"
    assert recorded["superseded"][0]["preregistered"]["alternative"] == "less"
    report = (out / "report.md").read_text()
    assert "## Registered test, made after the runs (exploratory)" in report and "before these runs" not in report
    assert "recorded when 4 of this study's runs already existed (replacing 1 earlier registration" in report
    assert main(["study", str(config), "--out", str(out)]) == 0  # the record is this one now: it stands


def test_a_hand_edited_registration_in_results_json_is_refused(measured, tmp_path, capsys):
    out = _copy(measured, tmp_path)
    results = json.loads((out / "results.json").read_text())
    results["study"]["preregistered"]["alpha"] = 0.2
    (out / "results.json").write_text(json.dumps(results))
    assert main(["study", "--report-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "preregistered.alpha: 0.05 -> 0.2" in err


def test_without_study_json_runs_are_reused_only_when_every_training_setting_matches(measured, tmp_path, capsys):
    out = _copy(measured, tmp_path)
    (out / "study.json").unlink()  # as the message on a damaged one advises
    longer = _config(tmp_path, {**TINY, "train": {**TINY["train"], "max_steps": 3}})
    assert main(["study", str(longer), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was trained with max_steps 2 (the grid: 3)" in err
    shutil.rmtree(out / "runs")  # the rows alone say it too
    assert main(["study", str(longer), "--out", str(out)]) == 2
    assert "rows/mhc-n4-seed0.json was trained with max_steps 2 (the grid: 3)" in capsys.readouterr().err


def test_a_logger_changes_no_run_and_a_registration_recorded_over_runs_says_so(measured, tmp_path, capsys,
                                                                               monkeypatch):
    out = _copy(measured, tmp_path)
    (out / "study.json").unlink()
    monkeypatch.setattr(runner, "available_cores", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["study", str(_config(tmp_path, TINY)), "--out", str(out), "--logger", "csv", "--jobs", "3"]) == 0
    # the banner says how the runs share the cores, as each run's environment sets them
    assert "4 runs: 4 done, 0 to measure, 0 to train (3 at a time, 2 torch thread(s) each)" in capsys.readouterr().err
    pool = runner._Pool(3, 1)
    pool.gpus = 0
    assert pool._env(0)["OMP_NUM_THREADS"] == pool._env(1)["MKL_NUM_THREADS"] == "2"
    assert "## Registered test, made after the runs (exploratory)" in (out / "report.md").read_text()


def test_settings_that_differ_only_in_what_a_run_shows_are_one_setting():
    with pytest.raises(ValueError) as error:
        parse_spec({"families": ["residual", "mhc"], "settings": [{"logger": "csv"}, {"logger": "tensorboard"}]})
    assert "settings[0] and settings[1] train the same runs" in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------ Holm families fixed by the config


def _hand_rows() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cost import hand_results

    return hand_results()


def test_a_configuration_beyond_the_baseline_s_curve_stays_in_the_holm_family():
    """``best`` ends below the baseline's best: its token speedup is a bound with no test. It stays in the family
    (counted as p = 1), so ``fast``'s Holm p is over the two configurations the study pairs with residual."""
    found = verdicts(_hand_rows())
    fast, best = found["baselines"]["residual"]
    tokens = fast["token_speedup"]
    assert tokens["holm_m"] == 2 and tokens["p_holm"] == pytest.approx(min(1.0, 2 * tokens["p"]))
    assert best["token_speedup"]["p"] is None and best["token_speedup"]["p_counted"] == 1.0
    assert found["holm_families"]["residual"] == {
        "members": ["fast", "best"],
        "untested": {"loss": [], "token_speedup": ["best"], "wall_clock_speedup": ["best"], "mfu": ["best"]}}


def test_the_committed_cost_study_s_holm_families_are_the_six_it_declares():
    results = json.loads((DOCS / "cost" / "results.json").read_text())
    found = verdicts(results)
    assert len(found["holm_families"]["residual"]["members"]) == 6
    mhc = next(e for e in found["baselines"]["residual"] if e["configuration"] == "mhc n=4")
    # mHC's token speedup: p 0.0156, Holm over the six (hc and attn-res are bounds), not over the four tested
    assert mhc["token_speedup"]["holm_m"] == 6 and mhc["token_speedup"]["p_holm"] == pytest.approx(0.0624, abs=1e-4)
    line = next(x for x in cost.verdict_lines(found) if x.startswith("- **mhc n=4** against `residual"))
    assert "p 0.016 (unadjusted), Holm p 0.062 (over 6 against `residual`)" in line


def test_a_declared_configuration_without_paired_seeds_stays_in_the_paired_table_s_family():
    results = json.loads((DOCS / "start" / "results.json").read_text())
    baseline = "residual"
    before = paired_table(results, baseline)
    first = next(line for line in before if line.startswith("| ") and "n=4" in line).split(" | ")[0][2:]
    results["rows"] = [r for r in results["rows"] if not (r["label"] == first and r["seed"] > 0)]  # one seed left
    after = paired_table(results, baseline)
    m = len(cost.family(results, baseline, _baseline_label))
    assert f"Holm p (over {m})" in after[0]
    assert any(line.startswith(f"| {first} |") and "fewer than two paired seeds" in line for line in after)


# ------------------------------------------------------------------------------------ labels and intervals


def test_mfu_over_seeds_is_a_geometric_mean_with_its_interval_on_the_log_scale():
    results = _hand_rows()
    for row in results["rows"]:
        if row["label"] == "fast":
            row["timing"]["tokens_per_s"] = 100.0 if row["seed"] == 0 else 1000.0  # MFU 1.2 % and 12 %
    mfu = next(e for e in verdicts(results)["baselines"]["residual"] if e["configuration"] == "fast")["mfu"]
    logs = [math.log(0.012), math.log(0.12)]
    half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev(logs) / math.sqrt(2)
    assert mfu["mean"] == pytest.approx(math.sqrt(0.012 * 0.12))
    assert mfu["ci95"] == pytest.approx([math.exp(statistics.fmean(logs) - half),
                                         math.exp(statistics.fmean(logs) + half)])
    assert mfu["ci95"][0] > 0  # a linear interval over two seeds goes below 0 %


def test_intervals_beside_holm_verdicts_are_simultaneous_too_and_every_p_is_labelled():
    found = verdicts(_hand_rows())
    fast = found["baselines"]["residual"][0]
    diffs = list(fast["loss"]["per_seed"].values())
    half = scipy_stats.t.ppf(1 - 0.05 / 4, 1) * statistics.stdev(diffs) / math.sqrt(2)  # Bonferroni over 2
    assert fast["loss"]["ci95_simultaneous"] == pytest.approx([statistics.fmean(diffs) - half,
                                                               statistics.fmean(diffs) + half])
    line = cost.verdict_line(fast, "residual")
    assert "Δ validation loss +1.0000 [95 % CI " in line and "; simultaneous " in line
    assert ", p 0.295 (unadjusted), Holm p 0.295 (over 2 against `residual`)" in line
    # the paired table: both intervals, each p said
    results = json.loads((DOCS / "recipe" / "results.json").read_text())
    header = paired_table(results, "residual")[0]
    assert ("| Δ validation loss [95 % CI] | [simultaneous 95 % CI, Bonferroni over 6] | p (two-sided, unadjusted) | "
            "Holm p (over 6) | verdict |") in header


def test_a_family_of_one_has_no_holm_p_and_no_simultaneous_interval():
    results = _hand_rows()
    results["rows"] = [r for r in results["rows"] if r["label"] != "best"]
    fast = verdicts(results)["baselines"]["residual"][0]
    line = cost.verdict_line(fast, "residual")
    assert "Holm" not in line and "simultaneous" not in line and ", p 0.295 (two-sided)" in line
    start = json.loads((DOCS / "start" / "results.json").read_text())
    labels = {r["label"] for r in start["rows"]}
    keep = {"residual", next(label for label in labels if label != "residual")}
    start["rows"] = [r for r in start["rows"] if r["label"] in keep]
    start["study"]["configurations"] = [c for c in start["study"]["configurations"] if c["label"] in keep]
    table = paired_table(start, "residual")
    assert "Holm" not in table[0] and "simultaneous" not in table[0] and "| p (two-sided) |" in table[0]


def test_a_one_sided_registered_test_gives_one_sided_bounds_and_no_holm_p_for_the_primary(measured):
    results = json.loads((measured / "results.json").read_text())
    lines = report_lines(results)
    header = next(line for line in lines if line.startswith("| test |"))
    # one contrast: its secondary test is the primary's, alone: no Holm column
    assert "| one-sided 95 % bound |" in header and "| p (one-sided) |" in header and "Holm" not in header
    test = evaluate(results)
    values = list(test["primary"]["per_seed"].values())
    high = statistics.fmean(values) + scipy_stats.t.ppf(0.95, 1) * statistics.stdev(values) / math.sqrt(2)
    assert test["primary"]["bound"] == pytest.approx([-math.inf, high])
    primary = next(line for line in lines if line.startswith("| primary"))
    assert f"| [-∞, {high:+.4f}] |" in primary
    # three contrasts (the committed confirmation): Holm over the three for the secondary, none for the primary
    committed = json.loads((DOCS / "start-confirm" / "results.json").read_text())
    lines = report_lines(committed)
    header = next(line for line in lines if line.startswith("| test |"))
    assert "| simultaneous (Bonferroni over 3) | p (one-sided, unadjusted) | Holm p (over the 3 contrasts) |" in header
    assert "| – (one test) |" in next(line for line in lines if line.startswith("| primary"))


def _registered_results(losses: dict[str, list[float]], **registration) -> dict:
    """Results of finished runs with these validation losses per seed, and a registration (parsed as a config's)."""
    rows = [{"label": label, "seed": seed, "status": "finished", "val_loss": value}
            for label, values in losses.items() for seed, value in enumerate(values)]
    block = {"registered": "2026-12-05", "hypothesis": "h", "alpha": 0.05, **registration}
    configurations = tuple(parse_spec({"train": {"preset": "tiny"}, "seeds": 2, "families": [
        "residual", "mhc", "s2hc", "identity"]}).configurations)
    from s2hc.study.preregistered import parse_preregistered
    from s2hc.study.spec import _entry

    parsed = parse_preregistered(block, configurations, lambda entry, where: _entry(entry, [4], where), "test")
    return {"study": {"preregistered": parsed}, "rows": rows}


def test_an_equivalence_test_is_two_one_sided_tests_against_the_margin():
    s2hc, mhc = [3.001, 3.004, 2.999, 3.002, 3.000], [3.000, 3.002, 3.001, 3.001, 2.998]
    results = _registered_results({"s2hc n=4": s2hc, "mhc n=4": mhc}, contrasts=[["s2hc", "mhc"]],
                                  alternative="equivalence", margin=0.01, secondary="none")
    test = evaluate(results)
    d = [a - b for a, b in zip(s2hc, mhc)]
    # TOST written out: t against each bound, one-sided each way, the larger p decides
    k, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    p_low = scipy_stats.t.sf((mean + 0.01) / (sd / math.sqrt(k)), k - 1)
    p_high = scipy_stats.t.cdf((mean - 0.01) / (sd / math.sqrt(k)), k - 1)
    assert test["primary"]["p"] == pytest.approx(max(p_low, p_high), rel=1e-9)
    half = scipy_stats.t.ppf(0.95, k - 1) * sd / math.sqrt(k)  # the 90 % interval: within ±margin iff p < α
    assert test["primary"]["bound"] == pytest.approx([mean - half, mean + half])
    assert test["primary"]["rejected"] and mean - half > -0.01 and mean + half < 0.01
    lines = report_lines(results)
    assert "equivalence, H1: within ±0.01, two one-sided tests" in lines[4]
    assert "| TOST 90 % interval |" in next(line for line in lines if line.startswith("| test |"))
    wide = _registered_results({"s2hc n=4": [3.0, 3.05, 2.95], "mhc n=4": [3.0, 3.0, 3.0]},
                               contrasts=[["s2hc", "mhc"]], alternative="equivalence", margin=0.01)
    assert not evaluate(wide)["primary"]["rejected"]  # seeds that spread past the margin show no equivalence


def test_an_interaction_is_the_difference_of_two_differences_and_each_contrast_can_be_its_own_test():
    losses = {"s2hc n=4": [3.0, 3.1, 3.2], "mhc n=4": [3.2, 3.3, 3.5], "identity n=4": [3.1, 3.0, 3.3],
              "residual": [3.4, 3.5, 3.4]}
    results = _registered_results(losses, contrasts=[["s2hc", "mhc", "identity", "residual"], ["mhc", "residual"]],
                                  alternative="less", primary="each")
    test = evaluate(results)
    assert test["primary"] is None and test["each"] and len(test["secondary"]) == 2
    interaction = test["secondary"][0]
    assert interaction["name"] == "(s2hc n=4 − mhc n=4) − (identity n=4 − residual)"
    expected = [(a - b) - (c - d) for a, b, c, d in zip(*losses.values())]
    assert list(interaction["per_seed"].values()) == pytest.approx(expected)
    raw = [scipy_stats.ttest_1samp(v, 0, alternative="less").pvalue
           for v in (expected, [b - d for b, d in zip(losses["mhc n=4"], losses["residual"])])]
    assert [t["p_holm"] for t in test["secondary"]] == pytest.approx(stats_holm(raw))
    lines = report_lines(results)
    assert "every one of the 2 contrasts is a primary test of its own" in lines[4]
    assert all(line.startswith("| primary") for line in lines if line.startswith("| primary") or
               line.startswith("| secondary"))


def stats_holm(p: list[float]) -> list[float]:
    """Holm's step-down adjustment written out for two tests."""
    small, large = sorted(range(2), key=lambda i: p[i])
    out = [0.0, 0.0]
    out[small] = min(1.0, 2 * p[small])
    out[large] = min(1.0, max(out[small], p[large]))
    return out


@pytest.mark.parametrize(("change", "message"), [
    ({"alternative": "equivalence"}, "margin must be a positive number"),
    ({"alternative": "less", "margin": 0.01}, "margin is the bound of an equivalence test"),
    ({"alternative": "less", "primary": "each", "secondary": "holm"}, "secondary must be none"),
    ({"alternative": "less", "contrasts": [["s2hc", "mhc", "identity"]]}, r"must be a \[first, second\] pair"),
    ({"alternative": "less", "contrasts": [["s2hc", "mhc", "s2hc", "mhc"]]},
     "interaction of one difference with itself"),
])
def test_bad_equivalence_and_interaction_registrations_are_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        _registered_results({}, **{"contrasts": [["s2hc", "mhc"]], **change})
