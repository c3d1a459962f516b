"""The GPU check's torchtitan step: an s2hc model trained a few steps by torchtitan's own trainer.

    python benchmarks/torchtitan_check.py [--dry-run] WHEELS WORK

torchtitan 0.3.0 and the packages of it the device image lacks (torchdata, tyro, docstring-parser, typeguard,
spmd-types, torch-checkpointing, datasets, dill, multiprocess; 2.8 MB, all pure Python) travel as wheels in WHEELS
(``.gpu-wheels/torchtitan/``): installed into WORK/site (``pip install --no-deps --no-index --target``, unzipped
when pip fails), put first on PYTHONPATH, so the image's Python environment is not touched. Then

    python -m torch.distributed.run --standalone --nproc_per_node=1 -m torchtitan.train \\
        --module torchtitan_cpu --config s2hc_debugmodel --training.steps 10 --debug.seed 0

on the GPU (torchtitan's llama3 debugmodel, width 256, 6 layers, with s²HC at n = 4 on s2hc's embedded corpus;
FlexAttention, bf16 FSDP2 at degree 1, torchtitan's defaults), ``s2hc_tiny`` for 3 steps on the CPU
(``--dry-run``). ``--module torchtitan_cpu`` is tests/torchtitan_cpu: on CUDA only its torch-version fix applies
(``torch.distributed.set_timeout``, which torch before 2.14 lacks). Everything the run prints goes to stdout as it
comes, then one line: the steps logged, the first and last loss. Exit status: the run's, or 1 when it logged no
step or a loss that is not finite; 2 on bad usage. Standard library only.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _compatible(wheel: Path) -> bool:
    """Whether a pure-Python wheel's tag fits this Python (``py3``, or ``py3N`` of this minor version)."""
    tag = wheel.name.split("-")[-3]
    return any(t in ("py3", f"py{sys.version_info.major}{sys.version_info.minor}") for t in tag.split("."))


def install(wheels: Path, site: Path) -> str:
    """The wheels of ``wheels`` into ``site``; what was done, in words."""
    found = sorted(w for w in wheels.glob("*.whl") if _compatible(w))
    if not found:
        return f"no wheel for this Python in {wheels}"
    names = sorted({w.name.split("-")[0] for w in found})
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--no-index", "--no-compile", "--find-links", str(wheels), "--target", str(site), *names]
    if subprocess.run(command).returncode == 0:
        return f"pip install --target from {wheels}: {', '.join(names)}"
    for wheel in found:  # no pip: a wheel is a zip file
        zipfile.ZipFile(wheel).extractall(site)
    return f"unzipped from {wheels} (pip failed): {', '.join(names)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU: s2hc_tiny, 3 steps")
    parser.add_argument("wheels", type=Path, help="torchtitan's wheels (.gpu-wheels/torchtitan)")
    parser.add_argument("work", type=Path, help="a scratch directory (its site/ and run/)")
    args = parser.parse_args(argv)
    site, run = args.work / "site", args.work / "run"
    site.mkdir(parents=True, exist_ok=True)
    print(f"torchtitan: {install(args.wheels, site)}", flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT / "tests"), str(ROOT / "src"),
                                                    env.get("PYTHONPATH", "")) if p)
    config, steps = ("s2hc_tiny", 3) if args.dry_run else ("s2hc_debugmodel", 10)
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "torchtitan.train", "--module", "torchtitan_cpu", "--config", config,
               "--training.steps", str(steps), "--dump_folder", str(run), "--debug.seed", "0"]
    print(" ".join(command), flush=True)
    start = time.monotonic()
    logged: dict[int, tuple[str, str]] = {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=args.work) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            match = STEP.search(ANSI.sub("", line))
            if match:
                logged[int(match[1])] = (match[2], match[3])
    seconds = time.monotonic() - start
    losses = [float(logged[step][0]) for step in sorted(logged)]
    if losses:
        print(f"torchtitan: {len(losses)} of {steps} steps of {config} in {seconds:.0f} s: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, grad_norm {logged[max(logged)][1]} (exit {process.returncode})", flush=True)
    else:
        print(f"torchtitan: no step logged in {seconds:.0f} s (exit {process.returncode})", flush=True)
    if process.returncode != 0:
        return process.returncode
    return 0 if losses and all(math.isfinite(loss) for loss in losses) else 1


if __name__ == "__main__":
    sys.exit(main())
