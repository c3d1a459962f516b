"""Check an installed s2hc the way a pip user meets it: every module imports, the package holds its data (corpus,
tokenizer, evaluation tasks, configs), every command's ``--help`` works, a short training run works from a
directory outside the source tree, and each command that needs a missing extra says so in one line (exit 2) and
writes nothing.

    python scripts/check_install.py            # the s2hc of this Python, through its `s2hc` command

``.ci/run`` runs it in a fresh virtual environment holding ``pip install -c constraints.txt .`` (no extra);
``tests/test_optional_imports.py`` runs :func:`check_all` in one process with the optional packages made
unimportable (``sys.modules[name] = None``), so the same cases guard every ``make test``.
A case whose extra is installed is skipped: it cannot be missing there. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: Modules that are the extra's own code: they raise MissingExtra on import without it (everything else imports).
EXTRA_MODULES = {"s2hc.hf": "hf", "s2hc.evaluate.harness": "eval", "s2hc.connection.kernels": "triton",
                 "s2hc.torchtitan": "torchtitan"}

# Small enough to take seconds on a CPU: the tiny preset cut down.
TINY = ["--preset", "tiny", "--set", "model_overrides={dim: 32, n_layers: 1, n_heads: 2, ffn_dim: 64}",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-progress"]

#: (the extra a command needs, the command, the directory it would write: it must not exist afterwards).
MISSING_EXTRA_CASES = [
    ("hf", ["export", "run", "--out", "exported"], "exported"),
    ("hf", ["upcycle", "hf-model", "--family", "s2hc", "--out", "up-hf"], "up-hf"),
    ("hf", ["diagnose", "--static", "run", "--out", "static"], "static"),
    ("eval", ["eval", "run", "--tasks", "s2hc_nextline", "--limit", "2", "--out", "eval-out"], "eval-out"),
    ("data", ["train", *TINY, "--max-steps", "2", "--tokenizer", "gpt2", "--out", "t-gpt2"], "t-gpt2"),
    ("data", ["train", *TINY, "--max-steps", "2", "--data", "hf:roneneldan/TinyStories", "--out", "t-hf"], "t-hf"),
    ("data", ["train", *TINY, "--max-steps", "2", "--data", "docs.parquet", "--out", "t-parquet"], "t-parquet"),
    ("data", ["eval", "run", "--data", "docs.parquet", "--no-progress"], None),
    ("data", ["train", *TINY, "--max-steps", "2", "--data", "docs.json", "--out", "t-json"], "t-json"),
    ("data", ["upcycle", "run", "--family", "s2hc", "--tokenizer", "gpt2", "--out", "up-gpt2"], "up-gpt2"),
    ("triton", ["train", *TINY, "--max-steps", "2", "--family", "s2hc", "--set", "connection={kernels: triton}",
                "--out", "t-triton"], "t-triton"),
    ("study", ["study", "smoke.yaml", "--out", "study"], "study"),
    *((logger, ["train", *TINY, "--max-steps", "2", "--logger", f"csv,{logger}", "--out", f"t-{logger}"], f"t-{logger}")
      for logger in ("tensorboard", "wandb", "mlflow")),
    ("bench", ["bench", "--families", "hyper-connections:mhc", "--preset", "tiny"], None),
]

Runner = Callable[[list[str]], tuple[int, str, str]]  # argv -> (exit status, stdout, stderr)


def extra_installed(extra: str) -> bool:
    """Whether every package of ``extra`` imports here (then its missing-extra case cannot happen)."""
    from s2hc.extras import EXTRA_OF, is_available

    return all(is_available(module) for module, owner in EXTRA_OF.items() if owner == extra)


def check_imports() -> list[str]:
    """Every s2hc module imports, except an extra's own modules without their extra (MissingExtra, its name)."""
    import s2hc
    from s2hc.extras import MissingExtra

    problems = []
    for info in pkgutil.walk_packages(s2hc.__path__, "s2hc."):
        owner = next((extra for prefix, extra in EXTRA_MODULES.items()
                      if info.name == prefix or info.name.startswith(prefix + ".")), None)
        try:
            importlib.import_module(info.name)
        except MissingExtra as error:
            if owner is None or error.extra != owner or extra_installed(owner):
                problems.append(f"import {info.name}: {error}")
        except Exception as error:  # noqa: BLE001 - every failure is a finding
            problems.append(f"import {info.name}: {type(error).__name__}: {error}")
    return problems


def check_package_data() -> list[str]:
    """Every pattern of pyproject.toml's package-data matches files in the installed package (the corpus, the
    tokenizer, the evaluation tasks, the configs): what a pip user's commands read."""
    from importlib import resources

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    problems = []
    for package, patterns in pyproject["tool"]["setuptools"]["package-data"].items():
        root = Path(str(resources.files(package)))
        problems += [f"package {package}: no file matches {pattern!r}" for pattern in patterns
                     if not any(root.glob(pattern))]
    return problems


def prepare(workdir: Path, run: Runner) -> list[str]:
    """The inputs of the cases in ``workdir``: a 2-step run (the embedded corpus and tokenizer from the package),
    a Parquet-named file, a JSON array, a Hugging Face directory's config, the shipped smoke study."""
    rc, out, err = run(["train", *TINY, "--max-steps", "2", "--out", "run"])
    problems = [] if rc == 0 and (workdir / "run" / "checkpoint.pt").is_file() else [
        f"s2hc train (2 steps) from {workdir}: exit {rc}: {err.strip()[-500:]}"]
    (workdir / "docs.parquet").write_bytes(b"PAR1")
    (workdir / "docs.json").write_text('[{"text": "a document"}]')
    (workdir / "hf-model").mkdir(exist_ok=True)
    (workdir / "hf-model" / "config.json").write_text('{"model_type": "qwen3"}')
    rc, text, err = run(["configs", "study-smoke"])
    if rc != 0 or "families:" not in text:
        problems.append(f"s2hc configs study-smoke: exit {rc}: {err.strip()}")
    (workdir / "smoke.yaml").write_text(text)
    return problems


def check_all(run: Runner, workdir: Path) -> tuple[list[str], int]:
    """(problems, cases checked): imports, every ``--help``, the 2-step run, each missing-extra case."""
    from s2hc.cli import build_parser

    problems = check_imports() + check_package_data()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for argv in [["--help"], *([name, "--help"] for name in commands)]:
        rc, out, err = run(argv)
        if rc != 0 or "usage:" not in out:
            problems.append(f"s2hc {' '.join(argv)}: exit {rc}: {err.strip()[-300:]}")
    problems += prepare(workdir, run)
    checked = 0
    for extra, argv, writes in MISSING_EXTRA_CASES:
        if extra_installed(extra):
            continue
        checked += 1
        rc, out, err = run(argv)
        lines = err.strip().splitlines()
        command = f"s2hc {' '.join(argv)}"
        if rc != 2 or len(lines) != 1 or f"pip install 's2hc[{extra}]'" not in lines[0]:
            problems.append(f"{command}: expected exit 2 and one line naming the {extra} extra, got exit {rc}: "
                            + " | ".join(lines[-5:]))
        if writes and (workdir / writes).exists():
            problems.append(f"{command}: refused, but left {writes}/ behind")
    return problems, checked


def command_runner(workdir: Path) -> Runner:
    """Run the ``s2hc`` command installed beside this Python, in ``workdir``."""
    executable = shutil.which("s2hc", path=str(Path(sys.executable).parent)) or "s2hc"

    def run(argv: list[str]) -> tuple[int, str, str]:
        done = subprocess.run([executable, *argv], cwd=workdir, capture_output=True, text=True, timeout=600)
        return done.returncode, done.stdout, done.stderr

    return run


def main() -> int:
    import s2hc

    source_tree = Path(__file__).resolve().parents[1]
    where = Path(s2hc.__file__).resolve()
    print(f"checking s2hc {s2hc.__version__} at {where.parent}")
    with tempfile.TemporaryDirectory(prefix="s2hc-install-check-") as tmp:
        workdir = Path(tmp)
        os.chdir(workdir)  # outside the source tree: packaged data must come from the package
        problems, checked = check_all(command_runner(workdir), workdir)
    if source_tree in where.parents:
        problems.append(f"s2hc is imported from the source tree ({where}), not from an installed package")
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"{checked} missing-extra commands checked; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
