"""Experiment loggers (s2hc.loggers): every scalar of metrics.jsonl reaches each logger, read back with the logger's
own reader; a resumed run's loggers read as one run's; a missing logger package is one line before anything runs."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from helpers import at_logged_step, crash, ctrl_c, small_config
from hypothesis import given
from hypothesis import strategies as st

from s2hc.cli import main
from s2hc.loggers import CSVSink, RunLog, parse_loggers, scalars
from s2hc.rundir import read_metrics
from s2hc.train import TrainConfig, train
from s2hc.train import loop as loop_module


def expected_scalars(run_dir) -> dict[str, dict[int, float]]:
    """What the loggers must hold: each scalar of metrics.jsonl by name and step (computed independently of
    s2hc.loggers.scalars, from the records)."""
    names = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "val/loss"}
    expected: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        for key, name in names.items():
            if key in record:
                expected.setdefault(name, {})[record["step"]] = record[key]
        if "val_loss" in record:
            expected.setdefault("val/perplexity", {})[record["step"]] = math.exp(record["val_loss"])
    return expected


# ------------------------------------------------------------------------------------------ names, scalars


def test_parse_loggers_names_and_refusals():
    assert parse_loggers(None) == () and parse_loggers("") == ()
    assert parse_loggers(" wandb, csv ,wandb") == ("wandb", "csv")
    with pytest.raises(ValueError, match=r"logger must be a comma-separated list of csv, tensorboard, wandb, mlflow "
                                         r"\(or empty\), got 'csv,tb' \('tb' unknown\)"):
        parse_loggers("csv,tb")
    with pytest.raises(ValueError, match="logger must be a comma-separated list"):
        TrainConfig(logger="comet")
    assert TrainConfig(logger="tensorboard, csv").logger == "tensorboard,csv"
    assert TrainConfig(logger="").logger is None


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=6), st.floats(0, 20))
def test_scalars_name_each_connection_and_the_read_out(series, val_loss):
    layers = [f"blocks.{i}.attn_hc" for i in range(len(series))]
    record = {"step": 3, "val_loss": val_loss, "diagnostics": {
        "layers": layers, "tokens": 32, "inert_layers": [0], "spectral_norm_max": series,
        "stream_similarity_mean": [*series, 0.5], "deviation_singular_values_mean": [[1.0, 2.0]] * len(series),
        "grad_norm": {"layers": {"embed": 2.0}, "hyper_connections": {layers[0]: 0.25}}}}
    values = scalars(record)
    assert values["val/loss"] == val_loss and values["val/perplexity"] == pytest.approx(math.exp(val_loss))
    for layer, value in zip(layers, series):
        assert values[f"hc/spectral_norm_max/{layer}"] == value
        assert values[f"hc/stream_similarity_mean/{layer}"] == value
    assert values["hc/stream_similarity_mean/output"] == 0.5
    assert values["grad_norm/layers/embed"] == 2.0 and values[f"grad_norm/hyper_connections/{layers[0]}"] == 0.25
    assert not any("deviation_singular_values" in name or "inert" in name or "tokens" in name for name in values)


def test_the_csv_sink_merges_a_step_adds_columns_and_a_resumed_one_is_rewritten_from_the_kept_records(tmp_path):
    path = tmp_path / "metrics.csv"
    sink = CSVSink(path, records=None)
    sink.write(1, {"train/loss": 3.0})
    sink.write(2, {"train/loss": 2.5})
    sink.write(2, {"val/loss": 2.4})  # the evaluation after step 2's line: the same row
    sink.write(3, {"train/loss": 2.0})
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("1", "3.0", ""), ("2", "2.5", "2.4"), ("3", "2.0", "")]
    # a run's records, as the loop hands them on, then resumed from step 2
    records = [{"step": 0, "platform": {}}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5},
               {"step": 2, "val_loss": 2.4}, {"step": 3, "loss": 2.0}]
    sink = CSVSink(path, records=None)
    for record in records:
        if scalars(record):
            sink.write(record["step"], scalars(record))
    written = path.read_bytes()
    with path.open("a") as handle:
        handle.write("4,1.")  # a line cut short by a kill
    lines = []
    resumed = CSVSink(path, records=records[:4], log=lines.append)
    assert lines == []  # a line cut short is no damage
    resumed.write(3, scalars(records[4]))
    assert path.read_bytes() == written  # as if the run had never stopped


def test_a_failing_logger_is_dropped_with_one_line_and_the_record_is_kept(tmp_path):
    class Broken:
        name = "wandb"

        def write(self, step, values):
            raise ConnectionError("no network")

        def close(self):
            pass

    written, lines = [], []

    class Record:
        kept_keys: set = set()

        def write(self, **record):
            written.append(record)

    log = RunLog(Record(), [Broken()], lines.append)
    log.write(step=1, loss=2.0)
    log.write(step=2, loss=1.0)
    assert [r["step"] for r in written] == [1, 2] and log.sinks == []
    assert lines == ["--logger wandb failed at step 1 (ConnectionError: no network); it is off for the rest of the "
                     "run (metrics.jsonl keeps every record)"]


# ------------------------------------------------------------------------------------- training with loggers


def _event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard", reason="the tensorboard extra reads the event files")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_csv_and_tensorboard_hold_every_scalar_and_a_crashed_run_resumed_reads_as_one(corpus_file, tmp_path,
                                                                                      monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    config = small_config(corpus_file, tmp_path, max_steps=6, log_every=1, eval_every=3, checkpoint_every=3,
                          diagnostics_every=3, logger="csv,tensorboard")
    with monkeypatch.context() as patch:
        at_logged_step(patch, 5, crash)  # logged 4 and 5 after the checkpoint of step 3
        with pytest.raises(KeyboardInterrupt):
            train(config)
    train(config, resume=True)
    run = Path(config.out)
    expected = expected_scalars(run)
    events = _event_scalars(run / "tensorboard")
    assert [step for step, _ in events["train/loss"]] == [1, 2, 3, 4, 5, 6]  # 4 and 5 once: the crash's purged
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    for name, by_step in expected.items():
        assert {s: v for s, v in events[name]} == pytest.approx(by_step, rel=1e-6)  # float32 in event files
        assert {int(r["step"]): float(r[name]) for r in rows if r[name]} == pytest.approx(by_step, rel=1e-12)
    # the per-connection diagnostics at steps 3 and 6
    diagnostics = [r["diagnostics"] for r in read_metrics(run) if "diagnostics" in r]
    layer = diagnostics[0]["layers"][1]
    assert [s for s, _ in events[f"hc/spectral_norm_max/{layer}"]] == [3, 6]
    assert events[f"hc/spectral_norm_max/{layer}"][1][1] == pytest.approx(diagnostics[1]["spectral_norm_max"][1])
    assert "train/tokens_per_s" in events and "grad_norm/layers/embed" in events


def test_wandb_offline_and_mlflow_runs_continue_on_resume(corpus_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra")
    pytest.importorskip("mlflow", reason="the mlflow extra")
    pytest.importorskip("sqlalchemy", reason="MLflow's default store is sqlite, through SQLAlchemy")
    for name in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run is kept for `wandb sync`
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = small_config(corpus_file, tmp_path, max_steps=4, log_every=1, eval_every=2, checkpoint_every=2,
                          logger="wandb,mlflow", logger_group="habits")
    with monkeypatch.context() as patch:
        at_logged_step(patch, 2, ctrl_c)
        with pytest.raises(loop_module.Interrupted):
            train(config)
    run = Path(config.out)
    ids = json.loads((run / "loggers.json").read_text())
    train(config, resume=True)
    assert json.loads((run / "loggers.json").read_text()) == ids  # the same W&B and MLflow runs

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{(run / 'mlflow.db').resolve()}")
    assert client.get_experiment_by_name("habits") is not None
    logged = client.get_run(ids["mlflow"])
    assert logged.info.run_name == run.name and logged.data.params["family"] == "s2hc"
    expected = expected_scalars(run)
    for name, by_step in expected.items():
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], name)}
        assert history == pytest.approx(by_step, rel=1e-12)

    offline = sorted((run / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(offline) == 2  # the first attempt and the resume, one W&B run id
    history: dict[str, dict[int, float]] = {}
    for attempt in offline:
        for row in wandb_history(next(attempt.glob("*.wandb"))):
            for name, value in row.items():
                history.setdefault(name, {})[int(row["_step"])] = value
    for name, by_step in expected.items():
        assert history[name] == pytest.approx(by_step, rel=1e-12)


def wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of a W&B run file (what `wandb sync` uploads), read with W&B's own record schema: a 7-byte
    header (``:W&B``, magic, version), then LevelDB log records (32 KiB blocks; each chunk has a CRC, a length and
    a type: 1 whole, 2 first, 3 middle, 4 last) holding ``wandb_internal_pb2.Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # the padding at a block's end
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_a_missing_logger_package_is_one_line_before_anything_is_written(corpus_file, tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as far as importlib can tell
    out = tmp_path / "run"
    status = main(["train", "--data", str(corpus_file), "--max-steps", "2", "--logger", "csv,wandb",
                   "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err == ("s2hc train: error: --logger wandb needs the wandb extra (wandb is not installed): "
                   "pip install 's2hc[wandb]'")
    assert not out.exists()


# ------------------------------------------------------------------------------------------ console lines


def test_without_a_progress_bar_a_line_per_log_and_per_evaluation(corpus_file, tmp_path, capsys):
    config = small_config(corpus_file, tmp_path, max_steps=4, log_every=2, eval_every=2)
    train(config)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    records = read_metrics(config.out)
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 2/4", "step 4/4", "step 4/4"]
    assert lines[0].startswith(f"step 2/4: loss {losses[0]:.4f}, lr ") and "tokens/s" in lines[0]
    assert lines[1] == f"step 2/4: validation loss {val[0]:.4f} (perplexity {math.exp(val[0]):,.2f})"


def test_on_a_terminal_the_bar_shows_the_last_validation_loss(corpus_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    config = small_config(corpus_file, tmp_path, max_steps=4, log_every=1, eval_every=2, progress=True)
    train(config)
    err = capsys.readouterr().err
    val = [r["val_loss"] for r in read_metrics(config.out) if "val_loss" in r]
    assert f"val={val[-1]:.3f}" in err and "loss=" in err
    assert "step 2/4:" not in err  # the bar, not the lines


def test_a_warmup_as_long_as_the_run_is_warned_of(corpus_file, tmp_path, capsys):
    train(small_config(corpus_file, tmp_path, max_steps=2, warmup_steps=4))
    assert ("s2hc: warning: warmup_steps=4 is not below max_steps=2: the learning rate rises for the whole run and "
            "reaches 0.0003, 50% of lr=0.0006; lower warmup_steps") in capsys.readouterr().err
    assert TrainConfig(max_steps=100, warmup_steps=100).schedule_warnings() == [
        "warmup_steps=100 is not below max_steps=100: the learning rate rises for the whole run and reaches "
        "lr=0.0006 only at its last step and never decays; lower warmup_steps (a tenth of the run would be 10)"]
    assert TrainConfig(max_steps=101, warmup_steps=100).schedule_warnings() == []


def test_the_default_warmup_is_a_tenth_of_the_schedule_so_the_first_commands_and_the_demo_warn_of_nothing():
    import shlex

    from s2hc.cli import build_parser
    from s2hc.cli.train import training_config
    from s2hc.config import load_yaml_config

    assert [TrainConfig(max_steps=n).warmup for n in (3, 20, 50, 1000, 5000)] == [0, 2, 5, 100, 100]
    root = Path(__file__).resolve().parents[1]
    commands = [line.partition("#")[0] for line in (root / "README.md").read_text().splitlines()
                if line.startswith("s2hc train --preset tiny")]
    assert len(commands) >= 2  # the quick start's first run; the loggers' example
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        config = training_config(args, family=args.family, n_streams=args.streams, out=args.out)
        assert config.schedule_warnings() == [], command
    demo = load_yaml_config(root / "configs" / "demo-tiny.yaml")
    assert TrainConfig.from_dict(demo).warmup == 30  # `make demo`: 300 steps, the 30 warmup steps it always had
    for steps in (20, 3):  # `make demo DEMO_STEPS=20` (README), CI's DEMO_STEPS=3
        assert TrainConfig.from_dict({**demo, "max_steps": steps, "eval_every": steps}).schedule_warnings() == []


def test_a_comparison_may_add_loggers_later_and_logs_each_run_under_its_directory(corpus_file, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    base = small_config(corpus_file, tmp_path, max_steps=2, eval_every=2, log_every=1, seed=5).to_dict()
    for key in ("family", "n_streams", "out"):
        base.pop(key)
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    out = tmp_path / "cmp"
    args = ["compare", "--config", str(config), "--families", "residual,mhc", "--out", str(out)]
    assert main([*args, "--logger", "csv"]) == 0
    assert main([*args, "--resume", "--logger", "csv,tensorboard", "--max-steps", "3"]) == 2  # a grid of other runs
    assert "holds a study of another grid or training settings" in capsys.readouterr().err
    # Loggers change what a run shows, not what it computes: the study grows; its finished runs stay as they are.
    assert main(["compare", "--config", str(config), "--families", "residual,mhc,s2hc", "--out", str(out),
                 "--resume", "--logger", "csv,tensorboard"]) == 0
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["s2hc-n4-seed5"]  # the one run trained now
    events = _event_scalars(out / "tensorboard" / "s2hc-n4-seed5")
    expected = expected_scalars(out / "runs" / "s2hc-n4-seed5")
    assert {s: v for s, v in events["train/loss"]} == pytest.approx(expected["train/loss"], rel=1e-6)
    for name in ("residual-seed5", "mhc-n4-seed5", "s2hc-n4-seed5"):
        assert (out / "runs" / name / "metrics.csv").is_file()


def test_a_study_warns_once_of_a_warmup_as_long_as_its_runs():
    from s2hc.study.runner import schedule_warnings
    from s2hc.study.spec import parse_spec

    spec = parse_spec({"train": {"max_steps": 20, "warmup_steps": 50}, "families": ["residual", "s2hc", "mhc"],
                       "seeds": [0, 1]})
    assert schedule_warnings(spec) == TrainConfig(max_steps=20, warmup_steps=50).schedule_warnings()
    assert schedule_warnings(parse_spec({"train": {"max_steps": 20, "warmup_steps": 2}, "families": ["s2hc"]})) == []
