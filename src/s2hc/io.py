"""Files written atomically, and the one check of an output path.

:func:`atomic_write_bytes`: a temporary file beside the target, fsync, then rename, so a reader, or a run
killed mid-write, sees either the old file or the new one, never half of one. A write that fails (a full
disk, a read-only filesystem) removes its temporary file, leaves the old file as it was, and raises
:class:`WriteError`: one line naming the file, the reason and what to do. The temporary file's name is s2hc's
alone (:func:`temporary_pattern`), so what a killed write left behind can be told from a user's own files.

:func:`check_output_dir` and :func:`check_output_file`: an output path a command is about to write, checked
before any work starts; ValueError naming the argument, the path and what is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any

#: What to do about a failed file operation, by errno (after the system's own reason): the one table, used by
#: WriteError here and by the command line's error lines (s2hc.cli.errors).
OS_HINTS = {
    errno.ENOSPC: "the disk is full: free some space",
    errno.EDQUOT: "the disk quota is exhausted: free some space",
    errno.EIO: "the disk or file system failed: check it, then run again",
    errno.EFBIG: "the file system cannot hold so large a file: write elsewhere",
    errno.EROFS: "choose a writable location",
    errno.EACCES: "choose a writable location",
    errno.EPERM: "choose a writable location",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another location",
    errno.EISDIR: "it is a directory: choose a file name",
    errno.ENOENT: "check the path",
    errno.EEXIST: "choose another name",
    errno.ENAMETOOLONG: "choose a shorter name",
}


class WriteError(OSError):
    """A file could not be written (full disk, read-only filesystem, no permission); the old file is unchanged.

    ``str(error)`` is one line: the file, the reason and what to do. ``errno`` is the underlying error's."""

    def __init__(self, path: Path | str, cause: OSError):
        reason = cause.strerror or str(cause) or type(cause).__name__
        code = errno.errorcode.get(cause.errno, "") if cause.errno is not None else ""
        hint = OS_HINTS.get(cause.errno, "check the path and the disk")
        message = f"could not write {str(path)!r}: {reason}{f' ({code})' if code else ''}; {hint}"
        super().__init__(cause.errno, message)
        self.path = str(path)

    def __str__(self) -> str:
        return self.strerror


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, or one in its ``__cause__`` / ``__context__`` chain (torch.save turns a
    failed ``write`` into ``RuntimeError: [enforce fail at inline_container.cc]``, its context the OSError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _Recorder:
    """A binary file that remembers the first OSError its ``write`` raised (a caller may swallow or wrap it)."""

    def __init__(self, handle):
        self._handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name):  # flush, tell, seek, fileno, ...
        return getattr(self._handle, name)


#: What marks a temporary file of :func:`atomic_write_bytes` as s2hc's: ``.NAME.s2hc-XXXXXXXX.tmp``.
TEMPORARY_MARK = "s2hc-"
_TEMPORARY_DIGITS = 8  # hexadecimal


def temporary_pattern(name: str) -> re.Pattern[str]:
    """The names :func:`atomic_write_bytes` gives its temporary files for a file called ``name`` (use
    ``fullmatch``): ``.NAME.s2hc-`` and 8 hexadecimal digits, then ``.tmp``. A user's ``.NAME.mine.tmp`` or
    ``.notes.tmp`` does not match."""
    return re.compile(rf"\.{re.escape(name)}\.{TEMPORARY_MARK}[0-9a-f]{{{_TEMPORARY_DIGITS}}}\.tmp")


def _create_temporary(path: Path) -> tuple[int, str]:
    """Create a new, empty temporary file for ``path`` beside it, named by :func:`temporary_pattern`, readable by
    this user alone (as ``mkstemp`` would); its descriptor and path."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{TEMPORARY_MARK}{secrets.token_hex(_TEMPORARY_DIGITS // 2)}.tmp"
        try:
            return os.open(tmp, flags, 0o600), str(tmp)
        except FileExistsError:  # another write of the same file drew the same digits: draw again
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(path))


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The temporary file is ``.NAME.s2hc-XXXXXXXX.tmp`` in the same directory (:func:`temporary_pattern`; a run
    directory removes those left by a killed process when it is next opened). Raises :class:`WriteError` when
    the disk refuses the data; the old ``path`` is then untouched and the temporary file removed."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temporary(path)
        with os.fdopen(fd, "wb") as raw:
            handle = _Recorder(raw)
            try:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            except BaseException as error:
                cause = handle.error or os_error_in(error)
                if cause is not None:
                    raise WriteError(path, cause) from error
                raise
        os.chmod(tmp, 0o666 & ~_umask())  # created 0600; give the usual permissions
        os.replace(tmp, path)
    except WriteError:
        _discard(tmp)
        raise
    except OSError as error:
        _discard(tmp)
        raise WriteError(path, error) from error
    except BaseException:
        _discard(tmp)
        raise
    fsync_path(path.parent)  # the rename itself survives a crash


def fsync_path(path: str | Path) -> None:
    """fsync the file or directory ``path`` (a directory: the names in it, so a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(tmp: str | None) -> None:
    if tmp is not None:
        with contextlib.suppress(OSError):
            Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda handle: handle.write(text.encode()))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True))


# ------------------------------------------------------------------------------------------- output paths


def json_kind(value: object) -> str:
    """What a JSON value is, in JSON's words (an error about a file speaks of the file, not of Python)."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


#: What :func:`json_loads` says of JSON nested deeper than the parser follows (``[[[[...``, thousands deep).
TOO_DEEP = "arrays or objects nested too deep to read"


def json_loads(text: str | bytes) -> Any:
    """``json.loads``, except that JSON nested deeper than Python's parser can follow is a
    ``json.JSONDecodeError`` (:data:`TOO_DEEP`, at its start) like any other defect, not a RecursionError: every
    reader of a file a user can hand over uses it, so that its one-line message covers that case too."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, text if isinstance(text, str) else "", 0) from None


def read_json_object(path: Path, remedy: str) -> dict[str, Any]:
    """The JSON object in the file ``path``; ValueError naming it, what is wrong and ``remedy`` (what to do) when
    it is not UTF-8, not JSON (or nested too deep to read), or JSON but not an object. OSError as raised (a
    missing file, no permission)."""
    try:
        value = json_loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not UTF-8 text; {remedy}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not JSON ({error.msg} at line {error.lineno} column {error.colno}); "
                         f"{remedy}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} holds {json_kind(value)}, not a JSON object; {remedy}")
    return value


def _reason(error: OSError) -> str:
    hint = OS_HINTS.get(error.errno)
    return f"{error.strerror or error}" + (f"; {hint}" if hint else "")


def check_output_dir(path: str | Path, argument: str = "--out", *, create: bool = True) -> Path:
    """``path`` as a directory this process can write into, created (with its parents) when ``create``.

    ValueError naming ``argument`` and the path when it is empty, a file, under a file, a dangling symbolic link (or
    under one), or not writable (read-only filesystem, no permission, ``/proc``). Returns the path with ``~``
    expanded."""
    if not str(path).strip():
        raise ValueError(f"{argument} is empty; name a directory, e.g. {argument} runs/my-run")
    directory = Path(path).expanduser()
    link = next((p for p in (directory, *directory.parents) if p.is_symlink() and not p.exists()), None)
    if link is not None:
        where = "is" if link == directory else f"lies under {str(link)!r}, which is"
        raise ValueError(f"{argument} {str(path)!r} {where} a dangling symbolic link (to {os.readlink(link)!r}, which "
                         f"does not exist); remove the link, create its target, or choose another {argument}")
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{argument} {str(path)!r} is a file, not a directory; choose another {argument}")
    if not directory.exists() and not create:
        raise ValueError(f"{argument} {str(path)!r} does not exist")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".s2hc-write-test.", suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"{argument} {str(path)!r} cannot be written: {_reason(error)}; choose another {argument}"
        ) from None
    return directory


def check_output_file(path: str | Path, argument: str) -> Path:
    """``path`` as a file this process can create or replace: its directory is checked (and created) by
    :func:`check_output_dir`; ValueError when ``path`` is empty or an existing directory."""
    if not str(path).strip():
        raise ValueError(f"{argument} is empty; name a file")
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"{argument} {str(path)!r} is a directory; name a file")
    if file.exists() and not os.access(file, os.W_OK):
        raise ValueError(f"{argument} {str(path)!r} is not writable; choose another {argument}")
    check_output_dir(file.parent, f"the directory of {argument}")
    return file
