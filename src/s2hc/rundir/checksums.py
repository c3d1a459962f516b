"""Checksums of checkpoints: a state's SHA-256 (independent of dict order and device) with the finite check every
save makes, and a file's. What :mod:`~s2hc.rundir.checkpoint` verifies on load, :mod:`~s2hc.rundir.sharded`
records per shard file and :mod:`~s2hc.rundir.kept` compares a copy with."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

CHECKSUM = "checksum"
SHARDS = "shards"  # in a sharded checkpoint's extra.pt: the SHA-256 of every shard file


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


def with_checksum(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with its :data:`CHECKSUM`; NonFiniteError naming the tensors holding NaN or infinity."""
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
