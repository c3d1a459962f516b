"""Checkpoint files: written atomically, read back with a clear error for anything that is not one.

Two kinds (:mod:`~s2hc.rundir.layout`): ``checkpoint.pt``, one file written by one process, and
``checkpoint.dcp/``, written by every rank through ``torch.distributed.checkpoint`` and readable by any
process count. :func:`load_checkpoint` and :func:`load_model` read either; what goes into a training
checkpoint and how it is restored into a model and optimizer is :mod:`s2hc.train.state`'s job.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..io import atomic_write_bytes
from ..models import ModelConfig, Transformer
from .layout import CHECKPOINT, EXTRA, SHARDED

FORMAT = "s2hc-checkpoint"
VERSION = 1


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (model, optimizer, step, loader, configs ...) with the format tag, atomically."""
    payload = {"format": FORMAT, "version": VERSION, **state}
    atomic_write_bytes(Path(path), lambda handle: torch.save(payload, handle))


# ----------------------------------------------------------------------------------- sharded checkpoints
#
# A run with several processes (or FSDP) writes ``DIR/checkpoint.dcp/``: the model and optimizer through
# ``torch.distributed.checkpoint`` (each rank writes its shards; loading reshards to any world size, one
# process included) and ``extra.pt`` with everything else. The directory is written under a temporary
# name and swapped in by rank 0 after every rank has finished, so a crash never leaves half of one.


def _is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / EXTRA).is_file() and (path / ".metadata").is_file()


def save_sharded_checkpoint(directory: Path, state: dict[str, Any], extra: dict[str, Any], *, is_main: bool,
                            barrier) -> None:
    """Collective: every rank calls this with its ``state`` (``{"model": ..., "optimizer": ...}`` from
    ``get_state_dict``); rank 0 (``is_main``) also writes ``extra`` and swaps the directory in."""
    import torch.distributed.checkpoint as dcp  # imported on use: it is slow to import

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if is_main:
        atomic_write_bytes(
            tmp / EXTRA, lambda handle: torch.save({"format": FORMAT, "version": VERSION, **extra}, handle)
        )
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_sharded_into(directory: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (as from ``get_state_dict`` for the current wrapping) from a sharded checkpoint."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())


def _full_model_state(directory: Path, model_config: dict) -> dict[str, torch.Tensor]:
    """The whole model's state dict assembled from a sharded checkpoint, in one process."""
    with torch.device("cpu"):
        model = Transformer(ModelConfig.from_dict(model_config))
    state = {"model": model.state_dict()}
    load_sharded_into(directory, state)
    return state["model"]


# ------------------------------------------------------------------------------------------------ reading


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """The checkpoints a run directory holds: ``checkpoint.pt`` and/or ``checkpoint.dcp/``."""
    run_dir = Path(run_dir)
    return [p for p in (run_dir / CHECKPOINT, run_dir / SHARDED) if p.is_file() or _is_sharded(p)]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint (file or sharded directory), or the newest checkpoint of a run directory.

    ValueError when there is none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir() and not _is_sharded(path):
        found = checkpoint_paths(path)
        if not found:
            raise ValueError(f"run directory {str(path)!r} holds no checkpoint ({CHECKPOINT} or {SHARDED}/)")
        return max(found, key=lambda p: _read_header(p)["step"])
    return path


def _read_header(file: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The payload of a checkpoint file, or the ``extra`` of a sharded one (no model tensors)."""
    source = file / EXTRA if _is_sharded(file) else file
    try:
        payload = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors all mean "not ours"
        raise ValueError(
            f"{str(file)!r} is not an s2hc checkpoint (could not be read: {type(error).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(file)!r} is not an s2hc checkpoint (no {FORMAT!r} tag)")
    if payload.get("version") != VERSION:
        raise ValueError(f"{str(file)!r} has checkpoint version {payload.get('version')!r}; this s2hc reads {VERSION}")
    return payload


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, with_model: bool = True
) -> dict[str, Any]:
    """Read a checkpoint of either kind; ValueError if ``path`` is not an s2hc checkpoint.

    The result has ``config``, ``model_config``, ``step``, ``loader``, ``rng``, ``history`` and (unless
    ``with_model=False``) ``model``: the whole model's state dict, assembled from shards when sharded. The
    optimizer state is read only from single-file checkpoints (``optimizer``); resuming reads it itself.
    """
    file = resolve_checkpoint(path)
    payload = _read_header(file, map_location)
    payload["path"] = str(file)
    if _is_sharded(file) and with_model:
        payload["model"] = _full_model_state(file, payload["model_config"])
    return payload


def load_model(path: str | Path, map_location: str | torch.device = "cpu"):
    """``(model, train_config)`` rebuilt from the configuration stored in a checkpoint, weights loaded."""
    payload = load_checkpoint(path, map_location)
    model = Transformer(ModelConfig.from_dict(payload["model_config"]))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        raise ValueError(
            f"{payload['path']!r} does not fit the model its own config describes ({first}); "
            f"it was probably written by another version of s2hc"
        ) from None
    return model, TrainConfig.from_dict(payload["config"])


def saved_step(run_dir: str | Path) -> int | None:
    """The step of a run directory's newest checkpoint, or None when there is none."""
    return load_checkpoint(run_dir, with_model=False)["step"] if checkpoint_paths(run_dir) else None
