"""Faults around the experiment loggers (s2hc.loggers): what s2hc did not write is never removed, a damaged or
foreign logger file is said in one line (or made whole), a logger that cannot start stops the run in one line
before it writes anything, and the MLflow database stays where the run's settings put it."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import cli_args, small_config
from test_faults_cli import assert_error, run_cli
from test_faults_outputs import listing

from s2hc import loggers
from s2hc.loggers import CSVSink, csv_defect, open_sinks, scalars
from s2hc.rundir import read_metrics
from s2hc.train import train


def cli_run(corpus_file, root: Path, *options: str, **changes) -> list[str]:
    """``s2hc train`` arguments of a small run in ``root/run`` (``changes``: TrainConfig fields), then ``options``."""
    values = {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2, **changes}
    return ["train", *cli_args(small_config(corpus_file, root, **values)), *options]


def csv_rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def assert_csv_repeats_the_record(run: Path) -> None:
    """metrics.csv holds each step once, with exactly the scalars of metrics.jsonl."""
    expected: dict[int, dict[str, float]] = {}
    for record in read_metrics(run):
        if scalars(record):
            expected.setdefault(record["step"], {}).update(scalars(record))
    rows = csv_rows(run)
    assert [int(row["step"]) for row in rows] == sorted(expected)
    for row in rows:
        assert {k: float(v) for k, v in row.items() if k != "step" and v} == expected[int(row["step"])]


# ------------------------------------------------------------------------- TensorBoard: only what s2hc wrote


def test_a_users_own_tensorboard_directory_is_refused_in_one_line_and_left_as_it_was(corpus_file, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1.mine").write_bytes(b"the user's own curves")
    (out / "tensorboard" / "notes.txt").write_text("mine")
    before = listing(out)
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--logger", "csv,tensorboard"), capsys)
    assert code == 2
    assert_error(line, "train", repr(str(out / "tensorboard")), "holds files this run did not write",
                 "move them away")
    assert listing(out) == before  # nothing removed, and no half-made run beside it
    # --overwrite removes a run, not a tensorboard/ it did not write
    (out / "config.yaml").write_text("{}\n")
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--overwrite"), capsys)
    assert code == 0, line
    assert {k: v for k, v in listing(out).items() if k.startswith("tensorboard")} == before


def test_a_new_attempt_of_a_run_replaces_only_its_own_event_files(corpus_file, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    out = tmp_path / "run"
    argv = cli_run(corpus_file, tmp_path, "--logger", "tensorboard", checkpoint_every=0, max_steps=2)
    assert run_cli(argv, capsys)[0] == 0
    board = out / "tensorboard"
    first = sorted(p.name for p in board.glob("events.out.tfevents.*"))
    assert len(first) == 1 and (board / loggers.TENSORBOARD_MARK).is_file()
    (board / "notes.txt").write_text("kept")  # the user's, in the run's directory
    code, _, line = run_cli([*argv, "--overwrite"], capsys)
    assert code == 0, line
    second = sorted(p.name for p in board.glob("events.out.tfevents.*"))  # --overwrite removed the run's own
    assert len(second) == 1 and second != first and (board / "notes.txt").read_text() == "kept"
    (out / "checkpoint.pt").unlink()  # a run with no checkpoint: --resume starts it again from step 0, anew
    code, _, line = run_cli([*argv, "--resume"], capsys)
    assert code == 0, line
    events = sorted(p.name for p in board.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events not in (first, second) and (board / "notes.txt").read_text() == "kept"


def test_two_runs_of_one_name_in_a_shared_logger_directory_keep_each_others_curves(corpus_file, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    shared = tmp_path / "shared"
    first = small_config(corpus_file, tmp_path / "a", max_steps=2, log_every=1, logger="tensorboard",
                         logger_dir=str(shared))
    train(first)
    theirs = listing(shared / "tensorboard" / "run")
    capsys.readouterr()
    second = small_config(corpus_file, tmp_path / "b", max_steps=2, log_every=1, logger="tensorboard",
                          logger_dir=str(shared))
    train(second)
    said = [line for line in capsys.readouterr().err.splitlines() if "TensorBoard" in line]
    assert said == [f"s2hc: {str(shared / 'tensorboard' / 'run')!r} holds the TensorBoard curves of another run "
                    f"named 'run': this run's go to {str(shared / 'tensorboard' / 'run-2')!r}"]
    assert listing(shared / "tensorboard" / "run") == theirs
    mine = listing(shared / "tensorboard" / "run-2")
    train(small_config(corpus_file, tmp_path / "b", max_steps=3, log_every=1, logger="tensorboard",
                       logger_dir=str(shared)), resume=True)
    assert sorted(p.name for p in (shared / "tensorboard").iterdir()) == ["run", "run-2"]  # the same one resumed
    assert listing(shared / "tensorboard" / "run") == theirs
    assert set(mine) < set(listing(shared / "tensorboard" / "run-2"))  # its events continued there


def test_a_tensorboard_path_that_is_a_file_is_one_line_and_a_resume_keeps_its_checkpoint(corpus_file, tmp_path,
                                                                                         capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    out = tmp_path / "run"
    assert run_cli(cli_run(corpus_file, tmp_path), capsys)[0] == 0
    (out / "tensorboard").write_text("not a directory")
    before = listing(out)
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--resume", "--logger", "tensorboard", max_steps=3),
                            capsys)
    assert code == 2
    assert_error(line, "train", repr(str(out / "tensorboard")), "is not a directory")
    assert listing(out) == before


# ------------------------------------------------------------------------- a logger that cannot start


def test_a_logger_that_fails_at_start_is_one_line_and_leaves_no_run(corpus_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    import torch.utils.tensorboard

    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("cannot open the event file\nsecond line of detail")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", Broken)
    out = tmp_path / "run"
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--logger", "csv,tensorboard"), capsys)
    assert code == 2
    assert line == (f"s2hc train: error: --logger tensorboard could not start in {str(out / 'tensorboard')!r} "
                    "(RuntimeError: cannot open the event file); fix that, or leave tensorboard out of --logger "
                    "(metrics.jsonl keeps every record)")
    assert not out.exists()  # not even the csv's file or the TensorBoard mark

    # a resumed run that fails so is left byte for byte as it was, its CSV and checkpoint with it
    assert run_cli(cli_run(corpus_file, tmp_path, "--logger", "csv"), capsys)[0] == 0
    before = listing(out)
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--resume", "--logger", "csv,tensorboard"), capsys)
    assert code == 2 and "--logger tensorboard could not start" in line
    assert listing(out) == before


def test_a_wandb_mode_w_and_b_does_not_know_is_one_line(corpus_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra")
    monkeypatch.setenv("WANDB_MODE", "bogus")
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--logger", "wandb"), capsys)
    assert code == 2
    assert line == ("s2hc train: error: WANDB_MODE must be online, offline or disabled (or unset: online with a W&B "
                    "API key, else offline), got 'bogus'")
    assert not (tmp_path / "run").exists()


def test_a_resume_after_the_loggers_package_was_uninstalled_is_one_line_and_the_run_is_untouched(
        corpus_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    out = tmp_path / "run"
    assert run_cli(cli_run(corpus_file, tmp_path, "--logger", "csv,tensorboard"), capsys)[0] == 0
    before = listing(out)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed, as far as importlib can tell
    code, _, line = run_cli(["train", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress"], capsys)
    assert code == 2
    assert line == ("s2hc train: error: --logger tensorboard needs the tensorboard extra (tensorboard is not "
                    "installed): pip install 's2hc[tensorboard]'")
    assert listing(out) == before
    code, _, line = run_cli(["train", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress",
                             "--logger", "csv"], capsys)  # the hint's other way: resume without it
    assert code == 0, line


# ------------------------------------------------------------------------------------------- metrics.csv


DAMAGE = {
    "cut short": lambda text: text[: len(text) // 2],
    "not UTF-8": lambda text: b"\xff\xfe\x00garbage".decode("latin-1") + text,
    "another header": lambda text: "when,what\n" + text.split("\n", 1)[1],
    "a row too wide": lambda text: text.replace("\n2,", "\n2,1,2,3,4,5,6,7,8,9,10,11,12,", 1),
    "a step that is no integer": lambda text: text.replace("\n2,", "\ntwo,", 1),
    "not CSV": lambda text: text.replace("\n2,", '\n"2\0,', 1),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_metrics_csv_is_said_in_one_line_and_made_whole_on_resume(damage, corpus_file, tmp_path,
                                                                            capsys):
    config = small_config(corpus_file, tmp_path, max_steps=2, log_every=1, eval_every=2, logger="csv")
    train(config)
    run = Path(config.out)
    path = run / "metrics.csv"
    path.write_bytes(DAMAGE[damage](path.read_text()).encode("latin-1" if damage == "not UTF-8" else "utf-8"))
    defect = csv_defect(path)
    capsys.readouterr()
    train(small_config(corpus_file, tmp_path, max_steps=3, log_every=1, eval_every=2, logger="csv"), resume=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "metrics.csv" in line]
    if damage == "cut short":
        assert said == []  # a kill's doing: no damage to speak of
    else:
        assert said == [f"s2hc: {str(path)!r} is damaged ({defect}); rewritten from metrics.jsonl"]
    assert_csv_repeats_the_record(run)


def test_csv_defects_name_what_is_wrong(tmp_path):
    path = tmp_path / "metrics.csv"
    assert csv_defect(path) is None
    for text, defect in [("step,train/loss\n1,2.0\n2,1.", None), ("", None),
                         (b"\xff", "not UTF-8 text (invalid start byte at byte 0)"),
                         ("loss\n1\n", "its header 'loss' is not 'step' then one column per scalar"),
                         ("step,a,a\n1,2,3\n", "its header 'step,a,a' is not 'step' then one column per scalar"),
                         ("step,a\n1,2,3\n", "line 2 has 3 fields, its header 2"),
                         ("step,a\n1.5,2\n", "line 2: step '1.5' is not an integer")]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        assert csv_defect(path) == defect, text
    records = [{"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 1.0}]
    CSVSink(path, records=records)
    assert csv_rows(tmp_path) == [{"step": "1", "train/loss": "2.0", "val/loss": "1.0",
                                   "val/perplexity": repr(2.718281828459045)}]


# ---------------------------------------------------------------------------------------------- loggers.json


@pytest.mark.parametrize("text, defect", [
    (b"\xff{", "not UTF-8 text (invalid start byte at byte 0)"),
    (b"{", "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    (b'"wandb"', "a JSON str, not an object of run ids"),
    (b'{"mlflow": "../../../elsewhere"}', "mlflow is '../../../elsewhere', not a run id"),
    (b'{"wandb": 7}', "wandb is '7', not a run id"),
    (b'{"comet": "abc"}', "an unknown key 'comet'"),
    (b" " * (1 << 17), "larger than 65536 bytes"),
])
def test_a_damaged_loggers_json_is_one_line_and_new_logger_runs_start(text, defect, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "loggers.json").write_bytes(text)
    lines: list[str] = []
    assert loggers._read_ids(run, lines.append) == {}
    assert lines == [f"{str(run / 'loggers.json')!r} is damaged ({defect}); this run starts new W&B and MLflow runs"]


def test_a_loggers_json_of_another_run_is_not_continued_and_a_moved_run_keeps_its_own(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for run in (ours, theirs):
        run.mkdir()
    ids = {"run": str(theirs.resolve()), "wandb": "abc123", "mlflow": "f" * 32}
    (theirs / "loggers.json").write_text(json.dumps(ids))
    shutil.copy(theirs / "loggers.json", ours / "loggers.json")  # copied with that run's files
    lines: list[str] = []
    assert loggers._read_ids(ours, lines.append) == {}
    assert lines == [f"{str(ours / 'loggers.json')!r} names the logger runs of {str(theirs.resolve())!r} (copied "
                     "from that run?): this run starts its own W&B and MLflow runs"]
    moved = tmp_path / "moved"
    theirs.rename(moved)  # the run moved whole: its logger runs are its own still
    assert loggers._read_ids(moved, lines.append) == {"wandb": "abc123", "mlflow": "f" * 32} and len(lines) == 1


# ---------------------------------------------------------------------------------------------------- MLflow


def _mlflow(monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra")
    pytest.importorskip("sqlalchemy", reason="MLflow's default store is sqlite, through SQLAlchemy")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    import mlflow

    return mlflow


def test_the_mlflow_database_is_where_the_run_directory_says_whatever_its_name(tmp_path, monkeypatch):
    _mlflow(monkeypatch)
    (tmp_path / "other").mkdir()
    for name in ("r%2F..%2F..%2Fother", "q?x=1", "h#frag"):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        for sink in open_sinks(("mlflow",), run, config={"seed": 0}):
            sink.close()
        assert (run / "mlflow.db").is_file(), name
    assert list((tmp_path / "other").iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "other", "runs"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["h#frag", "q?x=1", "r%2F..%2F..%2Fother"]


def test_an_mlflow_run_the_store_does_not_hold_does_not_block_resume(corpus_file, tmp_path, capsys, monkeypatch):
    mlflow = _mlflow(monkeypatch)
    ours = small_config(corpus_file, tmp_path, max_steps=2, log_every=1, eval_every=2, logger="mlflow")
    train(ours)
    run = Path(ours.out)
    first = json.loads((run / "loggers.json").read_text())["mlflow"]
    other_db = tmp_path / "elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other_db}")  # another store at the resume
    capsys.readouterr()
    train(small_config(corpus_file, tmp_path, max_steps=3, log_every=1, eval_every=2, logger="mlflow"), resume=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "--logger mlflow" in line]
    assert said == [f"s2hc: --logger mlflow: the tracking store {f'sqlite:///{other_db}'!r} holds no run "
                    f"{first!r} (the one loggers.json names; another MLFLOW_TRACKING_URI, or a database removed?): "
                    "this run logs to a new MLflow run"]
    second = json.loads((run / "loggers.json").read_text())["mlflow"]
    assert second != first
    client = mlflow.MlflowClient(f"sqlite:///{other_db}")
    assert [m.step for m in client.get_metric_history(second, "train/loss")] == [3]


def test_a_damaged_mlflow_database_is_one_line_and_the_resumed_run_is_untouched(corpus_file, tmp_path, capsys,
                                                                               monkeypatch):
    _mlflow(monkeypatch)
    out = tmp_path / "run"
    assert run_cli(cli_run(corpus_file, tmp_path, "--logger", "mlflow"), capsys)[0] == 0
    (out / "mlflow.db").write_bytes(b"not a database" * 100)
    before = listing(out)
    code, _, line = run_cli(cli_run(corpus_file, tmp_path, "--resume", max_steps=3), capsys)
    assert code == 2
    assert_error(line, "train", "--logger mlflow could not start with tracking URI", "mlflow.db",
                 "leave mlflow out of --logger")
    assert listing(out) == before
