"""Pretraining: configuration, optimiser and schedule, checkpoints, the loop, and family comparisons."""

from .checkpoint import load_checkpoint, load_model, save_checkpoint
from .compare import compare
from .config import TrainConfig
from .loop import Interrupted, RunResult, TrainingError, read_metrics, train
from .optim import learning_rate, make_optimizer

__all__ = [
    "Interrupted",
    "RunResult",
    "TrainConfig",
    "TrainingError",
    "compare",
    "learning_rate",
    "load_checkpoint",
    "load_model",
    "make_optimizer",
    "read_metrics",
    "save_checkpoint",
    "train",
]
