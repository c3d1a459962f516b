"""``s2hc compare``: a study with one axis (families × seeds). The spec it builds, the runs and report it writes
(the same as the study of that axis), the trained matrices in the report, and the report without the study extra."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import small_config

from s2hc.cli import main
from s2hc.diagnostics import plots
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.study import compare, compare_spec, load_spec, run_study, write_report
from s2hc.study import stats as study_stats

FAMILIES = ["residual", "s2hc", "mhc"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def base(corpus_file, tmp_path):
    return small_config(corpus_file, tmp_path, max_steps=2, eval_every=2, checkpoint_every=0, log_every=1,
                        seed=5)


def test_compare_builds_the_one_axis_study(base):
    spec = compare_spec(base.replace(family_options={"rotation": "expm"}), ["residual", "s2hc"], seeds=2,
                        n_streams=2)
    assert [c.label for c in spec.configurations] == ["residual", "s2hc (rotation=expm) n=2"]
    assert spec.seeds == (5, 6) and spec.baselines == ("residual",) and spec.title == "s2hc compare"
    assert [c.run_name(s) for c, s in spec.runs()] == [
        "residual-seed5", "s2hc-n2-rotation-expm-seed5", "residual-seed6", "s2hc-n2-rotation-expm-seed6"]
    # the settings that differ from TrainConfig's defaults, and none the grid sets
    assert spec.train["max_steps"] == 2 and not {"family", "n_streams", "seed", "out"} & set(spec.train)
    spec = compare_spec(base, ["mhc"])
    assert [c.label for c in spec.configurations] == ["mhc n=4"] and spec.seeds == (5,)


def _structure(report: str) -> list[str]:
    """Headings and table headers: what the report is made of, without its numbers and title."""
    return [line for line in report.splitlines()[1:] if line.startswith("#") or line.startswith("| configuration")]


def test_compare_writes_the_studys_runs_and_report(base, tmp_path, capsys):
    out = tmp_path / "compare"
    report = compare(base, FAMILIES, out=out).read_text()
    names = ["residual-seed5", "s2hc-n4-seed5", "mhc-n4-seed5"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(names)
    assert report.startswith("# s2hc compare\n")
    for text in ("| residual | 1 |", "| s2hc n=4 | 1 |", "| mhc n=4 | 1 |", "tokens/s", "step time vs residual",
                 "One seed per configuration", "## The trained residual matrices", "## Runs"):
        assert text in report
    results = json.loads((out / "results.json").read_text())
    rows = {row["family"]: row for row in results["rows"]}
    assert rows["residual"]["hc_params"] == 0 < rows["s2hc"]["hc_params"]
    assert load_checkpoint(out / "runs" / "s2hc-n4-seed5").model_config["n_streams"] == 4
    assert load_checkpoint(out / "runs" / "residual-seed5").model_config["n_streams"] == 1
    # each measured run's diagnostics: its own report, named in the Runs table; the figures from the first seed
    for name in ("s2hc-n4-seed5", "mhc-n4-seed5"):
        assert (out / "runs" / name / "diagnostics" / "report.md").is_file()
        assert f"| `runs/{name}/` | `diagnostics/report.md` in each |" in report
    assert "| residual | `runs/residual-seed5/` | nothing to measure |" in report
    if plots.have_matplotlib():
        for figure in ("validation_curves", "train_curves", "deviation_singular_values", "stream_similarity"):
            assert f"(figures/{figure}.png)" in report and (out / "figures" / f"{figure}.png").stat().st_size > 1000

    # the study of the same axis: the same runs and the same report, but for the title and the description
    spec_file = tmp_path / "study.yaml"
    spec_file.write_text(yaml.safe_dump({
        "train": compare_spec(base, FAMILIES).train, "n_streams": [4], "seeds": [5], "families": FAMILIES,
        "diagnostics_tokens": 1024}))
    study_out = tmp_path / "study"
    study_report = run_study(load_spec(spec_file), study_out, strict=False).read_text()
    assert sorted(p.name for p in (study_out / "runs").iterdir()) == sorted(names)
    assert _structure(study_report) == _structure(report)
    for name in names:
        run_config = yaml.safe_load((out / "configs" / f"{name}.yaml").read_text())
        assert yaml.safe_load((study_out / "configs" / f"{name}.yaml").read_text()) == run_config


def test_compare_cli_refuses_an_existing_run_resumes_and_overwrites(base, tmp_path, capsys):
    out = tmp_path / "cmp"
    config = tmp_path / "base.yaml"
    values = base.to_dict()
    for key in ("family", "n_streams", "out"):
        values.pop(key)
    config.write_text(yaml.safe_dump(values))
    args = ["compare", "--config", str(config), "--families", "residual", "--out", str(out)]
    assert main([*args, "--resume"]) == 2
    assert "holds none of these runs to resume (residual-seed5)" in capsys.readouterr().err
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# s2hc compare") and f"Report: {out / 'report.md'}" in printed
    assert main(args) == 2
    assert re.search(r"'.*runs/residual-seed5' already holds a run", capsys.readouterr().err)
    assert main([*args, "--resume"]) == 0  # finished: kept as it is, measured already
    assert main([*args, "--max-steps", "3", "--overwrite"]) == 0
    assert load_checkpoint(out / "runs" / "residual-seed5").step == 3


def test_the_report_without_the_study_extra(base, tmp_path, monkeypatch):
    """`make demo` installs only the plot extra, CI's core install none: the report is written, and says in one
    line each what it leaves out."""
    out = tmp_path / "cmp"
    compare(base, ["residual", "s2hc"], seeds=2, out=out)
    full = (out / "report.md").read_text()
    if study_stats.available():
        assert "## Paired differences against `residual`" in full
    monkeypatch.setattr(study_stats, "available", lambda: False)
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    report = write_report(out, strict=False).read_text()
    assert study_stats.NO_STATISTICS in report and plots.NO_FIGURES in report
    assert "Paired differences" not in report and "![" not in report
    assert re.search(r"\| s2hc n=4 \| 2 \| \d\.\d{4} ± \d\.\d{4} \|", report)  # mean ± std, no interval


def test_the_verdicts_at_equal_cost_of_a_real_comparison(base, tmp_path):
    """Every evaluation records the training seconds so far, a CPU run the float32 matmul peak it measured at its
    start; the rows carry the model's FLOP count; the report has a verdict line per configuration (loss, token and
    wall-clock speedups, the latter labelled CPU, and MFU) and verdicts.json holds every value."""
    out = tmp_path / "cmp"
    report = compare(base.replace(max_steps=4), ["residual", "s2hc"], seeds=2, out=out).read_text()
    records = read_metrics(out / "runs" / "s2hc-n4-seed5")
    evaluations = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    assert 0 < evaluations[0]["train_seconds"] < evaluations[1]["train_seconds"]
    step_times = load_checkpoint(out / "runs" / "s2hc-n4-seed5").history.step_times
    assert evaluations[1]["train_seconds"] == pytest.approx(sum(step_times), abs=1e-5)
    (platform,) = [r["platform"] for r in records if "platform" in r]
    assert platform["matmul_peak"]["flops_per_s"] > 0 and platform["matmul_peak"]["dtype"] == "float32"

    results = json.loads((out / "results.json").read_text())
    for row in results["rows"]:
        flops = row["cost"]["flops"]
        assert row["cost"]["precision"] == "float32" and row["cost"]["tokens_per_step"] == 4 * 32
        assert flops["train_per_token"] == 3 * flops["forward_per_token"] > flops["forward_matmul_per_token"] > 0
        assert (flops["parts"]["connections"]["matmul"] > 0) == (row["family"] == "s2hc")
        assert len(row["timing"]["val_seconds"]) == len(row["curves"]["val"]) == 2

    assert "## Verdicts at equal cost" in report
    line = next(x for x in report.splitlines() if x.startswith("- **s2hc n=4** against `residual` (seeds 5, 6)"))
    for text in ("Δ validation loss", "token speedup", "wall-clock speedup", "(CPU: ", "MFU ",
                 "peak: CPU, measured float32 512² matmul"):
        assert text in line
    found = json.loads((out / "verdicts.json").read_text())
    assert found["format"] == "s2hc-verdicts" and found["version"] == 2
    (entry,) = found["baselines"]["residual"]
    assert entry["configuration"] == "s2hc n=4" and entry["seeds"] == [5, 6]
    for measure in ("token_speedup", "wall_clock_speedup"):
        for value in entry[measure]["per_seed"].values():  # a value, or a bound beyond the baseline's curve
            assert (value["value"] or 0) > 0 or value["beyond"] in ("below", "above")
    assert entry["wall_clock_speedup"]["cpu"] and entry["mfu"]["available"] and 0 < entry["mfu"]["mean"] < 1
    if study_stats.available():
        assert entry["loss"]["ci95"] is not None and entry["loss"]["p_holm"] is not None


def test_curves_that_lie_on_top_of_each_other_both_stay_visible():
    """Two configurations with the same curve: different line styles and markers, the one drawn first the wider,
    so the one on top does not hide it."""
    pytest.importorskip("matplotlib")
    from s2hc.study.figures import _bands

    plt = plots._pyplot()
    fig, ax = plt.subplots()
    curve = {"status": "finished", "curves": {"val": [[1, 5.0], [2, 4.0], [3, 3.5]]}}
    _bands(ax, {"a": [curve], "b": [curve], "c": [curve]}, "val", "validation loss")
    lines = ax.get_lines()
    assert [tuple(line.get_ydata()) for line in lines] == [(5.0, 4.0, 3.5)] * 3
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    plt.close(fig)


def test_family_options_apply_to_the_compared_families_that_take_them(base):
    spec = compare_spec(base, ["residual", "hc", ("mhc", {"iterations": 5})], family_options={"alpha": 0.5})
    assert [c.label for c in spec.configurations] == [
        "residual", "hc (alpha=0.5) n=4", "mhc (alpha=0.5, iterations=5) n=4"]
    with pytest.raises(ValueError, match="--family-option iterations: family 'hc' does not take it"):
        compare_spec(base, ["hc", "mhc"], family_options={"iterations": 5})
    with pytest.raises(ValueError, match="residual takes no options"):
        compare_spec(base, [("residual", {"alpha": 0.5})])


def test_compare_cli_takes_family_options_and_family_key_value(monkeypatch, capsys, tmp_path):
    """`--family-option` goes to the families compared (not to the residual base config, which refused it), and
    `--families` takes FAMILY:KEY=VALUE as `s2hc bench` and `s2hc params` do."""
    import s2hc.study

    seen = {}

    def fake_compare(base, families, **kwargs):
        seen["spec"] = compare_spec(base, families, n_streams=kwargs["n_streams"],
                                    family_options=kwargs["family_options"])
        (tmp_path / "report.md").write_text("report\n")
        return tmp_path / "report.md"

    monkeypatch.setattr(s2hc.study, "compare", fake_compare)
    assert main(["compare", "--families", "hc,mhc", "--family-option", "alpha=0.5", "--out", str(tmp_path)]) == 0
    assert [c.label for c in seen["spec"].configurations] == ["hc (alpha=0.5) n=4", "mhc (alpha=0.5) n=4"]
    assert main(["compare", "--families", "residual,attn-res:block_size=2,mhc:iterations=3:alpha=0.5",
                 "--out", str(tmp_path)]) == 0
    assert [c.label for c in seen["spec"].configurations] == [
        "residual", "attn-res (block_size=2)", "mhc (alpha=0.5, iterations=3) n=4"]
    capsys.readouterr()
    assert main(["compare", "--families", "hc,mhc", "--family-option", "iterations=3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "family 'hc' does not take it" in err, err


def test_compare_family_is_no_prefix_of_family_option(capsys, tmp_path):
    assert main(["compare", "--family", "mhc", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "did you mean --families mhc?" in err and "KEY=VALUE, got" not in err, err


def test_train_family_takes_key_value():
    from s2hc.cli import build_parser
    from s2hc.cli.train import training_config

    args = build_parser().parse_args(["train", "--family", "attn-res:block_size=2", "--family-option", "eps=1e-5"])
    config = training_config(args, family=args.family, n_streams=args.streams)
    assert (config.family, config.family_options) == ("attn-res", {"eps": 1e-5, "block_size": 2})
    args = build_parser().parse_args(["train", "--family", "mhc:bogus"])
    with pytest.raises(ValueError, match="argument --family"):
        training_config(args, family=args.family)


def test_compare_sets_and_says_the_threads_of_its_runs(base, tmp_path, monkeypatch):
    """Each run (a process) gets the cores shared out over the runs at a time (OMP_NUM_THREADS), and the first line
    says so; the environment is as it was afterwards."""
    from s2hc.study import comparison

    seen = {}

    def fake_run_study(spec, out, **kwargs):
        seen.update(omp=os.environ.get("OMP_NUM_THREADS"), mkl=os.environ.get("MKL_NUM_THREADS"))
        return tmp_path / "report.md"

    monkeypatch.setattr(comparison, "run_study", fake_run_study)
    monkeypatch.setattr(comparison.runner, "available_cores", lambda: 6)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    lines: list[str] = []
    comparison.compare(base.replace(device="cpu"), ["residual"], out=tmp_path / "c", log=lines.append)
    assert seen == {"omp": "6", "mkl": "6"} and "OMP_NUM_THREADS" not in os.environ
    assert lines[0] == "each run trains with 6 torch thread(s): 6 core(s), 1 run at a time"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice wins, and is named
    lines.clear()
    comparison.compare(base.replace(device="cpu"), ["residual"], out=tmp_path / "d", log=lines.append)
    assert seen["omp"] == "2" and lines[0].endswith("2 torch thread(s): 6 core(s), 1 run at a time (OMP_NUM_THREADS)")


def test_a_stopped_compare_prints_the_command_that_goes_on(monkeypatch):
    from s2hc.cli.train import _resume_hint

    monkeypatch.delenv("MAKELEVEL", raising=False)
    argv = ["compare", "--config", "configs/demo tiny.yaml", "--families", "residual,mhc", "--out", "runs/demo",
            "--overwrite", "--max-steps", "20"]
    assert _resume_hint(argv) == ("`s2hc compare --config 'configs/demo tiny.yaml' --families residual,mhc --out "
                                  "runs/demo --max-steps 20 --resume`")
    monkeypatch.setenv("MAKELEVEL", "1")
    assert _resume_hint(argv).endswith("(from `make demo`: the same make command with DEMO_RESUME=1)")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(("variables", "expected"), [
    ([], "--out runs/demo --overwrite"),
    (["DEMO_STEPS=20"], "--out runs/demo --overwrite --max-steps 20 --eval-every 4"),  # five evaluations
    (["DEMO_STEPS=3"], "--out runs/demo --overwrite --max-steps 3 --eval-every 1"),
    (["DEMO_STEPS=20", "DEMO_RESUME=1"], "--out runs/demo --resume --max-steps 20 --eval-every 4"),
])
def test_make_demo_evaluates_a_short_demo_several_times_and_resumes(variables, expected, tmp_path):
    # --no-print-directory: under `make test` this make is a sub-make, which would print its directory around
    result = subprocess.run(["make", "--no-print-directory", "-n", "demo", f"VENV={tmp_path / 'venv'}", *variables],
                            cwd=ROOT,
                            capture_output=True, text=True, check=True)
    command = " ".join(result.stdout.replace("\\\n", " ").split())
    assert "s2hc compare --config configs/demo-tiny.yaml" in command
    assert command.endswith(expected), command
