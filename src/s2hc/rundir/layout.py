"""The files of a run directory, by name. Training writes them; everything after training only reads them.

::

    RUN/
      config.yaml       the TrainConfig of the run (what `s2hc train --resume` must match)
      metrics.jsonl     one JSON object per line: step, loss, lr, grad_norm, tokens, step_time; val_loss; diagnostics
      checkpoint.pt     one process: model, optimizer, data position, RNG, configs, history (torch.save)
      checkpoint.dcp/   several processes or FSDP: torch.distributed.checkpoint shards and extra.pt
      .lock             while a process trains in it: that process's pid and host (see guard.py)
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..io import atomic_write_text

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"  # one process: a single file
SHARDED = "checkpoint.dcp"  # several processes or FSDP: a torch.distributed.checkpoint directory
EXTRA = "extra.pt"  # inside SHARDED: configs, step, data position, RNG


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
