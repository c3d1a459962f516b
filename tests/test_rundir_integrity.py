"""The run directory's parts on their own, without training: the guard's rules, the lock, the cleaning of
interrupted saves, atomic writes on a full disk, checkpoint checksums and finiteness, metrics.jsonl repair."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_checkpoint

import s2hc.io as s2hc_io
from s2hc.io import WriteError, atomic_write_bytes, atomic_write_text, check_output_dir
from s2hc.rundir import MetricsLog, RunLock, check_run_directory, load_checkpoint, read_metrics
from s2hc.rundir.checkpoint import NonFiniteError, save_checkpoint, state_digest
from s2hc.rundir.guard import LOCK, clean_interrupted_saves, clear_run, open_run_directory


class FullDisk:
    """A file whose writes fail with ENOSPC once ``limit`` bytes went through (what a full disk does)."""

    def __init__(self, handle, limit: int):
        self.handle, self.limit, self.written = handle, limit, 0

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > self.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


def full_disk(monkeypatch, limit: int = 1000) -> None:
    """From now on every atomic write of s2hc meets a disk with ``limit`` bytes left."""
    real = os.fdopen
    monkeypatch.setattr(s2hc_io.os, "fdopen", lambda fd, mode="r", *a, **k: FullDisk(real(fd, mode, *a, **k), limit))


# ------------------------------------------------------------------------------------------ atomic writes


def test_a_full_disk_keeps_the_old_file_and_says_so_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, tiny_checkpoint(step=1, model={"w": torch.ones(10)}))
    before = path.read_bytes()
    full_disk(monkeypatch)
    with pytest.raises(WriteError) as caught:
        # torch.save raises a RuntimeError inside
        save_checkpoint(path, tiny_checkpoint(step=2, model={"w": torch.ones(100_000)}))
    message = str(caught.value)
    assert "\n" not in message and repr(str(path)) in message and "No space left on device (ENOSPC)" in message
    assert "free some space" in message and caught.value.errno == errno.ENOSPC
    with pytest.raises(WriteError, match="ENOSPC"):
        atomic_write_text(tmp_path / "metrics.jsonl", "x" * 5000)
    monkeypatch.undo()
    assert path.read_bytes() == before and load_checkpoint(path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left behind


def test_output_directories_are_checked_in_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = {
        "": r"--out is empty",
        str(tmp_path / "file"): r"is a file, not a directory",
        str(tmp_path / "file" / "below"): r"cannot be written: Not a directory",
        "/proc/s2hc-run": r"cannot be written",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_output_dir(path, "--out")
    assert check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the write probe is gone


# ----------------------------------------------------------------------------------- checksums, finiteness


def test_checksum_covers_every_tensor_byte_and_every_value():
    state = {"step": 3, "config": {"lr": 1e-3}, "model": {"w": torch.arange(6.0).reshape(2, 3)}, "t": (1, 2)}
    digest = state_digest(state)[0]
    assert digest == state_digest({"t": [1, 2], "model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3,
                                   "config": {"lr": 1e-3}})[0]  # dict order and tuple/list do not matter
    flipped = state["model"]["w"].clone()
    flipped.view(torch.int32)[1, 1] ^= 1  # one bit of one float
    for changed in ({**state, "step": 4}, {**state, "config": {"lr": 2e-3}}, {**state, "model": {"w": flipped}},
                    {**state, "model": {"w": state["model"]["w"].reshape(3, 2)}},
                    {**state, "model": {"w": state["model"]["w"].double()}}):
        assert state_digest(changed)[0] != digest
    assert state_digest({"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.tensor(1.0)})[0].startswith("sha256:")


def test_non_finite_tensors_are_never_saved(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, tiny_checkpoint(step=1, model={"w": torch.ones(3)}))
    before = path.read_bytes()
    poisoned = {"w": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}
    optimizer = {"state": {"w": {"exp_avg_sq": torch.tensor([float("inf")])}}}
    with pytest.raises(NonFiniteError, match=r"not saved: model\.b and 1 more hold NaN or infinite") as caught:
        save_checkpoint(path, tiny_checkpoint(step=2, model=poisoned, optimizer=optimizer))
    assert caught.value.names == ["model.b", "optimizer.state.w.exp_avg_sq"]
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_changed_checkpoint_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, tiny_checkpoint(step=1, model={"w": torch.zeros(4096)}))
    data = bytearray(path.read_bytes())
    start = data.find(bytes(4096 * 4))  # the zeros of w, stored uncompressed
    assert start > 0
    data[start + 8000] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"checkpoint '.*checkpoint.pt' is damaged: checksum mismatch"):
        load_checkpoint(path)
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(ValueError, match=r"checkpoint.pt' is not an s2hc checkpoint, or is damaged"):
        load_checkpoint(path)


def test_checkpoints_of_version_1_still_load(tmp_path):
    torch.save({"format": "s2hc-checkpoint", "version": 1, "step": 5, "config": {}, "model_config": {}},
               tmp_path / "old.pt")
    old = load_checkpoint(tmp_path / "old.pt")
    assert old.step == 5 and old.written_by is None and old.history.step_times == []


# ------------------------------------------------------------------------------------------ metrics.jsonl


def test_metrics_a_cut_last_line_is_dropped_and_other_bad_lines_are_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # readers skip the cut line
    said = []
    MetricsLog(tmp_path, keep_until_step=2, log=said.append)
    assert path.read_text() == "\n".join(lines[:2]) + "\n"
    assert len(said) == 1 and "dropped its last line" in said[0] and "metrics.jsonl" in said[0]

    for bad, problem in (('{"step": 1', "line 1 is not JSON"), ('{"loss": 2.0}', "line 1 is not a metrics record"),
                         ('[1, 2]', "line 1 is not a metrics record"), ('{"step": "3"}', "line 1 is not")):
        path.write_text(bad + "\n" + lines[1] + "\n")
        with pytest.raises(ValueError, match=rf"metrics.jsonl' {problem}"):
            read_metrics(tmp_path)
        with pytest.raises(ValueError, match=rf"metrics.jsonl' {problem}"):
            MetricsLog(tmp_path, keep_until_step=2)
    path.write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl' is not a UTF-8 text file"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"has no metrics.jsonl"):
        read_metrics(tmp_path / "nothing")


# ------------------------------------------------------------------------------------------------- guard


def test_the_rules_of_a_run_directory(tmp_path):
    run = tmp_path / "run"
    check_run_directory(run)  # new: fine, and nothing is created
    assert not run.exists()
    with pytest.raises(ValueError, match=r"--resume: '.*run' does not exist, so there is no run to resume.*drop"):
        check_run_directory(run, resume=True)
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds no run to resume .*drop --resume"):
        check_run_directory(run, resume=True)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"'.*run' already holds a run \(metrics.jsonl\); pass --resume to continue "
                                         r"it, --overwrite to replace it, or choose another --out"):
        check_run_directory(run)
    check_run_directory(run, resume=True)
    check_run_directory(run, overwrite=True)
    with pytest.raises(ValueError, match=r"give one of them"):
        check_run_directory(run, resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"--out is empty"):
        check_run_directory("  ")
    with pytest.raises(ValueError, match=r"is a file, not a directory"):
        check_run_directory(run / "notes.txt")
    (run / "diagnostics").mkdir()
    assert clear_run(run, log=None) == ["metrics.jsonl", "diagnostics"]
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # not the run's: kept


def test_open_run_directory_locks_and_leaves_nothing_when_nothing_was_written(tmp_path):
    run = tmp_path / "new" / "run"
    with open_run_directory(run, log=None) as opened:
        assert opened == run and (run / LOCK).read_text().split()[0] == str(os.getpid())
        in_use = rf"'{run}' is in use by another s2hc process \(pid {os.getpid()} on "
        with pytest.raises(ValueError, match=in_use), open_run_directory(run, log=None):
            pass
    assert not run.exists()  # created here, nothing written: removed again
    with open_run_directory(run, log=None):
        (run / "config.yaml").write_text("a: 1\n")
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # the lock file goes with the lock


def test_another_process_holding_the_lock_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from s2hc.rundir import RunLock; RunLock(sys.argv[1]).acquire(); "
         "print('locked', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"is in use by another s2hc process \(pid {holder.pid} on "):
            RunLock(tmp_path).acquire(log=None)
    finally:
        holder.kill()  # SIGKILL: no release, the lock file stays with its pid
        holder.wait()
    assert (tmp_path / LOCK).read_text().split()[0] == str(holder.pid)
    said = []
    lock = RunLock(tmp_path).acquire(log=said.append)
    assert len(said) == 1 and f"took over the lock left by pid {holder.pid}" in said[0]
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_temporary_files_of_interrupted_saves_are_removed_and_a_cut_swap_is_put_back(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"kept")
    (tmp_path / ".checkpoint.pt.s2hc-2b3c4d5e.tmp").write_bytes(os.urandom(1 << 20))
    (tmp_path / ".metrics.jsonl.s2hc-abc01234.tmp").write_text("x")
    (tmp_path / "notes.tmp").write_text("not ours")  # not a hidden temporary of an atomic write
    for name in ("checkpoint.dcp.old", "checkpoint.dcp.tmp"):  # a sharded save killed between its two renames
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_text(name)
        (tmp_path / name / "extra.pt").write_text(name)
    said = []
    removed = clean_interrupted_saves(tmp_path, log=said.append)
    assert (tmp_path / "checkpoint.dcp" / ".metadata").read_text() == "checkpoint.dcp.tmp"  # the newer, complete
    assert sorted(removed) == [".checkpoint.pt.s2hc-2b3c4d5e.tmp", ".metrics.jsonl.s2hc-abc01234.tmp",
                               "checkpoint.dcp.old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.dcp", "checkpoint.pt", "notes.tmp"]
    assert "put back checkpoint.dcp/" in said[0] and "removed 3 temporary file(s)" in said[1] and "MiB" in said[1]

    # the swap's first rename done, the new directory incomplete: the old one comes back
    os.replace(tmp_path / "checkpoint.dcp", tmp_path / "checkpoint.dcp.old")
    (tmp_path / "checkpoint.dcp.tmp").mkdir()
    clean_interrupted_saves(tmp_path, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.dcp", "checkpoint.pt", "notes.tmp"]


def test_atomic_write_bytes_is_unchanged_for_good_writes(tmp_path):
    atomic_write_bytes(tmp_path / "sub" / "a.bin", lambda handle: handle.write(b"abc"))
    assert (tmp_path / "sub" / "a.bin").read_bytes() == b"abc"
    assert oct((tmp_path / "sub" / "a.bin").stat().st_mode & 0o777) != oct(0o600)
