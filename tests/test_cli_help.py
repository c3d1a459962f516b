"""``s2hc train --help``: the flags in one section per group of settings, and the help says the allowed values."""

from __future__ import annotations

import pytest

from s2hc.cli import main
from s2hc.cli.train import GROUP_TITLES
from s2hc.config import GROUPS, option_fields
from s2hc.models import PRESETS


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_training_flags_come_in_one_section_per_group(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    starts = [text.index(f"\n{GROUP_TITLES[group]}:\n") for group in GROUPS]
    assert starts == sorted(starts)  # model, family, data, schedule, run, in that order
    sections = dict(zip(GROUPS, (text[a:b] for a, b in zip(starts, [*starts[1:], len(text)]))))
    for f in option_fields():  # every flag under its own group's title
        flag = "--" + ("no-" if f.type == "bool" and f.default else "") + f.name.replace("_", "-")
        assert f"  {flag}" in sections[f.metadata["group"]], (flag, f.metadata["group"])
    assert "  --family-option KEY=VALUE" in sections["family"]


def test_the_preset_help_lists_the_presets(capsys):
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "model preset, one of " + ", ".join(PRESETS) in text
