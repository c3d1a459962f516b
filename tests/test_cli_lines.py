"""What the command line prints for a mistake: one line naming the subcommand, no usage block (that is for
``--help``, and for the top level: no subcommand or an unknown one, where it lists the subcommands)."""

from __future__ import annotations

import pytest

from s2hc.cli import COMMANDS, build_parser, main


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


@pytest.mark.parametrize("argv, line", [
    (["train", "--max-steps", "0"], "s2hc train: error: max_steps must be an integer >= 1, got 0"),
    (["train", "--logger", "tb"], "s2hc train: error: logger must be a comma-separated list of csv, tensorboard, "
                                  "wandb, mlflow (or empty), got 'tb' ('tb' unknown)"),
    (["train", "--bogus", "1"], "s2hc train: error: unrecognized arguments: --bogus 1 (`s2hc train --help` lists "
                                "them)"),
    (["train", "--max-steps", "x"], "s2hc train: error: argument --max-steps: invalid int value: 'x'"),
    (["train", "--optimizer", "sgd"], "s2hc train: error: optimizer must be one of ['adamw', 'muon'], got 'sgd'"),
    (["study"], "s2hc study: error: the following arguments are required: --out (`s2hc study --help` lists them)"),
    (["configs", "nope"], None),
])
def test_a_mistake_is_one_line_without_the_usage(argv, line, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"s2hc {argv[0]}: error: ")
    if line is not None:
        assert err.strip() == line


@pytest.mark.parametrize("argv", [["trian"], []])
def test_the_top_level_keeps_its_usage_to_list_the_subcommands(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: s2hc") and "COMMAND" in err


def test_every_help_text_is_formatted(capsys):
    assert len(COMMANDS) >= 9
    for name in _subcommands():
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: s2hc"), name
        assert "%%" not in text and "%(" not in text, name  # argparse's escapes left in, or not expanded
