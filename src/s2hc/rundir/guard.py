"""The guard of a run directory: a run is created or resumed, never overwritten, and one process at a time writes it.

:func:`open_run_directory` is the one entrance training uses (``s2hc train`` and each run of ``s2hc compare``):

- ``--out`` is checked first: not empty, not a file, writable (:func:`s2hc.io.check_output_dir`);
- without ``resume`` a directory that already holds a run (``config.yaml``, ``metrics.jsonl`` or a checkpoint)
  is refused, unless ``overwrite`` asks to remove that run first; with ``resume`` a directory that holds no run
  is refused (a mistyped ``--out`` must not quietly start a new run);
- the directory is locked for the whole run (:class:`RunLock`: ``flock`` on ``RUN/.lock``, the holder's pid in
  it): a second process is refused with the holder's pid; the kernel drops the lock of a process that dies,
  so a lock file left by a killed run is taken over (and said so);
- temporary files of saves a killed process left behind are removed: those s2hc names itself
  (``.checkpoint.pt.s2hc-XXXXXXXX.tmp`` and the like, :func:`s2hc.io.temporary_pattern`, for the files it writes
  into a run directory; ``checkpoint.dcp.tmp/``; the same of the kept checkpoints in ``checkpoints/``), never a
  user's own ``.notes.tmp``; a sharded checkpoint whose swap was cut between its two renames is put back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ..io import check_output_dir
from ..loggers import TENSORBOARD_DIR, clear_tensorboard_dir
from .kept import kept_directory
from .layout import (
    CONFIG,
    DERIVED,
    KEPT,
    LOCK,
    METRICS,
    RUN_FILES,
    SHARDED,
    SHARDED_OLD,
    SHARDED_TMP,
    is_kept_temporary,
    is_temporary,
    parse_kept_name,
    sharded_temporaries,
)
from .sharded import is_sharded

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the pid in the lock file is the only guard
    fcntl = None



def notice(message: str) -> None:
    """The default ``log`` of this module: one line on stderr."""
    print(f"s2hc: {message}", file=sys.stderr, flush=True)


def run_files(run_dir: str | Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``run_dir`` (none when it does not exist)."""
    run_dir = Path(run_dir)
    return [name for name in RUN_FILES if (run_dir / name).exists()] if run_dir.is_dir() else []


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds (part of) a run: a config, metrics or a checkpoint."""
    return bool(run_files(run_dir))


def _check_path(out: str | Path, resume: bool, overwrite: bool) -> Path:
    """The checks that need no look inside: flags, an empty or file ``--out``, ``--resume`` of nothing."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    if not str(out).strip():
        raise ValueError("--out is empty; name the run directory, e.g. --out runs/my-run")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    if resume and not path.exists():
        raise ValueError(
            f"--resume: {str(out)!r} does not exist, so there is no run to resume; check --out, "
            f"or drop --resume to start a new run there"
        )
    return path


def _check_contents(path: Path, out: str | Path, resume: bool, overwrite: bool) -> None:
    found = run_files(path)
    if resume and not found:
        raise ValueError(
            f"--resume: {str(out)!r} holds no run to resume (no {CONFIG}, {METRICS} or checkpoint); check --out, "
            f"or drop --resume to start a new run there"
        )
    if found and not resume and not overwrite:
        raise ValueError(
            f"{str(out)!r} already holds a run ({', '.join(found)}); pass --resume to continue it, --overwrite to "
            f"replace it, or choose another --out"
        )


def check_run_directory(out: str | Path, *, resume: bool = False, overwrite: bool = False) -> Path:
    """ValueError unless training may go into ``out`` as asked (see the module's rules); changes nothing.

    Used to check every run of a comparison before the first one starts; :func:`open_run_directory` checks
    again under the lock."""
    path = _check_path(out, resume, overwrite)
    _check_contents(path, out, resume, overwrite)
    return path


# ----------------------------------------------------------------------------------------------- the lock


def _describe(holder: str) -> str:
    parts = holder.split()
    if len(parts) >= 2:
        return f"pid {parts[0]} on {parts[1]}"
    return f"pid {parts[0]}" if parts else "pid unknown: it is starting"


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has ended but was not reaped yet (Linux: state ``Z`` in ``/proc/PID/stat``); False where
    that cannot be told. A run whose parent was killed may wait so for a reaper that never comes (a container
    without an init), and it holds nothing any more."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # after "(command)", which may hold spaces


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs on this host (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return not _zombie(pid)


#: Errors of a disk that cannot take another file or byte: the remedy is space, not another directory.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class RunLock:
    """An exclusive lock on a directory for as long as a process works in it: ``DIR/.lock``, held with
    ``flock`` and holding ``"PID HOST"``.

    ``acquire`` raises ValueError naming the directory and the holder's pid when another process (or another
    run in this one) holds it. A process that dies loses its ``flock`` (the kernel releases it), so a lock file
    left by a killed run is simply taken over, and ``log`` says whose it was. ``release`` removes the file.
    Where ``flock`` is not supported (some network filesystems), the pid is the guard: a live process on this
    host with that pid keeps the directory, any other is taken over.
    """

    def __init__(self, directory: str | Path, argument: str = "--out"):
        self.directory, self.argument = Path(directory), argument
        self.path = self.directory / LOCK
        self._fd: int | None = None
        self.previous: str = ""  # the content of a lock file left behind, when one was taken over

    def _in_use(self, holder: str) -> ValueError:
        return ValueError(
            f"{str(self.directory)!r} is in use by another s2hc process ({_describe(holder)}); wait for it to "
            f"finish or stop it, or choose another {self.argument}"
        )

    def acquire(self, log: Callable[[str], None] | None = notice) -> RunLock:
        me = f"{os.getpid()} {socket.gethostname()}"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                if error.errno in _DISK_FULL:  # "choose a writable --out" would be the wrong remedy
                    raise OSError(error.errno, error.strerror, str(self.path)) from None
                raise ValueError(
                    f"{self.argument} {str(self.directory)!r}: cannot create its lock file ({error.strerror}); "
                    f"choose a writable {self.argument}"
                ) from None
            try:
                if fcntl is None:
                    raise OSError(errno.ENOLCK, "no fcntl")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise self._in_use(holder) from None
                # no flock here: a live holder on this host keeps it; on another host we cannot tell
                parts = holder.split()
                if parts and holder != me and (len(parts) < 2 or parts[1] != socket.gethostname()
                                               or _alive(int(parts[0]) if parts[0].isdigit() else -1)):
                    os.close(fd)
                    raise self._in_use(holder) from None
            try:  # the holder may have released (and removed) the file between our open and flock: use the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.previous = _read(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
        except OSError as error:  # a full disk: leave no empty lock file behind, and name it
            with contextlib.suppress(OSError):
                self.path.unlink()  # still held by us: no other process uses this file
            os.close(fd)
            raise OSError(error.errno, error.strerror, str(self.path)) from None
        self._fd = fd
        if self.previous and self.previous != me and log is not None:
            log(f"{str(self.directory)!r}: took over the lock left by {_describe(self.previous)}, which is no "
                f"longer running (killed?)")
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)  # while still held: no other process holds this file now
        os.close(fd)  # drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------- cleaning and opening


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _put_back(directory: Path, name: str, log: Callable[[str], None] | None, shown: str, prefix: str = "") -> None:
    """A sharded checkpoint ``directory/name`` missing because its swap was cut between its two renames: the
    complete new one (``NAME.tmp/``), else the old one (``NAME.old/``), renamed back into place."""
    target = directory / name
    if target.exists():
        return
    for candidate in (directory / temporary for temporary in sharded_temporaries(name)):
        if is_sharded(candidate):
            os.replace(candidate, target)
            if log is not None:
                log(f"{shown!r}: put back {prefix}{name}/ from {prefix}{candidate.name}/ (a save was cut between "
                    f"its two renames)")
            return


def _kept_leftovers(run_dir: Path, log: Callable[[str], None] | None) -> list[Path]:
    """What interrupted writes left in ``RUN/checkpoints/``, after a cut swap's checkpoint is put back: the
    temporaries of kept files and directories (a sharded one being removed is renamed to one first), and any
    sharded one that is not complete."""
    kept = run_dir / KEPT
    if not kept.is_dir() or kept.is_symlink():  # nothing outside the run directory is touched
        return []
    for path in list(kept.iterdir()):
        for suffix in (".tmp", ".old"):
            name = path.name.removesuffix(suffix)
            if name != path.name and parse_kept_name(name) is not None and path.is_dir():
                _put_back(kept, name, log, str(run_dir), prefix=f"{KEPT}/")
    leftovers = []
    for path in kept.iterdir():
        parsed = parse_kept_name(path.name)
        if is_kept_temporary(path.name) or (parsed is not None and parsed[1] and not is_sharded(path)):
            leftovers.append(path)
    return leftovers


def clean_interrupted_saves(run_dir: str | Path, log: Callable[[str], None] | None = notice) -> list[str]:
    """Remove what saves cut short by a kill left in ``run_dir``; returns the names removed.

    The temporary files :func:`s2hc.io.atomic_write_bytes` names for the files of a run (:data:`ATOMIC_FILES`:
    ``.checkpoint.pt.s2hc-XXXXXXXX.tmp`` and the like, exactly), ``checkpoint.dcp.tmp/`` and
    ``checkpoint.dcp.old/``, and in ``checkpoints/`` the same of the kept ones (``.step-00000100.pt.s2hc-
    XXXXXXXX.tmp``, ``best.dcp.tmp/``, and a sharded one whose removal was cut short); any other file, a user's
    ``.notes.tmp`` included, is left alone. A sharded save swaps its directory in with two renames; killed
    between them, ``checkpoint.dcp/`` (or a kept one) is missing and the complete new one (``.tmp``, else the
    old one, ``.old``) is put back first. Call it only while holding the directory's lock."""
    run_dir = Path(run_dir)
    _put_back(run_dir, SHARDED, log, str(run_dir))
    removed, size = [], 0
    leftovers = [p for p in run_dir.iterdir() if is_temporary(p.name) and p.is_file()]
    leftovers += [p for p in (run_dir / SHARDED_TMP, run_dir / SHARDED_OLD) if p.exists()]
    leftovers += _kept_leftovers(run_dir, log)
    for path in sorted(leftovers):
        with contextlib.suppress(OSError):
            size += _size(path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(str(path.relative_to(run_dir)))
    if removed and log is not None:
        log(f"{str(run_dir)!r}: removed {len(removed)} temporary file(s) of interrupted saves "
            f"({size / 2**20:.1f} MiB): {', '.join(removed)}")
    return removed


def clear_run(run_dir: str | Path, log: Callable[[str], None] | None = notice) -> list[str]:
    """Remove the run in ``run_dir`` (:data:`RUN_FILES` and :data:`DERIVED`); other files are left alone."""
    run_dir = Path(run_dir)
    removed = []
    for name in (*RUN_FILES, *DERIVED):
        path = run_dir / name
        if name == TENSORBOARD_DIR:  # only what the run wrote there (s2hc.loggers marks it): never a user's
            if clear_tensorboard_dir(path):
                removed.append(name)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    if removed and log is not None:
        log(f"--overwrite: removed the run in {str(run_dir)!r} ({', '.join(removed)})")
    return removed


@contextlib.contextmanager
def open_run_directory(out: str | Path, *, resume: bool = False, overwrite: bool = False,
                       log: Callable[[str], None] | None = notice) -> Iterator[Path]:
    """Check ``out`` for a run as asked, create it, lock it, clean it; yields the directory, locked.

    ``resume``: ``out`` must hold a run (ValueError otherwise). Neither: ``out`` must not hold one.
    ``overwrite``: the run in ``out``, if any, is removed (:func:`clear_run`). On leaving, the lock is released,
    and a directory this call created is removed again if nothing was written into it."""
    path = _check_path(out, resume, overwrite)
    created = not path.exists()
    check_output_dir(path, "--out")
    lock = RunLock(path).acquire(log)
    try:
        _check_contents(path, out, resume, overwrite)  # again, now that no other process can change it
        if not overwrite:  # --overwrite removes a link in its place
            kept_directory(path)  # ValueError when checkpoints/ is a link: nothing outside the run is read or written
        clean_interrupted_saves(path, log)
        if overwrite:
            clear_run(path, log)
        yield path
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty: a run that failed before writing anything leaves nothing


__all__ = [
    "LOCK",
    "RUN_FILES",
    "RunLock",
    "check_run_directory",
    "clean_interrupted_saves",
    "clear_run",
    "holds_run",
    "notice",
    "open_run_directory",
    "run_files",
]
