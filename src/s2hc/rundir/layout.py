"""The entries of a run directory, by name and role: the one list every other module reads.

::

    RUN/
      config.yaml       the TrainConfig of the run (what `s2hc train --resume` must match)
      metrics.jsonl     one JSON object per line: step, loss, lr, grad_norm, tokens, step_time, tokens_per_s; val_loss;
                        diagnostics; the weight-decay rule (once per run)
      checkpoint.pt     one process: model, optimizer, data position, RNG, configs, history (torch.save)
      checkpoint.dcp/   several processes or FSDP: torch.distributed.checkpoint shards and extra.pt
      checkpoints/      the checkpoints kept besides the latest (--keep-checkpoints K, --keep-best): step-00000100.pt
                        (or step-00000100.dcp/ when sharded), the newest K by step, and best.pt (best.dcp/), the
                        checkpoint of the lowest validation loss; each a copy of the latest of its step
      diagnostics/      written from the checkpoint by `s2hc diagnose` (and a study)
      metrics.csv, tensorboard/, wandb/, mlflow.db, mlartifacts/, loggers.json
                        what `--logger` writes (s2hc.loggers), when it writes into the run directory
      .lock             while a process trains in it: that process's pid and host (see guard.py)

Training writes the run's entries; everything after training only reads them, but for the derived ones.
:data:`ENTRIES` gives each one its role; :data:`RUN_FILES`, :data:`DERIVED`, :data:`ATOMIC_FILES` and
:func:`is_run_entry` are computed from it, so a new entry is declared here once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import load_yaml
from ..io import TEMPORARY_MARK, atomic_write_text, temporary_pattern
from ..loggers import CSV_FILE, IDS_FILE, LOGGER_FILES

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"  # one process: a single file
SHARDED = "checkpoint.dcp"  # several processes or FSDP: a torch.distributed.checkpoint directory
EXTRA = "extra.pt"  # inside SHARDED: configs, step, data position, RNG
DIAGNOSTICS = "diagnostics"
LOCK = ".lock"
KEPT = "checkpoints"  # the kept checkpoints: step-NNNNNNNN.pt / .dcp/ and best.pt / .dcp/ (kept_name)
BEST = "best"


def sharded_temporaries(name: str) -> tuple[str, str]:
    """``(NAME.tmp, NAME.old)``: a sharded checkpoint ``NAME`` being written, and the one it replaces while the
    new one is swapped in (:func:`s2hc.rundir.sharded.swap_in`)."""
    return name + ".tmp", name + ".old"


SHARDED_TMP, SHARDED_OLD = sharded_temporaries(SHARDED)  # a sharded save in progress (checkpoint.py)

#: Roles: a ``run`` entry means the directory holds a run (a new run there is refused without --overwrite);
#: a ``derived`` one is made from the run and removed with it; a ``working`` one exists while a process works
#: in the directory, or after it was killed there.
RUN, DERIVED_ROLE, WORKING = "run", "derived", "working"


@dataclass(frozen=True)
class Entry:
    """One name in a run directory: its ``role`` and whether s2hc writes it with
    :func:`s2hc.io.atomic_write_bytes` (``atomic``: a kill may leave that write's temporary file beside it)."""

    name: str
    role: str
    atomic: bool = False


ENTRIES = (
    Entry(CONFIG, RUN, atomic=True),
    Entry(METRICS, RUN, atomic=True),
    Entry(CHECKPOINT, RUN, atomic=True),
    Entry(SHARDED, RUN),
    Entry(KEPT, RUN),
    Entry(DIAGNOSTICS, DERIVED_ROLE),
    *(Entry(name, DERIVED_ROLE, atomic=name in (CSV_FILE, IDS_FILE)) for name in LOGGER_FILES),  # s2hc.loggers
    Entry(LOCK, WORKING),
    Entry(SHARDED_TMP, WORKING),
    Entry(SHARDED_OLD, WORKING),
)
RUN_FILES = tuple(e.name for e in ENTRIES if e.role == RUN)  # any of these: the directory holds a run
DERIVED = tuple(e.name for e in ENTRIES if e.role == DERIVED_ROLE)  # removed with the run by --overwrite
ATOMIC_FILES = tuple(e.name for e in ENTRIES if e.atomic)
_TEMPORARIES = tuple(temporary_pattern(name) for name in ATOMIC_FILES)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of an atomic write of one of :data:`ATOMIC_FILES` (s2hc's own name)."""
    return any(pattern.fullmatch(name) for pattern in _TEMPORARIES)


# ------------------------------------------------------------------------------ RUN/checkpoints/, the kept ones
#
# One name per kept checkpoint: ``step-`` and the step in 8 digits (more past 99,999,999), or ``best``, then
# ``.pt`` (one file) or ``.dcp`` (sharded). Writes there are atomic as in the run directory: a file through a
# temporary ``.NAME.s2hc-XXXXXXXX.tmp`` (a copy of the latest, renamed into place), a sharded
# one through ``NAME.tmp/`` (and ``NAME.old/`` while it replaces an older one); a sharded one being removed
# loses its extra.pt first, so an incomplete ``NAME/`` is one whose removal was cut short.

STEP_DIGITS = 8
_STEP = rf"step-[0-9]{{{STEP_DIGITS},}}"
_KEPT_NAME = re.compile(rf"(?:step-(?P<step>[0-9]{{{STEP_DIGITS},}})|{BEST})\.(?P<kind>pt|dcp)")
_KEPT_TEMPORARY = re.compile(rf"\.(?:{_STEP}|{BEST})\.(?:pt|dcp)\.{TEMPORARY_MARK}[0-9a-f]{{8}}\.tmp"  # a file's
                             rf"|(?:{_STEP}|{BEST})\.dcp\.(?:tmp|old)")  # a sharded one's directories


def kept_name(step: int | str, sharded: bool) -> str:
    """The name in ``RUN/checkpoints/`` of the kept checkpoint of ``step`` (an int >= 0, or ``"best"``):
    ``step-00000100.pt``, ``best.dcp``."""
    stem = BEST if step == BEST else f"step-{int(step):0{STEP_DIGITS}d}"
    return f"{stem}.{'dcp' if sharded else 'pt'}"


def parse_kept_name(name: str) -> tuple[int | str, bool] | None:
    """``(step or "best", sharded)`` of a kept checkpoint's name (:func:`kept_name`), None for any other name."""
    found = _KEPT_NAME.fullmatch(name)
    if found is None:
        return None
    return (BEST if found["step"] is None else int(found["step"])), found["kind"] == "dcp"


def is_kept_temporary(name: str) -> bool:
    """Whether ``name`` in ``RUN/checkpoints/`` is what a kept checkpoint's write leaves while in progress."""
    return _KEPT_TEMPORARY.fullmatch(name) is not None


def is_run_entry(name: str) -> bool:
    """Whether ``name`` belongs in a run directory: one of :data:`ENTRIES` or a temporary file of one. What an
    output directory may hold to be replaced by a new run; anything else is a user's."""
    return any(e.name == name for e in ENTRIES) or is_temporary(name)


def write_config(run_dir: Path, config: dict) -> None:
    """``RUN/config.yaml``: the run's configuration, keys in their dataclass order, written atomically."""
    atomic_write_text(Path(run_dir) / CONFIG, yaml.safe_dump(config, sort_keys=False))


def read_config(run_dir: Path) -> dict | None:
    """``RUN/config.yaml`` as a dict, None when there is none; ValueError naming the file when it is damaged."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return None
    try:
        values = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"{str(path)!r} is damaged: not valid YAML ({reason})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} is damaged: not a mapping of settings")
    return values
