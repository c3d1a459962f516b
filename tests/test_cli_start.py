"""The command line starts without what it does not use: ``s2hc --version``, ``s2hc --help`` and ``import s2hc``
import no torch, and a subcommand builds only its own parser and imports only what that needs (``s2hc train
--help`` neither the training loop, nor torch.distributed.checkpoint, nor the study). Checked by what a fresh
process has imported (``sys.modules``), never by a time (``benchmarks/cli_start.py`` measures those)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from s2hc.cli import COMMANDS, build_parser, main

#: Run in a fresh interpreter: ``main(argv)``, then the modules imported, as JSON on the last line.
CHILD = """
import contextlib, io, json, sys
argv, where = json.loads(sys.argv[1]), sys.argv[2]
out = io.StringIO()
if where == "import":
    import s2hc
    status = 0
else:
    from s2hc.cli import main
    with contextlib.redirect_stdout(out):
        status = main(argv)
print(json.dumps({"status": status, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def imported_by(argv: list[str], where: str = "cli") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), where], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []], ids=["version", "help", "nothing"])
def test_the_top_level_imports_no_torch(argv):
    result = imported_by(argv)
    assert result["status"] == (2 if not argv else 0)
    assert "torch" not in result["modules"]
    assert not [name for name in result["modules"] if name.startswith(("s2hc.connection", "s2hc.train.loop"))]


def test_import_s2hc_imports_no_torch_until_a_name_is_used():
    result = imported_by([], where="import")
    assert "torch" not in result["modules"] and "s2hc.connection" not in result["modules"]
    import s2hc
    from s2hc.connection import HyperConnection

    assert s2hc.HyperConnection is HyperConnection  # the lazy names are the library's own
    assert set(s2hc.__all__) <= set(dir(s2hc))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        s2hc.nope  # noqa: B018


def test_python_m_s2hc_version_imports_no_torch():
    code = ("import runpy, sys; sys.argv = ['s2hc', '--version']\ntry:\n    runpy.run_module('s2hc', "
            "run_name='__main__')\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("s2hc ")


def test_train_help_imports_neither_the_loop_nor_the_study():
    result = imported_by(["train", "--help"])
    assert result["status"] == 0 and "--max-steps" in result["out"] and "--config" in result["out"]
    heavy = ("torch.distributed.checkpoint", "s2hc.train.loop", "s2hc.study", "s2hc.diagnostics", "s2hc.bench",
             "s2hc.evaluate")
    assert not [name for name in result["modules"] if name.startswith(heavy)]


def test_every_module_says_which_subcommands_it_adds():
    """SUMMARY is what the top level lists without building a parser: the same names, in order, and help."""
    action = next(a for a in build_parser()._actions if a.dest == "command")
    full = {choice.dest: choice.help for choice in action._choices_actions}
    declared = {name: text for command in COMMANDS for name, text in command.SUMMARY.items()}
    assert list(declared) == list(action.choices) and declared == full


def test_the_top_level_help_is_the_same_with_stubs(capsys):
    assert build_parser(only="").format_help() == build_parser().format_help()
    assert main(["--help"]) == 0
    assert capsys.readouterr().out == build_parser().format_help()
