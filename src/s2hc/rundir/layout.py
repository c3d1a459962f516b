"""The entries of a run directory, by name and role: the one list every other module reads.

::

    RUN/
      config.yaml       the TrainConfig of the run (what `s2hc train --resume` must match)
      metrics.jsonl     one JSON object per line: step, loss, lr, grad_norm, tokens, step_time; val_loss; diagnostics;
                        the weight-decay rule (once per run)
      checkpoint.pt     one process: model, optimizer, data position, RNG, configs, history (torch.save)
      checkpoint.dcp/   several processes or FSDP: torch.distributed.checkpoint shards and extra.pt
      diagnostics/      written from the checkpoint by `s2hc diagnose` (and a study)
      metrics.csv, tensorboard/, wandb/, mlflow.db, mlartifacts/, loggers.json
                        what `--logger` writes (s2hc.loggers), when it writes into the run directory
      .lock             while a process trains in it: that process's pid and host (see guard.py)

Training writes the run's entries; everything after training only reads them, but for the derived ones.
:data:`ENTRIES` gives each one its role; :data:`RUN_FILES`, :data:`DERIVED`, :data:`ATOMIC_FILES` and
:func:`is_run_entry` are computed from it, so a new entry is declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..io import atomic_write_text, temporary_pattern
from ..loggers import CSV_FILE, IDS_FILE, LOGGER_FILES

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"  # one process: a single file
SHARDED = "checkpoint.dcp"  # several processes or FSDP: a torch.distributed.checkpoint directory
EXTRA = "extra.pt"  # inside SHARDED: configs, step, data position, RNG
DIAGNOSTICS = "diagnostics"
LOCK = ".lock"
SHARDED_TMP, SHARDED_OLD = SHARDED + ".tmp", SHARDED + ".old"  # a sharded save in progress (checkpoint.py)

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
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"{str(path)!r} is damaged: not valid YAML ({reason})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} is damaged: not a mapping of settings")
    return values
