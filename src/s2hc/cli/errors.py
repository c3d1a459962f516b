"""How ``s2hc`` reports a user's problem: one line, ``s2hc CMD: error: ...``, and an exit status.

:func:`report_error` is called by :func:`s2hc.cli.main` for a ``ValueError`` (exit 2), an ``OSError`` (exit 2;
1 for a full disk, an exhausted quota or an I/O error during the work), an optional package that is not
installed (exit 2: ``s2hc upcycle: error: a Hugging Face SOURCE needs the hf extra (transformers is not
installed): pip install 's2hc[hf]'``) or running out of memory (exit 1).
"""

from __future__ import annotations

import errno
import sys

from ..extras import as_missing_extra
from ..io import OS_HINTS


def report_error(command: str, error: BaseException) -> int:
    """One line and an exit status for a user's problem; a RuntimeError that is not running out of memory, or an
    ImportError of a package that no extra provides, is raised again (a bug)."""
    if isinstance(error, ValueError):
        return _fail(command, str(error), 2)
    if isinstance(error, ImportError):
        missing = as_missing_extra(error)
        if missing is None:
            raise error
        return _fail(command, str(missing), 2)
    if isinstance(error, OSError):
        return _fail(command, describe_os_error(error), 1 if error.errno in FAILED_RUN_ERRNOS else 2)
    if not out_of_memory(error):
        raise error
    return _fail(command, f"out of memory ({_first_line(error)}); use a smaller model, batch or sequence "
                 "length, or a machine with more memory", 1)


#: OSErrors that end a run that had started (exit 1) rather than refuse an argument (exit 2).
FAILED_RUN_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def describe_os_error(error: OSError) -> str:
    """One line for an OSError: the file, the reason and what to do (an error that says so already is kept)."""
    if error.filename is None and not str(error).startswith("[Errno"):  # a message already (s2hc.io.WriteError)
        return _first_line(error)
    reason = error.strerror or _first_line(error) or type(error).__name__
    where = f"{str(error.filename)!r}: " if error.filename is not None else ""
    if error.filename2 is not None:
        where = f"{str(error.filename)!r} -> {str(error.filename2)!r}: "
    hint = OS_HINTS.get(error.errno)
    return f"{where}{reason}" + (f"; {hint}" if hint else "")


def out_of_memory(error: RuntimeError) -> bool:
    """Whether ``error`` is an allocation that failed (CUDA or CPU): the machine's limit, not a bug."""
    torch = sys.modules.get("torch")  # not imported: no torch error (and `s2hc --help` starts without torch)
    return (torch is not None and isinstance(error, torch.OutOfMemoryError)) or "can't allocate memory" in str(error)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else ""


def _fail(command: str, message: str, status: int) -> int:
    message = " ".join(line.strip() for line in message.strip().splitlines())  # one line, whatever it was
    print(f"{command}: error: {message}", file=sys.stderr)
    return status
