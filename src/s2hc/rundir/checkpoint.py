"""Checkpoint files: written atomically, only when every tensor is finite, with a checksum verified on load.

Two kinds (:mod:`~s2hc.rundir.layout`): ``checkpoint.pt``, one file written by one process, and
``checkpoint.dcp/``, written by every rank through ``torch.distributed.checkpoint`` and readable by any
process count (:mod:`~s2hc.rundir.sharded`). What a checkpoint holds is :class:`~s2hc.rundir.schema.Checkpoint`
(with its versions); :func:`save_checkpoint` and :func:`~s2hc.rundir.sharded.save_sharded_checkpoint` write one,
:func:`load_checkpoint` and :func:`load_model` read either kind. How a training run collects its state and puts it
back into a model and optimizer is :mod:`s2hc.train.checkpointer`'s job.

Integrity (:mod:`~s2hc.rundir.checksums`): a checkpoint carries ``checksum``, the SHA-256 of everything else in it
(every tensor's dtype, shape and bytes, every key and value: the configs, the step, the data position), and a
sharded one the SHA-256 of each shard file in its ``extra.pt``. Loading verifies them (``verify=True``): a file
changed after it was written (a flipped bit, a truncated copy) is refused with a ValueError naming it. Version-1
files, written before checksums, load unverified; versions 2 and 3 differ only in ``written_by``.

Kept checkpoints (``RUN/checkpoints/``): :mod:`~s2hc.rundir.kept` copies, lists and prunes them;
``resolve_checkpoint(RUN, step=100)`` / ``step="best"`` picks one (``s2hc eval RUN --step 100``), and
:func:`check_kept_of_run` refuses one copied in from another run.

Safety: nothing is unpickled but data. Single files and ``extra.pt`` are read with ``weights_only=True``; a
sharded checkpoint's ``.metadata`` with an allowlist of torch.distributed.checkpoint's metadata classes and its
non-tensor values with ``weights_only=True`` (:func:`~s2hc.rundir.sharded.read_sharded_metadata`), since a checksum
is no signature.

This module re-exports the names of its neighbours that were defined here before they moved (``keep_copy``,
``save_sharded_checkpoint``, ``NonFiniteError``, ...): ``from s2hc.rundir.checkpoint import ...`` keeps working.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig, completed_settings
from ..io import atomic_write_bytes
from ..models import ModelConfig, Transformer
from .checksums import CHECKSUM, SHARDS, NonFiniteError, file_digest, state_digest, with_checksum
from .kept import (
    _written,
    keep_copy,
    kept_checkpoints,
    kept_directory,
    kept_path,
    prune_kept,
    remove_checkpoint,
    remove_other_kind,
)
from .layout import BEST, CHECKPOINT, EXTRA, KEPT, SHARDED
from .schema import FORMAT, READABLE, VERSION, Checkpoint, writer
from .sharded import (
    full_model_state,
    is_sharded,
    load_sharded_into,
    read_sharded_metadata,
    save_sharded_checkpoint,
    swap_in,
    weights_only_refusal,
)

__all__ = [  # the names of the checkpoint files' API, wherever they are defined
    "CHECKSUM", "SHARDS", "NonFiniteError", "best_val_loss", "check_kept_of_run", "checkpoint_paths", "file_digest",
    "is_sharded", "keep_copy", "kept_checkpoints", "kept_directory", "kept_path", "kept_steps", "load_checkpoint",
    "load_model", "load_sharded_into", "model_from_checkpoint", "parse_step", "peek_checkpoint", "prune_kept",
    "read_sharded_metadata", "remove_checkpoint", "remove_other_kind", "resolve_checkpoint", "save_checkpoint",
    "save_sharded_checkpoint", "saved_step", "state_digest", "swap_in", "weights_only_refusal",
]


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` (:class:`~s2hc.rundir.schema.Checkpoint`) with the format tag and its checksum,
    atomically. NonFiniteError (nothing written) when a tensor holds NaN or infinity; WriteError (the old file
    kept) when the disk refuses it."""
    payload = with_checksum({"format": FORMAT, "version": VERSION, **checkpoint.payload()})
    atomic_write_bytes(Path(path), lambda handle: torch.save(payload, handle))


# ------------------------------------------------------------------------ kept checkpoints: whose, and the best
#
# Reading a kept checkpoint's header: the run it belongs to, the loss a new best must beat.


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


def best_val_loss(run_dir: str | Path) -> float:
    """The validation loss of ``RUN/checkpoints/best``'s step (what a new best must beat), read from its
    history without loading its tensors; infinity when there is none. ValueError naming it when it is
    unreadable."""
    path = kept_checkpoints(run_dir).get(BEST)
    if path is None:
        return math.inf
    loss = _peek(path).history.val_loss
    return math.inf if loss is None else float(loss)


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
        checkpoint.model = full_model_state(file, checkpoint.model_config)
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
