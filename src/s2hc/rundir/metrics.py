"""``metrics.jsonl``: the record of a run, one JSON object per line, appended as training goes.

Every line is an object with an integer ``step``. A process killed while appending can leave a last line
cut short: readers skip it, and a resumed run drops it (and says so) before appending. Any other line that is
not such an object is an error naming the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..io import WriteError, atomic_write_text, json_loads
from .layout import METRICS


def _parse(path: Path) -> tuple[list[dict], str | None]:
    """``(records, partial)``: the records of ``path`` and the cut-short last line, if there is one."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{str(path)!r} is not a UTF-8 text file ({error.reason} at byte {error.start}); "
                         f"it is damaged") from None
    lines = text.split("\n")
    records, partial = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines)  # no newline after it: the write may have been cut short
        try:
            record = json_loads(line)
        except json.JSONDecodeError as error:
            if last:
                partial = line
                continue
            raise ValueError(
                f"{str(path)!r} line {number} is not JSON ({error.msg}); remove or fix that line"
            ) from None
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
                or not isinstance(record.get("step"), int):
            raise ValueError(
                f"{str(path)!r} line {number} is not a metrics record (an object with an integer 'step'); "
                f"remove or fix that line"
            )
        records.append(record)
    return records, partial


class MetricsLog:
    """Appends records to ``RUN/metrics.jsonl``. A new run starts it empty; a resumed run keeps the lines up
    to its checkpoint's step (``keep_until_step``) and drops the rest (a last line cut short by a kill
    included, which ``log`` reports), so the file reads as if the run had never stopped.

    ``kept_keys``: the keys of the records kept (empty for a new run), so that a record written once per run (the
    weight-decay record) is not written again on resume."""

    def __init__(self, run_dir: Path, keep_until_step: int | None, log: Callable[[str], None] | None = None):
        self.path = Path(run_dir) / METRICS
        self.kept_keys: set[str] = set()
        if keep_until_step is None or not self.path.exists():
            atomic_write_text(self.path, "")
            return
        records, partial = _parse(self.path)
        if partial is not None and log is not None:
            log(f"{str(self.path)!r}: dropped its last line, cut short by an interrupted write: {partial[:60]!r}")
        kept = [r for r in records if r["step"] <= keep_until_step]
        self.kept_keys = {key for record in kept for key in record}
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, **record: Any) -> None:
        try:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as error:
            raise WriteError(self.path, error) from error


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN/metrics.jsonl``, in order (a last line cut short by a kill is skipped).

    ValueError naming the file and line for a line that is not a JSON object with an integer ``step``."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ValueError(f"{str(Path(run_dir))!r} has no {METRICS}")
    return _parse(path)[0]


def final_train_loss(run_dir: str | Path, fraction: float = 0.1) -> float:
    """Mean train loss over the last ``fraction`` of a run's logged steps: one step's loss is too noisy."""
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    tail = losses[-max(1, int(len(losses) * fraction)) :]
    return sum(tail) / len(tail)
