"""Fault injection on real training runs: nothing in a run directory is ever lost or corrupted.

The faults reproduced: training into an existing run, two runs into one
directory, non-finite weights, optimizer state and validation loss, temporary files of killed saves, a
bit-flipped checkpoint, a cut metrics line, a mistyped ``--resume``; and a full disk while saving, SIGKILL at
random moments of training and saving, a concurrent run, a comparison's runs. Small model, a few steps each.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import crash_after_checkpoint, small_config
from test_rundir_integrity import full_disk

from s2hc.cli import main
from s2hc.rundir import holds_run, load_checkpoint, load_model, read_metrics
from s2hc.rundir.guard import LOCK
from s2hc.study import compare
from s2hc.train import TrainingError, train


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")  # one token cache for the module: tokenised once


@pytest.fixture()
def config(corpus_file, cache, tmp_path):
    return small_config(corpus_file, tmp_path, cache_dir=str(cache), max_steps=6, warmup_steps=2, lr=3e-3,
                        checkpoint_every=2, eval_every=3, log_every=1)


def curve(run_dir) -> list[tuple]:
    """Every loss and validation loss of a run, by step."""
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)
            if "loss" in r or "val_loss" in r]


def snapshot(run_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(run_dir).iterdir()) if p.is_file()}


def cli_args(config) -> list[str]:
    return [
        "--preset", config.preset, "--family", config.family, "--streams", str(config.n_streams),
        "--set", "model_overrides=" + json.dumps(config.model_overrides), "--data", config.data,
        "--cache-dir", config.cache_dir, "--seq-len", str(config.seq_len), "--batch-size", str(config.batch_size),
        "--max-steps", str(config.max_steps), "--warmup-steps", str(config.warmup_steps), "--lr", str(config.lr),
        "--eval-every", str(config.eval_every), "--set", f"eval_batches={config.eval_batches}",
        "--checkpoint-every", str(config.checkpoint_every), "--log-every", str(config.log_every),
        "--seed", str(config.seed), "--no-progress", "--out", config.out,
    ]


def error_line(capsys) -> str:
    """The one line a refused command prints last on stderr (after argparse's usage, when it prints one)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# --------------------------------------------------------------------------- a run is never overwritten


def test_training_into_an_existing_run_is_refused_and_overwrite_replaces_it(config, capsys):
    train(config.replace(max_steps=4))
    before = snapshot(config.out)
    other = config.replace(family="mhc", max_steps=8)
    with pytest.raises(ValueError, match=rf"'{config.out}' already holds a run \(config.yaml, metrics.jsonl, "
                                         r"checkpoint.pt\); pass --resume to continue it, --overwrite to replace it"):
        train(other)
    assert main(["train", *cli_args(other)]) == 2
    assert "already holds a run" in error_line(capsys)
    assert snapshot(config.out) == before  # not a byte changed

    train(other, overwrite=True)
    assert "--overwrite: removed the run" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(config.out) if "loss" in r] == list(range(1, 9))  # the new run alone
    model, saved = load_model(config.out)
    assert saved.family == "mhc" and model.config.family == "mhc" and load_checkpoint(config.out).step == 8


def test_resume_needs_a_run_and_out_must_name_one(config, tmp_path, capsys):
    missing = config.replace(out=str(tmp_path / "mistyped"))
    with pytest.raises(ValueError, match=r"--resume: '.*mistyped' does not exist, so there is no run to resume"):
        train(missing, resume=True)
    assert not Path(missing.out).exists()  # nothing created, nothing trained
    (tmp_path / "empty").mkdir()
    assert main(["train", *cli_args(config.replace(out=str(tmp_path / "empty"))), "--resume"]) == 2
    assert "holds no run to resume" in error_line(capsys)
    assert list((tmp_path / "empty").iterdir()) == []
    with pytest.raises(ValueError, match=r"give one of them"):
        train(config, resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"out.*empty"):  # refused by the config or by the guard: never the cwd
        train(config.replace(out=""))


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_again(config):
    reference = config.replace(out=config.out + "-reference")
    train(reference)
    Path(config.out).mkdir()
    Path(config.out, "config.yaml").write_text(Path(reference.out, "config.yaml").read_text())
    Path(config.out, "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    train(config, resume=True)
    assert curve(config.out) == curve(reference.out)
    Path(config.out, "checkpoint.pt").unlink()
    with pytest.raises(ValueError, match=r"trained with a different configuration \(seed: 1337 -> 5\)"):
        train(config.replace(seed=5), resume=True)


# ----------------------------------------------------------------------------- one process per directory


def test_a_second_run_into_a_directory_in_use_is_refused_and_the_first_is_unharmed(config, capsys):
    first = config.replace(max_steps=40, checkpoint_every=10, eval_every=20)
    reference = first.replace(out=first.out + "-reference")
    train(reference)
    process = subprocess.Popen([sys.executable, "-m", "s2hc", "train", *cli_args(first)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = Path(first.out) / LOCK
        deadline = time.time() + 120
        while time.time() < deadline and not (lock.exists() and lock.read_text().strip()):
            assert process.poll() is None, process.communicate()
            time.sleep(0.01)
        second = first.replace(family="mhc", seed=7)
        assert main(["train", *cli_args(second)]) == 2
        assert f"is in use by another s2hc process (pid {process.pid} on " in error_line(capsys)
        for kwargs in ({"resume": True}, {"overwrite": True}):  # not even --overwrite gets past the lock
            with pytest.raises(ValueError, match=rf"in use by another s2hc process \(pid {process.pid} "):
                train(second, **kwargs)
        assert process.poll() is None, "the first run ended before the second tried: make it longer"
    finally:
        out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert curve(first.out) == curve(reference.out)
    assert load_checkpoint(first.out).config == first.to_dict()
    assert "family: s2hc" in Path(first.out, "config.yaml").read_text()
    assert not (Path(first.out) / LOCK).exists()


# -------------------------------------------------------------------------------- nothing non-finite kept


def _infinite_learning_rate_at(monkeypatch, bad_step: int) -> None:
    import s2hc.train.loop as loop

    real = loop.learning_rate
    monkeypatch.setattr(loop, "learning_rate",
                        lambda step, **kw: math.inf if step == bad_step - 1 else real(step, **kw))


def test_non_finite_weights_stop_the_run_and_the_last_good_checkpoint_is_kept(config, monkeypatch):
    _infinite_learning_rate_at(monkeypatch, 3)
    with pytest.raises(TrainingError, match=r"non-finite weights after the update of step 3 \(.*learning rate "
                                            r"inf\); stopped; the last good checkpoint \(step 2\) is kept in "
                                            r"'.*checkpoint.pt'"):
        train(config.replace(checkpoint_every=1))
    saved = load_checkpoint(config.out)
    assert saved.step == 2
    assert all(torch.isfinite(t).all() for t in saved.model.values())
    assert all(torch.isfinite(t).all() for s in saved.optimizer["state"].values() for t in s.values())


def test_a_failed_run_never_names_the_checkpoint_of_an_earlier_run(config, monkeypatch):
    train(config)  # an earlier run, checkpoint at step 6
    _infinite_learning_rate_at(monkeypatch, 1)
    with pytest.raises(TrainingError, match=r"step 1 .*; stopped; no checkpoint of this run was written to "):
        train(config.replace(family="mhc"), overwrite=True)
    assert not Path(config.out, "checkpoint.pt").exists()


def test_a_non_finite_validation_loss_stops_the_run(config, monkeypatch):
    import s2hc.train.loop as loop

    monkeypatch.setattr(loop, "evaluate", lambda *args: math.nan)
    with pytest.raises(TrainingError, match=r"non-finite validation loss \(nan\) at step 3; stopped; the last good "
                                            r"checkpoint \(step 2\)"):
        train(config)
    assert load_checkpoint(config.out).step == 2
    assert not any("val_loss" in r for r in read_metrics(config.out))


def test_a_non_finite_optimizer_state_is_never_saved(config, monkeypatch):
    import s2hc.train.checkpointer as state

    real = state.get_state_dict

    def poisoned(model, optimizers):  # the checkpointer passes its optimizers as a tuple (AdamW, or Muon and AdamW)
        model_state, optimizer_state = real(model, optimizers)
        (optimizer,) = optimizers
        if optimizer.state[next(iter(optimizer.state))]["step"] >= 4:
            name = next(iter(optimizer_state["state"]))
            optimizer_state["state"][name]["exp_avg_sq"] = optimizer_state["state"][name]["exp_avg_sq"] * math.inf
        return model_state, optimizer_state

    monkeypatch.setattr(state, "get_state_dict", poisoned)
    with pytest.raises(TrainingError, match=r"the training state of step 4 is not finite, so it was not saved "
                                            r"\(optimizer\.state\..*\.exp_avg_sq hold NaN or infinite values\); "
                                            r"stopped; the last good checkpoint \(step 2\)"):
        train(config)
    assert load_checkpoint(config.out).step == 2


# --------------------------------------------------------------------- leftovers, bit rot, cut metrics


def test_temporary_files_of_killed_saves_are_removed_on_the_next_start(config, capsys):
    train(config.replace(max_steps=2))
    run = Path(config.out)
    (run / ".checkpoint.pt.s2hc-8a1ce2f0.tmp").write_bytes(os.urandom(1 << 20))
    (run / ".config.yaml.s2hc-0b9d4e17.tmp").write_text("half")
    (run / "checkpoint.dcp.tmp").mkdir()
    (run / "checkpoint.dcp.tmp" / "__0_0.distcp").write_bytes(b"partial")
    train(config.replace(max_steps=4), resume=True)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.jsonl"]
    assert "removed 3 temporary file(s) of interrupted saves" in capsys.readouterr().err


def _flip_a_bit_of_the_largest_tensor(path: Path) -> None:
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[member.header_offset + 26: member.header_offset + 30])
    start = member.header_offset + 30 + name_length + extra_length
    data[start + member.file_size // 2] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_bit_flipped_checkpoint_is_refused_by_resume_load_and_the_commands(config, capsys):
    train(config.replace(max_steps=2))
    checkpoint = Path(config.out) / "checkpoint.pt"
    _flip_a_bit_of_the_largest_tensor(checkpoint)
    damaged = rf"checkpoint '{checkpoint}' is damaged: checksum mismatch"
    for attempt in (lambda: load_checkpoint(config.out), lambda: load_model(config.out),
                    lambda: train(config.replace(max_steps=4), resume=True)):
        with pytest.raises(ValueError, match=damaged):
            attempt()
    assert main(["generate", config.out, "--prompt", "To be", "--max-new-tokens", "2", "--temperature", "0"]) == 2
    assert "is damaged: checksum mismatch" in error_line(capsys)


def test_sharded_checkpoints_carry_the_checksums_of_their_shards_and_are_finite_too(config, monkeypatch):
    """The torch.distributed.checkpoint kind (here FSDP2 in one process): every shard file's SHA-256 is in
    extra.pt and verified; a non-finite state is refused before any rank writes."""
    import s2hc.train.checkpointer as state

    sharded = config.replace(parallel="fsdp", max_steps=2)
    train(sharded)
    directory = Path(config.out) / "checkpoint.dcp"
    assert set(torch.load(directory / "extra.pt", weights_only=True)["shards"]) == {".metadata", "__0_0.distcp"}
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"checkpoint '{directory}' is damaged: checksum mismatch of __0_0.distcp"):
        train(sharded.replace(max_steps=4), resume=True)

    real = state.get_state_dict
    monkeypatch.setattr(state, "get_state_dict", lambda model, optimizer: (
        {name: t * math.nan if name.endswith("embed.weight") else t for name, t in real(model, optimizer)[0].items()},
        real(model, optimizer)[1]))
    with pytest.raises(TrainingError, match=r"the training state of step 2 is not finite, so it was not saved "
                                            r"\(model\.embed\.weight hold NaN"):
        train(sharded.replace(out=config.out + "-nan"))
    assert not (Path(config.out + "-nan") / "checkpoint.dcp").exists()


def test_a_cut_last_metrics_line_is_dropped_on_resume_and_a_bad_line_is_named(config, capsys):
    reference = config.replace(out=config.out + "-reference")
    train(reference)
    crash_after_checkpoint(config, 4)
    metrics = Path(config.out) / "metrics.jsonl"
    with metrics.open("a") as handle:
        handle.write('{"step": 5, "loss": 3.')  # killed while appending
    train(config, resume=True)
    assert curve(config.out) == curve(reference.out)
    assert "dropped its last line, cut short by an interrupted write" in capsys.readouterr().err

    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:3] + ['{"loss": 1.0}'] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl' line 4 is not a metrics record \(an object with an "
                                         r"integer 'step'\)"):
        train(config.replace(max_steps=8), resume=True)


# ------------------------------------------------------------------------------------------ full disk


def test_a_full_disk_while_saving_stops_the_run_and_keeps_the_last_checkpoint(config, monkeypatch, capsys):
    import s2hc.train.checkpointer as state

    reference = config.replace(out=config.out + "-reference")
    train(reference)
    real = state.save_checkpoint

    def disk_full_at_step_4(path, payload):
        if payload.step != 4:
            return real(path, payload)
        with monkeypatch.context() as patch:
            full_disk(patch, limit=100_000)
            return real(path, payload)

    monkeypatch.setattr(state, "save_checkpoint", disk_full_at_step_4)
    with pytest.raises(TrainingError) as caught:
        train(config)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"at step 4, could not write '{config.out}/checkpoint.pt': No space left on device "
                              f"(ENOSPC); the disk is full: free some space, then resume with "
                              f"`s2hc train --out {config.out} --resume`; stopped; "
                              f"the last good checkpoint (step 2) is kept in '{config.out}/checkpoint.pt'")
    assert load_checkpoint(config.out).step == 2  # verified: intact
    assert sorted(p.name for p in Path(config.out).iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.jsonl"]

    status = main(["train", *cli_args(config.replace(out=config.out + "-cli"))])
    assert status not in (0, 2) and "No space left on device" in error_line(capsys)

    monkeypatch.undo()
    train(config, resume=True)
    assert curve(config.out) == curve(reference.out)


# --------------------------------------------------------------------------- kill -9 at random moments

SLOW_SAVES = """
import os, sys, time
import s2hc.rundir.checkpoint as checkpoint
from s2hc.cli import main

marker, real = os.environ["S2HC_TEST_SAVING"], checkpoint.atomic_write_bytes

class Slow:  # a slow disk: a save takes ~0.2 s (1500 writes), so kills can land inside saves
    def __init__(self, handle):
        self.handle, self.writes = handle, 0
    def write(self, data):
        if self.writes == 0:
            open(marker, "a").close()
        self.writes += 1
        if self.writes % 100 == 0:
            time.sleep(0.01)
        return self.handle.write(data)
    def __getattr__(self, name):
        return getattr(self.handle, name)

checkpoint.atomic_write_bytes = lambda path, write: real(path, lambda handle: write(Slow(handle)))
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_at_random_moments_of_training_and_saving_then_resume_equals_an_uninterrupted_run(config, tmp_path):
    """SIGKILL while training, inside a checkpoint save (a slowed disk), and at a random moment from the start;
    after each, the next start resumes (or starts, when nothing was written yet) and the final run is the
    uninterrupted one, loss for loss; nothing temporary is left."""
    rng = random.Random(int(os.environ.get("S2HC_KILL_SEED", "13")))
    config = config.replace(max_steps=20, checkpoint_every=2, eval_every=5)
    reference = config.replace(out=str(tmp_path / "reference"))
    train(reference)
    script, marker = tmp_path / "slow_saves.py", tmp_path / "saving"
    script.write_text(SLOW_SAVES)

    def start(resume: bool) -> subprocess.Popen:
        marker.unlink(missing_ok=True)
        command = [sys.executable, str(script), "train", *cli_args(config), *(["--resume"] if resume else [])]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "S2HC_TEST_SAVING": str(marker)})

    def wait_for(condition, process) -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not condition():
            assert process.poll() is None, process.communicate()
            time.sleep(0.005)

    logged = Path(config.out) / "metrics.jsonl"
    moments = {
        "training": lambda p: wait_for(lambda: logged.exists() and logged.read_text().count('"loss"') >= 3, p)
        or time.sleep(rng.uniform(0, 0.3)),
        "saving": lambda p: wait_for(marker.exists, p) or time.sleep(rng.uniform(0, 0.05)),
        "any": lambda p: time.sleep(rng.uniform(0.5, 3.0)),
    }
    leftovers, messages = [], []
    for moment in ("training", "saving", "any"):
        process = start(resume=holds_run(config.out))
        moments[moment](process)
        assert process.poll() is None, f"the run ended before the kill ({moment}): {process.communicate()}"
        process.send_signal(signal.SIGKILL)
        messages.append(process.communicate(timeout=60)[1])
        leftovers += [p.name for p in Path(config.out).glob(".*.tmp")]
    final = start(resume=holds_run(config.out))
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert curve(config.out) == curve(reference.out)
    assert load_checkpoint(config.out).step == 20
    assert any(name.startswith(".checkpoint.pt.") for name in leftovers), "no kill landed inside a save"
    assert "took over the lock left by pid" in err + "".join(messages)
    assert sorted(p.name for p in Path(config.out).iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.jsonl"]


# ---------------------------------------------------------------------------------------------- compare


def test_compare_checks_every_run_before_the_first_starts(config, tmp_path):
    out = tmp_path / "compare"
    base = config.replace(max_steps=2, eval_every=0, checkpoint_every=0)
    residual, s2hc = out / "runs" / f"residual-seed{base.seed}", out / "runs" / f"s2hc-n4-seed{base.seed}"
    train(base.replace(family="residual", n_streams=1, out=str(residual)))  # as `compare` would have
    with pytest.raises(ValueError, match=r"'.*compare/runs/residual-seed\d+' already holds a run"):
        compare(base, ["s2hc", "residual"], out=out)
    assert not s2hc.exists()  # refused before s2hc trained
    with pytest.raises(ValueError, match=r"--resume: '.*other' holds none of these runs"):
        compare(base, ["residual"], out=tmp_path / "other", resume=True)
    before = snapshot(residual)
    report = compare(base, ["residual", "s2hc"], out=out, resume=True)  # residual kept, s2hc started
    assert snapshot(residual) == before
    assert "| s2hc n=4 |" in report.read_text() and load_checkpoint(s2hc).step == 2
    compare(base.replace(max_steps=3), ["residual"], out=out, overwrite=True)
    assert load_checkpoint(residual).step == 3
    assert not (out / LOCK).exists()
