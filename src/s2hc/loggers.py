"""Experiment loggers: where a run's scalars go besides ``metrics.jsonl``, which stays the record.

``s2hc train --logger csv,tensorboard,wandb,mlflow`` (any subset; ``logger`` in a config) sends every record the loop
writes to ``metrics.jsonl`` to each named logger as well, as scalars (:func:`scalars`):

==============================  =====================================================================
``train/loss``, ``train/lr``    every ``log_every`` steps, with ``train/grad_norm``, ``train/tokens_per_s``,
                                ``train/step_time`` (s) and ``train/tokens`` (seen so far)
``val/loss``, ``val/perplexity`` every evaluation
``hc/MEASURE/CONNECTION``       with ``diagnostics_every``: each measure of
                                :func:`s2hc.diagnostics.collect.training_diagnostics` per connection
                                (``hc/spectral_norm_max/blocks.0.attn_hc``; ``.../output`` for the read-out)
``grad_norm/GROUP/NAME``        with ``diagnostics_every``: gradient norms per layer and per connection
==============================  =====================================================================

Each logger is a :class:`MetricsSink`; the loop writes to one :class:`RunLog`, which appends the record to
``metrics.jsonl`` and hands its scalars to the sinks. Where they write (a run directory ``RUN``; a study sets
``logger_dir`` to its own directory, shared by its runs, and ``logger_group`` to its name):

- ``csv``: ``RUN/metrics.csv``, one row per step (wide: a column per scalar), always in the run directory;
- ``tensorboard``: ``LOGGER_DIR/tensorboard/`` (``LOGGER_DIR/tensorboard/RUN_NAME/`` for a study), read by
  ``tensorboard --logdir`` (the ``tensorboard`` extra);
- ``wandb``: a Weights & Biases run in project ``$WANDB_PROJECT`` (default ``s2hc``), grouped by
  ``logger_group``, files under ``LOGGER_DIR/wandb/``; offline (``WANDB_MODE=offline``, also chosen when no API key
  is configured) it needs no network and ``wandb sync`` uploads it later (the ``wandb`` extra);
- ``mlflow``: an MLflow run in experiment ``logger_group`` (default ``s2hc``) at ``$MLFLOW_TRACKING_URI``, default
  ``sqlite:///LOGGER_DIR/mlflow.db`` (``mlflow ui --backend-store-uri`` that URI; the ``mlflow`` extra).

Each optional package is imported only when its logger is named (a missing one is a one-line error before the run
starts). A resumed run continues its loggers as ``metrics.jsonl`` continues: the CSV and TensorBoard drop what was
logged after the checkpoint it resumes from, and the W&B and MLflow runs are the same runs (their ids are kept in
``RUN/loggers.json``; W&B ignores steps it has already seen). A logger that fails while the run trains is turned
off with one line, and the run goes on: ``metrics.jsonl`` keeps every record.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
#: The optional package each logger needs (s2hc.extras maps it to its extra).
PACKAGES = {"csv": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",)}
CSV_FILE, IDS_FILE, TENSORBOARD_DIR = "metrics.csv", "loggers.json", "tensorboard"
#: Everything the loggers may write into a run directory (s2hc.rundir.layout lists them: removed with the run).
LOGGER_FILES = (CSV_FILE, IDS_FILE, TENSORBOARD_DIR, "wandb", "mlflow.db", "mlartifacts")
DEFAULT_GROUP = "s2hc"
#: How a metrics.jsonl record's own scalars are named in the loggers.
NAMES = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
         "step_time": "train/step_time", "tokens": "train/tokens", "val_loss": "val/loss"}


def parse_loggers(text: str | None, argument: str = "logger") -> tuple[str, ...]:
    """``"csv, tensorboard"`` -> ``("csv", "tensorboard")`` (``""`` or None: none); ValueError naming ``argument`` for a
    name not in :data:`LOGGERS`.

    >>> parse_loggers("tensorboard,csv,csv")
    ('tensorboard', 'csv')
    """
    if not isinstance(text, (str, type(None))):
        raise ValueError(f"{argument} must be a comma-separated list of {', '.join(LOGGERS)}, got {text!r}")
    names = tuple(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(f"{argument} must be a comma-separated list of {', '.join(LOGGERS)} (or empty), got "
                         f"{text!r} ({', '.join(map(repr, unknown))} unknown)")
    return names


def logger_packages(text: str | None) -> tuple[str, ...]:
    """The optional packages the loggers ``text`` names need."""
    return tuple(package for name in parse_loggers(text) for package in PACKAGES[name])


# ------------------------------------------------------------------------------------------ the scalars


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``metrics.jsonl`` record, named for loggers (see the module's table); the step, texts,
    lists of lists (per-component spectra) and the once-per-run weight-decay record are left out.

    >>> scalars({"step": 5, "loss": 2.0, "val_loss": 1.0, "diverged": "nan"})
    {'train/loss': 2.0, 'val/loss': 1.0, 'val/perplexity': 2.718281828459045}
    """
    values: dict[str, float] = {}
    for key, name in NAMES.items():
        number = _number(record.get(key))
        if number is not None:
            values[name] = number
    if "val/loss" in values:  # exp overflows above ~709: a loss that large has no meaningful perplexity anyway
        values["val/perplexity"] = math.exp(values["val/loss"]) if values["val/loss"] < 700 else math.inf
    diagnostics = record.get("diagnostics")
    if isinstance(diagnostics, dict):
        values.update(_diagnostics_scalars(diagnostics))
    return values


def _diagnostics_scalars(record: dict[str, Any]) -> dict[str, float]:
    """``hc/MEASURE/CONNECTION`` for each per-connection list of a training-diagnostics record (one longer list,
    the stream similarity, ends with the read-out: ``output``), ``grad_norm/GROUP/NAME`` for the gradient norms."""
    layers = [str(name) for name in record.get("layers") or []]
    values: dict[str, float] = {}
    for measure, series in record.items():
        if measure in ("layers", "inert_layers", "tokens") or not isinstance(series, list):
            continue
        names = layers + ["output"] if len(series) == len(layers) + 1 else layers
        if len(series) != len(names):
            continue
        for name, value in zip(names, series):
            number = _number(value)
            if number is not None:
                values[f"hc/{measure}/{name}"] = number
    grads = record.get("grad_norm")
    for group, norms in (grads.items() if isinstance(grads, dict) else ()):
        for name, value in (norms.items() if isinstance(norms, dict) else ()):
            number = _number(value)
            if number is not None:
                values[f"grad_norm/{group}/{name}"] = number
    return values


# ------------------------------------------------------------------------------------------- the sinks


class MetricsSink(Protocol):
    """A logger: takes the scalars of each record, by step, until closed."""

    name: str

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class CSVSink:
    """``RUN/metrics.csv``: a ``step`` column and one per scalar, one row per step (a record of a step already
    written, the evaluation after the step's line, fills that row). Appended while the columns stay the same;
    rewritten atomically when a new scalar brings a column, or a row fills. A resumed run keeps the rows up to
    its checkpoint's step (``keep_until_step``), as ``metrics.jsonl`` does."""

    name = "csv"

    def __init__(self, path: Path, keep_until_step: int | None):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if keep_until_step is not None and self.path.is_file():
            with self.path.open(newline="") as handle:
                self.rows = [row for row in csv.DictReader(handle) if _kept(row, keep_until_step)]
        self.columns = list(dict.fromkeys(["step", *(key for row in self.rows for key in row)]))
        self._rewrite()

    def write(self, step: int, values: dict[str, float]) -> None:
        new_columns = [key for key in values if key not in self.columns]
        self.columns += new_columns
        if self.rows and int(self.rows[-1]["step"]) == step:
            self.rows[-1].update(values)
            self._rewrite()
            return
        self.rows.append({"step": step, **values})
        if new_columns:
            self._rewrite()
        else:
            with self.path.open("a", newline="") as handle:
                csv.DictWriter(handle, self.columns).writerow(self.rows[-1])

    def _rewrite(self) -> None:
        from .io import atomic_write_text

        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path, text.getvalue())

    def close(self) -> None:
        pass


def _kept(row: dict[str, str], keep_until_step: int) -> bool:
    try:
        return int(row.get("step") or "") <= keep_until_step
    except ValueError:  # a line cut short by a kill
        return False


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``). A new run starts the
    directory empty; a resumed one writes a purge marker at its first step, so TensorBoard drops what the killed
    run had logged after the checkpoint."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, resumed_step: int | None):
        from .extras import require

        require("tensorboard", "--logger tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        if resumed_step is None and log_dir.is_dir():
            shutil.rmtree(log_dir)  # ours: a new run's curves must not follow an old one's
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=10)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def _wandb_mode() -> str:
    """``$WANDB_MODE`` when set; otherwise ``online`` when an API key is configured (the environment or
    ``~/.netrc``, where ``wandb login`` writes it), else ``offline``: a run never stops to ask for a login."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


class WandbSink:
    """A Weights & Biases run (``wandb.init``): project ``$WANDB_PROJECT`` or ``s2hc``, ``group``, the run's config;
    ``run_id`` continues a run (a resume)."""

    name = "wandb"

    def __init__(self, directory: Path, name: str, group: str | None, config: dict[str, Any], run_id: str | None):
        from .extras import require

        wandb = require("wandb", "--logger wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_GROUP), dir=str(directory), name=name,
                              group=group, config=config, id=run_id, resume="allow" if run_id else None,
                              mode=_wandb_mode())
        self.run_id = self.run.id

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    """An MLflow run (``mlflow.MlflowClient``, no global state): experiment ``group``, the run's settings as
    parameters; ``run_id`` continues a run (a resume). Non-finite values are left out (MLflow stores them
    inconsistently across backends)."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, artifacts: Path | None, group: str, name: str, config: dict[str, Any],
                 run_id: str | None):
        from .extras import require

        mlflow = require("mlflow", "--logger mlflow")
        self.entities = require("mlflow.entities")
        self.client = mlflow.MlflowClient(tracking_uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(group)
            experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
                group, artifact_location=artifacts.resolve().as_uri() if artifacts is not None else None)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [self.entities.Param(key, str(value)[:6000]) for key, value in sorted(config.items())]
            self.client.log_batch(run_id, params=params)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def write(self, step: int, values: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, value, now, step) for key, value in values.items() if math.isfinite(value)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# --------------------------------------------------------------------------------------- the run's log


def open_sinks(names: tuple[str, ...], run_dir: Path, *, config: dict[str, Any], logger_dir: str | None = None,
               group: str | None = None, resumed_step: int | None = None) -> list[MetricsSink]:
    """The sinks ``names`` of the run in ``run_dir`` (its ``config`` as a dict: parameters for W&B and MLflow);
    ``resumed_step``: the checkpoint step a resumed run continues from (None: a new run). See the module's list
    for where each writes. A sink that cannot start raises (before the first step)."""
    run_dir = Path(run_dir)
    shared = logger_dir is not None
    root = Path(logger_dir).expanduser() if shared else run_dir
    name = run_dir.resolve().name
    ids = _read_ids(run_dir) if resumed_step is not None else {}
    sinks: list[MetricsSink] = []
    try:
        for logger in names:
            if logger == "csv":
                sinks.append(CSVSink(run_dir / CSV_FILE, resumed_step))
            elif logger == "tensorboard":
                sinks.append(TensorBoardSink(root / TENSORBOARD_DIR / name if shared else root / TENSORBOARD_DIR,
                                             resumed_step))
            elif logger == "wandb":
                sinks.append(WandbSink(root, name, group, config, ids.get("wandb")))
            elif logger == "mlflow":
                uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"
                artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else root / "mlartifacts"
                root.mkdir(parents=True, exist_ok=True)
                sinks.append(MLflowSink(uri, artifacts, group or DEFAULT_GROUP, name, config, ids.get("mlflow")))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    kept = {sink.name: sink.run_id for sink in sinks if getattr(sink, "run_id", None)}
    if kept:
        from .io import atomic_write_text

        atomic_write_text(run_dir / IDS_FILE, json.dumps(kept, indent=2) + "\n")
    return sinks


def _read_ids(run_dir: Path) -> dict[str, str]:
    """The W&B / MLflow run ids a run recorded (empty when it recorded none or the file is damaged: a resumed run
    then starts new logger runs, which loses no record)."""
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


class RunLog:
    """What the training loop writes to: each record goes to ``metrics`` (a :class:`s2hc.rundir.MetricsLog`, the
    record) and its scalars to every sink. A sink that raises is closed and dropped with one line to ``log``; the
    run goes on."""

    def __init__(self, metrics, sinks: list[MetricsSink], log: Callable[[str], None]):
        self.metrics, self.sinks, self.log = metrics, list(sinks), log

    @property
    def kept_keys(self) -> set[str]:
        return self.metrics.kept_keys

    def write(self, **record: Any) -> None:
        self.metrics.write(**record)
        values = scalars(record)
        if not values:
            return
        for sink in list(self.sinks):
            try:
                sink.write(int(record["step"]), values)
            except Exception as error:  # noqa: BLE001 - a logger's failure must not end the run
                self._drop(sink, f"failed at step {record['step']} ({type(error).__name__}: {error})")

    def _drop(self, sink: MetricsSink, why: str) -> None:
        self.sinks.remove(sink)
        self.log(f"--logger {sink.name} {why}; it is off for the rest of the run (metrics.jsonl keeps every record)")
        with contextlib.suppress(Exception):  # already reported
            sink.close()

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as error:  # noqa: BLE001 - the run has ended; say so and go on
                self.log(f"--logger {sink.name} could not be closed ({type(error).__name__}: {error})")
        self.sinks = []


__all__ = ["LOGGERS", "CSVSink", "MLflowSink", "MetricsSink", "RunLog", "TensorBoardSink", "WandbSink",
           "logger_packages", "open_sinks", "parse_loggers", "scalars"]
