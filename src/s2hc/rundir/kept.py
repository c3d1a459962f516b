"""Kept checkpoints (``RUN/checkpoints/``, :mod:`~s2hc.rundir.layout`): :func:`keep_copy` puts the checkpoint just
written in a second place (a copy verified byte for byte, never a hard link: each kept file is its own), atomically;
:func:`kept_checkpoints` lists them, :func:`prune_kept` removes all but the newest steps, :func:`remove_checkpoint`
removes one so that no kill leaves part of it under its name. Reading them (``resolve_checkpoint(RUN, step=100)``,
the run each belongs to, the best loss) is :mod:`~s2hc.rundir.checkpoint`'s.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from ..io import TEMPORARY_MARK, WriteError, fsync_path
from .checksums import file_digest
from .layout import BEST, CHECKPOINT, EXTRA, KEPT, SHARDED, kept_name, parse_kept_name, sharded_temporaries
from .sharded import is_sharded, swap_in

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
