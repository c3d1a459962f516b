"""The learning-rate schedules (s2hc.schedule, ``lr_schedule``): cosine, warmup-stable-decay and constant, their rates
at the boundaries of warmup, stable phase and decay, the settings refused in one line, and a run that resumes on
its schedule exactly."""

from __future__ import annotations

import pytest
from helpers import at_logged_step, ctrl_c, small_config

from s2hc.cli import main
from s2hc.config import TrainConfig
from s2hc.rundir import read_metrics
from s2hc.schedule import DEFAULT_DECAY_FRACTION, SCHEDULES, decay_start, learning_rate, span_and_warmup
from s2hc.train import Interrupted, train

KW = dict(peak=1.0, warmup_steps=10, max_steps=110, min_ratio=0.1)


def test_every_schedule_warms_up_alike():
    for kind in SCHEDULES:
        warmup = [learning_rate(s, **KW, kind=kind) for s in range(10)]
        assert warmup == pytest.approx([(s + 1) / 10 for s in range(10)])
        assert learning_rate(10, **KW, kind=kind) == pytest.approx(1.0)  # the first step after it: the peak


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction_to_the_floor():
    # 110 steps, the last fifth (22 steps, 88-109) decaying: 88 is the first below the peak, 109 (the span's last)
    # runs at the floor, which holds after
    assert DEFAULT_DECAY_FRACTION == 0.2 and decay_start(110, 10, None) == 88
    stable = [learning_rate(s, **KW, kind="wsd") for s in range(10, 88)]
    assert stable == [1.0] * 78
    assert learning_rate(88, **KW, kind="wsd") == pytest.approx(1 - 0.9 / 22)
    assert learning_rate(98, **KW, kind="wsd") == pytest.approx(0.55)  # halfway down
    assert learning_rate(109, **KW, kind="wsd") == pytest.approx(0.1)
    assert learning_rate(110, **KW, kind="wsd") == 0.1 == learning_rate(500, **KW, kind="wsd")
    decay = [learning_rate(s, **KW, kind="wsd") for s in range(87, 111)]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert steps[1:22] == pytest.approx([0.9 / 22] * 21) and steps[22] == pytest.approx(0.0)  # linear, then flat
    # another fraction; a decay that would start inside the warmup starts when it ends
    half = dict(peak=1.0, warmup_steps=10, max_steps=100, min_ratio=0.0, kind="wsd", decay_fraction=0.5)
    assert decay_start(100, 10, 0.5) == 50 and learning_rate(50, **half) == pytest.approx(0.98)
    assert decay_start(12, 10, 0.5) == 10
    assert [learning_rate(s, peak=1.0, warmup_steps=10, max_steps=12, min_ratio=0.1, kind="wsd", decay_fraction=0.5)
            for s in (9, 10, 11, 12)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_constant_holds_the_peak_after_the_warmup_whatever_the_span_and_floor():
    assert [learning_rate(s, **KW, kind="constant") for s in (10, 60, 109, 110, 10_000)] == [1.0] * 5


def test_cosine_is_the_default_and_unchanged():
    assert TrainConfig().lr_schedule == "cosine" and TrainConfig().decay_fraction is None
    assert learning_rate(60, **KW) == learning_rate(60, **KW, kind="cosine") == pytest.approx(0.55)
    assert learning_rate(110, **KW) == pytest.approx(0.1)


def test_a_configs_learning_rate_is_its_schedules():
    config = TrainConfig(max_steps=110, warmup_steps=10, lr=1.0, lr_schedule="wsd", decay_fraction=0.5)
    assert span_and_warmup(110, None, 10) == (110, 10)
    assert [config.learning_rate(s) for s in (9, 54, 55, 109)] == pytest.approx([1.0, 1.0, 0.9 - 0.9 / 55 + 0.1,
                                                                                  0.1])


@pytest.mark.parametrize("settings, message", [
    (dict(lr_schedule="linear"), "lr_schedule must be one of ['cosine', 'wsd', 'constant'], got 'linear'"),
    (dict(lr_schedule="wsd", decay_fraction=0), "decay_fraction must be a finite number in (0, 1], got 0"),
    (dict(lr_schedule="wsd", decay_fraction=1.5), "decay_fraction must be a finite number in (0, 1], got 1.5"),
    (dict(lr_schedule="wsd", decay_fraction=float("nan")), "decay_fraction must be a finite number in (0, 1], got nan"),
    (dict(decay_fraction=0.3), "decay_fraction=0.3 is the decay of lr_schedule 'wsd', and lr_schedule is 'cosine'; "
                               "set lr_schedule: wsd, or leave decay_fraction out"),
])
def test_a_bad_schedule_setting_is_one_line(settings, message):
    with pytest.raises(ValueError) as error:
        TrainConfig(**settings)
    assert str(error.value) == message


def test_the_cli_refuses_a_bad_schedule_in_one_line(capsys):
    assert main(["train", "--lr-schedule", "wsd", "--decay-fraction", "2", "--out", "nowhere"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "s2hc train: error: decay_fraction must be a finite number in (0, 1], got 2.0"]


def _lrs_and_losses(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["lr"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.parametrize("kind, fraction", [("wsd", 0.5), ("constant", None)])
def test_a_resumed_run_continues_its_schedule_exactly(kind, fraction, corpus_file, tmp_path, monkeypatch):
    """Stopped (Ctrl-C) in the stable phase and resumed: the same rates and losses, bit for bit, as the run that was
    never stopped, and the rates those of the schedule (the warmup, the peak, the decay to the floor at the end)."""
    config = small_config(corpus_file, tmp_path, max_steps=6, warmup_steps=1, lr=1e-3, lr_schedule=kind,
                          decay_fraction=fraction, log_every=1, checkpoint_every=2, eval_every=0)
    reference = config.replace(out=str(tmp_path / "reference"))
    train(reference)
    with monkeypatch.context() as patch:
        at_logged_step(patch, 2, ctrl_c)
        with pytest.raises(Interrupted, match="stopped by signal 2 after step 2"):
            train(config)
    train(config, resume=True)
    resumed, whole = _lrs_and_losses(config.out), _lrs_and_losses(reference.out)
    assert resumed == whole and list(whole) == [1, 2, 3, 4, 5, 6]
    expected = [1e-3, 1e-3, 1e-3, 1e-3 - 0.9e-3 / 3, 1e-3 - 1.8e-3 / 3, 1e-4] if kind == "wsd" else [1e-3] * 6
    assert [whole[step][0] for step in range(1, 7)] == pytest.approx(expected)


def test_extending_a_wsd_run_says_its_schedule_ended_and_a_constant_one_says_nothing():
    from s2hc.train.loop import _kept_schedule, _schedule_notice

    for kind, fraction in (("wsd", 0.25), ("constant", None)):
        before = TrainConfig(max_steps=8, lr_schedule=kind, decay_fraction=fraction, out="runs/x").to_dict()
        config = _kept_schedule(before, TrainConfig(max_steps=12, lr_schedule=kind, decay_fraction=fraction,
                                                    out="runs/x"), 8)
        line = _schedule_notice(before, config, 8)
        if kind == "wsd":
            assert line.startswith("extending runs/x from 8 to 12 steps: the wsd schedule ended at step 8; steps 9-12 "
                                   "continue at its floor lr 6.0e-05")
        else:
            assert line is None and config.learning_rate(11) == config.lr
