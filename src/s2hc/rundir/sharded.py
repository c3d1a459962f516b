"""Sharded checkpoints (``checkpoint.dcp/``, a kept ``step-N.dcp/``): written by every rank through
``torch.distributed.checkpoint`` and readable by any process count, with the SHA-256 of every shard file in their
``extra.pt`` (:mod:`~s2hc.rundir.checksums`), swapped in whole; read without unpickling anything but data.

Safety: a sharded checkpoint's ``.metadata`` is read with an allowlist of torch.distributed.checkpoint's metadata
classes and its non-tensor values with ``weights_only=True`` (:func:`read_sharded_metadata`), since a checksum is
no signature. Its header (``extra.pt``) is read by :mod:`~s2hc.rundir.checkpoint` like a one-file checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..io import WriteError, atomic_write_bytes, fsync_path, os_error_in
from ..models import ModelConfig, Transformer
from .checksums import SHARDS, file_digest, with_checksum
from .layout import EXTRA, sharded_temporaries
from .schema import FORMAT, VERSION, Checkpoint

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
    return path.is_dir() and (path / EXTRA).is_file() and (path / METADATA).is_file()



def save_sharded_checkpoint(directory: Path, state: dict[str, Any], checkpoint: Checkpoint, *, is_main: bool,
                            barrier) -> None:
    """Collective: every rank calls this with its ``state`` (``{"model": ..., "optimizer": ...}`` from
    ``get_state_dict``); rank 0 (``is_main``) also writes the rest of ``checkpoint`` (its
    :meth:`~s2hc.rundir.schema.Checkpoint.header`) and swaps the directory in. The caller checks that the state
    is finite (it is sharded: only every rank together can)."""
    import torch.distributed.checkpoint as dcp  # imported on use: it is slow to import

    directory = Path(directory)
    tmp = directory.with_name(sharded_temporaries(directory.name)[0])
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        directory.parent.mkdir(parents=True, exist_ok=True)  # RUN/checkpoints/ for a kept one
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
            payload = with_checksum({"format": FORMAT, "version": VERSION, **checkpoint.header(), SHARDS: shards})
            atomic_write_bytes(tmp / EXTRA, lambda handle: torch.save(payload, handle))
            swap_in(tmp, directory)
    finally:
        barrier()  # even when rank 0 failed: the other ranks must not wait here for ever


def swap_in(tmp: Path, directory: Path) -> None:
    """Put the complete sharded checkpoint ``tmp`` (``NAME.tmp/``) in place as ``directory``: the one there
    renamed to ``NAME.old/``, ``tmp`` renamed in, ``NAME.old/`` removed. Killed between the two renames, the
    run directory's guard puts ``NAME/`` back (:func:`s2hc.rundir.guard.clean_interrupted_saves`). WriteError
    naming ``directory`` when a rename is refused."""
    old, moved = directory.with_name(sharded_temporaries(directory.name)[1]), False
    try:
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            moved = True
        os.replace(tmp, directory)
        fsync_path(directory.parent)
    except OSError as error:
        if moved and not directory.exists():  # the second rename refused: the old one back in place
            with contextlib.suppress(OSError):
                os.replace(old, directory)
        raise WriteError(directory, error) from error
    shutil.rmtree(old, ignore_errors=True)


def load_sharded_into(directory: Path, state: dict[str, Any], *, unused_state: bool = False) -> None:
    """Fill ``state`` (as from ``get_state_dict`` for the current wrapping) from a sharded checkpoint.

    ``unused_state``: ``state["optimizer"]["state"]`` loses the parameters of which the checkpoint holds no
    optimizer state at all (they never had a gradient when it was saved), instead of failing on them.
    ValueError naming the file when the directory is damaged, not a checkpoint, or would have to unpickle
    anything but data (see :func:`read_sharded_metadata`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    reader_class, planner_class = _safe_loading()
    metadata = read_sharded_metadata(directory)
    if unused_state and isinstance(state.get("optimizer"), dict) and isinstance(state["optimizer"].get("state"), dict):
        saved = metadata.state_dict_metadata
        per_parameter = state["optimizer"]["state"]
        for name in [n for n, values in per_parameter.items() if isinstance(values, dict)
                     and not any(f"optimizer.state.{n}.{key}" in saved for key in values)]:
            del per_parameter[name]
    reader = reader_class(directory, metadata)
    try:
        dcp.load(state, storage_reader=reader, planner=planner_class(reader),
                 no_dist=not dist.is_initialized())
    except CheckpointException as error:  # a BaseException: it would escape every `except Exception`
        raise _unreadable(directory, error) from None


def full_model_state(directory: Path, model_config: dict) -> dict[str, torch.Tensor]:
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
