"""Pretraining: the loop, its optimiser and schedule, multi-process wrapping, and checkpointed state.

The configuration is :class:`s2hc.config.TrainConfig`; what a run writes is described in :mod:`s2hc.rundir`.
"""

from ..config import TrainConfig
from .init_from import resume_config
from .loop import Interrupted, RunResult, TrainingError, train
from .optim import learning_rate, make_optimizer

__all__ = ["Interrupted", "RunResult", "TrainConfig", "TrainingError", "learning_rate", "make_optimizer",
           "resume_config", "train"]
