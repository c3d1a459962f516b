"""``s2hc study``: the grid checked before anything runs, the smoke study end to end (killed and finished, re-run
as a no-op, the report rebuilt from results.json alone), divergence recorded, the lock, and the statistics."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from s2hc.cli import main
from s2hc.models import Transformer, get_preset
from s2hc.rundir import RunLock, load_model, saved_step
from s2hc.study import load_spec, parse_spec, run_study
from s2hc.study.measure import loss_spike, rotation_probe
from s2hc.study.runner import prepare
from s2hc.study.stats import describe, holm, paired

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "configs" / "study-smoke.yaml"
SMOKE_RUNS = ["residual-seed0", "mhc-n4-seed0", "s2hc-n4-seed0", "residual-seed1", "mhc-n4-seed1", "s2hc-n4-seed1"]


def study(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "s2hc", "study", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(*args: str) -> subprocess.CompletedProcess:
    process = study(*args)
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def comparable(out: Path) -> dict:
    """results.json without what depends on the machine's speed (timing, wall time, the environment) and where each
    start of a run trained (a resumed run has one platform record per start)."""
    results = json.loads((out / "results.json").read_text())
    results.pop("environment")
    for row in results["rows"]:
        row.pop("timing")
        row.pop("platform")
    return results


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """The smoke study, run once without interruption."""
    out = tmp_path_factory.mktemp("study") / "smoke"
    finish(str(SMOKE), "--out", str(out))
    return out


# ------------------------------------------------------------------------------------ the smoke study


def test_smoke_study_writes_runs_rows_results_and_report(smoke):
    results = json.loads((smoke / "results.json").read_text())
    assert [row["name"] for row in results["rows"]] == SMOKE_RUNS
    for row in results["rows"]:
        assert row["status"] == "finished" and row["diverged_at"] is None
        assert math.isfinite(row["val_loss"]) and row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]), 1e-5)
        assert row["curves"]["val"][-1] == [40, row["val_loss"]]
        assert row["grad_norm"]["max"] >= row["grad_norm"]["p95"] >= row["grad_norm"]["median"] > 0
        assert row["timing"]["tokens_per_s"] > 0
        # where it trained, once (it started once): what decides its rounding
        (platform,) = row["platform"]
        assert platform["step"] == 0 and platform["threads"] >= 1 and platform["torch"] == torch.__version__
        assert platform["cpu"] and platform["cpu_capability"] and platform["device"] == "cpu"
        model, config = load_model(smoke / "runs" / row["name"])  # an ordinary run directory
        assert (model.config.family, config.seed) == (row["family"], row["seed"])
        assert row["params"] == model.num_params() and row["hc_params"] == model.num_connection_params()
        assert (row["diagnostics"] is None) == (row["family"] == "residual")
        assert (row["rotations"] is not None) == (row["family"] == "s2hc")
    s2hc_row = results["rows"][2]
    assert s2hc_row["diagnostics"]["headline"]["negative_share_mean"] > 0  # s²HC uses negative entries
    assert results["rows"][1]["diagnostics"]["headline"]["negative_share_mean"] == 0  # mHC cannot
    report = (smoke / "report.md").read_text()
    for heading in ("## Loss per configuration", "## Paired differences against `residual`",
                    "## Paired differences against `mhc`", "## Training stability", "## The trained residual matrices",
                    "## Early training: the rotations of the first and last connections"):
        assert heading in report
    for figure in ("validation_curves", "final_validation_loss", "deviation_singular_values", "column_sums",
                   "amax_gain", "stream_similarity"):
        assert (smoke / "figures" / f"{figure}.png").stat().st_size > 1000
        assert f"figures/{figure}.png" in report


def test_rerunning_a_finished_study_trains_nothing(smoke):
    stamps = {p: p.stat().st_mtime_ns for p in [*smoke.glob("runs/*/checkpoint.pt"), *smoke.glob("rows/*.json")]}
    before = comparable(smoke)
    done = finish(str(SMOKE), "--out", str(smoke))
    assert "6 runs: 6 done, 0 to measure, 0 to train" in done.stderr and "start " not in done.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert comparable(smoke) == before


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def test_a_killed_study_finishes_with_the_same_results(smoke, tmp_path):
    out = tmp_path / "smoke"
    # SIGTERM: the study passes it on, every run saves a checkpoint, the study exits 128 + 15.
    process = study(str(SMOKE), "--out", str(out))
    _wait_for(out / "runs" / "mhc-n4-seed0" / "checkpoint.pt", process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM and "run the same command again" in err
    assert 0 < saved_step(out / "runs" / "mhc-n4-seed0") < 40
    # SIGKILL of the whole process group: no chance to save; the next call resumes from the last checkpoints.
    process = study(str(SMOKE), "--out", str(out), start_new_session=True)
    _wait_for(out / "runs" / "s2hc-n4-seed0" / "checkpoint.pt", process)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    assert 0 < saved_step(out / "runs" / "s2hc-n4-seed0") < 40 and not (out / "results.json").exists()
    done = finish(str(SMOKE), "--out", str(out))
    assert "resuming from step" in done.stderr
    assert comparable(out) == comparable(smoke)


def test_report_only_rebuilds_the_same_report_from_results_json_alone(smoke, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    shutil.copy(smoke / "results.json", out / "results.json")  # nothing else: no runs, no rows
    assert main(["study", "--report-only", "--out", str(out)]) == 0
    first = (out / "report.md").read_text()
    assert main(["study", "--report-only", "--out", str(out)]) == 0
    assert (out / "report.md").read_text() == first == (smoke / "report.md").read_text()


def test_a_study_directory_in_use_is_refused_and_nothing_is_lost(smoke, capsys):
    before = comparable(smoke)
    with RunLock(smoke):
        assert main(["study", str(SMOKE), "--out", str(smoke)]) == 2
    assert "is in use by another s2hc process" in capsys.readouterr().err
    assert comparable(smoke) == before


def test_a_committed_study_grows_from_its_results_alone(smoke, tmp_path, capsys):
    """docs/ keeps a finished study's study.json and results.json, not its run directories or rows: copied to a
    new directory, the grown grid trains only its new runs (the rows come from results.json)."""
    for name in ("study.json", "results.json"):
        shutil.copy(smoke / name, tmp_path / name)
    grown = tmp_path / "grown.yaml"
    grown.write_text(SMOKE.read_text().replace("seeds: 2", "seeds: 3"))
    capsys.readouterr()
    assert main(["study", str(grown), "--out", str(tmp_path), "--print-commands"]) == 0
    commands = capsys.readouterr().out.split("\n")
    assert [c.split("--out ")[1] for c in commands if c.startswith("s2hc train")] == [
        str(tmp_path / "runs" / name) for name in ("residual-seed2", "mhc-n4-seed2", "s2hc-n4-seed2")]


def test_print_commands_lists_plain_train_commands(smoke, tmp_path, capsys):
    assert main(["study", str(SMOKE), "--out", str(tmp_path / "new"), "--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [["s2hc", "train"]] * 6
    assert all(f"--out {tmp_path / 'new' / 'runs' / name}" in line for line, name in zip(lines, SMOKE_RUNS))
    assert all((tmp_path / "new" / "configs" / f"{name}.yaml").is_file() for name in SMOKE_RUNS)
    assert main(["study", str(SMOKE), "--out", str(smoke), "--print-commands"]) == 0
    assert capsys.readouterr().out.startswith("# every run is finished")


def test_a_diverged_run_is_recorded_not_averaged(tmp_path, monkeypatch):
    import s2hc.train.loop as loop
    from s2hc.train import TrainingError, train

    spec = parse_spec({
        "train": {"preset": "tiny", "model_overrides": {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
                  "seq_len": 32, "batch_size": 2, "max_steps": 8, "eval_every": 0, "eval_batches": 1,
                  "checkpoint_every": 2, "log_every": 1, "dtype": "float32", "device": "cpu"},
        "seeds": 3, "families": ["hc"], "baselines": [], "diagnostics_tokens": 64,
    })
    runs = prepare(spec, tmp_path)
    real, calls = loop.F.cross_entropy, {"n": 0}

    def poisoned(*args, **kwargs):  # seed 0's fifth step returns a NaN loss
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(loop.F, "cross_entropy", poisoned)
    with pytest.raises(TrainingError):
        train(spec.run_config(runs[0].configuration, 0, runs[0].run_dir))
    monkeypatch.setattr(loop.F, "cross_entropy", real)
    run_study(spec, tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["status"], r["diverged_at"]) for r in rows] == [("diverged", 5), ("finished", None), ("finished", None)]
    assert "non-finite loss" in rows[0]["diverged_reason"] and rows[0]["val_loss"] is None
    report = (tmp_path / "report.md").read_text()
    assert "| hc n=4 | 2 (+1 diverged) |" in report and "seed 0 at step 5" in report


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "text, message",
    [
        ("families: [residual]\ncolour: red", "unknown key(s) ['colour']"),
        ("families: [resnet]", "families[0] must be one of"),
        ("families: ['s2hc:spin=3']", "spin"),
        ("families: ['s2hc:rotation=bogus']", "bogus"),
        ("families: [{family: mhc, n_streams: [0]}]", "n_streams must be an integer >= 1, got 0"),
        ("families: [mhc]\nn_streams: [4]\nstreams: [4]", "gives both 'n_streams' and 'streams'"),
        ("families: [{family: mhc, colour: red}]", "a mapping entry takes 'family'"),
        ("families: [residual]\ntrain: {max_step: 3}", "unknown config key(s) ['max_step']"),
        ("families: [residual]\ntrain: {seed: 3}", "train sets ['seed']"),
        ("families: [residual]\ntrain: {lr: -1}", "lr must be"),
        ("families: []", "'families' is missing or empty"),
        ("train: {preset: tiny}", "'families' is missing or empty"),
        ("families: [residual]\nseeds: []", "seeds is empty"),
        ("families: [residual]\nseeds: 0", "seeds must be an integer in [1, 1000], got 0"),
        ("families: [mhc, mhc]", "'mhc n=4' is listed twice"),
        ("families: ['residual:x=1']", "residual takes no options"),
        ("families: [residual]\nbaselines: [nope]", "baselines must be one of"),
        ("families: [residual]\nsettings: [{seed: 1}]", "settings[0] sets ['seed'], which the grid sets"),
        ("families: [residual, mhc]\nsettings: [{lr: 0}]", "residual [lr=0]: lr must be"),
        ("families: [residual, mhc]\nfactorial: [{factors: {family: [mhc, hc]}}]",
         "factorial[0]: the cell {'family': 'hc'} (with no condition) must match exactly one configuration; it "
         "matches none"),
    ],
)
def test_a_bad_study_config_is_refused_before_anything_runs(text, message, tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text(text)
    assert main(["study", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_another_grid_in_the_same_directory_is_refused_but_a_study_may_grow(tmp_path):
    grid = {"families": ["residual", "mhc"], "train": {"max_steps": 5}, "seeds": 2}
    prepare(parse_spec(grid), tmp_path)
    for other in ({"train": {"max_steps": 6}}, {"families": ["residual"]}, {"seeds": [1, 2]}):
        with pytest.raises(ValueError, match="holds a study of another grid .*a study may only grow"):
            prepare(parse_spec({**grid, **other}), tmp_path)
    prepare(parse_spec({**grid, "baselines": []}), tmp_path)  # the same runs
    grown = prepare(parse_spec({**grid, "families": ["residual", "mhc", "s2hc"], "seeds": 3}), tmp_path)
    assert len(grown) == 9 and json.loads((tmp_path / "study.json").read_text())["grid"]["seeds"] == [0, 1, 2]
    with pytest.raises(ValueError, match="holds a study of another grid"):  # the grown grid is the record now
        prepare(parse_spec(grid), tmp_path)


def test_report_only_without_results_is_refused(tmp_path, capsys):
    assert main(["study", "--report-only", "--out", str(tmp_path)]) == 2
    assert "results.json' does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def residual_run(corpus_file, tmp_path_factory):
    """A residual run of the small model (1 step): a source for grids that start from another run's weights."""
    from helpers import small_config

    from s2hc.train import train

    config = small_config(corpus_file, tmp_path_factory.mktemp("base"), family="residual", n_streams=1, max_steps=1)
    train(config)
    return config.out


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/study-*.yaml")), ids=lambda p: p.name)
def test_every_shipped_study_config_is_a_valid_grid(path, residual_run):
    from s2hc.config import load_yaml_config

    starts_from_a_run = "init_from" in load_yaml_config(path)["train"]
    if starts_from_a_run:  # its source is trained first (the config says how): without it, one clear error
        with pytest.raises(ValueError, match="train.init_from .* cannot be read .*; train that run first"):
            load_spec(path)
    spec = load_spec(path, [f"init_from={residual_run}"] if starts_from_a_run else [])
    # the smallest, the rounding floor: one cell, three seeds; a sweep may give its costly cells their own seeds
    assert len(spec.runs()) >= 3 and max(len(spec.seeds_of(c)) for c in spec.configurations) >= 2
    for configuration in spec.configurations:  # every model of the grid builds (on the meta device: no memory)
        config = spec.run_config(configuration, spec.seeds[0], "unused")
        with torch.device("meta"):
            assert Transformer(config.model_config()).num_params() > 0


def test_a_grid_from_a_residual_run_refuses_families_that_cannot_keep_its_function(residual_run):
    train = {"init_from": str(residual_run), "max_steps": 5}
    with pytest.raises(ValueError, match="hc n=4: family .*'hc' cannot start from a residual model"):
        parse_spec({"train": train, "families": ["residual", "s2hc", "hc"]})
    assert len(parse_spec({"train": train, "families": ["residual", "s2hc"], "seeds": 2}).runs()) == 4


def test_the_committed_study_is_the_planned_grid():
    spec = load_spec(ROOT / "configs" / "study-tiny.yaml")
    labels = {c.label for c in spec.configurations}
    for family in ("hc", "mhc", "mhc-lite", "kromhc", "s2hc", "identity", "orthogonal", "isometric"):
        assert f"{family} n=4" in labels
    assert {"residual", "s2hc (rotation=expm) n=4", "s2hc (exact_identity_init=true) n=4"} <= labels
    assert {"s2hc n=2", "s2hc n=8", "mhc n=2", "mhc n=8"} <= labels and len(spec.seeds) >= 3


def test_grid_entries_labels_and_run_order():
    spec = parse_spec({"families": ["residual", "s2hc:rotation=expm,exact_identity_init=true",
                                    {"family": "mhc", "n_streams": [2, 8]}], "seeds": [3, 5], "n_streams": [4]})
    assert [c.label for c in spec.configurations] == [
        "residual", "s2hc (exact_identity_init=true, rotation=expm) n=4", "mhc n=2", "mhc n=8"]
    assert spec.configurations[1].run_name(3) == "s2hc-n4-exact_identity_init-true-rotation-expm-seed3"
    assert [(c.label, s) for c, s in spec.runs()][:5] == [
        ("residual", 3), (spec.configurations[1].label, 3), ("mhc n=2", 3), ("mhc n=8", 3), ("residual", 5)]


def test_streams_is_read_as_n_streams_with_a_notice(capsys):
    """`n_streams` as in training configs; the study's older name `streams` still works, and says so once."""
    new = parse_spec({"families": ["residual", {"family": "mhc", "n_streams": [2]}, "s2hc"], "n_streams": [8]})
    capsys.readouterr()
    old = parse_spec({"families": ["residual", {"family": "mhc", "streams": [2]}, "s2hc"], "streams": [8]})
    assert old == new and [c.label for c in new.configurations] == ["residual", "mhc n=2", "s2hc n=8"]
    notices = capsys.readouterr().err.splitlines()
    assert len(notices) == 2 and all("'streams' is deprecated, call it 'n_streams'" in line for line in notices)


# ------------------------------------------------------------------------------------------ statistics


def test_describe_is_the_student_t_interval():
    summary = describe([1.0, 2.0, 3.0])
    half = 4.302652729749464 / math.sqrt(3)  # t(0.975, 2)
    assert summary["mean"] == 2.0 and summary["std"] == 1.0
    assert summary["ci95"] == pytest.approx([2.0 - half, 2.0 + half], rel=1e-12)
    assert describe([4.0])["ci95"] is None and describe([])["n"] == 0


def test_paired_test_against_the_closed_form_for_two_degrees_of_freedom():
    values, baseline = {0: 1.0, 1: 2.0, 2: 3.5, 9: 7.0}, {0: 0.5, 1: 1.0, 2: 3.0}  # seed 9 is unpaired
    result = paired(values, baseline)
    diffs = [0.5, 1.0, 0.5]
    t = (sum(diffs) / 3) / (scipy_stats.tstd(diffs) / math.sqrt(3))
    assert result["seeds"] == [0, 1, 2] and result["mean"] == pytest.approx(2 / 3)
    assert result["p"] == pytest.approx(1 - abs(t) / math.sqrt(t * t + 2), rel=1e-9)  # Student t, df = 2
    assert paired({0: 1.0}, {0: 2.0}) is None
    assert paired({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0})["p"] == 1.0


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_matches_its_definition(pvalues):
    m, adjusted = len(pvalues), holm(pvalues)
    ranked = sorted(pvalues)
    for p, a in zip(pvalues, adjusted):
        expected = max(min(1.0, (m - j) * ranked[j]) for j in range(m) if ranked[j] <= p)
        assert a == pytest.approx(expected) and p <= a + 1e-15 <= 1 + 1e-15


def test_loss_spike_is_the_largest_rise_above_the_running_minimum():
    assert loss_spike([5.0, 4.0, 4.5, 3.0, 3.2, 3.1]) == pytest.approx(0.5)
    assert loss_spike([3.0, 2.0, 1.0]) == 0.0 and loss_spike([]) == 0.0


def test_the_first_and_last_connections_rotation_gradients_are_rounding_noise():
    """The claim the report's early-training section rests on: the first connection sees identical streams (rows of
    H_res sum to 1: copies stay copies) and the last one's streams are summed (columns sum to 1: the sum is kept),
    so their rotation parameters' gradient vanishes in exact arithmetic (float64 ~ 0), while every other
    connection's is real (float32 and float64 agree)."""
    model = Transformer(get_preset("tiny", family="s2hc", n_streams=4, dim=32, n_layers=3, n_heads=2, ffn_dim=64),
                        init_seed=0)  # as training builds it: the probe rebuilds the initial model from the seed
    config = type("Config", (), {"seed": 0, "init_from": None, "init_rng": "per_parameter"})()
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    probe = rotation_probe(model, config, (x, torch.roll(x, -1, dims=1)))
    ends64, middle64 = probe["grad_init_fp64"][::5], probe["grad_init_fp64"][1:5]
    assert len(probe["grad_init_fp64"]) == 6 and max(ends64) < 1e-12 * min(middle64)
    assert probe["grad_init_fp32"][1:5] == pytest.approx(middle64, rel=1e-3)
    assert probe["drift"] == [0.0] * 6  # the model is its own initialisation


@pytest.mark.parametrize("committed", ["study", "start", "recipe", "depth", "gated", "gated-lss", "upcycling",
                                       "upcycling/scratch", "crn", "floor", "cost"])
def test_the_committed_reports_are_what_their_results_give(committed, tmp_path):
    """docs/ holds studies' results.json and report.md: the report must be what `--report-only` builds from the
    results with the code as it is (so the numbers quoted in docs/ trace back to data, and the code still reads
    them)."""
    source = ROOT / "docs" / committed
    shutil.copy(source / "results.json", tmp_path / "results.json")
    assert main(["study", "--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (source / "report.md").read_text()
