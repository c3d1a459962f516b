"""The training harness: schedule, optimiser groups, checkpoints, exact resume (with real signals), faults."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_MODEL, cli_args, crash_after_checkpoint, poison_loss_at, tiny_checkpoint

from s2hc.cli import main
from s2hc.rundir import load_checkpoint, load_model, read_metrics
from s2hc.rundir.checkpoint import save_checkpoint
from s2hc.train import TrainConfig, TrainingError, learning_rate, train
from s2hc.train.optim import parameter_groups


@pytest.fixture()
def small(corpus_file, tmp_path) -> TrainConfig:
    return TrainConfig(
        preset="tiny", family="s2hc", n_streams=4, model_overrides=dict(SMALL_MODEL),
        data=str(corpus_file), cache_dir=str(tmp_path / "cache"), seq_len=32, batch_size=4,
        max_steps=12, warmup_steps=2, lr=3e-3, eval_every=4, eval_batches=2, checkpoint_every=2,
        log_every=1, progress=False, out=str(tmp_path / "run"),
    )


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


# ------------------------------------------------------------------------------------ schedule, optimiser


def test_cosine_schedule_with_warmup_and_floor():
    kw = dict(peak=1.0, warmup_steps=10, max_steps=110, min_ratio=0.1)
    warm = [learning_rate(s, **kw) for s in range(10)]
    assert warm == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert learning_rate(10, **kw) == pytest.approx(1.0)
    assert learning_rate(60, **kw) == pytest.approx(0.55)  # halfway down the cosine
    assert learning_rate(110, **kw) == pytest.approx(0.1) == learning_rate(500, **kw)
    decay = [learning_rate(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_weight_decay_only_on_matrices():
    from s2hc.models import Transformer, get_preset

    model = Transformer(get_preset("tiny", family="s2hc", n_streams=4, **SMALL_MODEL))
    decay, no_decay = parameter_groups(model, 0.1)  # every family and rule: tests/test_weight_decay.py
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    hc = next(m for m in model.modules() if m.__class__.__name__ == "HyperConnection")
    assert any(p is hc.projection for p in decay["params"]) and "blocks.0.attn_hc.projection" in decay["names"]
    assert any(p is hc.alpha_pre for p in no_decay["params"]) and "blocks.0.attn_hc.alpha_pre" in no_decay["names"]
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_roundtrip_and_foreign_files(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, tiny_checkpoint(step=3, model={"w": torch.ones(2)}))
    assert load_checkpoint(path).step == 3
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind
    (tmp_path / "junk.pt").write_bytes(os.urandom(100))
    with pytest.raises(ValueError, match=r"junk.pt' is not an s2hc checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt' is not an s2hc checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"checkpoint '.*missing.pt' does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"holds no checkpoint"):
        load_checkpoint(tmp_path)


def test_training_writes_metrics_checkpoint_and_rebuilds_the_model(small):
    result = train(small)
    assert result.step == 12 and math.isfinite(result.train_loss) and result.val_loss is not None
    records = read_metrics(small.out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    first, last = losses(small.out)[0][1], losses(small.out)[-1][1]
    assert last < first  # it learns
    model, config = load_model(small.out)
    assert config == small and model.config.family == "s2hc"
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    payload = load_checkpoint(small.out)
    assert payload.step == 12
    assert torch.equal(model(x), model(x))


def test_resume_in_process_equals_uninterrupted(small, tmp_path):
    train(small)
    # "interrupted" at step 6: keep the step-6 checkpoint of a second run, then resume it
    interrupted = small.replace(out=str(tmp_path / "interrupted"), max_steps=12)
    crash_after_checkpoint(interrupted, 6)
    assert load_checkpoint(interrupted.out).step == 6
    train(interrupted, resume=True)
    assert losses(interrupted.out) == losses(small.out)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_to_the_same_loss_curve(small, tmp_path, signum):
    """A real signal mid-run; `--resume` then gives the uninterrupted run's loss curve, step for step."""
    config = small.replace(max_steps=40, checkpoint_every=3, out=str(tmp_path / "killed"))
    reference = config.replace(out=str(tmp_path / "reference"))
    train(reference)  # also fills the token cache, so the subprocess starts training at once
    command = [sys.executable, "-m", "s2hc", "train", *cli_args(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = Path(config.out) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line) >= 7:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    if signum == signal.SIGTERM:  # caught: a checkpoint at the step it stopped, exit 128 + 15
        assert process.returncode == 143 and f"resume with `s2hc train --out {config.out} --resume`" in err
    else:
        assert process.returncode == -signal.SIGKILL
    stopped_at = load_checkpoint(config.out).step
    assert 1 <= stopped_at < 40
    assert main(["train", *cli_args(config), "--resume"]) == 0
    assert losses(config.out) == losses(reference.out)
    assert load_checkpoint(config.out).step == 40


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(small, monkeypatch):
    poison_loss_at(monkeypatch, 5)
    with pytest.raises(
        TrainingError, match=r"non-finite loss \(nan\) or gradient at step 5.*last good checkpoint \(step 4\)"
    ):
        train(small.replace(eval_every=0))
    assert load_checkpoint(small.out).step == 4
    assert all(math.isfinite(r["loss"]) for r in read_metrics(small.out) if "loss" in r)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "huge"], r"preset"),
        (["--family", "sinkhorn"], r"family"),
        (["--data", "/nonexistent/corpus.txt"], r"/nonexistent/corpus.txt"),
        (["--set", "learning_rate=1"], r"unknown config key\(s\) \['learning_rate'\]"),
        (["--config", "/nonexistent.yaml"], r"config file '/nonexistent.yaml' does not exist"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message, small, capsys):
    base = ["train", "--no-progress", "--out", small.out, "--cache-dir", small.cache_dir, "--max-steps", "1"]
    assert main(base + args) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_connection_options_reach_every_connection(small, monkeypatch):
    """``connection`` in the config is applied to the model's connections: with recompute, every connection
    of every step goes through torch.utils.checkpoint. Unknown keys are refused when the config is made."""
    import s2hc.connection.module as connection  # where HyperConnection.forward looks up checkpoint

    calls = []
    real = connection.checkpoint
    monkeypatch.setattr(connection, "checkpoint", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    train(small.replace(max_steps=1, connection={"recompute": True}))
    assert len(calls) == SMALL_MODEL["n_layers"] * 2  # one training step; evaluation runs without gradients
    with pytest.raises(
        ValueError, match=r"connection must be a dict with keys from \['fused', 'recompute', 'kernels'\]"
    ):
        small.replace(connection={"recompute": True, "kernel": "triton"})


def test_too_small_corpus_for_the_sequence_length(small, tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("To be, or not to be.")
    assert main(["train", *cli_args(small.replace(data=str(tiny), seq_len=256))]) == 2
    assert "256" in capsys.readouterr().err


def test_resume_with_another_model_shape_is_refused(small, capsys):
    train(small.replace(max_steps=2))
    other = small.replace(model_overrides={**SMALL_MODEL, "dim": 64}, max_steps=4)
    assert main(["train", *cli_args(other), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "model_overrides" in err


# `s2hc compare`, a study with one axis: tests/test_compare.py


def test_every_shipped_config_builds(tmp_path):
    from s2hc.config import load_yaml_config

    configs = [p for p in sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))
               if not p.name.startswith("study-")]  # grids of runs: tests/test_study.py
    assert len(configs) >= 5
    for path in configs:
        config = TrainConfig.from_dict(load_yaml_config(path))
        with torch.device("meta"):
            from s2hc.models import Transformer

            model = Transformer(config.model_config())
        assert model.num_params() > 0, path


def test_data_seed_changes_the_data_order_and_nothing_else(corpus_file, tmp_path):
    """``data_seed`` (default: ``seed``) seeds only the data order: equal to ``seed`` it is the default run; another
    value gives the same initial weights another order, the order ``seed=data_seed`` would give."""
    from helpers import small_config

    def losses(**changes):
        config = small_config(corpus_file, tmp_path / "-".join(f"{k}{v}" for k, v in changes.items()),
                              max_steps=3, log_every=1, **changes)
        train(config)
        return [r["loss"] for r in read_metrics(config.out) if "loss" in r]

    default = losses(seed=0)
    assert losses(seed=0, data_seed=0) == default
    crossed = losses(seed=0, data_seed=1)
    assert crossed[0] != default[0]
    other_init = losses(seed=1)
    assert crossed[0] != other_init[0]  # the same batches as seed 1, but seed 0's weights
    with pytest.raises(ValueError, match="data_seed must be an integer"):
        small_config(corpus_file, tmp_path / "bad", data_seed=-1)
