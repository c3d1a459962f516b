"""How long the command line takes to start: the median wall time of N fresh processes of each command.

    python benchmarks/cli_start.py [--runs 7] [--s2hc .venv/bin/s2hc]

Times ``s2hc --version``, ``s2hc --help``, ``s2hc train --help`` and ``python -c "import s2hc"``, each run N
times in a new process (interleaved: one of each command per round, so a load that comes and goes on a shared
machine falls on all of them alike), and prints the machine and a Markdown table of the median, minimum and
maximum seconds. Nothing is checked: a busy machine gives larger numbers, not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def machine() -> str:
    """CPU model, cores, load, Python and torch versions (torch read from its metadata, not imported)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # no /proc on macOS
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "absent"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{cpu}, {os.cpu_count()} cores, load average {load}; Python {platform.python_version()}, "
            f"torch {torch}")


def commands(s2hc: str) -> dict[str, list[str]]:
    return {
        "s2hc --version": [s2hc, "--version"],
        "s2hc --help": [s2hc, "--help"],
        "s2hc train --help": [s2hc, "train", "--help"],
        'python -c "import s2hc"': [sys.executable, "-c", "import s2hc"],
    }


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per command (default 7)")
    default = Path(sys.executable).with_name("s2hc")
    parser.add_argument("--s2hc", default=str(default) if default.exists() else shutil.which("s2hc") or "s2hc",
                        help="the s2hc executable (default: the one beside this Python)")
    args = parser.parse_args()
    todo = commands(args.s2hc)
    for argv in todo.values():  # once each, untimed: the files in the page cache, .pyc written
        time_once(argv)
    times: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(args.runs):
        for name, argv in todo.items():
            times[name].append(time_once(argv))
    print(f"Machine: {machine()}\n")
    print(f"Wall time of {args.runs} fresh processes per command, interleaved:\n")
    print("| command | median s | min s | max s |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
