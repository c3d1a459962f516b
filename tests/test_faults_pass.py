"""A fault-injection pass over the newer commands: ``kill -9`` at random moments of
``export``, ``upcycle``, ``study`` (``--jobs 1`` and ``2``) and ``eval --out``, and a real full disk (a small
tmpfs) under each; and ``kill -9`` of a streamed ``train`` while it writes its token cache (its chunks whole or
absent, a damaged one never trained on), and of a ``train`` keeping checkpoints while it prunes them (inside the
pruning and around it: the kept ones whole, the newest K again after the resume).

After every fault: what was already written is not lost (a previous output still loads, byte for byte
unchanged), nothing half-made looks valid (an export without its tokenizer, a run directory with a config but
no checkpoint where the command promises complete-or-absent, a JSON file cut short, a study's run training on),
and the same command called again finishes (exit 0, a valid output; a study resumes).

Kill moments are drawn from a seeded generator (``S2HC_KILL_SEED``, default 22): "any" is a random time after
the start (mostly imports, loading, computing; for ``eval``, a random fraction of its own uninterrupted duration,
measured first, so that the kills land on a fast machine too), the others a random delay after something the
command does is seen from outside (its ``.OUT.s2hc-tmp-*`` build directory appears, a run's first checkpoint, a run
measured).
A command that ends before its kill moment must have finished cleanly; each test checks that kills landed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_faults_cli
import test_faults_outputs
import yaml
from helpers import OFFLINE_ENV, SMALL_MODEL
from test_faults_cli import run_cli
from test_faults_outputs import assert_export_of, leftovers, listing
from test_faults_processes import descendants, gone, lock_holder, wait_until

from s2hc import cli
from s2hc.rundir import load_checkpoint, load_model, saved_step
from s2hc.rundir.guard import LOCK

REPO = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("S2HC_KILL_SEED", "22"))
LINUX = sys.platform.startswith("linux")
needs_linux = pytest.mark.skipif(not LINUX, reason="a parent-death signal and /proc exist on Linux alone")


small_filesystem = test_faults_cli.small_filesystem  # the fixtures reused: a real small tmpfs (skipped where
residual_run = test_faults_outputs.residual_run  # mounting is not allowed), a residual run of the small model


# A study of one seed draws its final-loss figure around a single value (matplotlib widens the limits itself).
pytestmark = pytest.mark.filterwarnings("ignore:Attempting to set identical low and high ylims:UserWarning")


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


def start(argv: list[str], err: Path) -> subprocess.Popen:
    """``python -m s2hc ARGV`` in a session of its own (as a shell starts it), stderr into ``err``."""
    err.parent.mkdir(parents=True, exist_ok=True)
    with err.open("w") as handle:  # the child has its own copy
        return subprocess.Popen([sys.executable, "-m", "s2hc", *argv], cwd=REPO, env={**os.environ, **OFFLINE_ENV},
                                stdout=subprocess.DEVNULL, stderr=handle, start_new_session=True)


def kill_9(process: subprocess.Popen, ready, delay: float, err: Path, before_kill=None) -> bool:
    """Wait until ``ready()`` (None: at once), then ``delay`` s more, then SIGKILL ``process`` (alone, as
    ``kill -9 PID``); whether the kill landed. A command that ended first must have finished with status 0."""
    deadline = time.monotonic() + 120
    while ready is not None and not ready() and process.poll() is None:
        assert time.monotonic() < deadline, f"the kill moment never came: {err.read_text()}"
        time.sleep(0.005)
    until = time.monotonic() + delay
    while process.poll() is None and time.monotonic() < until:
        time.sleep(0.005)
    if before_kill is not None and process.poll() is None:
        before_kill()
    killed = process.poll() is None
    if killed:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    if not killed:
        assert process.returncode == 0, err.read_text()
    return killed


def duration(argv: list[str], err: Path) -> float:
    """Seconds ``python -m s2hc ARGV`` takes here, uninterrupted (it must succeed): kill moments drawn as fractions
    of it fall inside the command on a fast machine as on a slow one, where fixed seconds fall after its end."""
    began = time.monotonic()
    process = start(argv, err)
    assert process.wait(timeout=300) == 0, err.read_text()
    return time.monotonic() - began


def hidden_marked(out: Path) -> None:
    """Beside ``out`` nothing else looks like an output: what a kill left there is hidden and marked temporary."""
    assert all(".s2hc-tmp-" in name or ".s2hc-old-" in name or name.endswith(".s2hc-lock") for name in leftovers(out))
    assert [p.name for p in out.parent.iterdir() if not p.name.startswith(".")] in ([], [out.name])


def previous_or_absent(out: Path, before: dict[str, bytes] | None, ignore=()) -> str:
    """``previous`` (``out`` is byte for byte ``before``), ``absent`` (no ``out``; with a previous output, it is
    whole in the ``.OUT.s2hc-old-*`` the next call puts back) or ``other`` (for the caller to check as new)."""
    if not out.exists():
        if before is not None:
            old = [out.parent / n for n in leftovers(out) if ".s2hc-old-" in n]
            assert old and {k: v for k, v in listing(old[-1]).items() if k not in ignore} == before
        return "absent"
    now = {k: v for k, v in listing(out).items() if k not in ignore}
    return "previous" if now == before else "other"


def building(out: Path):
    return lambda: any(".s2hc-tmp-" in name for name in leftovers(out))


# -------------------------------------------------------------------------------------------- kill -9: export


def test_kill_9_of_export_at_random_moments_keeps_the_previous_export_or_nothing(tiny_checkpoint, residual_run,
                                                                                tmp_path, capsys):
    pytest.importorskip("transformers")
    rng = rng_for("export")
    out, logs = tmp_path / "out" / "hf", tmp_path / "logs"
    out.parent.mkdir()
    # (a previous export there?, moment, delay)
    moments = [(False, building(out), rng.uniform(0, 0.2)), (True, None, rng.uniform(2.0, 6.0)),
               (True, building(out), rng.uniform(0, 0.2))]
    landed = 0
    for k, (previous, ready, delay) in enumerate(moments):
        if previous and not (out.exists() and _is_export_of(out, tiny_checkpoint)):
            assert run_cli(["export", str(tiny_checkpoint), "--out", str(out), "--overwrite"], capsys)[0] == 0
        before = listing(out) if previous else None
        process = start(["export", str(residual_run), "--out", str(out), "--overwrite"], logs / f"export-{k}.err")
        landed += kill_9(process, ready, delay, logs / f"export-{k}.err")
        state = previous_or_absent(out, before)
        if state == "other":  # the kill came after the swap (or the export ended): the new export, whole
            assert_export_of(out, residual_run)
        hidden_marked(out)
    assert landed >= 2, "the kills came too late: every export had finished"
    code, _, line = run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)
    assert code == 0, line
    assert_export_of(out, residual_run)
    assert leftovers(out) == []


def _is_export_of(out: Path, run: Path) -> bool:
    try:
        assert_export_of(out, run)
    except (AssertionError, OSError, ValueError):
        return False
    return True


# ------------------------------------------------------------------------------------------- kill -9: upcycle


def _assert_upcycled(out: Path, streams: int) -> None:
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK) == ["checkpoint.pt", "config.yaml"]
    model, _ = load_model(out)  # verified: the checkpoint is whole
    assert model.config.n_streams == streams and load_checkpoint(out).step == 0


def test_kill_9_of_upcycle_at_random_moments_keeps_the_run_that_was_there_or_nothing(residual_run, tmp_path,
                                                                                    capsys):
    rng = rng_for("upcycle")
    out, logs = tmp_path / "out" / "up", tmp_path / "logs"
    out.parent.mkdir()
    argv = ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)]
    moments = [(False, None, rng.uniform(0.5, 2.5)), (True, building(out), rng.uniform(0, 0.05)),
               (True, None, rng.uniform(1.0, 2.5))]
    landed = 0
    for k, (previous, ready, delay) in enumerate(moments):
        if previous:
            assert run_cli([*argv, "--streams", "2", "--overwrite"], capsys)[0] == 0
        before = {k: v for k, v in listing(out).items() if k != LOCK} if previous else None
        err = logs / f"upcycle-{k}.err"
        process = start([*argv, "--streams", "4", *(["--overwrite"] if previous else [])], err)
        landed += kill_9(process, ready, delay, err)
        state = previous_or_absent(out, before, ignore=(LOCK,))
        if state == "other":  # never a config.yaml without its checkpoint
            _assert_upcycled(out, 4)
        hidden_marked(out)
    assert landed >= 2, "the kills came too late: every upcycle had finished"
    code, _, line = run_cli([*argv, "--streams", "4", "--overwrite"], capsys)
    assert code == 0, line
    _assert_upcycled(out, 4)
    assert leftovers(out) == []


# ---------------------------------------------------------------------------------------- kill -9: eval --out


def eval_argv(run: Path, corpus: Path, out: Path, batches: int) -> list[str]:
    return ["eval", str(run), "--data", str(corpus), "--cache-dir", str(run.parent / "cache"), "--max-batches",
            str(batches), "--no-progress", "--out", str(out)]


def _assert_result(out: Path, batches: int) -> None:
    result = json.loads((out / "perplexity.json").read_text())  # complete JSON
    assert result["tokens"] == batches * 8 * 32 and result["perplexity"] > 0, result


def _visible(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.exists() else []


def test_kill_9_of_eval_output_at_random_moments_keeps_the_previous_result_or_nothing(tiny_checkpoint, corpus_file,
                                                                                    tmp_path, capsys):
    rng = rng_for("eval")
    out, logs = tmp_path / "out" / "ev", tmp_path / "logs"
    took = duration(eval_argv(tiny_checkpoint, corpus_file, tmp_path / "timed" / "ev", 2), logs / "eval-timed.err")
    landed = 0
    for k, previous in enumerate([False, True, True]):
        if previous:
            assert run_cli(eval_argv(tiny_checkpoint, corpus_file, out, 1), capsys)[0] == 0
        if previous:
            _assert_result(out, 1)
        before = (out / "perplexity.json").read_bytes() if previous else None
        err = logs / f"eval-{k}.err"
        moment = rng.uniform(0.3, 0.85) * took
        landed += kill_9(start(eval_argv(tiny_checkpoint, corpus_file, out, 2), err), None, moment, err)
        if _visible(out) == []:
            assert before is None  # an empty output directory at most, never a result lost
        elif (out / "perplexity.json").read_bytes() != before:
            _assert_result(out, 2)  # the new result, whole
        assert _visible(out) in ([], ["perplexity.json"])
        assert all(p.name.startswith(".perplexity.json.s2hc-") and p.name.endswith(".tmp")
                   for p in out.glob(".*")) if out.exists() else True
    assert landed >= 2, "the kills came too late: every evaluation had finished"
    code, _, line = run_cli(eval_argv(tiny_checkpoint, corpus_file, out, 2), capsys)
    assert code == 0, line
    _assert_result(out, 2)


# ------------------------------------------------------------------------------------------ kill -9: study

STEPS = 60


def write_study(path: Path, corpus_file: Path, cache: Path, seeds: int) -> Path:
    path.write_text(yaml.safe_dump({
        "description": "fault pass", "seeds": seeds, "families": ["residual"], "baselines": [],
        "diagnostics_tokens": 64,
        "train": {"preset": "tiny", "model_overrides": dict(SMALL_MODEL), "data": str(corpus_file),
                  "cache_dir": str(cache), "seq_len": 32, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 2,
                  "lr": 3e-3, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 10, "log_every": 1,
                  "dtype": "float32", "device": "cpu"}}))
    return path


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line names ``text`` (a study's directory: its runs' commands do)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            if text in cmdline.read_bytes().decode(errors="replace") and not gone(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
    return [pid for pid in found if pid != os.getpid()]


def check_study_after_a_kill(out: Path, measured: dict[str, bytes]) -> None:
    """Nothing half-made looks valid; every run measured before is as it was."""
    for row in out.glob("rows/*.json"):
        assert isinstance(json.loads(row.read_text()), dict)  # complete JSON
    for run in out.glob("runs/*"):
        if (run / "checkpoint.pt").exists():
            load_checkpoint(run, with_model=False)  # verified (checksums): whole
    if (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())
        assert all(row["status"] == "finished" for row in results["rows"])
    if (out / "report.md").exists():
        assert (out / "results.json").exists()
        named = [line.split("](")[1].rstrip(")") for line in (out / "report.md").read_text().splitlines()
                 if line.startswith("![")]
        assert all((out / name).is_file() for name in named)
    for name, data in measured.items():
        assert (out / name).read_bytes() == data, f"{name} changed after it was measured"
    for name in [p.name for p in out.glob("rows/*.json")]:
        run = out / "runs" / name.removesuffix(".json")
        measured.setdefault(f"rows/{name}", (out / "rows" / name).read_bytes())
        measured.setdefault(f"runs/{run.name}/checkpoint.pt", (run / "checkpoint.pt").read_bytes())


def _resumable(out: Path) -> list[str]:
    """The runs of a study that hold a checkpoint short of the last step and are not measured yet."""
    return [run.name for run in out.glob("runs/*")
            if not (out / "rows" / f"{run.name}.json").exists() and 0 < (saved_step(run) or 0) < STEPS]


def _assert_resumed(err: str, resumable: list[str]) -> None:
    """Every run that had a checkpoint and that this call of the study started was resumed from it."""
    for name in resumable:
        started = [line for line in err.splitlines() if line.startswith(f"s2hc study: start {name}")]
        assert all("(resuming from step" in line for line in started), err


@needs_linux
@pytest.mark.parametrize("jobs", [1, 2])
def test_kill_9_of_a_study_at_random_moments_leaves_no_run_training_and_the_study_called_again_resumes(
        jobs, tiny_checkpoint, corpus_file, tmp_path, capsys):
    rng = rng_for(f"study-{jobs}")
    out, logs = tmp_path / "study", tmp_path / "logs"
    seeds = jobs  # one run at a time: one run, killed while it trains, then while it is measured and reported
    config = write_study(tmp_path / "study.yaml", corpus_file, tiny_checkpoint.parent / "cache", seeds=seeds)
    argv = ["study", str(config), "--out", str(out), "--jobs", str(jobs)]

    def training():
        return any(lock_holder(run) and saved_step(run) for run in out.glob("runs/*")
                   if (run / "checkpoint.pt").exists())

    moments = {"any": (None, rng.uniform(1.5, 6.0)), "training": (training, rng.uniform(0, 0.3)),
               "measured": (lambda: any(out.glob("rows/*.json")), rng.uniform(0, 0.5))}
    # With two jobs the kill while training comes first: a random moment first can fall after both runs trained on
    # a fast machine, leaving no training for the second kill to interrupt.
    order = ["training", "measured"] if jobs == 1 else ["training", "any"]
    measured: dict[str, bytes] = {}
    landed, children, said = 0, [], []
    try:
        for k, moment in enumerate(order):
            err = logs / f"study-{k}.err"
            resumable = _resumable(out)
            process = start(argv, err)
            ready, delay = moments[moment]
            seen: list[int] = []

            def note_children(seen=seen, study=process.pid):
                seen.extend(descendants(study))
                seen.extend(pid for run in out.glob("runs/*") if (pid := lock_holder(run)))

            landed += kill_9(process, ready, delay, err, before_kill=note_children)
            children += seen
            wait_until(lambda seen=seen: all(gone(pid) for pid in seen) and not processes_naming(str(out)),
                       f"the study's runs ({seen}) to die with it", timeout=20)
            check_study_after_a_kill(out, measured)
            said.append(err.read_text())
            _assert_resumed(said[-1], resumable)
        assert landed >= 1, "the kills came too late: the study had finished"
        assert children, "no kill landed while a run was training"
        resumable = _resumable(out)
        code = cli.main(argv)  # called again, here in-process (the same command, the imports already done)
        text = capsys.readouterr().err
        assert code == 0, text
    finally:
        for pid in children + processes_naming(str(out)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert all(f"start {name} (resuming from step" in text for name in resumable), text
    assert any("(resuming from step" in t for t in [*said, text]), "no call of the study resumed a run"
    results = json.loads((out / "results.json").read_text())
    assert [row["name"] for row in results["rows"]] == [f"residual-seed{seed}" for seed in range(seeds)]
    assert all(row["status"] == "finished" for row in results["rows"])
    assert all(saved_step(run) == STEPS and not (run / LOCK).exists() for run in out.glob("runs/*"))
    for name, data in measured.items():  # a run measured before a kill is kept as it was
        assert (out / name).read_bytes() == data
    assert (out / "report.md").is_file() and not processes_naming(str(out))


# ------------------------------------------------------------------------------- kill -9: a run with loggers

LOGGED_STEPS = 60


def _tensorboard_steps(log_dir: Path, tag: str) -> list[int]:
    """The steps of ``tag`` as TensorBoard shows them (its reader applies a resumed run's purge marker)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def _check_logged_run_after_a_kill(out: Path, before: tuple[int, bytes] | None, notes: bytes) -> None:
    """The checkpoint saved before the kill is the one there, byte for byte, unless a later one replaced it whole;
    metrics.csv is whole but for a last line cut short; the TensorBoard directory is marked as the run's; the user's
    file beside the run is as it was."""
    from s2hc.loggers import TENSORBOARD_MARK, csv_defect

    if before is not None:
        step = saved_step(out)
        assert step >= before[0]
        if step == before[0]:
            assert (out / "checkpoint.pt").read_bytes() == before[1]
        load_checkpoint(out, with_model=False)  # verified: whole
    assert csv_defect(out / "metrics.csv") is None
    if (out / "tensorboard").exists():
        assert json.loads((out / "tensorboard" / TENSORBOARD_MARK).read_text()) == {"run": str(out.resolve())}
    assert (out / "notes.txt").read_bytes() == notes


@needs_linux
def test_kill_9_of_a_run_with_csv_and_tensorboard_keeps_its_checkpoint_and_the_resume_logs_each_step_once(
        corpus_file, tmp_path, capsys):
    """``--logger csv,tensorboard``: killed after a checkpoint, then its resume killed at a random moment (while it
    starts its loggers, or trains); the resume that finishes has each step once in metrics.csv, as metrics.jsonl
    has it, and in TensorBoard (a killed attempt's later steps purged)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    from helpers import cli_args, small_config
    from test_faults_loggers import assert_csv_repeats_the_record

    rng = rng_for("loggers")
    config = small_config(corpus_file, tmp_path, max_steps=LOGGED_STEPS, log_every=1, eval_every=5,
                          checkpoint_every=5, logger="csv,tensorboard")
    out, logs = Path(config.out), tmp_path / "logs"
    out.mkdir()
    notes = b"the user's own notes, beside the run"
    (out / "notes.txt").write_bytes(notes)
    argv = ["train", *cli_args(config), "--logger", "csv,tensorboard"]
    moments = [(lambda: (out / "checkpoint.pt").exists(), rng.uniform(0, 0.5)), (None, rng.uniform(2.0, 6.0))]
    landed = 0
    for k, (ready, delay) in enumerate(moments):
        before = (saved_step(out), (out / "checkpoint.pt").read_bytes()) if (out / "checkpoint.pt").exists() else None
        err = logs / f"logged-{k}.err"
        landed += kill_9(start([*argv, *(["--resume"] if k else [])], err), ready, delay, err)
        _check_logged_run_after_a_kill(out, before, notes)
    assert landed >= 1, "the kills came too late: every run had finished"
    code, _, line = run_cli([*argv, "--resume"], capsys)
    assert code == 0, line
    assert saved_step(out) == LOGGED_STEPS
    assert_csv_repeats_the_record(out)
    assert _tensorboard_steps(out / "tensorboard", "train/loss") == list(range(1, LOGGED_STEPS + 1))
    assert (out / "notes.txt").read_bytes() == notes


# --------------------------------------------------------------------------------------- a real full disk


def resize(mount: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True, capture_output=True)


def fill(mount: Path, leave: int) -> Path:
    """A file that leaves about ``leave`` bytes free on ``mount`` (0: none at all)."""
    filler = mount / "filler"
    stats = os.statvfs(mount)
    size = stats.f_bavail * stats.f_frsize - leave if leave else 1 << 40
    chunk = b"\0" * (1 << 16)
    with filler.open("wb", buffering=0) as handle:
        try:
            while size > 0:
                size -= handle.write(chunk[:size])
            os.fsync(handle.fileno())
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def test_a_full_disk_under_export_keeps_the_previous_export_and_export_runs_again(tiny_checkpoint, residual_run,
                                                                                 small_filesystem, capsys):
    pytest.importorskip("transformers")
    resize(small_filesystem, "3m")
    out = small_filesystem / "hf"
    assert run_cli(["export", str(tiny_checkpoint), "--out", str(out), "--overwrite"], capsys)[0] == 0
    before = listing(out)
    filler = fill(small_filesystem, leave=300_000)  # less than the new model.safetensors
    code, _, line = run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)
    assert code == 1
    assert line.startswith("s2hc export: error: ") and str(out) in line and "No space left on device" in line, line
    assert listing(out) == before and leftovers(out) == []
    filler.unlink()
    assert run_cli(["export", str(residual_run), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert_export_of(out, residual_run)


def test_a_full_disk_under_upcycle_keeps_the_previous_run_and_upcycle_runs_again(residual_run, small_filesystem,
                                                                                capsys):
    resize(small_filesystem, "3m")
    out = small_filesystem / "up"
    argv = ["upcycle", str(residual_run), "--family", "s2hc", "--out", str(out)]
    assert run_cli([*argv, "--streams", "2"], capsys)[0] == 0
    before = listing(out)
    filler = fill(small_filesystem, leave=200_000)  # less than the new checkpoint
    code, _, line = run_cli([*argv, "--streams", "4", "--overwrite"], capsys)
    assert code == 1
    assert line.startswith("s2hc upcycle: error: ") and "No space left on device" in line, line
    assert str(out) in line and "checkpoint.pt" in line, line
    assert {k: v for k, v in listing(out).items() if k != LOCK} == {k: v for k, v in before.items() if k != LOCK}
    assert leftovers(out) == []
    filler.unlink()
    assert run_cli([*argv, "--streams", "4", "--overwrite"], capsys)[0] == 0
    _assert_upcycled(out, 4)


def test_a_full_disk_under_eval_output_keeps_the_previous_result_and_eval_runs_again(tiny_checkpoint, corpus_file,
                                                                                    small_filesystem, capsys):
    out = small_filesystem / "ev"
    assert run_cli(eval_argv(tiny_checkpoint, corpus_file, out, 1), capsys)[0] == 0
    before = (out / "perplexity.json").read_bytes()
    filler = fill(small_filesystem, leave=0)
    code, _, line = run_cli(eval_argv(tiny_checkpoint, corpus_file, out, 2), capsys)
    assert code == 1
    assert line.startswith("s2hc eval: error: ") and str(out / "perplexity.json") in line, line
    assert "No space left on device" in line, line
    assert (out / "perplexity.json").read_bytes() == before and sorted(p.name for p in out.iterdir()) == [
        "perplexity.json"]
    filler.unlink()
    assert run_cli(eval_argv(tiny_checkpoint, corpus_file, out, 2), capsys)[0] == 0
    _assert_result(out, 2)


@needs_linux
def test_a_full_disk_under_a_study_keeps_the_last_checkpoint_and_the_study_called_again_finishes(
        tiny_checkpoint, corpus_file, small_filesystem, tmp_path, capsys):
    """Room for the run's first checkpoint, not for its second beside it (a save replaces the file whole): the
    disk fills while the study's run saves; the study says so in its one line, naming the file."""
    resize(small_filesystem, "8m")
    out = small_filesystem / "study"
    config = write_study(tmp_path / "study.yaml", corpus_file, tiny_checkpoint.parent / "cache", seeds=1)
    filler = fill(small_filesystem, leave=2_800_000)  # one checkpoint is 1.9 MB
    code = cli.main(["study", str(config), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    log, run = out / "logs" / "residual-seed0.log", out / "runs" / "residual-seed0"
    assert lines[-1].startswith(f"s2hc study: 1 run(s) failed: residual-seed0 (exit status 1, log {log}: "), lines
    assert "No space left on device" in lines[-1] and str(run / "checkpoint.pt") in lines[-1], lines
    kept = (run / "checkpoint.pt").read_bytes()
    assert saved_step(run) == 10 and not list(run.glob(".*.tmp"))  # the last good checkpoint, no temporary file
    load_checkpoint(run)  # verified: whole
    assert not list(out.glob("rows/*")) and not (out / "results.json").exists() and not (out / "report.md").exists()
    filler.unlink()
    code = cli.main(["study", str(config), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "start residual-seed0 (resuming from step 10)" in err and "Traceback" not in err
    assert kept != (run / "checkpoint.pt").read_bytes() and saved_step(run) == STEPS
    results = json.loads((out / "results.json").read_text())
    assert [row["status"] for row in results["rows"]] == ["finished"]


# ---------------------------------------------------------------------------------- kill -9: the stream cache

# `s2hc train` itself, its chunks made small (a few hundred tokens, not millions) so that a short run writes many
STREAM_CODE = ("import sys\n"
               "from s2hc.data import stream\n"
               "stream.FIRST_CHUNK_TOKENS, stream.CHUNK_TOKENS = 256, 512\n"
               "from s2hc import cli\n"
               "sys.exit(cli.main(sys.argv[1:]))\n")
STREAM_STEPS = 40


def start_streaming(argv: list[str], err: Path) -> subprocess.Popen:
    err.parent.mkdir(parents=True, exist_ok=True)
    with err.open("w") as handle:
        return subprocess.Popen([sys.executable, "-c", STREAM_CODE, *argv], cwd=REPO,
                                env={**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=handle, start_new_session=True)


def streaming_argv(data: Path, cache: Path, out: Path) -> list[str]:
    from s2hc.rundir import holds_run

    return ["train", "--preset", "tiny", "--family", "s2hc", "--streams", "4",
            "--set", "model_overrides=" + json.dumps(SMALL_MODEL), "--set", "device=cpu", "--data", str(data),
            "--streaming", "always", "--cache-dir", str(cache), "--seq-len", "32", "--batch-size", "4",
            "--max-steps", str(STREAM_STEPS), "--warmup-steps", "2", "--eval-every", "10", "--eval-batches", "1",
            "--checkpoint-every", "5", "--log-every", "1", "--no-progress", "--out", str(out),
            *(["--resume"] if holds_run(out) else [])]


def assert_cache_trusted(cache: Path) -> int:
    """Every chunk a later run would read is whole: its record matches its checksum, its tokens their sha256 and
    count (what a kill leaves half-written is a hidden temporary file, never a chunk). The number of chunks."""
    import hashlib

    from s2hc.data.stream import record_checksum

    chunks = 0
    for record_path in cache.rglob("0*.json"):
        record = json.loads(record_path.read_text())  # complete JSON
        data = record_path.with_suffix(".bin").read_bytes()
        assert record["checksum"] == record_checksum(record), record_path
        assert len(data) == 2 * record["n_tokens"] and hashlib.sha256(data).hexdigest() == record["sha256"]
        chunks += 1
    for path in cache.rglob(".*"):
        assert path.name.endswith(".tmp") and ".s2hc-" in path.name, path
    return chunks


def _curve(out: Path) -> list[tuple]:
    from s2hc.rundir import read_metrics

    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(out) if "loss" in r or "val_loss" in r]


@needs_linux
def test_kill_9_while_the_stream_cache_is_written_resumes_on_whole_chunks_only(corpus_file, tmp_path):
    """A streamed run killed while it writes its token cache (a chunk just written, a checkpoint just saved) leaves
    only whole chunks; resumed over a cache then damaged by hand where its checkpoint reads on (a chunk cut short, a
    validation chunk's document range edited), it says so in one line per file, tokenises those again, and its
    losses are the uninterrupted run's, step for step."""
    rng = rng_for("stream-cache")
    paragraphs = [p for p in corpus_file.read_text().split("\n\n") if p.strip()]
    data = tmp_path / "paragraphs.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    logs = tmp_path / "logs"
    reference = tmp_path / "reference"
    process = start_streaming(streaming_argv(data, tmp_path / "reference-cache", reference), logs / "reference.err")
    assert process.wait(timeout=300) == 0, (logs / "reference.err").read_text()
    assert assert_cache_trusted(tmp_path / "reference-cache") >= 8

    out, cache = tmp_path / "run", tmp_path / "cache"
    moments = [(lambda: any(cache.rglob("train/0*.json")), rng.uniform(0, 0.2)),
               (lambda: (saved_step(out) or 0) >= 10, rng.uniform(0, 0.2)),
               (lambda: (saved_step(out) or 0) >= 20, 0.0)]
    landed = 0
    for k, (ready, delay) in enumerate(moments):
        err = logs / f"stream-{k}.err"
        landed += kill_9(start_streaming(streaming_argv(data, cache, out), err), ready, delay, err)
        assert_cache_trusted(cache)
        if saved_step(out):
            load_checkpoint(out, with_model=False)  # verified: whole
    assert landed >= 2, "the kills came too late: every run had finished"
    step = saved_step(out)
    assert step is not None and step < STREAM_STEPS, "the last kill came after the run's end"

    state = load_checkpoint(out, with_model=False).loader
    (split_dir,) = cache.rglob("train")
    chunk = split_dir / f"{state['chunk']:08d}.bin"  # where the resumed run reads on
    whole = chunk.read_bytes()
    chunk.write_bytes(whole[: len(whole) // 2])
    (val_record,) = cache.rglob("val/00000000.json")
    record = json.loads(val_record.read_text())
    val_record.write_text(json.dumps({**record, "doc_end": record["doc_end"] + 1}))
    err = logs / "stream-resume.err"
    assert start_streaming(streaming_argv(data, cache, out), err).wait(timeout=300) == 0, err.read_text()
    said = [line for line in err.read_text().splitlines() if "is not trusted" in line]
    assert sorted(line.split("'")[1] for line in said) == sorted([str(chunk), str(val_record)]), said
    assert chunk.read_bytes() == whole and assert_cache_trusted(cache)
    assert _curve(out) == _curve(reference)


# ------------------------------------------------------------------------ kill -9: pruning kept checkpoints

# `s2hc ARGV` that kills itself (SIGKILL, as `kill -9` does) right after the $S2HC_KILL_AFTER-th kept checkpoint it
# prunes is removed: a kill inside the pruning, where random moments rarely land (it takes microseconds).
PRUNE_CODE = ("import os, signal, sys\n"
              "import s2hc.rundir.kept as kept\n"
              "real, removed = kept.remove_checkpoint, []\n"
              "def remove(path):\n"
              "    real(path)\n"
              "    removed.append(path)\n"
              "    if len(removed) == int(os.environ['S2HC_KILL_AFTER']):\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "kept.remove_checkpoint = remove\n"
              "from s2hc import cli\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")


def pruned_argv(corpus_file: Path, cache: Path, out: Path, steps: int, keep: int) -> list[str]:
    return ["train", "--preset", "tiny", "--family", "s2hc", "--streams", "4",
            "--set", "model_overrides=" + json.dumps(SMALL_MODEL), "--set", "device=cpu", "--data", str(corpus_file),
            "--cache-dir", str(cache), "--seq-len", "32", "--batch-size", "4", "--max-steps", str(steps),
            "--warmup-steps", "2", "--eval-every", "1", "--eval-batches", "1", "--checkpoint-every", "1",
            "--keep-checkpoints", str(keep), "--keep-best", "--log-every", "1", "--no-progress", "--out", str(out),
            *(["--resume"] if (out / "checkpoint.pt").exists() else [])]


def assert_kept_consistent(out: Path) -> dict:
    """Every kept checkpoint is whole (verified), of this run, and of a step the run's metrics logged; what a kill
    left beside them is a hidden temporary name the next start removes. The kept ones."""
    from s2hc.rundir import kept_checkpoints, read_metrics
    from s2hc.rundir.checkpoint import check_kept_of_run
    from s2hc.rundir.layout import is_kept_temporary, parse_kept_name

    for path in (out / "checkpoints").iterdir():
        assert parse_kept_name(path.name) is not None or is_kept_temporary(path.name), path
    kept = kept_checkpoints(out)
    logged = {r["step"] for r in read_metrics(out) if "loss" in r}
    for key, path in kept.items():
        saved = load_checkpoint(path, with_model=False)  # verified
        assert saved.step in logged and (key == "best" or key == saved.step), path
    check_kept_of_run(out)
    return kept


@needs_linux
def test_kill_9_while_kept_checkpoints_are_pruned_leaves_a_whole_kept_set_and_the_run_resumes(corpus_file, tmp_path):
    """A run keeping the newest checkpoints (and the best) killed inside its pruning (after one of several removals,
    after the only one) and at random moments around it: what it keeps is whole, and resumed it prunes down to the
    newest K again, each step logged once."""
    rng = rng_for("pruning")
    out, cache, logs = tmp_path / "run", tmp_path / "cache", tmp_path / "logs"
    err = logs / "first.err"
    assert start(pruned_argv(corpus_file, cache, out, 4, 4), err).wait(timeout=300) == 0, err.read_text()
    assert [k for k in assert_kept_consistent(out) if k != "best"] == [1, 2, 3, 4]

    # keep 1 from now on: step 5 prunes steps 1-4, killed after the first removal; step 6 prunes 2-5, killed after
    # the third
    for k, (steps, after) in enumerate([(5, 1), (6, 3)]):
        err, argv = logs / f"prune-{k}.err", pruned_argv(corpus_file, cache, out, steps, 1)
        with err.open("w") as handle:
            process = subprocess.Popen([sys.executable, "-c", PRUNE_CODE, *argv], cwd=REPO,
                                       env={**os.environ, **OFFLINE_ENV, "S2HC_KILL_AFTER": str(after)},
                                       stdout=subprocess.DEVNULL, stderr=handle, start_new_session=True)
        assert process.wait(timeout=300) == -signal.SIGKILL, err.read_text()
        kept = assert_kept_consistent(out)
        assert steps in kept and len([k for k in kept if k != "best"]) > 1  # the new one kept, the pruning cut short

    # random moments while every step is kept, evaluated and pruned
    landed = 0
    for k, steps in enumerate((12,)):
        err = logs / f"random-{k}.err"
        process, began = start(pruned_argv(corpus_file, cache, out, steps, 2), err), saved_step(out)
        landed += kill_9(process, lambda began=began: saved_step(out) > began, rng.uniform(0, 0.3), err)
        assert_kept_consistent(out)
    assert landed >= 1, "the kill came too late: the run had finished"

    err = logs / "last.err"
    assert start(pruned_argv(corpus_file, cache, out, 14, 2), err).wait(timeout=300) == 0, err.read_text()
    kept = assert_kept_consistent(out)
    assert list(kept) == [13, 14, "best"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    from s2hc.rundir import read_metrics

    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, 15))  # each step once: a resume cuts the metrics back to its checkpoint
