"""``s2hc study``: every run of a grid as an ordinary ``s2hc train`` process, resumable, then one report.

``OUT/`` holds ``study.json`` (the checked grid; a later call must bring the same one, or one that grows it:
the same training settings with more configurations or seeds), ``configs/NAME.yaml``
(each run's full training configuration), ``runs/NAME/`` (each run's directory: ``s2hc eval``, ``diagnose`` and
``export`` work on it), ``logs/NAME.log`` (its output), ``rows/NAME.json`` (its measurements, see
:mod:`.measure`), and at the end ``results.json`` and ``report.md`` with ``figures/``.

Runs are the plain commands :func:`train_command` returns (``--print-commands`` lists them for a scheduler),
started ``jobs`` at a time. Calling the study again finishes it: a measured run is skipped, a finished one is
measured, an interrupted one resumes from its checkpoint, a diverged one is recorded as diverged.

No run outlives the study (:mod:`s2hc.train.processes`): each runs in a process group of its own, which the
study stops (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`) and reaps on every way out, an exception
included; a study killed outright (``kill -9``) takes its runs with it through their parent-death signal
(Linux; elsewhere they run on), so the study called again takes their locks over.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from .. import __version__
from ..config import BEFORE_FIELD, TrainConfig, completed_settings, load_yaml_config, shown_fields
from ..devices import resolve_device
from ..extras import check_available
from ..io import atomic_write_text, check_output_dir, read_json_object
from ..rundir import RunLock, holds_run, read_config, read_metrics, saved_step
from ..rundir.guard import clear_run
from ..train.processes import die_with_parent_env, stop_processes
from .measure import ROW_VERSION, measure_run
from .preregistered import changed_fields
from .report import REPORT, REPORT_PACKAGES, RESULTS, RUNS, STUDY_FILE, write_report
from .spec import Configuration, StudySpec

STUDY = STUDY_FILE
REGISTRATION = "registration"  # study.json's (and results.json's) record of the registered test
STOP_GRACE_S = 60.0  # how long a run asked to stop may take to finish its step and save before it is killed


class StudyInterrupted(RuntimeError):
    """SIGINT or SIGTERM reached the study: its runs saved checkpoints and stopped; calling it again resumes."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}; the runs saved their checkpoints: run the same command "
                         "again to resume")
        self.signum = signum


class StudyFailed(RuntimeError):
    """Some runs failed (neither finished nor diverged); the others were kept."""


@dataclass(frozen=True)
class Run:
    """One (configuration, seed) of the grid and its files under ``OUT``."""

    configuration: Configuration
    seed: int
    out: Path

    @property
    def name(self) -> str:
        return self.configuration.run_name(self.seed)

    @property
    def run_dir(self) -> Path:
        return self.out / RUNS / self.name

    @property
    def config_path(self) -> Path:
        return self.out / "configs" / f"{self.name}.yaml"

    @property
    def row_path(self) -> Path:
        return self.out / "rows" / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.out / "logs" / f"{self.name}.log"


def train_command(run: Run, nproc: int = 1, executable: str | None = None) -> list[str]:
    """The ``s2hc train`` command of ``run`` (``--resume`` when its directory already holds the run; ``--nproc``
    for several processes). ``executable``: a Python to run it with (``python -m s2hc``), not the ``s2hc`` script."""
    program = [executable, "-m", "s2hc"] if executable else ["s2hc"]
    command = [*program, "train", "--config", str(run.config_path), "--out", str(run.run_dir)]
    command += ["--nproc", str(nproc)] if nproc > 1 else []
    return command + (["--resume"] if holds_run(run.run_dir) else [])


def _read_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (the study's own file, ``what`` says which); ValueError naming the file when
    it is damaged or written by something else, and what to do."""
    return read_json_object(path, f"remove it (the study {what}) to let the study write it again")


def _row(run: Run) -> dict[str, Any] | None:
    """The run's measured row (of this version): its ``rows/NAME.json``, else its row in the directory's
    ``results.json`` (a committed study keeps only that: copied to a new directory, it grows without training
    its measured runs again)."""
    if run.row_path.is_file():
        row = _read_object(run.row_path, "measures that run again")
    else:
        row = _recorded_rows(run.out / RESULTS).get(run.name)
    return row if row is not None and row.get("version") == ROW_VERSION else None


def _recorded_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of the ``results.json`` at ``path`` by run name; empty when there is none."""
    if not path.is_file():
        return {}
    rows = _read_object(path, "results: the study writes them again").get("rows") or []
    return {row["name"]: row for row in rows if isinstance(row, dict) and "name" in row}


def _state(run: Run, spec: StudySpec) -> str:
    """``measured``, ``finished`` (to measure), ``diverged`` (to measure), ``started`` or ``new``."""
    if _row(run) is not None:
        return "measured"
    if not holds_run(run.run_dir):
        return "new"
    if saved_step(run.run_dir) == load_yaml_config(run.config_path).get("max_steps"):  # a damaged one: one line
        return "finished"
    with contextlib.suppress(ValueError):
        if any("diverged" in r for r in read_metrics(run.run_dir)):
            return "diverged"
    return "started"


def _grows(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether the grid ``after`` keeps every run of ``before`` as it was: the same training settings, and its
    runs (configuration, seed) include ``before``'s (a study may grow; its finished runs stay valid)."""
    return (_computed(before.get("train")) == _computed(after["train"])
            and _grid_runs(before) <= _grid_runs(after))


def _grid_runs(grid: dict[str, Any]) -> set[tuple[str, int]]:
    """A recorded grid's runs: each configuration (less its own seeds) as JSON, with each of its seeds (its
    setting's own, else the grid's)."""
    runs = set()
    for configuration in grid.get("configurations", []):
        seeds = configuration.get("seeds", grid.get("seeds", []))
        key = json.dumps({k: v for k, v in configuration.items() if k != "seeds"}, sort_keys=True)
        runs |= {(key, seed) for seed in seeds}
    return runs


def _computed(train: Any) -> Any:
    """A grid's ``train`` settings less those that change only what a run shows and where it logs
    (:func:`~s2hc.config.shown_fields`: a study may add a logger and still grow): what decides its runs."""
    if not isinstance(train, dict):
        return train
    # A grid recorded before `init_rng` existed drew its weights sequentially; every grid since records the field.
    train = {"init_rng": BEFORE_FIELD["init_rng"], **train}
    return {key: value for key, value in train.items() if key not in shown_fields()}


def _recorded_grid(path: Path, recorded: dict[str, Any]) -> dict[str, Any]:
    """The ``grid`` of a ``study.json``; ValueError naming the file when it is not an object."""
    grid = recorded.get("grid", {})
    if not isinstance(grid, dict):
        raise ValueError(f"{str(path)!r}: 'grid' is a {type(grid).__name__}, not an object; remove the file (the "
                         "study records its grid again)")
    return grid


def prepare(spec: StudySpec, out: Path, *, code: dict[str, Any] | None = None, action: str = "run",
            new_registration: bool = False) -> list[Run]:
    """Write ``study.json`` and every run's config; ValueError when ``out`` holds a study whose runs the grid
    would not keep (other training settings, or configurations or seeds left out), a run or row trained with other
    settings than the grid gives it (:func:`_check_trained`), or a registered test other than the one recorded once
    runs exist (:func:`_registration`; ``new_registration``: record it as made after them instead); MissingExtra
    when a run needs an optional package that is not installed. ``study.json`` keeps every invocation
    (``invocations``: when, ``action``, and ``code``, the :func:`provenance` of the code that ran) and the
    registration (``registration``)."""
    for configuration, seed in spec.runs():  # before anything is written, as `s2hc train` checks
        spec.run_config(configuration, seed, out).check_extras()
    check_output_dir(out, "--out")
    recorded = out / STUDY
    grid = json.loads(json.dumps(spec.grid()))
    previous = _read_object(recorded, "records its grid again") if recorded.is_file() else None
    if previous is not None and not _grows(_recorded_grid(recorded, previous), grid):
        raise ValueError(f"--out {str(out)!r} holds a study of another grid or training settings ({STUDY} "
                         "differs); a study may only grow (the same train settings, more configurations or seeds): "
                         "choose another --out, or remove that directory to start it again")
    runs = [Run(configuration, seed, out) for configuration, seed in spec.runs()]
    existing = _check_trained(spec, runs, vouched=previous is not None)
    registration = _registration(spec, previous, existing, new_registration, out)
    invocations = (previous or {}).get("invocations")
    invocations = [*(invocations if isinstance(invocations, list) else []),
                   _invocation(action, provenance() if code is None else code)]
    atomic_write_text(recorded, json.dumps({"grid": spec.grid(), "study": spec.to_dict(), "invocations": invocations,
                                            **({REGISTRATION: registration} if registration else {})},
                                           indent=2) + "\n")
    for run in runs:
        config = spec.run_config(run.configuration, run.seed, run.run_dir).to_dict()
        config.pop("out")
        config["progress"] = spec.train.get("progress", False)  # a bar in a log file is noise
        if config["logger"]:  # the study's runs log side by side: its directory, grouped under its name
            config["logger_dir"] = config["logger_dir"] or str(out)
            config["logger_group"] = config["logger_group"] or out.resolve().name
        run.config_path.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(config, sort_keys=False)
        if not run.config_path.is_file() or run.config_path.read_text() != text:
            atomic_write_text(run.config_path, text)
    return runs


def trained_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What decides what a run trains: its settings (a TrainConfig's dict, or a run's stored ``config.yaml``,
    completed as :func:`~s2hc.config.completed_settings` reads it) as TrainConfig resolves them, less its directory
    and what changes only what a run shows and where it logs (:func:`~s2hc.config.shown_fields`); as JSON holds
    them, so that a row's record compares equal."""
    values = TrainConfig.from_dict({**completed_settings(config), "out": "unused"}).to_dict()
    aside = {"out", *shown_fields()}
    return json.loads(json.dumps({k: v for k, v in values.items() if k not in aside}, default=repr))


def _differences(found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``max_steps 2 (the grid: 3)`` for each setting ``found`` has otherwise than ``wanted`` (``model_overrides``
    key by key)."""
    out = []
    for key in sorted(set(found) | set(wanted)):
        a, b = found.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{line}" for line in _differences(a, b)]
        elif a != b:
            out.append(f"{key} {json.dumps(a)} (the grid: {json.dumps(b)})")
    return out


def _check_trained(spec: StudySpec, runs: list[Run], vouched: bool) -> int:
    """How many of ``runs`` exist (a run directory or a measured row); ValueError in one line naming the run and
    the settings when one was trained otherwise than the grid gives it: a run directory by its own config, a row by
    the settings it records (``trained_with``). A row that records none (measured before rows did) is reused only
    when ``vouched``: a ``study.json`` whose grid this one grows holds the settings it was trained with."""
    existing = 0
    for run in runs:
        wanted = trained_settings(spec.run_config(run.configuration, run.seed, run.run_dir).to_dict())
        row, stored = _row(run), read_config(run.run_dir) if holds_run(run.run_dir) else None
        existing += row is not None or holds_run(run.run_dir)
        for where, found in ((f"{RUNS}/{run.name}/", stored), (_row_where(run), (row or {}).get("trained_with"))):
            if found is None:
                continue
            different = _differences(trained_settings(found) if where.startswith(RUNS) else found, wanted)
            if different:
                raise ValueError(
                    f"--out {str(run.out)!r}: {where} was trained with {', '.join(different)}; a run is reused only "
                    "when every training setting matches: choose another --out, or remove that run's row and "
                    "directory to train it again")
        if row is not None and "trained_with" not in row and stored is None and not vouched:
            raise ValueError(
                f"--out {str(run.out)!r}: {_row_where(run)} does not record the settings it was trained with (measured "
                f"before rows recorded them) and {STUDY}, which recorded them, is gone: nothing says it is this grid's "
                f"run; restore {STUDY}, or remove the row to train it again")
    return existing


def _row_where(run: Run) -> str:
    """Where a run's row is read from: ``rows/NAME.json``, else the directory's ``results.json``."""
    return f"rows/{run.name}.json" if run.row_path.is_file() else f"{RESULTS} (row {run.name})"


def _registration(spec: StudySpec, previous: dict[str, Any] | None, existing: int, new: bool,
                  out: Path) -> dict[str, Any] | None:
    """The registration ``study.json`` keeps: ``preregistered`` (the block, normalised), ``recorded`` (when) and
    ``runs_existing`` (how many of the grid's runs existed when it was recorded: 0, a registration before the runs;
    None, carried over from a ``study.json`` that predates the record); earlier ones under ``superseded``. None
    when neither this grid nor the record has one. ValueError in one line naming each changed field, old and new,
    when the registration differs from the recorded one once runs exist, unless ``new``."""
    block = json.loads(json.dumps(spec.preregistered)) if spec.preregistered is not None else None
    record = (previous or {}).get(REGISTRATION)
    if previous is not None and not isinstance(record, dict):  # a study.json from before the record
        old = previous.get("study", {}).get("preregistered") if isinstance(previous.get("study"), dict) else None
        record = None if old is None else {"preregistered": old, "recorded": None, "runs_existing": None}
    if record is None and block is None:
        return None
    if record is not None and record.get("preregistered") == block:
        if record.get("runs_existing") is None and not existing:  # nothing has run: it is before the runs after all
            record = {**record, "runs_existing": 0}
        return record
    old = None if record is None else record.get("preregistered")
    if existing and (record is not None or previous is not None) and not new:
        changed = "; ".join(changed_fields(old, block))
        raise ValueError(f"--out {str(out)!r}: the registered test differs from the one {STUDY} recorded for these "
                         f"runs ({changed}), and {existing} of its runs exist: a registration cannot change once runs "
                         "exist; restore it, or pass --new-registration to record this one as made after the runs (the "
                         "report says so)")
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    superseded = [*(record.get("superseded") or []), {k: v for k, v in record.items() if k != "superseded"}] \
        if record is not None else []
    return {"preregistered": block, "recorded": at, "runs_existing": existing,
            **({"superseded": superseded} if superseded else {})}


def schedule_warnings(spec: StudySpec) -> list[str]:
    """The distinct :meth:`~s2hc.config.TrainConfig.schedule_warnings` of the grid's runs."""
    lines = (line for configuration, seed in spec.runs()
             for line in spec.run_config(configuration, seed, "unused").schedule_warnings())
    return list(dict.fromkeys(lines))


def print_commands(spec: StudySpec, out: Path, config: str | Path | None = None, new_registration: bool = False
                   ) -> list[str]:
    """The shell commands of every run not yet finished, one per line (what a scheduler would run). ``config``:
    the study config's file (where the commit is read when s2hc is not a checkout, :func:`provenance`);
    ``new_registration``: as :func:`prepare`."""
    out = Path(out).expanduser()
    check_output_dir(out, "--out")
    with RunLock(out):
        runs = prepare(spec, out, code=provenance(config), action="print-commands", new_registration=new_registration)
        return [shlex.join(train_command(run, spec.nproc)) for run in runs if _state(run, spec) in ("new", "started")]


#: The commit an installed snapshot of s2hc was built from, for a study that runs it outside a git checkout
#: (``S2HC_COMMIT=$(git rev-parse --short HEAD)``); :data:`DIRTY_ENV` ``1`` when that tree was not clean, ``0``
#: when it was (unset: unknown).
COMMIT_ENV, DIRTY_ENV = "S2HC_COMMIT", "S2HC_DIRTY"
#: Where a recorded commit came from (``commit_source``).
FROM_PACKAGE, FROM_ENV, FROM_CONFIG = "s2hc's checkout", COMMIT_ENV, "the config's checkout"


def _git(directory: Path, *args: str) -> str | None:
    """``git -C directory ARGS``'s output, stripped; None when git fails (no checkout, no git)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() if done.returncode == 0 else None
    return None


def _tracked(path: Path) -> bool:
    """Whether ``path`` is a file git tracks in the checkout it lies in (an installed package inside an unrelated
    checkout, a virtual environment's site-packages, is not: that checkout's commit is not its code)."""
    return _git(path.parent, "ls-files", "--error-unmatch", "--", path.name) is not None


def _package_dir() -> Path:
    """The directory of the s2hc package that runs (a checkout's ``src/s2hc``, or an installed copy)."""
    return Path(__file__).resolve().parent.parent


def provenance(config: str | Path | None = None) -> dict[str, Any]:
    """The code a study runs, as far as it can be known: ``commit`` (short hash), ``dirty`` (whether the sources
    differed from it; None: unknown) and ``commit_source``, the first of: s2hc's own checkout (the package's files
    tracked there; dirty: its sources or the config differ), :data:`COMMIT_ENV` (an installed snapshot that says
    which commit it was built from), the checkout the study's ``config`` lies in (s2hc ran from an installed
    package; dirty: that checkout's tracked files differ). ``commit`` None when none of them says."""
    package = _package_dir()
    config = Path(config).resolve() if config else None
    if _tracked(package / "__init__.py"):
        commit = _git(package, "rev-parse", "--short", "HEAD")
        if commit:  # a checkout whose s2hc sources differ from the commit: say so, the commit alone is not the code
            paths = ["."] + ([str(config)] if config and _git(package, "ls-files", "--", str(config)) else [])
            changed = _git(package, "status", "--porcelain", "--untracked-files=no", "--", *paths)
            return {"commit": commit, "dirty": changed is None or bool(changed), "commit_source": FROM_PACKAGE}
    if os.environ.get(COMMIT_ENV, "").strip():
        dirty = os.environ.get(DIRTY_ENV, "").strip().lower()
        return {"commit": os.environ[COMMIT_ENV].strip(), "commit_source": FROM_ENV,
                "dirty": {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(dirty)}
    if config is not None and _tracked(config):
        commit = _git(config.parent, "rev-parse", "--short", "HEAD")
        if commit:
            changed = _git(config.parent, "status", "--porcelain", "--untracked-files=no")
            return {"commit": commit, "dirty": changed is None or bool(changed), "commit_source": FROM_CONFIG}
    return {"commit": None, "dirty": None, "commit_source": None}


def _invocation(action: str, code: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``study.json``'s ``invocations``: when, what (``run``, ``print-commands``), the s2hc version
    and :func:`provenance`."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"at": at, "action": action, "s2hc": __version__, **code}


def _environment(elapsed_s: float, jobs: int, code: dict[str, Any] | None = None) -> dict[str, Any]:
    code = provenance() if code is None else code
    commit = code["commit"]
    found = {"commit": commit}
    if commit:
        found["dirty"] = code["dirty"]
        if code["commit_source"] != FROM_PACKAGE:  # as results always said it for a checkout: no new key there
            found["commit_source"] = code["commit_source"]
    return {
        "s2hc": __version__, **found, "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores visible, "
                   + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"),
        "jobs": jobs, "wall_s": round(elapsed_s, 1),
    }


# A hang-up (the terminal closed) stops the runs as SIGTERM does (they do not catch SIGHUP); a study under nohup,
# which ignores it, goes on.
_FORWARDED = {signal.SIGHUP: signal.SIGTERM} if hasattr(signal, "SIGHUP") else {}


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads_text(threads: int | None) -> str:
    return "each on its own GPU" if threads is None else f"{threads} torch thread(s) each"


def run_threads(jobs: int, device: str) -> int | None:
    """The torch threads each of ``jobs`` concurrent training runs gets on a CPU: ``OMP_NUM_THREADS`` when set,
    else the cores shared out (at least 1); None where the runs train on a GPU (``device``)."""
    if device != "cpu" and torch.cuda.is_available():
        return None
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, available_cores() // jobs)


class _Pool:
    """Up to ``jobs`` training processes at once; each gets its share of the CPU threads, or its own GPU."""

    def __init__(self, jobs: int, nproc: int):
        self.jobs, self.nproc = jobs, nproc
        self.active: dict[int, tuple[subprocess.Popen, Run, float, Any]] = {}
        self.gpus = torch.cuda.device_count()

    def _env(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str((slot * self.nproc + i) % self.gpus) for i in range(self.nproc))
        else:  # torch's own default is every core, whatever else runs
            threads = str(run_threads(self.jobs, "cpu"))
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        return env

    def start(self, run: Run) -> None:
        slot = next(i for i in range(self.jobs) if i not in self.active)
        run.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = run.log_path.open("a")
        command = train_command(run, self.nproc, sys.executable)
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        # A process group of its own: the terminal's Ctrl-C reaches the study alone, which passes it on once (a run
        # that got it twice would stop without saving), and stopping the run stops what it started in its group.
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=die_with_parent_env(self._env(slot)))
        self.active[slot] = (process, run, time.monotonic(), handle)

    def finished(self) -> list[tuple[Run, int, float]]:
        """The runs that ended since the last call: ``(run, exit status, seconds)``."""
        ended = []
        for slot, (process, run, started, handle) in list(self.active.items()):
            if process.poll() is not None:
                handle.close()
                del self.active[slot]
                ended.append((run, process.returncode, time.monotonic() - started))
        return ended

    def stop(self, received: list[int]) -> None:
        """Pass every signal in ``received`` on, those that arrive meanwhile too, until every run has ended: after
        the first each run saves a checkpoint after its current step, a second one stops them at once."""
        passed = 0
        while self.active:
            for signum in received[passed:]:
                for process, *_ in self.active.values():
                    with contextlib.suppress(ProcessLookupError):
                        process.send_signal(_FORWARDED.get(signum, signum))
            passed = len(received)
            self.finished()
            time.sleep(0.05)

    def close(self, hurry=lambda: False) -> None:
        """Stop and reap every run still running (SIGTERM, SIGKILL after :data:`STOP_GRACE_S` or when ``hurry()``);
        on every way out of the study, so that no run trains on unsupervised, holding its lock."""
        stop_processes([process for process, *_ in self.active.values()], STOP_GRACE_S, hurry)
        for *_, handle in self.active.values():
            handle.close()
        self.active.clear()


@contextlib.contextmanager
def _signals_to(received: list[int]):
    """SIGINT, SIGTERM and (unless ignored) SIGHUP appended to ``received`` while inside."""
    hangup = [s for s in _FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, *hangup)}
    for s in previous:
        signal.signal(s, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_study(spec: StudySpec, out: str | Path, jobs: int = 1, device: str = "auto", log=None, *,
              strict: bool = True, fresh: bool = False, config: str | Path | None = None,
              new_registration: bool = False) -> Path:
    """Run every run of ``spec`` not yet finished in ``out``, measure each, write ``results.json`` and the report.

    ``jobs`` runs at a time; ``device`` measures the trained models (``auto``: a GPU when there is one).
    ``log``: where progress lines go (default stderr). ``strict``: refuse before the first run without the study
    extra (False: the report says what it leaves out, see :func:`.report.write_report`). ``fresh``: start this
    grid anew (``s2hc compare --overwrite``): its runs' directories, rows and logs and the recorded grid are
    removed first, under the lock (other runs in ``out`` are left alone). ``config``: the study config's file,
    where the commit is read when s2hc does not run from a checkout (:func:`provenance`). ``new_registration``:
    record a registered test other than the recorded one, over existing runs, as made after them (:func:`prepare`
    refuses it otherwise). Raises
    :class:`StudyInterrupted` after SIGINT/SIGTERM (the runs saved checkpoints) and :class:`StudyFailed` when a
    run failed (the others are finished and kept). Returns the report's path.
    """
    if strict:
        check_available(REPORT_PACKAGES, "the study's report")  # before the first run, not after the last
    resolve_device(device, "--device")  # the measuring device, first used after the first run has trained
    log = log or (lambda line: print(f"s2hc study: {line}", file=sys.stderr, flush=True))
    out = Path(out).expanduser()
    started_at = time.monotonic()
    check_output_dir(out, "--out")
    with RunLock(out):
        if fresh:
            _start_anew(spec, out)
        code = provenance(config)
        runs = prepare(spec, out, code=code, new_registration=new_registration)
        for line in schedule_warnings(spec):
            log(f"warning: {line}")
        states = {run.name: _state(run, spec) for run in runs}
        to_train = [run for run in runs if states[run.name] in ("new", "started")]
        to_measure = [run for run in runs if states[run.name] in ("finished", "diverged")]
        done = sum(state == "measured" for state in states.values())
        log(f"{len(runs)} runs: {done} done, {len(to_measure)} to measure, {len(to_train)} to train "
            f"({jobs} at a time, {_threads_text(run_threads(jobs, device))}) in {out}")
        for run in to_measure:
            _measure(run, spec, device, log)
        failures = _train_all(to_train, spec, jobs, device, log)
        if failures:
            raise StudyFailed(f"{len(failures)} run(s) failed: " + "; ".join(failures)
                              + f". The others are kept; see {out / 'logs'}, then run the same command again")
        rows = [_row(run) for run in runs]
        recorded = _read_object(out / STUDY, "records its grid again")
        results = {"study": spec.to_dict(), "rows": rows,
                   "environment": {**_environment(time.monotonic() - started_at, jobs, code),
                                   "invocations": recorded.get("invocations", [])}}
        if recorded.get(REGISTRATION):  # when the registered test was recorded, against the runs: the report says
            results[REGISTRATION] = recorded[REGISTRATION]
        atomic_write_text(out / RESULTS, json.dumps(results, indent=1) + "\n")
        return write_report(out, strict=strict)


def _start_anew(spec: StudySpec, out: Path) -> None:
    """Remove what ``out`` holds of ``spec``'s runs (run directory, row, log) and the study's own files, so that
    the grid starts from nothing; files of runs outside the grid stay."""
    for configuration, seed in spec.runs():
        run = Run(configuration, seed, out)
        clear_run(run.run_dir)
        for path in (run.row_path, run.log_path):
            path.unlink(missing_ok=True)
    for name in (STUDY, RESULTS, REPORT):
        (out / name).unlink(missing_ok=True)


def _measure(run: Run, spec: StudySpec, device: str, log) -> dict[str, Any]:
    row = measure_run(run.configuration, run.seed, run.run_dir, spec.diagnostics_tokens, device=device)
    row["trained_with"] = trained_settings(read_config(run.run_dir))  # a later grid reuses it only if they match
    run.row_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.row_path, json.dumps(row, indent=1) + "\n")
    if row["status"] == "diverged":
        log(f"{run.name} diverged at step {row['diverged_at']}: {row['diverged_reason']}")
    return row


def _last_line(path: Path) -> str:
    """The last non-empty line of a run's log (a failed run ends with its one-line error); '' when none."""
    with contextlib.suppress(OSError), path.open("rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
        lines = [line.strip() for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""
    return ""


def _train_all(runs: list[Run], spec: StudySpec, jobs: int, device: str, log) -> list[str]:
    """Train ``runs`` ``jobs`` at a time, measuring each as it ends; the failures, described. However this ends
    (an exception: a measurement that failed, a closed stderr), no run is left training: those still running are
    stopped and reaped."""
    pool, received = _Pool(jobs, spec.nproc), []
    with _signals_to(received):
        try:
            return _supervise(pool, list(runs), spec, device, log, received)
        finally:
            signals = len(received)
            pool.close(hurry=lambda: len(received) > signals)  # a signal while they stop: kill them now


def time_to_go(minutes: float) -> str:
    """What is left to train, said so that a run still to go never reads as "0 min": whole minutes rounded up, or
    "under a minute to go".

    >>> time_to_go(0.2), time_to_go(3.1)
    ('under a minute to go', 'about 4 min to go')
    """
    return "under a minute to go" if minutes < 1 else f"about {math.ceil(minutes)} min to go"


def _supervise(pool: _Pool, pending: list[Run], spec: StudySpec, device: str, log, received: list[int]) -> list[str]:
    """Start ``pending`` in ``pool`` as slots free up and measure each run as it ends; the failures, described.
    Raises :class:`StudyInterrupted` once a signal in ``received`` has stopped every run."""
    failures, durations, total, jobs = [], [], len(pending), pool.jobs
    while pending or pool.active:
        while pending and len(pool.active) < jobs and not received:
            run = pending.pop(0)
            step = saved_step(run.run_dir) if holds_run(run.run_dir) else None
            log(f"start {run.name}" + (f" (resuming from step {step})" if step else ""))
            pool.start(run)
        if received:
            pool.stop(received)
            raise StudyInterrupted(received[0])
        for run, status, seconds in pool.finished():
            durations.append(seconds)
            state = _state(run, spec)
            if status == 0 or state == "diverged":
                _measure(run, spec, device, log)
            else:
                said = _last_line(run.log_path)  # the run's own one-line error: a full disk, the file it names
                failures.append(f"{run.name} (exit status {status}, log {run.log_path}" + (f": {said}" if said else "")
                                + ")")
                log(f"{run.name} failed with exit status {status}; its log: {run.log_path}")
            left = len(pending) + len(pool.active)
            eta = sum(durations) / len(durations) * left / jobs / 60
            log(f"{total - left}/{total} trained, {left} left" + (f", {time_to_go(eta)}" if left else ""))
        time.sleep(0.2)
    return failures
