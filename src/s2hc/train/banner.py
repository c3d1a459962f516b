"""The lines a run prints on stderr before its first step (rank 0): what is trained, where, in which precision,
on how many tokens per step, with which optimizer, and, with ``compile``, that the first steps will be slow.

Plain text, one setting per line, so that a log file of a batch job shows the same as a terminal:

    s2hc train: s2hc with n = 4 streams, preset tiny; a new run in runs/train, steps 0 to 300
      parameters  1,234,567 (1.23 M), of which the connections 12,345 (12.3 K, 1.00%)
      device      cpu (2 torch threads), float32 (no autocast) for --dtype auto
      tokens      4,096 per step: batch 8 × seq_len 128 × grad_accum 4 × 1 process
      optimizer   adamw, lr 0.002, weight decay 0.1 (matrices)
    compiling… torch.compile compiles each block on the first steps, which take tens of seconds
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import TrainConfig
from ..reports import count, human


def start_lines(config: TrainConfig, *, step: int, params: int, connection_params: int, device: torch.device,
                amp_dtype: torch.dtype | None, tokens_per_step: int, world_size: int, out: Path) -> list[str]:
    """The banner of a run about to take its first step (``step``: where it starts, above 0 when resumed from a
    checkpoint); with ``compile``, a last line saying that the first steps compile."""
    streams = f" with n = {config.n_streams} streams" if config.n_streams > 1 else ""
    where = f"resumed at step {step} in {out}" if step else f"a new run in {out}"
    share = f", {connection_params / params:.2%}" if params else ""
    processes = f"{world_size} process" + ("es" if world_size > 1 else "")
    lines = [
        f"s2hc train: {config.family}{streams}, preset {config.preset}; {where}, steps {step} to {config.max_steps}",
        f"  parameters  {count(params)} ({human(params)}), of which the connections {count(connection_params)}"
        f" ({human(connection_params)}{share})",
        f"  device      {_device(device, world_size)}, {_precision(config.dtype, amp_dtype)}",
        f"  tokens      {count(tokens_per_step)} per step: batch {config.batch_size} × seq_len {config.seq_len} × "
        f"grad_accum {config.grad_accum} × {processes}",
        f"  optimizer   {config.optimizer}, lr {config.lr:g}, weight decay {config.weight_decay:g} "
        f"({config.weight_decay_on})",
    ]
    if config.compile:
        lines.append("compiling… torch.compile compiles each block on the first steps, which take tens of seconds")
    return lines


def _device(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        name = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        name = f"{device} ({torch.get_num_threads()} torch threads)"
    return name + (f", one of {world_size} processes" if world_size > 1 else "")


def _precision(name: str, amp_dtype: torch.dtype | None) -> str:
    """``bfloat16 autocast (float32 weights)`` or ``float32 (no autocast)``, and what ``--dtype auto`` chose."""
    chosen = "float32 (no autocast)" if amp_dtype is None else \
        f"{str(amp_dtype).removeprefix('torch.')} autocast (float32 weights)"
    return chosen + (" for --dtype auto" if name == "auto" else "")
