"""Record the seeds each committed version of a study's results.json held, from git's history of that file:
``docs/STUDY/seed_history.json``, which the findings pages read (scripts/findings.py, ``Study.grown_after_looking``).

    python scripts/seed_history.py depth

A study whose seeds grew after a committed version had been read has more than one stage: its planned tests were
not fixed before the data were seen, so the pages label their p exploratory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stages(study: str) -> list[dict]:
    """Oldest first: per commit that changed ``docs/STUDY/results.json``, its date and the seeds each configuration
    had finished there, kept where the seeds changed."""
    path = f"docs/{study}/results.json"
    log = subprocess.run(["git", "log", "--reverse", "--format=%h %ad", "--date=short", "--", path], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.split("\n")
    out: list[dict] = []
    for line in filter(None, log):
        commit, date = line.split()
        results = json.loads(subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                                            capture_output=True, text=True).stdout)
        seeds: dict[str, list[int]] = {}
        for row in results["rows"]:
            if row["status"] == "finished":
                seeds.setdefault(row["label"], []).append(row["seed"])
        seeds = {label: sorted(values) for label, values in seeds.items()}
        if not out or out[-1]["seeds"] != seeds:
            out.append({"commit": commit, "date": date, "seeds": seeds})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="the study's directory under docs/")
    args = parser.parse_args(argv)
    found = stages(args.study)
    record = {"source": f"git log of docs/{args.study}/results.json (scripts/seed_history.py)", "stages": found}
    (ROOT / "docs" / args.study / "seed_history.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
