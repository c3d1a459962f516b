"""Checkpoint files: written atomically, only when every tensor is finite, with a checksum verified on load.

Two kinds (:mod:`~s2hc.rundir.layout`): ``checkpoint.pt``, one file written by one process, and
``checkpoint.dcp/``, written by every rank through ``torch.distributed.checkpoint`` and readable by any
process count. What a checkpoint holds is :class:`~s2hc.rundir.schema.Checkpoint` (with its versions);
:func:`save_checkpoint` and :func:`save_sharded_checkpoint` write one, :func:`load_checkpoint` and
:func:`load_model` read either kind. How a training run collects its state and puts it back into a model and
optimizer is :mod:`s2hc.train.checkpointer`'s job.

Integrity: a checkpoint carries ``checksum``, the SHA-256 of everything else in it (every tensor's dtype,
shape and bytes, every key and value: the configs, the step, the data position), and a sharded one the
SHA-256 of each shard file in its ``extra.pt``. Loading verifies them (``verify=True``): a file changed after
it was written (a flipped bit, a truncated copy) is refused with a ValueError naming it. Version-1 files,
written before checksums, load unverified; versions 2 and 3 differ only in ``written_by``.

Safety: nothing is unpickled but data. Single files and ``extra.pt`` are read with ``weights_only=True``; a
sharded checkpoint's ``.metadata`` with an allowlist of torch.distributed.checkpoint's metadata classes and its
non-tensor values with ``weights_only=True`` (:func:`read_sharded_metadata`), since a checksum is no signature.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..io import WriteError, atomic_write_bytes, os_error_in
from ..models import ModelConfig, Transformer
from .layout import CHECKPOINT, EXTRA, SHARDED
from .schema import FORMAT, READABLE, VERSION, Checkpoint, writer

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


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` (:class:`~s2hc.rundir.schema.Checkpoint`) with the format tag and its checksum,
    atomically. NonFiniteError (nothing written) when a tensor holds NaN or infinity; WriteError (the old file
    kept) when the disk refuses it."""
    payload = _with_checksum({"format": FORMAT, "version": VERSION, **checkpoint.payload()})
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



def save_sharded_checkpoint(directory: Path, state: dict[str, Any], checkpoint: Checkpoint, *, is_main: bool,
                            barrier) -> None:
    """Collective: every rank calls this with its ``state`` (``{"model": ..., "optimizer": ...}`` from
    ``get_state_dict``); rank 0 (``is_main``) also writes the rest of ``checkpoint`` (its
    :meth:`~s2hc.rundir.schema.Checkpoint.header`) and swaps the directory in. The caller checks that the state
    is finite (it is sharded: only every rank together can)."""
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
            payload = _with_checksum({"format": FORMAT, "version": VERSION, **checkpoint.header(), SHARDS: shards})
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
    """Fill ``state`` (as from ``get_state_dict`` for the current wrapping) from a sharded checkpoint.

    ValueError naming the file when the directory is damaged, not a checkpoint, or would have to unpickle
    anything but data (see :func:`read_sharded_metadata`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    reader_class, planner_class = _safe_loading()
    reader = reader_class(directory, read_sharded_metadata(directory))
    try:
        dcp.load(state, storage_reader=reader, planner=planner_class(reader),
                 no_dist=not dist.is_initialized())
    except CheckpointException as error:  # a BaseException: it would escape every `except Exception`
        raise _unreadable(directory, error) from None


def _full_model_state(directory: Path, model_config: dict) -> dict[str, torch.Tensor]:
    """The whole model's state dict assembled from a sharded checkpoint, in one process."""
    with torch.device("cpu"):
        model = Transformer(ModelConfig.from_dict(model_config))
    state = {"model": model.state_dict()}
    load_sharded_into(directory, state)
    return state["model"]


# --------------------------------------------------------------------- reading sharded checkpoints safely
#
# torch.distributed.checkpoint reads ``.metadata`` with ``pickle.load`` and every non-tensor value (the
# optimizer's param_groups) with ``torch.load(weights_only=False)``: a crafted directory runs any code it likes
# on load. The checksums in extra.pt do not stop it: they are no signature, whoever writes the directory can
# rewrite them. So s2hc parses ``.metadata`` itself, admitting only the classes DCP metadata is made of, hands dcp
# a reader that returns what was parsed (the file is read once, by us) and a planner that loads non-tensor values
# with ``weights_only=True``; tensors dcp already loads with ``weights_only=True`` (torch 2.5 and later).

METADATA = ".metadata"

# Every global a ``.metadata`` written by torch.distributed.checkpoint references: found by recording
# ``find_class`` while unpickling the one s2hc's own sharded save writes (FSDP2, torch 2.13), these classes living
# in these modules since torch 2.4. torch's dtypes and layouts (torch.float32, torch.strided) are admitted by kind
# in _metadata_global; tests/test_checkpoint_unpickling.py checks the list against a fresh save.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # torch.layout's pickle: a lookup of torch's layouts by name
}
# StorageMeta.checkpoint_id, the directory it was saved to (informational): read as a pure path, which cannot
# touch the file system and reads on any OS (a WindowsPath cannot be made on Linux, nor a PosixPath on Windows).
_PATH_MODULES = ("pathlib", "pathlib._local")  # pathlib._local: Python 3.13's
_PURE_PATHS = {"PosixPath": "PurePosixPath", "PurePosixPath": "PurePosixPath",
               "WindowsPath": "PureWindowsPath", "PureWindowsPath": "PureWindowsPath"}


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle referenced a global outside the allowlist; ``name`` is ``module.name``."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _metadata_global(module: str, name: str) -> Any | None:
    """The object ``module.name`` stands for in DCP metadata, or None when it is not one of its classes."""
    if module == "torch" and name != "Size":  # torch.float32, torch.strided: values, looked up, never called
        value = vars(torch).get(name)  # vars, not getattr: no lazy import of a submodule a pickle names
        return value if isinstance(value, (torch.dtype, torch.layout)) else None
    if module in _PATH_MODULES and name in _PURE_PATHS:
        import pathlib

        return getattr(pathlib, _PURE_PATHS[name])
    if name not in _METADATA_GLOBALS.get(module, ()):
        return None
    import importlib

    return getattr(importlib.import_module(module), name)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: every other global (``os.system``, ``builtins.exec``) is refused
    before it is looked up, so no code a file names ever runs."""

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(module, name)
        if found is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return found


def read_sharded_metadata(directory: Path) -> Any:
    """The ``torch.distributed.checkpoint`` Metadata of a sharded checkpoint, unpickled with the allowlist.

    ValueError naming ``.metadata`` when it pickles anything else, is damaged, or names a shard file that is
    not a plain file name in ``directory`` or that is missing."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except _RefusedGlobal as error:
        raise ValueError(f"{str(path)!r}: refuses to load pickled class {error.name!r} "
                         f"(not a torch.distributed.checkpoint metadata class)") from None
    except OSError as error:
        raise ValueError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except Exception as error:  # noqa: BLE001 - a damaged pickle raises any of a dozen types
        raise ValueError(f"{str(path)!r} is not torch.distributed.checkpoint metadata, or is damaged "
                         f"(could not be read: {type(error).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{str(path)!r} is not torch.distributed.checkpoint metadata "
                         f"(it holds a {type(metadata).__name__})")
    for name in sorted({getattr(info, "relative_path", None) for info in metadata.storage_data.values()},
                       key=str):
        _check_shard_name(path, name)
    return metadata


def _check_shard_name(metadata_path: Path, name: Any) -> None:
    """ValueError unless ``name``, a shard file ``.metadata`` names, is a file beside it: dcp joins it to the
    directory as given, so ``../x`` or ``/x`` would read a file no checksum covers."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{str(metadata_path)!r} names shard file {name!r}; shard files are plain file names "
                         f"in {str(metadata_path.parent)!r}")
    if not (metadata_path.parent / name).is_file():
        raise ValueError(f"{str(metadata_path)!r} names shard file {name!r}, which is missing")


@functools.cache
def _safe_loading() -> tuple[type, type]:
    """``(reader, planner)`` classes for ``dcp.load``; made on first use, torch.distributed.checkpoint being slow
    to import."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element

    class MetadataReader(FileSystemReader):
        """A FileSystemReader whose metadata is the one :func:`read_sharded_metadata` parsed, never unpickled
        by dcp."""

        def __init__(self, directory: Path, metadata: Any):
            super().__init__(str(directory))
            self.directory, self.parsed = Path(directory), metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(self.parsed, "storage_meta", None) is None:  # what FileSystemReader does
                self.parsed.storage_meta = StorageMeta()
            self.parsed.storage_meta.load_id = self.load_id
            return self.parsed

    class PlainDataPlanner(DefaultLoadPlanner):
        """A DefaultLoadPlanner that loads non-tensor values with ``torch.load(weights_only=True)``."""

        def __init__(self, reader: MetadataReader):
            super().__init__()
            self.reader = reader

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors: all refusals
                info = self.reader.storage_data.get(read_item.storage_index)
                file = self.reader.directory / getattr(info, "relative_path", "")
                raise _ShardValueError(f"{str(file)!r}: refuses to load the value of {fqn!r}: "
                                       f"{weights_only_refusal(error)}") from None
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, but weights_only
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return MetadataReader, PlainDataPlanner


class _ShardValueError(ValueError):
    """A value in a shard file that s2hc refuses; raised inside dcp.load, which wraps it."""


def weights_only_refusal(error: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its message is a page long): a pickled
    global that is not data, or a file that is not plain data or is damaged."""
    # torch words it "Unsupported global: GLOBAL m.f" or "unsupported GLOBAL m.f whose module m is blocked"
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(error), re.IGNORECASE)
    if found:
        return f"it pickles {found.group(1)!r}, which is not data; it was not loaded"
    return f"it is not plain data or is damaged ({type(error).__name__})"


def _unreadable(directory: Path, error: BaseException) -> ValueError:
    """One ValueError for what dcp.load raised: ours, when one of its ranks' failures is ours, else one naming
    the directory and the first failure."""
    causes = [failure[0] for failure in getattr(error, "failures", {}).values()] or [error]
    for cause in causes:
        if isinstance(cause, _ShardValueError):
            return ValueError(str(cause))
    first = next((line for line in str(causes[0]).splitlines() if line.strip()), "")
    return ValueError(f"sharded checkpoint {str(directory)!r} is damaged or not s2hc's (torch.distributed."
                      f"checkpoint could not read it: {type(causes[0]).__name__}: {first.strip()})")


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
        return max(found, key=lambda p: _read_header(p, verify=False).step)
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
        shards = payload.get(SHARDS)
        present = {p.name for p in file.iterdir() if p.is_file() and p.name != EXTRA}
        if not isinstance(shards, dict) or set(shards) != present:
            missing, extra = sorted(set(shards or {}) - present), sorted(present - set(shards or {}))
            raise _damaged(file, f"its shard files differ from those saved (missing {missing}, unexpected {extra})")
        for name, digest in shards.items():
            if file_digest(file / name) != digest:
                raise _damaged(file, f"checksum mismatch of {name}")


def _read_header(file: Path, map_location: str | torch.device = "cpu", verify: bool = True) -> Checkpoint:
    """The checkpoint in a file, or the ``extra.pt`` of a sharded one (no model tensors), verified."""
    source = file / EXTRA if is_sharded(file) else file
    try:
        payload = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors all mean "not ours" or damaged
        raise ValueError(
            f"{str(file)!r} is not an s2hc checkpoint, or is damaged (could not be read: {type(error).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(file)!r} is not an s2hc checkpoint (no {FORMAT!r} tag)")
    version = payload.get("version")
    if version not in READABLE:
        raise ValueError(
            f"{str(file)!r} has checkpoint version {version!r}; this s2hc reads {list(READABLE)}"
        )
    if verify:
        _verify(file, payload)
    else:
        payload.pop(CHECKSUM, None)
    stored = {k: v for k, v in payload.items() if k not in ("format", "version", SHARDS)}
    return Checkpoint.from_payload(stored, str(file), version)


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, with_model: bool = True, verify: bool = True
) -> Checkpoint:
    """Read a checkpoint of either kind (a file, a sharded directory or a run directory's newest); ValueError if
    ``path`` is not an s2hc checkpoint or is damaged.

    With ``with_model`` the result's ``model`` is the whole model's state dict, assembled from shards when
    sharded; without it, None. ``optimizer`` is read only from single-file checkpoints; resuming reads a
    sharded one itself. ``verify``: check the checksums (every shard file's too); off only to re-read a file
    verified a moment ago.
    """
    file = resolve_checkpoint(path)
    checkpoint = _read_header(file, map_location, verify)
    if not with_model:
        checkpoint.model = checkpoint.optimizer = None
    elif is_sharded(file):
        checkpoint.model = _full_model_state(file, checkpoint.model_config)
    return checkpoint


def load_model(path: str | Path, map_location: str | torch.device = "cpu"):
    """``(model, train_config)`` rebuilt from the configuration stored in a checkpoint, weights loaded."""
    return model_from_checkpoint(load_checkpoint(path, map_location))


def model_from_checkpoint(checkpoint: Checkpoint):
    """``(model, train_config)`` from what :func:`load_checkpoint` returned (with the model's weights)."""
    model = Transformer(ModelConfig.from_dict(checkpoint.model_config))
    try:
        model.load_state_dict(checkpoint.model)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        written = checkpoint.written_by or "an s2hc from before checkpoint version 3"
        raise ValueError(
            f"{checkpoint.path!r} does not fit the model its own config describes ({first}); it was written by "
            f"{written}, this is {writer()}"
        ) from None
    return model, TrainConfig.from_dict(checkpoint.config)


def saved_step(run_dir: str | Path) -> int | None:
    """The step of a run directory's newest checkpoint, or None when there is none."""
    if not checkpoint_paths(run_dir):
        return None
    return load_checkpoint(run_dir, with_model=False, verify=False).step
