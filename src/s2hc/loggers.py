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
starts). A logger that cannot start is one line too (``--logger NAME could not start (...)``), before the run writes
its ``config.yaml`` or ``metrics.jsonl``, so a new run leaves nothing to refuse and a resumed one is as it was.

A resumed run continues its loggers as ``metrics.jsonl`` continues: the CSV is rewritten from the kept records (a
damaged one is said in one line and made whole), TensorBoard drops what was logged after the checkpoint it resumes
from, and the W&B and MLflow runs are the same runs (their ids are kept in ``RUN/loggers.json`` with the run
directory they belong to; W&B ignores steps it has already seen). A ``loggers.json`` that is damaged, or that names
another run's logger runs (copied with that run's files), or an MLflow run the tracking store does not hold (another
``$MLFLOW_TRACKING_URI``, a removed database) is said in one line, and new logger runs start: no record is lost, and
no other run's curves are written into. A logger that fails while the run trains is turned off with one line, and
the run goes on: ``metrics.jsonl`` keeps every record.

s2hc removes only what it wrote: a TensorBoard directory it writes holds a mark (:data:`TENSORBOARD_MARK`, naming
the run directory); a new run replaces the event files of a directory marked as its own, and never touches one that
is not (a user's own ``OUT/tensorboard/`` is refused in one line; in a shared ``logger_dir``, another run of the same
name gets ``NAME-2/``, said in one line). ``--overwrite`` removes from ``OUT/tensorboard/`` only the event files of
a marked one.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import urllib.parse
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
#: In a TensorBoard directory s2hc writes: ``{"run": RUN_DIR}``, the run whose curves it holds (only a marked
#: directory's event files are ever removed). TensorBoard reads only ``*tfevents*`` files, so it ignores the mark.
TENSORBOARD_MARK = ".s2hc-run.json"
EVENT_FILES = "events.out.tfevents."
#: A W&B or MLflow run id as both make them (letters, digits, ``-``, ``_``): anything else in ``loggers.json`` is
#: damage, and is never handed on (MLflow's file store makes a run id part of a path).
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The W&B modes ``$WANDB_MODE`` may name (``wandb.init``'s ``mode``).
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
MAX_IDS_BYTES = 1 << 16  # loggers.json holds a few ids: a larger one is damaged, and is not read whole
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
    rewritten atomically when a new scalar brings a column, or a row fills.

    A resumed run passes the records ``metrics.jsonl`` keeps (``records``; None for a new run): the CSV is rewritten
    from them, not read back, since it only repeats them. So a file cut short by a kill, damaged, or written by
    another version is made whole; a damaged one is said in one line to ``log`` (:func:`csv_defect`)."""

    name = "csv"

    def __init__(self, path: Path, records: list[dict[str, Any]] | None,
                 log: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self.columns = ["step"]
        if records is not None:
            defect = csv_defect(self.path)
            if defect is not None and log is not None:
                log(f"{str(self.path)!r} is damaged ({defect}); rewritten from metrics.jsonl")
            for record in records:
                values = scalars(record)
                if values:
                    self._add(int(record["step"]), values)
        self._rewrite()

    def _add(self, step: int, values: dict[str, float]) -> tuple[bool, bool]:
        """Add ``values`` at ``step``; ``(new columns, row filled)``."""
        new_columns = [key for key in values if key not in self.columns]
        self.columns += new_columns
        if self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update(values)
            return bool(new_columns), True
        self.rows.append({"step": step, **values})
        return bool(new_columns), False

    def write(self, step: int, values: dict[str, float]) -> None:
        new_columns, filled = self._add(step, values)
        if new_columns or filled:
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


def csv_defect(path: Path) -> str | None:
    """What is wrong with the ``metrics.csv`` at ``path`` (None: nothing, or no file): not UTF-8, not CSV, a header
    that does not start with ``step``, a row of another width or a step that is not an integer. A last line cut
    short (a kill while appending) is not a defect."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as error:
        return f"not UTF-8 text ({error.reason} at byte {error.start})"
    except OSError as error:
        return f"unreadable ({error.strerror or type(error).__name__})"
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()
    elif lines:
        lines.pop()  # no newline after it: a line cut short
    try:
        rows = list(csv.reader(lines))
    except csv.Error as error:
        return f"not CSV ({error})"
    if not rows:
        return None if not text else "no header line"
    header = rows[0]
    if not header or header[0] != "step" or len(set(header)) != len(header):
        return f"its header {','.join(header)[:60]!r} is not 'step' then one column per scalar"
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            return f"line {number} has {len(row)} fields, its header {len(header)}"
        if not re.fullmatch(r"-?[0-9]{1,18}", row[0]):
            return f"line {number}: step {row[0][:20]!r} is not an integer"
    return None


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``), a directory marked as
    this run's (:func:`tensorboard_dir` chose it). A new run starts it without event files (only those of an earlier
    attempt of the same run are there to remove); a resumed one writes a purge marker at its first step, so
    TensorBoard drops what the killed run had logged after the checkpoint."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, resumed_step: int | None, run_dir: Path):
        from .extras import require

        require("tensorboard", "--logger tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir, self.new = Path(log_dir), resumed_step is None
        marked = _marked(self.log_dir, run_dir)
        if self.new:
            for path in _event_files(self.log_dir):  # an earlier attempt of this run (the mark says so)
                path.unlink()
        existed, marking = self.log_dir.exists(), not marked and (self.new or not _holds_other_files(self.log_dir))
        if marking:  # a resumed run's curves written before marks existed stay unmarked: never removed by s2hc
            from .io import atomic_write_text

            self.log_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.log_dir / TENSORBOARD_MARK, json.dumps({"run": _identity(run_dir)}) + "\n")
        purge = None if resumed_step is None else resumed_step + 1
        try:
            self.writer = SummaryWriter(str(self.log_dir), purge_step=purge, flush_secs=10)
        except BaseException:
            if marking:  # as it was: the run does not start
                with contextlib.suppress(OSError):
                    (self.log_dir / TENSORBOARD_MARK).unlink()
                    if not existed:
                        self.log_dir.rmdir()
            raise

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()

    def discard(self) -> None:
        """Remove what this new run wrote (its event files, the mark, the directory when that leaves it empty): the
        run did not start."""
        if not self.new:
            return
        with contextlib.suppress(OSError):
            for path in _event_files(self.log_dir):
                path.unlink()
            (self.log_dir / TENSORBOARD_MARK).unlink(missing_ok=True)
            self.log_dir.rmdir()


def _identity(run_dir: Path) -> str:
    """The run directory, as loggers.json and a TensorBoard mark name it."""
    return str(Path(run_dir).expanduser().resolve())


def _mark_of(log_dir: Path) -> str | None:
    """The run directory a TensorBoard directory's mark names: None without a mark, ``""`` for a damaged one."""
    path = Path(log_dir) / TENSORBOARD_MARK
    if not path.is_file():
        return "" if path.exists() or path.is_symlink() else None
    try:
        value = json.loads(path.read_bytes()[:MAX_IDS_BYTES].decode("utf-8")).get("run")
    except (OSError, ValueError, AttributeError, RecursionError):
        return ""
    return value if isinstance(value, str) else ""


def _marked(log_dir: Path, run_dir: Path) -> bool:
    """Whether ``log_dir`` is marked as the run in ``run_dir``'s. A directory inside the run directory needs only a
    mark (a run directory moved or copied whole keeps its own curves); one outside must name this run directory."""
    mark = _mark_of(log_dir)
    if mark is None:
        return False
    inside = Path(log_dir).expanduser().resolve().parent == Path(run_dir).expanduser().resolve()
    return inside or mark == _identity(run_dir)


def _event_files(log_dir: Path) -> list[Path]:
    return sorted(p for p in Path(log_dir).glob(EVENT_FILES + "*") if p.is_file() and not p.is_symlink())


def _holds_other_files(log_dir: Path) -> bool:
    """Whether ``log_dir`` holds anything (a directory that is empty, or absent, is free to use)."""
    path = Path(log_dir)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return True
    return path.is_dir() and any(path.iterdir())


def clear_tensorboard_dir(log_dir: Path) -> bool:
    """Remove what a run wrote into the ``tensorboard/`` of its run directory (``--overwrite``): its event files,
    then its mark and the directory when nothing else is left; whether it was the run's (marked). A directory
    without the mark (a user's own), or a link, is left alone, and so is anything else a user put into a marked one
    (which then keeps its mark: the next run writes there again)."""
    path = Path(log_dir)
    if path.is_symlink() or not path.is_dir():
        return False
    if _mark_of(path) is None:
        if any(path.iterdir()):
            return False
        path.rmdir()  # empty: nothing of anyone's is lost
        return True
    for events in _event_files(path):
        events.unlink()
    if all(entry.name == TENSORBOARD_MARK for entry in path.iterdir()):
        (path / TENSORBOARD_MARK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.rmdir()
    return True


def tensorboard_dir(run_dir: Path, logger_dir: Path | None, resumed: bool,
                    log: Callable[[str], None] | None = None) -> Path:
    """Where the run in ``run_dir`` writes its TensorBoard events: ``RUN/tensorboard/``, or with a shared
    ``logger_dir`` ``LOGGER_DIR/tensorboard/RUN_NAME/``; never a directory of files it did not write.

    In the run directory, a ``tensorboard/`` that holds files but no mark is a user's: a new run refuses it
    (ValueError, one line); a resumed run written before marks existed keeps writing beside its curves. In a shared
    directory, ``RUN_NAME/`` marked as another run's (two runs of one name) is left to it: the first of
    ``RUN_NAME-2/``, ``RUN_NAME-3/``, ... that is this run's or free is used, and said in one line."""
    run_dir = Path(run_dir)
    if logger_dir is None:
        path = run_dir / TENSORBOARD_DIR
        if path.exists() and not path.is_dir():
            raise ValueError(f"{str(path)!r} is not a directory; --logger tensorboard writes its event files there: "
                             "move that file away")
        if not resumed and _holds_other_files(path) and not _marked(path, run_dir):
            raise ValueError(f"{str(path)!r} holds files this run did not write (it has no {TENSORBOARD_MARK}); "
                             "--logger tensorboard would replace them: move them away, or choose another --out")
        return path
    base, name = Path(logger_dir).expanduser() / TENSORBOARD_DIR, run_dir.expanduser().resolve().name
    candidates = [base / (name if k == 1 else f"{name}-{k}") for k in range(1, 101)]
    for path in candidates:
        if _marked(path, run_dir):
            return path
    if resumed and _mark_of(candidates[0]) is None and candidates[0].is_dir():
        return candidates[0]  # a run written before marks existed
    for path in candidates:
        if not _holds_other_files(path):
            if path != candidates[0] and log is not None:
                log(f"{str(candidates[0])!r} holds the TensorBoard curves of another run named {name!r}: this "
                    f"run's go to {str(path)!r}")
            return path
    raise ValueError(f"{str(base)!r} holds TensorBoard directories {name!r} to {candidates[-1].name!r}, all of "
                     "other runs; choose another logger_dir, or another run name")


def _wandb_mode() -> str:
    """``$WANDB_MODE`` when set (one of :data:`WANDB_MODES`, else ValueError in one line: W&B's own refusal is
    several); otherwise ``online`` when an API key is configured (the environment or ``~/.netrc``, where ``wandb
    login`` writes it), else ``offline``: a run never stops to ask for a login."""
    mode = os.environ.get("WANDB_MODE", "").strip()
    if mode:
        if mode not in WANDB_MODES:
            raise ValueError(f"WANDB_MODE must be online, offline or disabled (or unset: online with a W&B API key, "
                             f"else offline), got {mode[:40]!r}")
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except (OSError, UnicodeDecodeError):
        return "offline"


class WandbSink:
    """A Weights & Biases run (``wandb.init``): project ``$WANDB_PROJECT`` or ``s2hc``, ``group``, the run's config;
    ``run_id`` continues a run (a resume)."""

    name = "wandb"

    def __init__(self, directory: Path, name: str, group: str | None, config: dict[str, Any], run_id: str | None):
        from .extras import require

        wandb = require("wandb", "--logger wandb")
        mode = _wandb_mode()
        with _starting(self.name, f"in {str(directory)!r}"):
            directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_GROUP), dir=str(directory),
                                  name=name, group=group, config=config, id=run_id,
                                  resume="allow" if run_id else None, mode=mode)
        self.run_id = self.run.id

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def default_tracking_uri(root: Path) -> str:
    """``sqlite:///ROOT/mlflow.db``, the path quoted: a ``%2F``, ``?`` or ``#`` in a directory's name would
    otherwise be read as a path separator, a query or a fragment, and put the database elsewhere."""
    return "sqlite:///" + urllib.parse.quote(str((Path(root) / "mlflow.db").resolve()))


class MLflowSink:
    """An MLflow run (``mlflow.MlflowClient``, no global state): experiment ``group``, the run's settings as
    parameters; ``run_id`` continues a run (a resume), unless the store does not hold it (another tracking URI, a
    removed database): a new run is started, and said in one line to ``log``. Non-finite values are left out (MLflow
    stores them inconsistently across backends)."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, artifacts: Path | None, group: str, name: str, config: dict[str, Any],
                 run_id: str | None, log: Callable[[str], None] | None = None):
        from .extras import require

        mlflow = require("mlflow", "--logger mlflow")
        self.entities = require("mlflow.entities")
        with _starting(self.name, f"with tracking URI {tracking_uri!r}"):
            self.client = mlflow.MlflowClient(tracking_uri)
            if run_id is not None and not self._holds(run_id):
                if log is not None:
                    log(f"--logger mlflow: the tracking store {tracking_uri!r} holds no run {run_id!r} (the one "
                        f"{IDS_FILE} names; another MLFLOW_TRACKING_URI, or a database removed?): this run logs to "
                        "a new MLflow run")
                run_id = None
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

    def _holds(self, run_id: str) -> bool:
        """Whether the store holds the run ``run_id``, not deleted (a store that cannot be read raises)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            if getattr(error, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return False
            raise
        return run.info.lifecycle_stage == "active"

    def write(self, step: int, values: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, value, now, step) for key, value in values.items() if math.isfinite(value)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@contextlib.contextmanager
def _starting(logger: str, where: str):
    """Turn whatever a logger's package raises while it starts into one line (ValueError): the run does not start,
    and the line names the logger, where it writes and the package's reason (a traceback, or W&B's and MLflow's
    several lines, would say neither plainly)."""
    try:
        yield
    except ImportError:
        raise  # a missing extra: already one line (s2hc.extras)
    except Exception as error:  # noqa: BLE001 - any package's failure, said in one line
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0].strip()[:300]}" if lines else type(error).__name__
        raise ValueError(f"--logger {logger} could not start {where} ({reason}); fix that, or leave {logger} out of "
                         "--logger (metrics.jsonl keeps every record)") from error


# --------------------------------------------------------------------------------------- the run's log


def open_sinks(names: tuple[str, ...], run_dir: Path, *, config: dict[str, Any], logger_dir: str | None = None,
               group: str | None = None, resumed_step: int | None = None,
               records: Callable[[], list[dict[str, Any]] | None] | None = None,
               log: Callable[[str], None] | None = None) -> list[MetricsSink]:
    """The sinks ``names`` of the run in ``run_dir`` (its ``config`` as a dict: parameters for W&B and MLflow);
    ``resumed_step``: the checkpoint step a resumed run continues from (None: a new run); ``records``: the
    ``metrics.jsonl`` records a resumed run keeps, asked for only by the CSV (which is rewritten from them; None:
    from none). See the module's list for where each writes; ``log`` takes the one-line notices (a damaged file made
    whole, a new logger run).

    Called before the run writes its ``config.yaml`` and ``metrics.jsonl``: a sink that cannot start raises
    ValueError in one line (a missing package :class:`s2hc.extras.MissingExtra`), after the sinks already started are
    closed and what a new run's TensorBoard wrote is removed; ``metrics.jsonl`` is read, not written."""
    run_dir = Path(run_dir)
    shared = logger_dir is not None
    root = Path(logger_dir).expanduser() if shared else run_dir
    name = run_dir.resolve().name
    resumed = resumed_step is not None
    ids = _read_ids(run_dir, log if {"wandb", "mlflow"} & set(names) else None) if resumed else {}
    kept = ((records() if records is not None else None) or []) if resumed and "csv" in names else None
    sinks: list[MetricsSink] = []
    try:
        for logger in names:
            if logger == "csv":
                with _starting(logger, f"in {str(run_dir / CSV_FILE)!r}"):
                    sinks.append(CSVSink(run_dir / CSV_FILE, kept, log))
            elif logger == "tensorboard":
                log_dir = tensorboard_dir(run_dir, root if shared else None, resumed, log)
                with _starting(logger, f"in {str(log_dir)!r}"):
                    sinks.append(TensorBoardSink(log_dir, resumed_step, run_dir))
            elif logger == "wandb":
                sinks.append(WandbSink(root, name, group, config, ids.get("wandb")))
            elif logger == "mlflow":
                uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(root)
                artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else root / "mlartifacts"
                with _starting(logger, f"in {str(root)!r}"):
                    root.mkdir(parents=True, exist_ok=True)
                sinks.append(MLflowSink(uri, artifacts, group or DEFAULT_GROUP, name, config, ids.get("mlflow"), log))
        run_ids = {sink.name: sink.run_id for sink in sinks if getattr(sink, "run_id", None)}
        if run_ids:
            from .io import atomic_write_text

            atomic_write_text(run_dir / IDS_FILE, json.dumps({"run": _identity(run_dir), **run_ids}, indent=2) + "\n")
    except BaseException:
        for sink in sinks:
            with contextlib.suppress(Exception):  # the error that stops the run is the one to say
                sink.close()
            if not resumed and hasattr(sink, "discard"):
                sink.discard()
        raise
    return sinks


def _read_ids(run_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """The W&B / MLflow run ids the run in ``run_dir`` recorded. Empty when it recorded none, when ``loggers.json``
    is damaged, or when it is another run's (it names another run directory that holds a ``loggers.json`` with the
    same ids: a copy of that run, whose logger runs are not this one's); the last two are said to ``log``. A
    resumed run then starts new logger runs, which loses no record. A run directory moved whole keeps its ids."""
    path = run_dir / IDS_FILE
    if not path.exists() and not path.is_symlink():
        return {}
    ids, defect = _parse_ids(path)
    if defect is not None:
        if log is not None:
            log(f"{str(path)!r} is damaged ({defect}); this run starts new W&B and MLflow runs")
        return {}
    owner = ids.pop("run", None)
    if owner is not None and owner != _identity(run_dir):
        other, _ = _parse_ids(Path(owner) / IDS_FILE)
        if any(ids.get(key) == other.get(key) for key in ("wandb", "mlflow") if key in ids):
            if log is not None:
                log(f"{str(path)!r} names the logger runs of {owner!r} (copied from that run?): this run starts its "
                    "own W&B and MLflow runs")
            return {}
    return ids


def _parse_ids(path: Path) -> tuple[dict[str, str], str | None]:
    """``(ids, defect)`` of a ``loggers.json``: a JSON object of ``wandb``, ``mlflow`` (:data:`RUN_ID`) and ``run``
    (the run directory), all optional; ``({}, why)`` for anything else."""
    try:
        with Path(path).open("rb") as handle:
            data = handle.read(MAX_IDS_BYTES + 1)
    except OSError as error:
        return {}, f"unreadable: {error.strerror or type(error).__name__}"
    if len(data) > MAX_IDS_BYTES:
        return {}, f"larger than {MAX_IDS_BYTES} bytes"
    try:
        ids = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        return {}, f"not UTF-8 text ({error.reason} at byte {error.start})"
    except RecursionError:
        return {}, "nested too deeply"
    except ValueError as error:
        return {}, f"not JSON: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    if not isinstance(ids, dict):
        return {}, f"a JSON {type(ids).__name__}, not an object of run ids"
    for key, value in ids.items():
        if key not in ("run", "wandb", "mlflow"):
            return {}, f"an unknown key {key[:40]!r}"
        if not isinstance(value, str) or (key != "run" and not RUN_ID.fullmatch(value)):
            return {}, f"{key} is {str(value)[:40]!r}, not a run id" if key != "run" else "run is not a path"
    return ids, None


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


__all__ = ["LOGGERS", "TENSORBOARD_MARK", "CSVSink", "MLflowSink", "MetricsSink", "RunLog", "TensorBoardSink",
           "WandbSink", "csv_defect", "clear_tensorboard_dir", "default_tracking_uri", "logger_packages", "open_sinks",
           "parse_loggers", "scalars", "tensorboard_dir"]
