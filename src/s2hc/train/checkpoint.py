"""Checkpoints: written atomically, read back with a clear error for anything that is not one."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "s2hc-checkpoint"
VERSION = 1
FILENAME = "checkpoint.pt"


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    A reader (or a run killed mid-write) sees either the old file or the new one, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda handle: handle.write(text.encode()))


def rng_state() -> dict[str, Any]:
    """Every RNG a run touches, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (model, optimizer, step, loader, configs ...) with the format tag, atomically."""
    payload = {"format": FORMAT, "version": VERSION, **state}
    atomic_write_bytes(Path(path), lambda handle: torch.save(payload, handle))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the latest checkpoint of a run directory; ValueError when there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / FILENAME).is_file():
            raise ValueError(f"run directory {str(path)!r} holds no checkpoint ({FILENAME})")
        return path / FILENAME
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; ValueError if ``path`` is not an s2hc checkpoint."""
    file = resolve_checkpoint(path)
    try:
        payload = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors all mean "not ours"
        raise ValueError(f"{str(file)!r} is not an s2hc checkpoint (could not be read: {type(error).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(file)!r} is not an s2hc checkpoint (no {FORMAT!r} tag)")
    if payload.get("version") != VERSION:
        raise ValueError(f"{str(file)!r} has checkpoint version {payload.get('version')!r}; this s2hc reads {VERSION}")
    return payload


def load_model(path: str | Path, map_location: str | torch.device = "cpu"):
    """``(model, train_config)`` rebuilt from the configuration stored in a checkpoint, weights loaded."""
    from ..models import ModelConfig, Transformer
    from .config import TrainConfig

    payload = load_checkpoint(path, map_location)
    model = Transformer(ModelConfig.from_dict(payload["model_config"]))
    model.load_state_dict(payload["model"])
    return model, TrainConfig.from_dict(payload["config"])
