"""Pretraining: the loop, its optimiser and schedule, multi-process wrapping, and checkpointed state.

The configuration is :class:`s2hc.config.TrainConfig`; what a run writes is described in :mod:`s2hc.rundir`.

The names below are imported on first use (PEP 562): ``python -m s2hc`` imports :mod:`.processes` first
thing, and ``s2hc --version`` must not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for type checkers and readers; at run time __getattr__ imports them
    from ..config import TrainConfig
    from ..schedule import learning_rate
    from .init_from import resume_config
    from .loop import Interrupted, RunResult, TrainingError, train
    from .optim import make_optimizer

#: Where each public name lives (a module relative to this package).
_HOMES = {
    "Interrupted": ".loop", "RunResult": ".loop", "TrainingError": ".loop", "train": ".loop",
    "TrainConfig": "..config", "resume_config": ".init_from", "learning_rate": "..schedule", "make_optimizer": ".optim",
}

__all__ = ["Interrupted", "RunResult", "TrainConfig", "TrainingError", "learning_rate", "make_optimizer",
           "resume_config", "train"]


def __getattr__(name: str):
    """A public name, imported (and kept in the package) the first time it is asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
