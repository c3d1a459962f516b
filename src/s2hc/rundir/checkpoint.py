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

Kept checkpoints (``RUN/checkpoints/``, :mod:`~s2hc.rundir.layout`): :func:`keep_copy` puts the checkpoint just
written in a second place (a copy verified byte for byte, never a hard link: each kept file is its own), atomically;
:func:`kept_checkpoints` lists them, :func:`prune_kept` removes all but the newest steps, and
``resolve_checkpoint(RUN, step=100)`` / ``step="best"`` picks one (``s2hc eval RUN --step 100``).

Safety: nothing is unpickled but data. Single files and ``extra.pt`` are read with ``weights_only=True``; a
sharded checkpoint's ``.metadata`` with an allowlist of torch.distributed.checkpoint's metadata classes and its
non-tensor values with ``weights_only=True`` (:func:`read_sharded_metadata`), since a checksum is no signature.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import pickle
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig, completed_settings
from ..io import TEMPORARY_MARK, WriteError, atomic_write_bytes, fsync_path, os_error_in
from ..models import ModelConfig, Transformer
from .layout import BEST, CHECKPOINT, EXTRA, KEPT, SHARDED, kept_name, parse_kept_name, sharded_temporaries
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
            payload = _with_checksum({"format": FORMAT, "version": VERSION, **checkpoint.header(), SHARDS: shards})
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


# ----------------------------------------------------------------------------------- kept checkpoints
#
# The checkpoint just written is put in a second place (RUN/checkpoints/step-N.pt, best.pt, or the latest when
# the best was written first) without computing the state again: a copy of its file, compared with its source
# before it is renamed into place. Never a hard link: a kept file must not share its bytes with any other name,
# or `cp checkpoints/step-3.pt checkpoint.pt` (the rollback a damaged latest's message advises), which writes
# into the file checkpoint.pt names, would rewrite step-4.pt and best.pt with it.


def _copy_verified(source: Path, target: Path) -> None:
    """``target`` (a new name): a copy of ``source``'s bytes, fsynced and compared with them. FileExistsError when
    ``target`` exists; OSError when the copy fails or differs (a disk or memory error)."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    if file_digest(target) != file_digest(source):
        target.unlink(missing_ok=True)
        raise OSError(f"the copy of {str(source)!r} differs from it (a disk or memory error)") from None


def _place_file(source: Path, target: Path) -> None:
    """``target``: a copy of the file ``source``, through a temporary name (``.NAME.s2hc-XXXXXXXX.tmp``) renamed
    over it."""
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{TEMPORARY_MARK}{secrets.token_hex(4)}.tmp")
        try:
            _copy_verified(source, tmp)
        except FileExistsError:  # another write drew the same digits
            continue
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        try:
            os.replace(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(target.parent)
        return
    raise FileExistsError(f"no unused temporary name for {str(target)!r}")


def keep_copy(source: Path, target: Path) -> None:
    """Make ``target`` the checkpoint ``source`` too (a file, or a complete sharded directory), atomically: a
    kill leaves either the old ``target`` or the new one, and a temporary name the run directory's guard removes.

    Copies of ``source``'s files, compared byte for byte with them before they are put in place; never hard
    links, so that writing into one name (a user's ``cp``) changes no other. A sharded one is built in
    ``NAME.tmp/``, its ``extra.pt`` last (so a complete-looking ``NAME.tmp/`` is complete), then swapped in
    (:func:`swap_in`). WriteError naming ``target`` when the disk refuses it; the old ``target`` is then untouched."""
    source, target = Path(source), Path(target)
    if source == target:
        return
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not is_sharded(source):
            _place_file(source, target)
            return
        tmp = target.with_name(sharded_temporaries(target.name)[0])
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files = sorted((p for p in source.iterdir() if p.is_file()), key=lambda p: (p.name == EXTRA, p.name))
        for file in files:
            _copy_verified(file, tmp / file.name)
        fsync_path(tmp)
        swap_in(tmp, target)
    except OSError as error:  # a kill leaves NAME.tmp/ instead, which the guard removes
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, WriteError):
            raise
        raise WriteError(target, error) from error


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint file, or a sharded directory so that no kill leaves part of one under its name: a
    kept one (``RUN/checkpoints/``) is renamed to a temporary name first (which the guard removes), the latest
    loses its ``extra.pt`` first (an incomplete directory, which nothing reads as a checkpoint)."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        path.unlink(missing_ok=True)
        return
    if parse_kept_name(path.name) is not None:
        doomed = path.with_name(f".{path.name}.{TEMPORARY_MARK}{secrets.token_hex(4)}.tmp")
        os.replace(path, doomed)
        path = doomed
    else:
        (path / EXTRA).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _written(path: Path) -> int:
    """When a checkpoint was written (ns): its file's, or a sharded one's extra.pt's, which is written last."""
    return ((path / EXTRA) if path.is_dir() else path).stat().st_mtime_ns


def kept_directory(run_dir: str | Path) -> Path:
    """``RUN/checkpoints/``; ValueError naming it when it is a symbolic link: the kept checkpoints are the run's
    own files, and s2hc neither reads nor writes (nor prunes) checkpoints outside the run directory."""
    directory = Path(run_dir) / KEPT
    if directory.is_symlink():
        raise ValueError(f"{str(directory)!r} is a symbolic link (to {os.readlink(directory)!r}); a run keeps its "
                         f"checkpoints in a directory of its own: replace the link by a directory (or remove it)")
    return directory


def kept_checkpoints(run_dir: str | Path) -> dict[int | str, Path]:
    """The complete checkpoints in ``RUN/checkpoints/``: ``{step: path, ...}`` in step order, then ``"best":
    path`` when there is one. Of two kinds of one name (a run whose process count changed, killed before it
    removed the older kind), the one written last. ValueError naming ``RUN/checkpoints/`` or a checkpoint in it
    that is a symbolic link (:func:`kept_directory`)."""
    directory = kept_directory(run_dir)
    found: dict[int | str, Path] = {}
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        parsed = parse_kept_name(path.name)
        if parsed is None:
            continue
        if path.is_symlink():
            raise ValueError(f"{str(path)!r} is a symbolic link (to {os.readlink(path)!r}); a run's kept "
                             f"checkpoints are its own files: remove the link")
        key, sharded = parsed
        if not (is_sharded(path) if sharded else path.is_file()):
            continue  # a sharded one whose removal was cut short
        try:
            if key not in found or _written(path) > _written(found[key]):
                found[key] = path
        except FileNotFoundError:  # removed meanwhile by the run that keeps them
            continue
    steps = sorted(k for k in found if k != BEST)
    return {**{k: found[k] for k in steps}, **({BEST: found[BEST]} if BEST in found else {})}


def _run_of(path: Path) -> str | None:
    """The run id a checkpoint records (None: an older file, or one damaged, which its reader names)."""
    try:
        return _peek(path).run_id
    except ValueError:
        return None


def _other_run(kept: Path, theirs: str, latest: Path, ours: str) -> ValueError:
    return ValueError(
        f"checkpoints {str(kept)!r} and {str(latest)!r} belong to two different runs (run ids {theirs} and {ours}): "
        f"one was copied in from another run's directory; move it out (a run directory holds one run's checkpoints)"
    )


def check_kept_of_run(run_dir: str | Path, latest: Checkpoint | None = None,
                      only: Path | None = None) -> None:
    """ValueError naming the first kept checkpoint of ``RUN/checkpoints/`` (or only ``only``) that records another
    run id than the run's latest checkpoint (``latest``, its header, or read here): one copied in from another run,
    which a resume (its ``best.pt`` is the loss to beat, its steps are pruned) or ``--step`` must not take for the
    run's own. Checkpoints without a run id (written before version 4) pass."""
    if latest is None:
        found = checkpoint_paths(run_dir)
        if not found:
            return
        try:
            latest = _peek(max(found, key=lambda p: _written(p)))
        except ValueError:  # damaged: named when it is loaded, not here
            return
    if latest.run_id is None:
        return
    for path in [only] if only is not None else kept_checkpoints(run_dir).values():
        theirs = _run_of(path)
        if theirs is not None and theirs != latest.run_id:
            raise _other_run(path, theirs, Path(latest.path or Path(run_dir) / CHECKPOINT), latest.run_id)


def kept_path(run_dir: str | Path, step: int | str, sharded: bool) -> Path:
    """Where the kept checkpoint of ``step`` (or ``"best"``) of that kind goes: ``RUN/checkpoints/NAME``."""
    return Path(run_dir) / KEPT / kept_name(step, sharded)


def remove_other_kind(path: Path) -> None:
    """Remove the checkpoint of the other kind of the same name as ``path`` (``step-N.dcp`` beside a new
    ``step-N.pt``, ``checkpoint.pt`` beside a new ``checkpoint.dcp``): older now."""
    other = {CHECKPOINT: SHARDED, SHARDED: CHECKPOINT}.get(path.name)
    if other is None:
        parsed = parse_kept_name(path.name)
        if parsed is None:
            return
        other = kept_name(parsed[0], not parsed[1])
    target = path.with_name(other)
    if target.exists():
        remove_checkpoint(target)


def prune_kept(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove the step checkpoints of ``RUN/checkpoints/`` but the newest ``keep`` (>= 1) by step (the best one
    is not a step checkpoint); returns what was removed."""
    kept = [(key, path) for key, path in kept_checkpoints(run_dir).items() if key != BEST]
    removed = []
    for step, _ in kept[:-keep]:
        for sharded in (False, True):
            path = kept_path(run_dir, step, sharded)
            if path.exists():
                remove_checkpoint(path)
                removed.append(path)
    return removed


def best_val_loss(run_dir: str | Path) -> float:
    """The validation loss of ``RUN/checkpoints/best``'s step (what a new best must beat), read from its
    history without loading its tensors; infinity when there is none. ValueError naming it when it is
    unreadable."""
    path = kept_checkpoints(run_dir).get(BEST)
    if path is None:
        return math.inf
    loss = _peek(path).history.val_loss
    return math.inf if loss is None else float(loss)


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
    """The latest checkpoints a run directory holds: ``checkpoint.pt`` and/or ``checkpoint.dcp/`` (the kept
    ones of ``RUN/checkpoints/`` are :func:`kept_checkpoints`)."""
    run_dir = Path(run_dir)
    return [p for p in (run_dir / CHECKPOINT, run_dir / SHARDED) if p.is_file() or is_sharded(p)]


def parse_step(value: int | str) -> int | str:
    """A checkpoint's step as a caller names it: an integer >= 0 (``100``, ``"100"``) or ``"best"``; ValueError
    otherwise. What ``--step`` of ``s2hc eval``, ``generate``, ``export`` and ``diagnose`` reads."""
    if value == BEST:
        return BEST
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    raise ValueError(f"step must be a step number >= 0 or {BEST!r}, got {value!r}")


def resolve_checkpoint(path: str | Path, step: int | str | None = None) -> Path:
    """A checkpoint (file or sharded directory), or a run directory's checkpoint: without ``step`` its newest
    (``checkpoint.pt`` / ``checkpoint.dcp/``); with ``step`` (an int, its string, or ``"best"``,
    :func:`parse_step`) the one kept of that step (``RUN/checkpoints/step-00000100.pt``, or the latest when it
    is of that step) or the best one (``RUN/checkpoints/best.pt``).

    ValueError when there is none: for a step, one line listing the steps kept and whether a best one is."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if step is not None:
        return _kept_checkpoint(path, parse_step(step))
    if path.is_dir() and not is_sharded(path):
        found = checkpoint_paths(path)
        if not found:
            raise ValueError(f"run directory {str(path)!r} holds no checkpoint ({CHECKPOINT} or {SHARDED}/)")
        if len(found) == 1:
            return found[0]
        return max(found, key=lambda p: _peek(p).step)
    return path


def _kept_checkpoint(run_dir: Path, step: int | str) -> Path:
    if not run_dir.is_dir() or is_sharded(run_dir):
        raise ValueError(f"step {step!r} names a checkpoint of a run directory, and {str(run_dir)!r} is a checkpoint "
                         f"itself; give its run directory, or no step")
    kept = kept_checkpoints(run_dir)
    if step in kept:
        check_kept_of_run(run_dir, only=kept[step])
        return kept[step]
    latest, latest_step = _latest_step(run_dir)
    if step != BEST and latest_step == step:
        return latest
    wanted = ("no best checkpoint (a run keeps one with --keep-best)" if step == BEST else
              f"no checkpoint of step {step}")
    raise ValueError(f"run directory {str(run_dir)!r} keeps {wanted}; {_kept_summary(kept, latest_step)}")


def _latest_step(run_dir: Path) -> tuple[Path | None, int | None]:
    """The run directory's newest latest checkpoint and its step (None, None: none, or damaged)."""
    latest = checkpoint_paths(run_dir)
    if not latest:
        return None, None
    return max(((p, _step_or_none(p)) for p in latest), key=lambda item: -1 if item[1] is None else item[1])


def kept_steps(run_dir: str | Path) -> str:
    """``it keeps steps 4, 5, 6 and best (step 3)``: the checkpoints ``--step`` may name in a run directory, for a
    refusal (ValueError when its ``checkpoints/`` is refused, :func:`kept_checkpoints`)."""
    return _kept_summary(kept_checkpoints(run_dir), _latest_step(Path(run_dir))[1])


def _step_or_none(path: Path) -> int | None:
    try:
        return _peek(path).step
    except ValueError:  # damaged: named when it is loaded, not here
        return None


def _kept_summary(kept: dict[int | str, Path], latest_step: int | None) -> str:
    """``it keeps steps 4, 5, 6 and best (step 3)``: what a run directory holds, for a refusal."""
    steps = sorted({k for k in kept if k != BEST} | ({latest_step} if latest_step is not None else set()))
    held = (f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else "no step's checkpoint")
    if BEST not in kept:
        return f"it keeps {held} and no best checkpoint"
    best_step = _step_or_none(kept[BEST])
    return f"it keeps {held} and best{'' if best_step is None else f' (step {best_step})'}"


def _damaged(file: Path, what: str) -> ValueError:
    try:
        kept = kept_checkpoints(file.parent) if file.name in (CHECKPOINT, SHARDED) else {}  # a run's latest
    except ValueError:  # a linked checkpoints/: none to advise
        kept = {}
    names = ", ".join(p.name for p in kept.values())
    hint = f", or resume from a kept checkpoint: copy an intact one of {str(file.parent / KEPT)!r} ({names}) over it" \
        if kept else ""
    return ValueError(
        f"checkpoint {str(file)!r} is damaged: {what} (it changed after it was written: a disk, memory or copy "
        f"error); restore it from a copy, or start the run again with --overwrite{hint}"
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


def _read_header(file: Path, map_location: str | torch.device = "cpu", verify: bool = True,
                 mmap: bool = False) -> Checkpoint:
    """The checkpoint in a file, or the ``extra.pt`` of a sharded one (no model tensors), verified. ``mmap``
    (unverified reads): the tensors mapped, not read (a file of torch's legacy format is read whole)."""
    source = file / EXTRA if is_sharded(file) else file
    try:
        try:
            payload = torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
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


def _peek(file: Path) -> Checkpoint:
    """A checkpoint's step and history, unverified and without reading its tensors (mapped, never touched)."""
    return _read_header(file, verify=False, mmap=True)


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, with_model: bool = True, verify: bool = True,
    step: int | str | None = None,
) -> Checkpoint:
    """Read a checkpoint of either kind (a file, a sharded directory, or a run directory's newest, or with
    ``step`` its kept checkpoint of that step or ``"best"``: :func:`resolve_checkpoint`); ValueError if ``path``
    is not an s2hc checkpoint or is damaged, or keeps no checkpoint of ``step``.

    With ``with_model`` the result's ``model`` is the whole model's state dict, assembled from shards when
    sharded; without it, None. ``optimizer`` is read only from single-file checkpoints; resuming reads a
    sharded one itself. ``verify``: check the checksums (every shard file's too); off only to re-read a file
    verified a moment ago.
    """
    file = resolve_checkpoint(path, step)
    checkpoint = _read_header(file, map_location, verify)
    if not with_model:
        checkpoint.model = checkpoint.optimizer = None
    elif is_sharded(file):
        checkpoint.model = _full_model_state(file, checkpoint.model_config)
    return checkpoint


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *, step: int | str | None = None):
    """``(model, train_config)`` rebuilt from the configuration stored in a checkpoint, weights loaded: ``path``
    and ``step`` as :func:`resolve_checkpoint` takes them (``load_model("runs/x", step="best")``)."""
    return model_from_checkpoint(load_checkpoint(path, map_location, step=step))


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
    return model, TrainConfig.from_dict(completed_settings(checkpoint.config))  # an older run's, as it computed


def peek_checkpoint(path: str | Path) -> Checkpoint:
    """The header of a checkpoint (a run directory's newest, as :func:`resolve_checkpoint` finds it): its step,
    configs, history and the processes that trained it, unverified and without its tensors. For a look before a
    run starts (how many processes a resume launches); a resume itself reads it verified."""
    checkpoint = _peek(resolve_checkpoint(path))
    checkpoint.model = checkpoint.optimizer = None
    return checkpoint


def saved_step(run_dir: str | Path) -> int | None:
    """The step of a run directory's newest checkpoint, or None when there is none."""
    if not checkpoint_paths(run_dir):
        return None
    return load_checkpoint(run_dir, with_model=False, verify=False).step
