"""Training processes that do not outlive the process that started them.

``s2hc study`` runs each run as a child ``s2hc train``; a child left running after the study is gone would
hold its run's lock, so the study called again could not resume it. Two mechanisms, one for each way a parent
ends:

- :func:`stop_processes`: a parent that is still alive (an exception, a signal, the end of its work) stops its
  children: SIGTERM (a run saves a checkpoint after its current step), then SIGKILL after a grace period, and
  reaps them all. Each child runs in a process group of its own (``start_new_session``), so the signal reaches
  whatever the child started in its group, and a Ctrl-C at the terminal reaches the parent alone, which passes
  it on once (a run that got it twice would stop without its checkpoint).
- :func:`die_with_parent`: a parent that is killed outright (``kill -9``) cannot stop anything, so the child
  asks the kernel, when it starts, to kill it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``). The
  parent asks for this through the environment (:func:`die_with_parent_env`), and the child acts on it in its
  own start-up rather than in a ``preexec_fn``, which is unsafe in a parent with threads. The parent-death
  signal fires when the *thread* that started the child ends: the study starts and reaps its children in one
  thread, which therefore outlives them. macOS and Windows have no such signal: there a child of a parent killed
  with ``kill -9`` runs on until it ends (stop it by the pid in its run's ``.lock``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

#: Set by a parent to its own pid: the child asks to be killed when that parent dies (:func:`die_with_parent`).
DIE_WITH_PARENT = "S2HC_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_following: list[int] = []  # the parent this process dies with, once die_with_parent() has asked the kernel


def die_with_parent_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) asking a child started with it to die with this process."""
    return {**(os.environ if env is None else env), DIE_WITH_PARENT: str(os.getpid())}


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies; False where it cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), ctypes.c_ulong(0), ctypes.c_ulong(0),
                            ctypes.c_ulong(0))
    except (OSError, AttributeError):  # no libc with prctl (an unusual build): nothing to ask
        return False
    return result == 0


def die_with_parent() -> None:
    """When the environment asks (:data:`DIE_WITH_PARENT` names this process's parent): be killed (SIGKILL) when
    the parent dies. Called first thing by ``python -m s2hc``.

    The variable is removed from this process's environment, so the processes it starts are not asked to follow
    it unless it asks again (a launcher asks for its torchrun workers itself). SIGKILL, not SIGTERM: the parent
    is gone, nobody waits for a clean stop, and the run's lock must be free at once for the parent called again;
    the run resumes from its last checkpoint. A parent that died before the request was made (between the
    start of this process and now) cannot be followed any more: this process then stops at once (exit 1)."""
    parent = os.environ.pop(DIE_WITH_PARENT, "")
    if not parent.strip().isdigit():
        return
    if not _set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != int(parent):
        print(f"s2hc: not starting: its parent process (pid {int(parent)}) has ended", file=sys.stderr, flush=True)
        raise SystemExit(1)
    _following[:] = [int(parent)]


def dies_with_parent() -> bool:
    """Whether this process dies with its parent (:func:`die_with_parent` asked the kernel, and it agreed)."""
    return bool(_following)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to ``process``'s process group (it leads one: ``start_new_session``), else to it alone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg") and os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)


def stop_processes(processes: Iterable[subprocess.Popen], grace_s: float = 30.0,
                   hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop and reap every one of ``processes`` still running: SIGTERM, then SIGKILL to those still running after
    ``grace_s`` seconds (or as soon as ``hurry()`` is true: a second Ctrl-C). Each signal goes to the process's
    group. Returns once every one has ended; their exit statuses are in ``returncode``."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM if hasattr(signal, "SIGTERM") else signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while any(process.poll() is None for process in running) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    for process in running:
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
    for process in running:
        process.wait()


__all__ = ["DIE_WITH_PARENT", "die_with_parent", "die_with_parent_env", "dies_with_parent", "stop_processes"]
