"""The run directory: what training writes and what evaluate, diagnose, export, compare and bench read.

- :mod:`~s2hc.rundir.layout`: the file names (``config.yaml``, ``metrics.jsonl``, ``checkpoint.pt`` or
  ``checkpoint.dcp/``) and :func:`write_config`.
- :mod:`~s2hc.rundir.checkpoint`: one-file and sharded checkpoints, written atomically; :func:`load_model`
  rebuilds ``(model, train_config)`` from either.
- :mod:`~s2hc.rundir.metrics`: ``metrics.jsonl`` (:class:`MetricsLog`, :func:`read_metrics`).
"""

from .checkpoint import checkpoint_paths, load_checkpoint, load_model, resolve_checkpoint, saved_step
from .layout import CHECKPOINT, CONFIG, METRICS, SHARDED, write_config
from .metrics import MetricsLog, final_train_loss, read_metrics

__all__ = [
    "CHECKPOINT",
    "CONFIG",
    "METRICS",
    "MetricsLog",
    "SHARDED",
    "checkpoint_paths",
    "final_train_loss",
    "load_checkpoint",
    "load_model",
    "read_metrics",
    "resolve_checkpoint",
    "saved_step",
    "write_config",
]
