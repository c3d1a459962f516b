"""Re-run one cell of every committed study at the current commit and record how far it lands from its row.

    python scripts/rerun_cells.py [--out runs/reruns-final] [--json docs/reruns/cells.json] [--only STUDY ...]
    python scripts/rerun_cells.py --control STUDY --at COMMIT

Each cell is trained as its study trained it (the study config's run config, ``s2hc train`` in a process of its
own with the thread count its committed row records, one where it records none, as ``s2hc study --jobs 2`` runs on
two cores) and its final validation loss is set beside the committed row's, with where each trained. The upcycling
study's base model (``configs/upcycle-base.yaml``) is trained first. Each cell is written with ``"round": "final"``
and ``"code"``, the git tree of ``src/`` it trained with (a commit that changes only the docs keeps it): one cell per
study and code. The cells of the earlier rounds (no ``round``: seven studies at older commits, on another CPU) stay
in the JSON.
Resumable: a cell already in the JSON for this code is kept, a run directory already finished is read again.

``--control STUDY --at COMMIT`` trains the same cell with the code of an older COMMIT (its ``src/`` and ``configs/``,
the run configs written by that code's own ``s2hc study --print-commands``) on this machine, and records it with
``"round": "control"``: where a final cell trained on another CPU than its row, the control says whether the code or
the CPU moved it (the same loss as the final cell at the row's own code: the CPU).

docs/results.md renders the rounds and the controls (its "Rounding" section) from the JSON this writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: committed study directory -> (its config, the cell's configuration label, seed)
CELLS = {
    "study": ("configs/study-tiny.yaml", "s2hc n=4", 1),
    "recipe": ("configs/study-recipe.yaml",
               "s2hc (projection_init=normal) n=4 [weight_decay_on=all, weight_decay=1.43]", 1),
    "start": ("configs/study-start.yaml", "mhc (gate_init=residual) n=4", 1),
    "depth": ("configs/study-depth.yaml", "s2hc n=4 [n_layers=8]", 0),
    "gated": ("configs/study-gated.yaml", "gated-residual n=4", 1),
    "gated-lss": ("configs/study-gated-lss.yaml", "mhc n=4 [lss_init=0.6]", 1),
    "upcycling": ("configs/study-upcycle.yaml", "s2hc n=4", 1),
    "crn": ("configs/study-crn.yaml", "s2hc n=4 [init_rng=sequential]", 1),
    "floor": ("configs/study-floor.yaml", "s2hc n=4 [init_rng=per_parameter]", 1),
    # the cost and production studies' gated residual, seed 1: the same run, which the two studies trained 0.006 apart
    # (1 thread on one Intel Xeon, 2 on an AMD EPYC, commits apart); re-run at one commit on one CPU, each at its
    # row's thread count, the two cells say whether the thread count or the code moved it
    "cost": ("configs/study-cost.yaml", "gated-residual n=4", 1),
    "start-confirm": ("configs/study-start-confirm.yaml", "s2hc (gate_init=residual) n=4", 5),
    "hc-gain": ("configs/study-hc-gain.yaml", "hc (hold_sums=both) n=4", 1),
    "production": ("configs/study-production.yaml", "gated-residual n=4", 1),
    "equivalence": ("configs/study-equivalence.yaml", "s2hc n=4", 10),
    "depth-rate": ("configs/study-depth-rate.yaml", "hc n=4 [lr=0.002, n_layers=8]", 0),
}
UPCYCLE_BASE = ("configs/upcycle-base.yaml", "runs/upcycle-base")


def _train(command: list[str], log: Path, threads: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        subprocess.run(command, check=True, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _final(run_dir: Path) -> tuple[float, dict | None]:
    """The run's last validation loss and its first platform record."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    platform = next((r["platform"] for r in records if "platform" in r), None)
    return val[-1], platform


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def _commit(at: str = "HEAD") -> str:
    return _git("rev-parse", "--short", at)


def _code() -> str:
    """The git tree of ``src/`` at HEAD (with ``+`` when the working tree's ``src/`` differs from it)."""
    return _git("rev-parse", "--short", "HEAD:src") + ("+" if _git("status", "--porcelain", "--", "src") else "")


def rerun(study: str, out: Path) -> dict:
    from s2hc.study.runner import Run, prepare, train_command
    from s2hc.study.spec import load_spec

    config, label, seed = CELLS[study]
    if study == "upcycling" and not (ROOT / UPCYCLE_BASE[1] / "metrics.jsonl").is_file():
        _train([sys.executable, "-m", "s2hc", "train", "--config", UPCYCLE_BASE[0], "--out", UPCYCLE_BASE[1],
                "--no-progress"], out / "upcycle-base.log")
    spec = load_spec(ROOT / config)
    configuration = next((c for c in spec.configurations if c.label == label), None)
    if configuration is None:
        raise SystemExit(f"{config} has no configuration {label!r}")
    directory = out / study
    prepare(spec, directory)
    run = Run(configuration, seed, directory)
    committed = json.loads((ROOT / "docs" / study / "results.json").read_text())
    row = next((r for r in committed["rows"] if r["name"] == run.name), None)
    if row is None:
        raise SystemExit(f"docs/{study}/results.json has no row {run.name!r} (the cell CELLS names)")
    committed_platform = (row.get("platform") or [{}])[0] or {}
    threads = committed_platform.get("threads") or 1
    if not (run.run_dir / "metrics.jsonl").is_file() or row["steps"] != _steps(run.run_dir):
        _train(train_command(run, 1, sys.executable), run.log_path, threads)
    val_loss, platform = _final(run.run_dir)
    committed_at = committed["environment"].get("commit")
    return _cell(study, row, committed_at, val_loss, platform, _commit(), _code(), "final")


def control(study: str, at: str, out: Path) -> dict:
    """The cell of ``study`` trained with the code of commit ``at`` (checked out under ``out``) on this machine."""
    config, label, seed = CELLS[study]
    commit = _commit(at)
    if not commit:
        raise SystemExit(f"--at: {at!r} is not a commit of this repository")
    code_dir = out / f"code-{commit}"
    if not (code_dir / "src").is_dir():
        code_dir.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src", "configs"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(code_dir)], input=archive, check=True)
    env = {**os.environ, "PYTHONPATH": str(code_dir / "src")}
    found = subprocess.run([sys.executable, "-c", "import s2hc; print(s2hc.__file__)"], env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    if not Path(found).is_relative_to(code_dir):  # an import hook of an installed s2hc would train the wrong code
        raise SystemExit(f"--at {at}: Python imports s2hc from {found}, not from the checked-out {code_dir / 'src'}")
    study_dir = out / f"{study}-{commit}"
    printed = subprocess.run([sys.executable, "-m", "s2hc", "study", config, "--out", str(study_dir),
                              "--print-commands"], cwd=code_dir, env=env, check=True, capture_output=True,
                             text=True).stdout
    committed = json.loads((ROOT / "docs" / study / "results.json").read_text())
    row = next((r for r in committed["rows"] if r["label"] == label and r["seed"] == seed), None)
    if row is None:
        raise SystemExit(f"docs/{study}/results.json has no row of {label!r} seed {seed} (the cell CELLS names)")
    run_dir = study_dir / "runs" / row["name"]
    commands = [shlex.split(line) for line in printed.splitlines() if line.strip()]
    command = next((c for c in commands if "--out" in c and Path(c[c.index("--out") + 1]) == run_dir), None)
    finished = (run_dir / "metrics.jsonl").is_file() and _steps(run_dir) == row["steps"]
    if command is None and not finished:
        raise SystemExit(f"the code of {commit} printed no command for {row['name']!r} in {study_dir}")
    committed_platform = (row.get("platform") or [{}])[0] or {}
    if command is not None:
        program = command.index("train")  # `s2hc train ...` run by this Python with the old code on its path
        with (study_dir / f"{row['name']}.log").open("a") as handle:
            threads = str(committed_platform.get("threads") or 1)
            subprocess.run([sys.executable, "-m", "s2hc", *command[program:], "--no-progress"], check=True,
                           stdout=handle, stderr=subprocess.STDOUT, cwd=code_dir,
                           env={**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    val_loss, platform = _final(run_dir)
    return _cell(study, row, committed["environment"].get("commit"), val_loss, platform, commit,
                 _git("rev-parse", "--short", f"{commit}:src"), "control")


def _cell(study: str, row: dict, committed_at: str | None, val_loss: float, platform: dict | None, commit: str,
          code: str, kind: str) -> dict:
    """One cell of cells.json: the committed row beside its re-run, where and with which code each trained."""
    committed_platform = (row.get("platform") or [{}])[0] or {}
    return {"study": study, "label": row["label"], "seed": row["seed"], "name": row["name"],
            "committed": row["val_loss"], "committed_at": committed_at, "rerun": round(val_loss, 6),
            "difference": round(val_loss - row["val_loss"], 6), "commit": commit, "code": code, "round": kind,
            "platform": platform, "committed_platform": committed_platform or None}


def _steps(run_dir: Path) -> int | None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if "val_loss" in r]
    return steps[-1] if steps else None


def main(argv: list[str] | None = None) -> None:
    from s2hc.io import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "reruns-final")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "reruns" / "cells.json")
    parser.add_argument("--only", nargs="*", choices=list(CELLS), default=list(CELLS))
    parser.add_argument("--control", choices=list(CELLS), help="train STUDY's cell with the code of --at")
    parser.add_argument("--at", help="the commit whose code trains the --control cell")
    args = parser.parse_args(argv)
    if (args.control is None) != (args.at is None):
        parser.error("--control and --at go together")
    done = json.loads(args.json.read_text()) if args.json.is_file() else {"cells": []}
    if args.control:
        cell = control(args.control, args.at, args.out / "controls")
        done["cells"] = [c for c in done["cells"] if not (c["study"] == args.control and c.get("round") == "control"
                                                          and c["commit"] == cell["commit"])] + [cell]
        atomic_write_text(args.json, json.dumps(done, indent=1) + "\n")
        print(f"{args.control} at {cell['commit']}: {cell['name']} {cell['rerun']} against {cell['committed']} "
              f"({cell['difference']:+.6f})", flush=True)
        return
    code = _code()
    for study in args.only:
        if not (ROOT / "docs" / study / "results.json").is_file():
            print(f"{study}: skipped, docs/{study}/results.json is not committed yet (its study has not finished)",
                  flush=True)
            continue
        if any(c["study"] == study and c.get("code") == code for c in done["cells"]):
            continue
        cell = rerun(study, args.out / code)
        done["cells"] = [c for c in done["cells"] if not (c["study"] == study and c.get("round") == "final")]
        done["cells"].append(cell)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(done, indent=1) + "\n")
        print(f"{study}: {cell['name']} {cell['rerun']} against {cell['committed']} ({cell['difference']:+.6f})",
              flush=True)


if __name__ == "__main__":
    main()
