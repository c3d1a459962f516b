"""``metrics.jsonl``: the record of a run, one JSON object per line, appended as training goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..io import atomic_write_text
from .layout import METRICS


class MetricsLog:
    """Appends records to ``RUN/metrics.jsonl``. A new run starts it empty; a resumed run keeps the lines up
    to its checkpoint's step (``keep_until_step``) and drops the rest, so the file reads as if the run had
    never stopped."""

    def __init__(self, run_dir: Path, keep_until_step: int | None):
        self.path = Path(run_dir) / METRICS
        if keep_until_step is None:
            atomic_write_text(self.path, "")
        else:
            kept = [r for r in read_metrics(run_dir) if r["step"] <= keep_until_step] if self.path.exists() else []
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, **record: Any) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN/metrics.jsonl``, in order."""
    path = Path(run_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_train_loss(run_dir: str | Path, fraction: float = 0.1) -> float:
    """Mean train loss over the last ``fraction`` of a run's logged steps: one step's loss is too noisy."""
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    tail = losses[-max(1, int(len(losses) * fraction)) :]
    return sum(tail) / len(tail)
