"""The core imports and the CLI start without any extra: the next import of an optional package at a module's top
level is caught here in seconds, not by a pip user (as when `make demo` failed on a fresh clone).

In a child process every package of :data:`s2hc.extras.EXTRA_OF` is made unimportable (``sys.modules[name] =
None``, which ``import`` and ``importlib.util.find_spec`` both treat as absent) before s2hc is imported; then
``scripts/check_install.py`` (what ``.ci/run`` runs in a fresh virtual environment without extras) runs its checks
in that process: every module imports (an extra's own modules raise MissingExtra naming it), every ``--help``, a
2-step run, and each command that needs an extra gives one line naming it, exit 2, and writes nothing.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = runpy.run_path(str(ROOT / "src" / "s2hc" / "extras.py"))

CHILD = r"""
import contextlib, io, json, os, sys
from pathlib import Path

for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # absent, for `import` and for importlib.util.find_spec
sys.path.insert(0, sys.argv[2])
import check_install
from s2hc.cli import main

workdir = Path(sys.argv[3])
os.chdir(workdir)

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()

problems, checked = check_install.check_all(run, workdir)
leaked = sorted(name for name in json.loads(sys.argv[1]) if sys.modules.get(name) is not None)
print(json.dumps({"problems": problems, "checked": checked, "leaked": leaked}))
"""


def test_every_optional_dependency_of_pyproject_has_its_extra_in_the_map():
    """A new optional package must be in EXTRA_OF: that is what the child below makes unimportable."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in optional.items():
        if extra in ("test", "dev"):  # the tools that run the tests, and the extras they gather
            continue
        for requirement in requirements:
            distribution = requirement.split(">")[0].split("=")[0].split("[")[0].strip()
            module = distribution.replace("-", "_")
            assert module in EXTRAS["EXTRA_OF"], f"{requirement} of [{extra}] is not in EXTRA_OF"
            named = EXTRAS["EXTRA_OF"][module]  # the extra its error names must install it
            assert any(r.startswith(distribution) for r in optional[named]), f"[{named}] lacks {distribution}"


def test_the_core_and_the_cli_work_with_every_optional_package_unimportable(tmp_path):
    blocked = sorted(EXTRAS["EXTRA_OF"])
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(blocked), str(ROOT / "scripts"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == []
    assert result["leaked"] == []  # nothing got past the block
    cases = runpy.run_path(str(ROOT / "scripts" / "check_install.py"))["MISSING_EXTRA_CASES"]
    assert result["checked"] == len(cases)  # every case ran: each of its extras was missing
    # plot degrades; torchtitan has no s2hc command (torchrun -m torchtitan.train --module s2hc.torchtitan): its
    # package raising MissingExtra on import is what check_imports checks
    assert {extra for extra, _, _ in cases} == set(EXTRAS["EXTRA_OF"].values()) - {"plot", "torchtitan"}


def test_missing_extra_names_the_extra_the_package_and_the_pip_command():
    error = EXTRAS["MissingExtra"]("safetensors", "--static")
    assert str(error) == "--static needs the hf extra (safetensors is not installed): pip install 's2hc[hf]'"
    assert isinstance(error, ImportError) and error.extra == "hf" and error.name == "safetensors"
    converted = EXTRAS["as_missing_extra"](ModuleNotFoundError("No module named 'scipy'", name="scipy.stats"))
    assert converted.extra == "study"
    assert EXTRAS["as_missing_extra"](ModuleNotFoundError("No module named 'nope'", name="nope")) is None
