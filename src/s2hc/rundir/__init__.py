"""The run directory: what training writes and what evaluate, diagnose, export, compare and bench read.

- :mod:`~s2hc.rundir.layout`: the file names (``config.yaml``, ``metrics.jsonl``, ``checkpoint.pt`` or
  ``checkpoint.dcp/``, the kept ``checkpoints/step-00000100.pt`` and ``checkpoints/best.pt``) and
  :func:`write_config`.
- :mod:`~s2hc.rundir.guard`: a run is created or resumed, never overwritten; one process at a time
  (:func:`open_run_directory`, :class:`RunLock`); temporary files of interrupted saves are removed.
- :mod:`~s2hc.rundir.checkpoint`: one-file and sharded checkpoints, written atomically and only when finite,
  with checksums verified on load (:mod:`~s2hc.rundir.checksums`); :func:`load_model` rebuilds
  ``(model, train_config)`` from either; :func:`resolve_checkpoint` (and ``load_model(RUN, step=100)``,
  ``step="best"``) picks a kept one.
- :mod:`~s2hc.rundir.sharded`: the sharded ones (``checkpoint.dcp/``), written by every rank through
  ``torch.distributed.checkpoint`` and read without unpickling anything but data.
- :mod:`~s2hc.rundir.kept`: the kept copies (``checkpoints/step-00000100.pt``, ``best.pt``): copied, listed,
  pruned.
- :mod:`~s2hc.rundir.metrics`: ``metrics.jsonl`` (:class:`MetricsLog`, :func:`read_metrics`).
"""

from .checkpoint import (
    NonFiniteError,
    checkpoint_paths,
    kept_checkpoints,
    load_checkpoint,
    load_model,
    model_from_checkpoint,
    parse_step,
    peek_checkpoint,
    resolve_checkpoint,
    saved_step,
)
from .guard import RunLock, check_run_directory, holds_run, open_run_directory
from .layout import CHECKPOINT, CONFIG, KEPT, METRICS, SHARDED, read_config, write_config
from .metrics import MetricsLog, final_train_loss, read_metrics
from .schema import Checkpoint, History

__all__ = [
    "CHECKPOINT",
    "Checkpoint",
    "History",
    "CONFIG",
    "KEPT",
    "METRICS",
    "MetricsLog",
    "NonFiniteError",
    "RunLock",
    "SHARDED",
    "check_run_directory",
    "checkpoint_paths",
    "final_train_loss",
    "holds_run",
    "kept_checkpoints",
    "load_checkpoint",
    "load_model",
    "model_from_checkpoint",
    "open_run_directory",
    "parse_step",
    "peek_checkpoint",
    "read_config",
    "read_metrics",
    "resolve_checkpoint",
    "saved_step",
    "write_config",
]
