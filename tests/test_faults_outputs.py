"""Writes that are complete or absent: ``export``, ``upcycle`` and the study's report.

- ``s2hc export`` builds its directory beside the target and swaps it in whole: a full disk while re-exporting
  keeps the previous export (its config with its own weights), a SIGKILL while building leaves the previous
  export or nothing (never a directory ``AutoModelForCausalLM`` loads without its tokenizer), one between the
  swap's two renames is put back by the next export; a directory with a user's files is refused, not deleted.
- ``s2hc upcycle`` never writes over its own SOURCE, builds its run directory beside and swaps it in, and a
  killed upcycle can simply be run again (it has no ``--resume`` to ask for).
- ``write_report``: a kill while the figures are redrawn leaves no ``report.md`` beside figures of other results.

Kills are real: the command runs in a subprocess whose chosen write blocks (touching a marker file first), and
the test sends SIGKILL once the marker appears.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import OFFLINE_ENV, small_config
from test_faults_cli import assert_error, fail_fsync_for, run_cli

from s2hc.rundir import holds_run, load_checkpoint, load_model

REPO = Path(__file__).resolve().parents[1]
FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"  # what safetensors says


@pytest.fixture(scope="module")
def residual_run(corpus_file, tmp_path_factory) -> Path:
    """A residual run of the small model (2 steps): another model than ``tiny_checkpoint``, and a SOURCE that
    ``upcycle`` accepts."""
    from s2hc.train import train

    config = small_config(corpus_file, tmp_path_factory.mktemp("residual"), family="residual", n_streams=1,
                          max_steps=2)
    train(config)
    return Path(config.out)


def leftovers(out: Path) -> list[str]:
    """What s2hc left beside ``out`` (``.OUT.s2hc-tmp-*``, ``.OUT.s2hc-old-*``, ``.OUT.s2hc-lock``)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def assert_export_of(out: Path, run: Path) -> None:
    """``out`` loads with ``AutoModelForCausalLM`` and holds ``run``'s model: its config and its weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import s2hc.hf  # noqa: F401  (registers the classes)

    model, _ = load_model(run)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.s2hc == model.config.to_dict()
    expected, actual = model.state_dict(), loaded.model.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    AutoTokenizer.from_pretrained(out)  # the tokenizer is there too
    assert json.loads((out / "s2hc_training.json").read_text())["step"] == load_checkpoint(run).step


# ------------------------------------------------------------------------------- killed in a subprocess

KILLABLE = """
import os, sys, time
from pathlib import Path

point, marker = os.environ["S2HC_TEST_KILL_AT"], Path(os.environ["S2HC_TEST_MARKER"])


def block():
    marker.touch()
    time.sleep(600)


if point == "export-building":  # the weights and the tokenizer written, the last file not yet
    import importlib
    export = importlib.import_module("s2hc.hf.export")  # the module: s2hc.hf.export is also the function's name
    real = export.atomic_write_text
    def write(path, text):
        if Path(path).name == "s2hc_training.json":
            block()
        return real(path, text)
    export.atomic_write_text = write
elif point == "swap":  # between the two renames of the swap: the old output moved away, the new not yet in
    import s2hc.rundir.staging as staging
    staging._move_in = lambda building, target: block()
elif point == "upcycle-checkpoint":  # config.yaml written, the checkpoint not yet
    import s2hc.upcycle as upcycle
    upcycle.save_checkpoint = lambda path, state: block()

from s2hc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_killed(tmp_path: Path, point: str, argv: list[str]) -> str:
    """Run ``s2hc ARGV`` in a subprocess, SIGKILL it at ``point`` (see :data:`KILLABLE`); its stderr."""
    (tmp_path / "kill").mkdir(exist_ok=True)  # out of the way of the outputs beside tmp_path's
    script, marker = tmp_path / "kill" / "killable.py", tmp_path / "kill" / f"marker-{point}"
    script.write_text(KILLABLE)
    marker.unlink(missing_ok=True)
    env = {**os.environ, **OFFLINE_ENV, "S2HC_TEST_KILL_AT": point, "S2HC_TEST_MARKER": str(marker)}
    process = subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=REPO)
    deadline = time.time() + 240
    while not marker.exists():
        assert process.poll() is None, f"it ended before the kill point {point}: {process.communicate()}"
        assert time.time() < deadline, f"the kill point {point} was never reached"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    return process.communicate(timeout=60)[1]


# ------------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("disk", ["safetensors fails", "fsync fails"])
def test_a_full_disk_while_re_exporting_keeps_the_previous_export(disk, tiny_checkpoint, residual_run, tmp_path,
                                                                  capsys, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import modeling_utils

    out = tmp_path / "hf"
    assert run_cli(["export", str(tiny_checkpoint), "--out", str(out)], capsys)[0] == 0
    if disk == "safetensors fails":
        def save_file(*args, **kwargs):
            raise Exception(FULL_DISK)

        monkeypatch.setattr(modeling_utils, "safe_save_file", save_file)
    else:
        fail_fsync_for(monkeypatch, "model.safetensors")
    code, _, line = run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)
    assert code == 1
    assert_error(line, "export", repr(str(out / "model.safetensors")), "No space left on device")
    assert_export_of(out, tiny_checkpoint)  # one model's config with its own weights, the tokenizer with them
    assert leftovers(out) == []
    monkeypatch.undo()
    assert run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert_export_of(out, residual_run)


@pytest.mark.parametrize("previous", [False, True], ids=["first export", "re-export"])
def test_an_export_killed_while_building_leaves_the_previous_export_or_nothing(previous, tiny_checkpoint,
                                                                               residual_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    if previous:
        assert run_cli(["export", str(tiny_checkpoint), "--out", str(out)], capsys)[0] == 0
    run_killed(tmp_path, "export-building", ["export", str(residual_run), "--out", str(out), "--overwrite"])
    if previous:
        assert_export_of(out, tiny_checkpoint)
    else:
        assert not out.exists()  # nothing that loads without its tokenizer and provenance
    # what the kill left is hidden and marked temporary: no other directory holds an export
    assert all(".s2hc-tmp-" in name or name.endswith(".s2hc-lock") for name in leftovers(out))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["hf"] * previous + ["kill"]
    code, _, _ = run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)
    assert code == 0
    assert_export_of(out, residual_run)
    assert leftovers(out) == []


def test_an_export_killed_between_the_renames_is_put_back_by_the_next(tiny_checkpoint, residual_run, tmp_path,
                                                                      capsys):
    pytest.importorskip("transformers")
    from s2hc.rundir.staging import recover_directory

    out = tmp_path / "hf"
    assert run_cli(["export", str(tiny_checkpoint), "--out", str(out)], capsys)[0] == 0
    run_killed(tmp_path, "swap", ["export", str(residual_run), "--out", str(out), "--overwrite"])
    assert not out.exists()  # what a user finds: the previous export in .hf.s2hc-old-*, the new in .hf.s2hc-tmp-*
    assert [name.split("-")[1] for name in leftovers(out) if "s2hc-" in name and "lock" not in name] == [
        "old", "tmp"]
    recover_directory(out, log=None)
    assert_export_of(out, tiny_checkpoint)
    assert leftovers(out) == []
    assert run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert_export_of(out, residual_run)


def test_export_refuses_a_directory_holding_a_users_files(tiny_checkpoint, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    (out / "config.json").write_text("{}")
    code, _, line = run_cli(["export", str(tiny_checkpoint), "--out", str(out)], capsys)
    assert code == 2
    assert_error(line, "export", "out_dir", repr(str(out)), "notes.txt", "not an s2hc export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes\n"


# ------------------------------------------------------------------------------------------------ upcycle


def listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["the source", "inside the source", "around the source", "its checkpoint's run"])
def test_upcycle_refuses_to_write_over_its_own_source(where, residual_run, tmp_path, capsys, monkeypatch):
    import s2hc.upcycle

    source = tmp_path / "parent" / "residual"
    shutil.copytree(residual_run, source)
    before = listing(tmp_path / "parent")
    given = str(source / "checkpoint.pt") if where == "its checkpoint's run" else str(source)
    out = {"the source": source, "inside the source": source / "up", "around the source": tmp_path / "parent",
           "its checkpoint's run": source}[where]

    def read_source(*args, **kwargs):
        raise AssertionError("the source was read before --out was checked")

    monkeypatch.setattr(s2hc.upcycle, "read_source", read_source)
    code, _, line = run_cli(["upcycle", given, "--family", "s2hc", "--out", str(out), "--overwrite"], capsys)
    assert code == 2
    assert_error(line, "upcycle", "--out", repr(str(out)), "its own input")
    assert listing(tmp_path / "parent") == before  # the run and its metrics are all there


def test_a_killed_upcycle_leaves_no_run_and_runs_again(residual_run, tmp_path, capsys):
    out = tmp_path / "up"
    run_killed(tmp_path, "upcycle-checkpoint", ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)])
    assert not out.exists() and not holds_run(out)  # no config.yaml without its checkpoint
    code, _, line = run_cli(["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)], capsys)
    assert code == 0, line
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.yaml"]
    assert load_checkpoint(out).step == 0
    assert leftovers(out) == []


def test_a_killed_upcycle_overwrite_keeps_the_run_that_was_there(residual_run, tmp_path, capsys):
    out = tmp_path / "up"
    argv = ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)]
    assert run_cli([*argv, "--streams", "2"], capsys)[0] == 0
    before = listing(out)
    run_killed(tmp_path, "upcycle-checkpoint", [*argv, "--streams", "4", "--overwrite"])
    assert {k: v for k, v in listing(out).items() if k != ".lock"} == before  # a killed run's lock, taken over
    assert run_cli([*argv, "--streams", "4", "--overwrite"], capsys)[0] == 0
    assert load_model(out)[0].config.n_streams == 4
    assert leftovers(out) == []


def test_upcycle_into_a_run_asks_for_overwrite_not_resume(residual_run, tmp_path, capsys):
    out = tmp_path / "up"
    argv = ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)]
    assert run_cli(argv, capsys)[0] == 0
    code, _, line = run_cli(argv, capsys)
    assert code == 2
    assert_error(line, "upcycle", repr(str(out)), "already holds a run", "--overwrite")
    assert "--resume" not in line  # upcycle has no such flag


def test_upcycle_overwrite_refuses_a_run_directory_holding_a_users_files(residual_run, tmp_path, capsys):
    out = tmp_path / "up"
    argv = ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)]
    assert run_cli(argv, capsys)[0] == 0
    (out / "notes.txt").write_text("mine\n")
    before = listing(out)
    code, _, line = run_cli([*argv, "--overwrite"], capsys)
    assert code == 2
    assert_error(line, "upcycle", "--out", "notes.txt", "not an s2hc run")
    assert listing(out) == before


# ------------------------------------------------------------------------------------------- study report


class Killed(BaseException):
    """What a SIGKILL does to the write in progress: it stops there, and no cleanup runs after it."""


def test_a_report_cut_while_its_figures_are_redrawn_is_absent_not_stale(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    pytest.importorskip("scipy")
    from s2hc.study import figures, report

    out = tmp_path / "study"
    out.mkdir()
    results = json.loads((REPO / "docs" / "study" / "results.json").read_text())
    (out / "results.json").write_text(json.dumps(results))
    report.write_report(out)
    results["study"]["description"] = "The second version of these results."
    (out / "results.json").write_text(json.dumps(results))

    def cut(*args, **kwargs):  # the curves are redrawn from the new results; the kill lands on the next figure
        raise Killed

    monkeypatch.setattr(figures, "plot_final", cut)
    with pytest.raises(Killed):
        report.write_report(out)
    assert not (out / "report.md").exists()  # not the old report beside the new curves
    monkeypatch.undo()
    text = report.write_report(out).read_text()
    assert "The second version of these results." in text
    named = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert named and all((out / name).is_file() for name in named)
