"""Checkpoint files: written atomically, only when every tensor is finite, with a checksum verified on load.

Two kinds (:mod:`~s2hc.rundir.layout`): ``checkpoint.pt``, one file written by one process, and
``checkpoint.dcp/``, written by every rank through ``torch.distributed.checkpoint`` and readable by any
process count. :func:`load_checkpoint` and :func:`load_model` read either; what goes into a training
checkpoint and how it is restored into a model and optimizer is :mod:`s2hc.train.state`'s job.

Integrity: a checkpoint carries ``checksum``, the SHA-256 of everything else in it (every tensor's dtype,
shape and bytes, every key and value: the configs, the step, the data position), and a sharded one the
SHA-256 of each shard file in its ``extra.pt``. Loading verifies them (``verify=True``): a file changed after
it was written (a flipped bit, a truncated copy) is refused with a ValueError naming it. Version-1 files,
written before checksums, load unverified.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..io import WriteError, atomic_write_bytes, os_error_in
from ..models import ModelConfig, Transformer
from .layout import CHECKPOINT, EXTRA, SHARDED

FORMAT = "s2hc-checkpoint"
VERSION = 2  # 2: carries a checksum; 1: before checksums, still read (unverified)
READABLE = (1, 2)
CHECKSUM = "checksum"


class NonFiniteError(ValueError):
    """A state to be saved holds NaN or infinite values, so nothing was written; ``names`` lists those tensors."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


# ---------------------------------------------------------------------------------------------- checksums


def _scalar(value: Any) -> bytes:
    return f"{type(value).__name__}:{value!r};".encode()


def state_digest(state: Any, *, check_finite: bool = False) -> tuple[str, list[str]]:
    """``("sha256:...", non_finite)``: the SHA-256 of ``state`` (nested dicts, lists, tensors and scalars,
    independent of dict order and of the device), and the names (``model.embed.weight``) of the floating
    tensors holding NaN or infinity when ``check_finite``."""
    digest, bad = hashlib.sha256(), []

    def visit(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if check_finite and (tensor.is_floating_point() or tensor.is_complex()) \
                    and not bool(torch.isfinite(tensor).all()):
                bad.append(name)
            tensor = tensor.cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            digest.update(b"D%d;" % len(value))
            for key in sorted(value, key=lambda k: (type(k).__name__, str(k))):
                digest.update(_scalar(key))
                visit(value[key], f"{name}.{key}" if name else str(key))
        elif isinstance(value, (list, tuple)):
            digest.update(b"L%d;" % len(value))
            for index, item in enumerate(value):
                visit(item, f"{name}[{index}]")
        else:
            digest.update(_scalar(value))

    visit(state, "")
    return "sha256:" + digest.hexdigest(), bad


def _non_finite_message(bad: list[str]) -> str:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"{bad[0]}{more} hold NaN or infinite values"


def _with_checksum(payload: dict[str, Any]) -> dict[str, Any]:
    checksum, bad = state_digest(payload, check_finite=True)
    if bad:
        raise NonFiniteError(f"not saved: {_non_finite_message(bad)}", bad)
    return {**payload, CHECKSUM: checksum}


def file_digest(path: Path) -> str:
    """``"sha256:..."`` of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (model, optimizer, step, loader, configs ...) with the format tag and its checksum,
    atomically. NonFiniteError (nothing written) when a tensor holds NaN or infinity; WriteError (the old file
    kept) when the disk refuses it."""
    payload = _with_checksum({"format": FORMAT, "version": VERSION, **state})
    atomic_write_bytes(Path(path), lambda handle: torch.save(payload, handle))


# ----------------------------------------------------------------------------------- sharded checkpoints
#
# A run with several processes (or FSDP) writes ``DIR/checkpoint.dcp/``: the model and optimizer through
# ``torch.distributed.checkpoint`` (each rank writes its shards; loading reshards to any world size, one
# process included) and ``extra.pt`` with everything else and the SHA-256 of every shard file. The directory
# is written under a temporary name and swapped in by rank 0 after every rank has finished, so a crash never
# leaves half of one (killed between the swap's two renames, the run directory's guard puts it back).


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / EXTRA).is_file() and (path / ".metadata").is_file()



def save_sharded_checkpoint(directory: Path, state: dict[str, Any], extra: dict[str, Any], *, is_main: bool,
                            barrier) -> None:
    """Collective: every rank calls this with its ``state`` (``{"model": ..., "optimizer": ...}`` from
    ``get_state_dict``); rank 0 (``is_main``) also writes ``extra`` and swaps the directory in. The caller checks
    that the state is finite (it is sharded: only every rank together can)."""
    import torch.distributed.checkpoint as dcp  # imported on use: it is slow to import

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except Exception as error:
        cause = os_error_in(error)
        if cause is None:
            raise
        raise WriteError(tmp, cause) from error
    try:
        if is_main:
            shards = {p.name: file_digest(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != EXTRA}
            payload = _with_checksum({"format": FORMAT, "version": VERSION, **extra, "shards": shards})
            atomic_write_bytes(tmp / EXTRA, lambda handle: torch.save(payload, handle))
            old = directory.with_name(directory.name + ".old")
            try:
                if directory.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(directory, old)
                os.replace(tmp, directory)
            except OSError as error:
                raise WriteError(directory, error) from error
            shutil.rmtree(old, ignore_errors=True)
    finally:
        barrier()  # even when rank 0 failed: the other ranks must not wait here for ever


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
    return [p for p in (run_dir / CHECKPOINT, run_dir / SHARDED) if p.is_file() or is_sharded(p)]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint (file or sharded directory), or the newest checkpoint of a run directory.

    ValueError when there is none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir() and not is_sharded(path):
        found = checkpoint_paths(path)
        if not found:
            raise ValueError(f"run directory {str(path)!r} holds no checkpoint ({CHECKPOINT} or {SHARDED}/)")
        if len(found) == 1:
            return found[0]
        return max(found, key=lambda p: _read_header(p, verify=False)["step"])
    return path


def _damaged(file: Path, what: str) -> ValueError:
    return ValueError(
        f"checkpoint {str(file)!r} is damaged: {what} (it changed after it was written: a disk, memory or copy "
        f"error); restore it from a copy, or start the run again with --overwrite"
    )


def _verify(file: Path, payload: dict[str, Any]) -> None:
    """ValueError naming ``file`` unless ``payload`` (and, when sharded, every shard file) has its checksum."""
    recorded = payload.pop(CHECKSUM, None)
    if payload["version"] < 2:
        return
    if not isinstance(recorded, str):
        raise _damaged(file, "it has no checksum")
    if state_digest(payload)[0] != recorded:
        raise _damaged(file, "checksum mismatch")
    if is_sharded(file):
        shards = payload.get("shards")
        present = {p.name for p in file.iterdir() if p.is_file() and p.name != EXTRA}
        if not isinstance(shards, dict) or set(shards) != present:
            missing, extra = sorted(set(shards or {}) - present), sorted(present - set(shards or {}))
            raise _damaged(file, f"its shard files differ from those saved (missing {missing}, unexpected {extra})")
        for name, digest in shards.items():
            if file_digest(file / name) != digest:
                raise _damaged(file, f"checksum mismatch of {name}")


def _read_header(file: Path, map_location: str | torch.device = "cpu", verify: bool = True) -> dict[str, Any]:
    """The payload of a checkpoint file, or the ``extra`` of a sharded one (no model tensors), verified."""
    source = file / EXTRA if is_sharded(file) else file
    try:
        payload = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors all mean "not ours" or damaged
        raise ValueError(
            f"{str(file)!r} is not an s2hc checkpoint, or is damaged (could not be read: {type(error).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(file)!r} is not an s2hc checkpoint (no {FORMAT!r} tag)")
    if payload.get("version") not in READABLE:
        raise ValueError(
            f"{str(file)!r} has checkpoint version {payload.get('version')!r}; this s2hc reads {list(READABLE)}"
        )
    if verify:
        _verify(file, payload)
    else:
        payload.pop(CHECKSUM, None)
    return payload


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, with_model: bool = True, verify: bool = True
) -> dict[str, Any]:
    """Read a checkpoint of either kind; ValueError if ``path`` is not an s2hc checkpoint or is damaged.

    The result has ``config``, ``model_config``, ``step``, ``loader``, ``rng``, ``history`` and (unless
    ``with_model=False``) ``model``: the whole model's state dict, assembled from shards when sharded. The
    optimizer state is read only from single-file checkpoints (``optimizer``); resuming reads it itself.
    ``verify``: check the checksums (every shard file's too); off only to re-read a file verified a moment ago.
    """
    file = resolve_checkpoint(path)
    payload = _read_header(file, map_location, verify)
    payload["path"] = str(file)
    if is_sharded(file) and with_model:
        payload["model"] = _full_model_state(file, payload["model_config"])
    return payload


def load_model(path: str | Path, map_location: str | torch.device = "cpu"):
    """``(model, train_config)`` rebuilt from the configuration stored in a checkpoint, weights loaded."""
    return model_from_payload(load_checkpoint(path, map_location))


def model_from_payload(payload: dict[str, Any]):
    """``(model, train_config)`` from what :func:`load_checkpoint` returned (with the model's weights)."""
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
    if not checkpoint_paths(run_dir):
        return None
    return load_checkpoint(run_dir, with_model=False, verify=False)["step"]
