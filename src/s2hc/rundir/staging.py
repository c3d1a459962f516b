"""Output directories written complete or absent: built beside the target, then swapped in.

:func:`replace_directory` is how ``s2hc export`` and ``s2hc upcycle`` write their directory ``PARENT/OUT``:

1. ``PARENT/.OUT.s2hc-lock`` is locked (:class:`~s2hc.rundir.guard.RunLock`) for the whole call, so two
   processes never build the same ``OUT``; what an earlier, killed call left is recovered (below);
2. an existing ``OUT`` must hold only what the command itself writes (its ``allowed`` names): a directory with
   anyone else's files is refused, naming them, rather than deleted;
3. the new output is built in ``PARENT/.OUT.s2hc-tmp-XXXXXXXX/`` (the same parent, so the renames are atomic),
   and every file and directory in it is fsynced;
4. the swap: ``OUT`` is renamed to ``PARENT/.OUT.s2hc-old-XXXXXXXX/``, the new one renamed to ``OUT``, the old
   one removed. Until the second rename, the previous output is whole.

What a user finds after a kill (or a full disk, a power cut):

- while building: ``OUT`` as it was (the previous output, or nothing) and a ``.OUT.s2hc-tmp-*`` directory;
- between the two renames: no ``OUT``; the previous output in ``.OUT.s2hc-old-*``, the new one in
  ``.OUT.s2hc-tmp-*``; moving ``.OUT.s2hc-old-*`` back to ``OUT`` by hand restores it;
- after the swap: ``OUT`` is the new output, perhaps beside a ``.OUT.s2hc-old-*`` not yet removed.

The next call on ``OUT`` (or :func:`recover_directory`) puts the previous output back when ``OUT`` is missing
and removes the leftover ``.OUT.s2hc-tmp-*`` / ``.OUT.s2hc-old-*`` directories; nothing else is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ..io import WriteError, check_output_dir, fsync_path
from .guard import RunLock, notice

BUILDING, PREVIOUS = "s2hc-tmp", "s2hc-old"  # the marks of the two sibling directories of a swap
_DIGITS = 8  # hexadecimal


def _absolute(target: str | Path) -> Path:
    """``target`` made absolute without resolving symbolic links (a link is renamed as the link itself)."""
    return Path(os.path.abspath(Path(target).expanduser()))


def sibling_pattern(target: Path, mark: str) -> re.Pattern[str]:
    """The names of ``target``'s sibling directories marked ``mark`` (:data:`BUILDING` or :data:`PREVIOUS`)."""
    return re.compile(rf"\.{re.escape(target.name)}\.{mark}-[0-9a-f]{{{_DIGITS}}}")


def _siblings(target: Path, mark: str) -> list[Path]:
    pattern = sibling_pattern(target, mark)
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir())


class _SiblingLock(RunLock):
    """The lock of an output directory, held beside it (``PARENT/.OUT.s2hc-lock``): the directory itself is
    renamed during the swap, so a lock inside it would move with it."""

    def __init__(self, target: Path, argument: str):
        super().__init__(target, argument)
        self.path = target.parent / f".{target.name}.s2hc-lock"


def recover_directory(target: str | Path, log: Callable[[str], None] | None = notice) -> list[str]:
    """Undo what a killed :func:`replace_directory` on ``target`` left; returns the names removed.

    ``target`` missing beside a ``.OUT.s2hc-old-*`` directory (killed between the two renames): that previous
    output is put back. Then the leftover ``.OUT.s2hc-tmp-*`` and ``.OUT.s2hc-old-*`` directories, and the lock
    file a killed process left, are removed. ValueError while another s2hc process writes ``target``."""
    path = _absolute(target)
    lock = _SiblingLock(path, "the output").acquire(log)
    try:
        return _recover(path, log)
    finally:
        lock.release()


def _recover(target: Path, log: Callable[[str], None] | None) -> list[str]:
    """:func:`recover_directory` under the target's lock."""
    previous = _siblings(target, PREVIOUS)
    if previous and not target.exists() and not target.is_symlink():
        newest = max(previous, key=lambda p: p.stat().st_mtime)
        os.rename(newest, target)
        fsync_path(target.parent)
        if log is not None:
            log(f"{str(target)!r}: put back the previous output from {newest.name}/ (an earlier write was "
                f"killed between the two renames of its swap)")
    removed = []
    for leftover in _siblings(target, BUILDING) + _siblings(target, PREVIOUS):
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover.name)
    if removed and log is not None:
        log(f"{str(target)!r}: removed what interrupted writes left beside it: {', '.join(removed)}")
    return removed


def check_replaceable(target: str | Path, argument: str, kind: str, allowed: Callable[[str], bool]) -> Path:
    """ValueError unless ``target`` is missing, or a directory holding only names ``allowed`` accepts (what the
    command writes); the message names ``argument``, the path and the first foreign files. Changes nothing."""
    path = _absolute(target)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{argument} {str(target)!r} is a file, not a directory; choose another {argument}")
    if not path.is_dir():
        return path
    foreign = sorted(name for name in os.listdir(path) if not allowed(name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{argument} {str(target)!r} holds files that are not {kind} ({shown}); s2hc replaces "
                         f"the whole directory, so move them away or choose another {argument}")
    return path


def _check_writable(target: str | Path, argument: str) -> Path:
    """:func:`s2hc.io.check_output_dir` of ``target`` (its messages name ``argument`` and ``target`` as given),
    leaving no empty ``target`` behind: the swap creates it, whole."""
    path = _absolute(target)
    existed = path.exists()
    check_output_dir(target, argument)
    if not existed:
        path.rmdir()
    return path


@contextlib.contextmanager
def replace_directory(target: str | Path, *, argument: str, kind: str, allowed: Callable[[str], bool],
                      lock_inside: bool = False, check: Callable[[], None] | None = None,
                      log: Callable[[str], None] | None = notice) -> Iterator[Path]:
    """Yield an empty directory beside ``target`` to build the new output in; on a normal exit it is fsynced
    and swapped in for ``target`` (see the module's steps), on an exception it is removed and ``target`` is as
    it was. ``lock_inside``: also hold ``target``'s own run lock (``OUT/.lock``), refusing a directory another
    s2hc process is training in. ``check``: the caller's own checks of ``target``, run again under the lock.
    ValueError for a target that is not replaceable (:func:`check_replaceable`)
    or in use."""
    path = _check_writable(target, argument)
    lock = _SiblingLock(path, argument).acquire(log)
    inside = None
    try:
        _recover(path, log)
        check_replaceable(target, argument, kind, allowed)  # again, now that no other s2hc call can change it
        if check is not None:
            check()
        if lock_inside and path.is_dir():
            inside = RunLock(path, argument).acquire(log)
        token = secrets.token_hex(_DIGITS // 2)
        building = path.parent / f".{path.name}.{BUILDING}-{token}"
        building.mkdir()
        try:
            yield building
            _sync_tree(building, path)
            _swap(building, path, path.parent / f".{path.name}.{PREVIOUS}-{token}", inside)
        except WriteError as error:
            shutil.rmtree(building, ignore_errors=True)
            raise _named_in_target(error, building, path) from error.__cause__
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    finally:
        if inside is not None:
            inside.release()
        lock.release()


def _named_in_target(error: WriteError, building: Path, target: Path) -> WriteError:
    """``error`` naming the file as the user knows it (``OUT/model.safetensors``), not inside the temporary
    directory it was written in."""
    error.strerror = str(error).replace(str(building), str(target))
    error.path = error.path.replace(str(building), str(target))
    return error


def _swap(building: Path, target: Path, previous: Path, inside: RunLock | None) -> None:
    """Rename ``target`` (if any) to ``previous``, ``building`` to ``target``, then remove ``previous``."""
    if target.exists() or target.is_symlink():
        _move_away(target, previous)
        if inside is not None:
            inside.path = previous / inside.path.name  # the lock file moved with its directory
    try:
        _move_in(building, target)
    except Exception:
        if previous.exists() and not target.exists():
            os.rename(previous, target)  # the second rename failed: the previous output back in its place
        raise
    if previous.exists():
        if inside is not None:
            inside.release()  # before its directory goes
        shutil.rmtree(previous, ignore_errors=True)


def _move_away(target: Path, previous: Path) -> None:
    """The first rename of a swap: the previous output out of the way, whole."""
    os.rename(target, previous)
    fsync_path(target.parent)


def _move_in(building: Path, target: Path) -> None:
    """The second rename of a swap: the new output in place, whole."""
    os.rename(building, target)
    fsync_path(target.parent)


def _sync_tree(root: Path, target: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root``): what a rename makes visible is on disk.
    Files written by other libraries (``save_pretrained``) are not fsynced by them, and a full disk may only
    show here. :class:`~s2hc.io.WriteError` names the file as it would be in ``target``."""
    for directory, _, files in os.walk(root):
        for name in files:
            file = Path(directory, name)
            try:
                fsync_path(file)
            except OSError as error:
                raise WriteError(target / file.relative_to(root), error) from error
        fsync_path(directory)


__all__ = ["check_replaceable", "recover_directory", "replace_directory", "sibling_pattern"]
