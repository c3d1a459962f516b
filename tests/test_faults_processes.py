"""Processes that must not outlive, or ignore, the one that runs them; files that must not be taken for ours.

Reproduced on real processes (``python -m s2hc``) with a small model:

- ``kill -9`` of ``s2hc study`` takes its ``s2hc train`` child with it (Linux: a parent-death signal), so the
  study called again takes over the dead child's lock and goes on; a run of several processes (torchrun and its
  workers) goes too; a lock whose holder is a zombie is taken over;
- whatever ends the study's runner (an exception, here a log whose pipe is gone), no child is left running:
  SIGTERM, then SIGKILL after a grace period, and every child reaped;
- the first SIGINT/SIGTERM asks for a stop after the current step and says so; a second one stops at once;
- opening a run directory removes only the temporary files s2hc itself names, never a user's ``.*.tmp``.
- two processes on one directory (two ``train --resume`` at once, a study and a train, either first): the
  second is refused in one line naming the holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import SMALL_MODEL, small_config

from s2hc.cli import main
from s2hc.io import atomic_write_bytes
from s2hc.rundir import open_run_directory
from s2hc.rundir.guard import LOCK, RunLock, _alive
from s2hc.study import parse_spec, run_study
from s2hc.study import runner as study_runner
from s2hc.train import train
from s2hc.train.processes import stop_processes

ROOT = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")
needs_linux = pytest.mark.skipif(not LINUX, reason="a parent-death signal and /proc exist on Linux alone")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")  # one token cache for the module: tokenised once


@pytest.fixture()
def leftovers():
    """PIDs a test started or found; whatever of them still runs at the end is killed (a failing test must not
    leave training processes behind)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_until(condition, what: str, timeout: float = 60.0, process: subprocess.Popen | None = None,
               err: Path | None = None) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after ``timeout`` s or when ``process`` ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"ended (status {process.returncode}) before {what}: {err.read_text() if err else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {err.read_text() if err else ''}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended: no such process, or a zombie nobody reaped yet."""
    return not _alive(pid)


def lock_holder(run_dir: Path) -> int | None:
    text = (run_dir / LOCK).read_text().split() if (run_dir / LOCK).is_file() else []
    return int(text[0]) if text and text[0].isdigit() else None


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"loss"') if metrics.is_file() else 0


def study_train(corpus_file: Path, cache: Path, **changes) -> dict:
    """The ``train:`` settings of a small study: one step takes milliseconds on a CPU core."""
    return {"preset": "tiny", "model_overrides": dict(SMALL_MODEL), "data": str(corpus_file), "cache_dir": str(cache),
            "seq_len": 32, "batch_size": 4, "max_steps": 100_000, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0,
            "eval_batches": 1, "checkpoint_every": 5, "log_every": 1, "dtype": "float32", "device": "cpu",
            **changes}


def start_study(config: Path, out: Path, err: Path) -> subprocess.Popen:
    """``s2hc study CONFIG --out OUT``, stderr into ``err``; in a session of its own, as a shell would start it."""
    return subprocess.Popen([sys.executable, "-m", "s2hc", "study", str(config), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True)


# --------------------------------------------------------------------- kill -9 of a study takes its runs


@needs_linux
def test_kill_9_of_a_study_takes_its_run_with_it_and_the_study_called_again_goes_on(corpus_file, cache, tmp_path,
                                                                                    leftovers):
    config, out, err = tmp_path / "study.yaml", tmp_path / "study", tmp_path / "study.err"
    config.write_text(yaml.safe_dump({"train": study_train(corpus_file, cache), "seeds": 1, "families": ["residual"],
                                      "baselines": [], "diagnostics_tokens": 64}))
    run_dir, log = out / "runs" / "residual-seed0", out / "logs" / "residual-seed0.log"
    first = start_study(config, out, err)
    leftovers.append(first.pid)
    wait_until(lambda: (run_dir / "checkpoint.pt").exists() and lock_holder(run_dir), "the run's first checkpoint",
               process=first, err=err)
    child = lock_holder(run_dir)
    leftovers.append(child)
    first.send_signal(signal.SIGKILL)  # the study alone, as `kill -9 PID` does
    first.wait(timeout=30)
    wait_until(lambda: gone(child), f"the study's run (pid {child}) to die with the study", timeout=15)

    second = start_study(config, out, err)  # what docs/study.md says to do after a kill
    leftovers.append(second.pid)
    wait_until(lambda: f"took over the lock left by pid {child}" in log.read_text(),
               "the study called again to take over the dead run's lock", process=second, err=err)
    wait_until(lambda: lock_holder(run_dir) not in (None, child), "the new run to hold the lock", process=second,
               err=err)
    run = lock_holder(run_dir)
    leftovers.append(run)
    wait_until(lambda: logged_steps(run_dir) > 5, "the new run to train", process=second, err=err)
    second.send_signal(signal.SIGTERM)  # passed on: the run saves a checkpoint, stops and releases its lock
    assert second.wait(timeout=60) == 128 + signal.SIGTERM, err.read_text()
    assert "start residual-seed0 (resuming from step 5)" in err.read_text()
    assert not (run_dir / LOCK).exists() and all(gone(pid) for pid in leftovers)


@needs_linux
def test_a_run_asked_to_die_with_a_parent_that_is_already_gone_does_not_start(tmp_path):
    """The parent may die before the child has asked the kernel to follow it: the child sees it and stops."""
    env = {**os.environ, "S2HC_DIE_WITH_PARENT": "1"}  # pid 1 is nobody's parent here
    done = subprocess.run([sys.executable, "-m", "s2hc", "--version"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "its parent process (pid 1) has ended" in done.stderr


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rpartition(")")[2].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, level = [], [pid]
    while level:
        level = [child for child, parent in parents.items() if parent in level]
        found += level
    return found


PARENT = """
import os, subprocess, sys
from s2hc.train.processes import die_with_parent_env
child = subprocess.Popen([sys.executable, "-m", "s2hc", *sys.argv[1:]], start_new_session=True,
                         env=die_with_parent_env({**os.environ, "OMP_NUM_THREADS": "1"}))
sys.exit(child.wait())
"""


@needs_linux
def test_kill_9_of_the_parent_of_a_multi_process_run_takes_torchrun_and_its_workers(corpus_file, cache, tmp_path,
                                                                                   leftovers):
    """A study's run with ``nproc: 2``: the launcher becomes torchrun, whose workers die with it."""
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--family", "s2hc", "--streams", "4", "--set",
            "model_overrides=" + json.dumps(SMALL_MODEL), "--data", str(corpus_file), "--cache-dir", str(cache),
            "--seq-len", "32", "--batch-size", "2", "--max-steps", "100000", "--eval-every", "0",
            "--checkpoint-every", "2", "--no-progress", "--out", str(out), "--nproc", "2"]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    leftovers.append(parent.pid)
    wait_until(lambda: (out / "checkpoint.dcp").is_dir(), "the job's first checkpoint", timeout=120, process=parent)
    tree = descendants(parent.pid)
    leftovers.extend(tree)
    assert len(tree) >= 3, tree  # torchrun (in the launcher's place) and 2 workers
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    wait_until(lambda: all(gone(pid) for pid in tree), "torchrun and its workers to die with the parent", timeout=30)


# ------------------------------------------------------------- no run outlives the study's runner


def test_an_error_in_a_parallel_study_stops_and_reaps_every_run(corpus_file, cache, tmp_path, monkeypatch):
    spec = parse_spec({"train": study_train(corpus_file, cache), "seeds": 2, "families": ["residual"],
                       "baselines": [], "diagnostics_tokens": 64})
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording(*args, **kwargs):
        process = real_popen(*args, **kwargs)
        command = args[0] if args else kwargs.get("args")
        if not (isinstance(command, (list, tuple)) and command and command[0] == "git"):  # the runs, not the
            started.append(process)  # git that finds the study's commit
        return process

    def log(line: str) -> None:  # stderr closed under the study (`s2hc study ... | head`): a real error
        if line.startswith("start residual-seed1"):
            wait_until(lambda: logged_steps(tmp_path / "runs" / "residual-seed0") >= 1, "the first run to train",
                       process=started[0])
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(study_runner.subprocess, "Popen", recording)
    try:
        with pytest.raises(BrokenPipeError):
            run_study(spec, tmp_path, jobs=2, log=log)
        assert len(started) == 1 and started[0].returncode is not None, "a run still trains after the study ended"
        assert started[0].returncode == 128 + signal.SIGTERM  # asked to stop: it saved a checkpoint
        assert not (tmp_path / "runs" / "residual-seed0" / LOCK).exists()
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()


def test_stopping_children_sends_sigterm_then_sigkill_after_the_grace_period(tmp_path):
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(60)")
    polite = "import sys, time; print('ready', flush=True); time.sleep(60)"
    processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True) for code in (stubborn, polite)]
    try:
        assert [p.stdout.readline().strip() for p in processes] == ["ready", "ready"]
        started = time.monotonic()
        stop_processes(processes, grace_s=1.0)
        assert [p.returncode for p in processes] == [-signal.SIGKILL, -signal.SIGTERM]
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


# ----------------------------------------------------------------------- a second signal stops at once


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (a run installs one for SIGTERM as it starts)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@needs_linux
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_a_long_step_at_once(corpus_file, cache, tmp_path, signum, leftovers):
    config = small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=10, grad_accum=1_000_000,
                          eval_every=0, checkpoint_every=1)
    err = tmp_path / "train.err"
    command = [sys.executable, "-m", "s2hc", "train", "--preset", "tiny", "--family", "s2hc", "--streams", "4",
               "--set", "model_overrides=" + json.dumps(SMALL_MODEL), "--data", config.data, "--cache-dir",
               config.cache_dir, "--seq-len", "32", "--batch-size", "4", "--max-steps", "10", "--grad-accum",
               "1000000", "--eval-every", "0", "--no-progress", "--out", config.out]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err.open("w"))
    leftovers.append(process.pid)
    metrics = Path(config.out) / "metrics.jsonl"
    wait_until(lambda: metrics.is_file() and '"platform"' in metrics.read_text(), "the run to be set up",
               process=process, err=err)
    time.sleep(1.5)  # past the console into the first step, which takes minutes (a signal before it stops at once)
    process.send_signal(signum)
    wait_until(lambda: "stopping after this step" in err.read_text(), "the first signal to be acknowledged",
               timeout=30, process=process, err=err)
    assert "again to stop now" in err.read_text()
    assert process.poll() is None, "the first signal must wait for the step to end"
    started = time.monotonic()
    process.send_signal(signum)
    assert process.wait(timeout=30) == 130, err.read_text()
    assert time.monotonic() - started < 10
    assert "Traceback" not in err.read_text() and "stopping now" in err.read_text()
    run = Path(config.out)
    assert not (run / LOCK).exists() and not list(run.glob(".*.tmp"))


# ---------------------------------------------------------- a signal before the loop stops the run at once


def test_sigterm_while_the_data_is_tokenised_stops_the_run_at_once_and_leaves_no_run(tmp_path, leftovers):
    """One SIGTERM stops a run wherever it is: here tokenising 10 MB of text (tens of seconds on 2 cores)."""
    from s2hc.data.corpus import load_corpus
    from s2hc.rundir import holds_run

    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(load_corpus("train")))
    run, err = tmp_path / "run", tmp_path / "train.err"
    command = [sys.executable, "-m", "s2hc", "train", "--preset", "tiny", "--data", str(text), "--cache-dir",
               str(tmp_path / "cache"), "--max-steps", "5", "--no-progress", "--out", str(run)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err.open("w"))
    leftovers.append(process.pid)
    wait_until(lambda: (run / LOCK).exists(), "the run directory to be opened", process=process, err=err)
    time.sleep(0.3)  # into the tokenisation
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, err.read_text()
    assert time.monotonic() - started < 30
    said = err.read_text()
    assert said.strip().splitlines()[-1] == (
        "s2hc train: stopped by signal 15 before the first step; nothing was saved: run the same command again")
    assert "Traceback" not in said
    assert not holds_run(run) and not (run / LOCK).exists()  # the same command is not refused


def _signal_in(monkeypatch, where: str, signum: int = signal.SIGTERM) -> None:
    """A real ``signum`` to this process when the run enters ``s2hc.train.loop.<where>`` (a ``_Run`` method or a
    function of the module)."""
    from s2hc.train import loop

    owner, name = (loop._Run, where.removeprefix("_Run.")) if where.startswith("_Run.") else (loop, where)
    real = getattr(owner, name)

    def signalled(*args, **kwargs):
        signal.raise_signal(signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


@pytest.mark.parametrize("where", ["_Run._build_model", "_platform"])  # the model built; config.yaml written
def test_sigterm_before_the_first_step_stops_a_new_run_at_once_and_leaves_no_run(corpus_file, cache, tmp_path,
                                                                                 monkeypatch, where):
    from s2hc.rundir import holds_run
    from s2hc.train import Interrupted

    config = small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=2)
    with monkeypatch.context() as patch:
        _signal_in(patch, where)
        with pytest.raises(Interrupted, match="stopped by signal 15 before the first step; nothing was saved") as info:
            train(config)
    assert info.value.signum == signal.SIGTERM
    run = Path(config.out)
    assert not holds_run(run) and not (run / LOCK).exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is the run's alone
    assert train(config).step == 2  # the same command again: not refused


def test_sigterm_while_a_resume_restores_the_model_keeps_the_run_as_it_was(corpus_file, cache, tmp_path,
                                                                          monkeypatch):
    from s2hc.rundir import load_checkpoint, read_metrics
    from s2hc.train import Interrupted

    config = small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=2, log_every=1)
    train(config)
    run = Path(config.out)
    before = (run / "metrics.jsonl").read_text(), (run / "checkpoint.pt").read_bytes()
    with monkeypatch.context() as patch:
        _signal_in(patch, "_Run._build_model")
        with pytest.raises(Interrupted, match=r"before training went on; the run is as it was: resume with "
                                              rf"`s2hc train --out {run} --resume`"):
            train(config.replace(max_steps=4), resume=True)
    assert ((run / "metrics.jsonl").read_text(), (run / "checkpoint.pt").read_bytes()) == before
    assert not (run / LOCK).exists()
    assert train(config.replace(max_steps=4), resume=True).step == 4
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    assert load_checkpoint(run, with_model=False).step == 4


# ------------------------------------------------------------- only s2hc's own temporary files are removed

KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
from s2hc.io import atomic_write_bytes

def write(handle):  # half a checkpoint, then a kill: its temporary file stays behind
    handle.write(b"half of a checkpoint")
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)

atomic_write_bytes(Path(sys.argv[1]) / "checkpoint.pt", write)
"""


def test_opening_a_run_directory_removes_only_the_temporary_files_s2hc_names(corpus_file, cache, tmp_path):
    config = small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=2)
    train(config)
    run = Path(config.out)
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(run)], cwd=ROOT, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    interrupted = [p.name for p in run.glob(".checkpoint.pt.*.tmp")]
    assert len(interrupted) == 1, interrupted
    users = {".notes.tmp": "my notes", ".checkpoint.pt.mine.tmp": "a copy I keep", ".config.yaml.tmp": "draft",
             ".metrics.jsonl.v2.tmp": "mine", ".checkpoint.pt.s2hc-mine.tmp": "not a name s2hc makes"}
    for name, text in users.items():
        (run / name).write_text(text)
    said: list[str] = []
    with open_run_directory(run, resume=True, log=said.append):
        pass
    assert {name: (run / name).read_text() for name in users} == users
    assert not (run / interrupted[0]).exists()
    assert any("removed 1 temporary file(s) of interrupted saves" in line and interrupted[0] in line
               for line in said), said


def test_atomic_writes_name_their_temporary_files_distinctively(tmp_path):
    seen = []
    atomic_write_bytes(tmp_path / "checkpoint.pt", lambda handle: seen.extend(p.name for p in tmp_path.iterdir()))
    assert len(seen) == 1 and seen[0].startswith(".checkpoint.pt.s2hc-") and seen[0].endswith(".tmp"), seen


# ------------------------------------------------------------ a lock held by a zombie is taken over


@needs_linux
def test_the_pid_guard_takes_over_a_lock_whose_holder_is_a_zombie(tmp_path, monkeypatch):
    """Where flock is not supported the pid decides; a dead child nobody has reaped yet is not alive."""
    import s2hc.rundir.guard as guard

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(")")[-1].split()[0] == "Z",
               "the child to end")
    try:
        assert not _alive(zombie.pid) and _alive(os.getpid())
        import socket

        (tmp_path / LOCK).write_text(f"{zombie.pid} {socket.gethostname()}\n")
        monkeypatch.setattr(guard, "fcntl", None)
        said: list[str] = []
        RunLock(tmp_path).acquire(log=said.append).release()
        assert f"took over the lock left by pid {zombie.pid}" in said[0]
    finally:
        zombie.wait()


# ------------------------------------------------------------------------- two processes on one directory


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def test_a_second_resume_and_a_study_on_a_run_in_use_are_refused_and_a_train_on_a_study_in_use(
        corpus_file, cache, tmp_path, leftovers, capsys):
    """Two `s2hc train --out RUN --resume` at once, a study and a train on one directory, either first: the second
    is refused in one line naming the holder, before it writes anything; the first goes on."""
    config = small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=2, checkpoint_every=1,
                          eval_every=0, log_every=1)
    train(config)
    run_dir, err = Path(config.out), tmp_path / "first.err"
    first = subprocess.Popen([sys.executable, "-m", "s2hc", "train", "--out", str(run_dir), "--resume",
                              "--max-steps", "100000", "--checkpoint-every", "5"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True)
    leftovers.append(first.pid)
    wait_until(lambda: lock_holder(run_dir) == first.pid and logged_steps(run_dir) > 2, "the resumed run to train",
               process=first, err=err)
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({"train": study_train(corpus_file, cache), "seeds": 1, "families": ["residual"],
                                     "baselines": [], "diagnostics_tokens": 64}))
    in_use = f"{str(run_dir)!r} is in use by another s2hc process (pid {first.pid} on "
    capsys.readouterr()
    for argv in (["train", "--out", str(run_dir), "--resume"], ["study", str(study), "--out", str(run_dir)]):
        assert main(argv) == 2
        assert in_use in _one_line(capsys)
    assert first.poll() is None
    first.send_signal(signal.SIGTERM)  # the first saves its checkpoint and stops, as ever
    assert first.wait(timeout=60) == 128 + signal.SIGTERM, err.read_text()
    assert not (run_dir / LOCK).exists()

    out, err = tmp_path / "study", tmp_path / "study.err"
    running = start_study(study, out, err)
    leftovers.append(running.pid)
    wait_until(lambda: lock_holder(out) == running.pid, "the study to hold its directory", process=running, err=err)
    assert main(["train", "--config", "demo-tiny", "--out", str(out)]) == 2
    assert f"{str(out)!r} is in use by another s2hc process (pid {running.pid} on " in _one_line(capsys)
    running.send_signal(signal.SIGTERM)
    running.wait(timeout=60)
