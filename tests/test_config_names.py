"""A shipped config by its name wherever a config file is taken (``s2hc train --config demo-tiny``, ``s2hc compare
--config demo-tiny``, ``s2hc study study-smoke``), as ``s2hc configs`` lists them; a file of that name in the working
directory comes first; a name that is neither is one line listing the shipped ones."""

from __future__ import annotations

import pytest
import yaml

from s2hc.cli import build_parser, main
from s2hc.cli.train import training_config
from s2hc.config import TrainConfig, config_path, shipped_configs


def parsed_config(argv: list[str]) -> TrainConfig:
    args = build_parser().parse_args(argv)
    return training_config(args)


def shipped_values(name: str) -> dict:
    return yaml.safe_load(shipped_configs()[name])


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("name", ["demo-tiny", "demo-tiny.yaml"])
def test_train_and_compare_take_a_shipped_configs_name(command, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: as after a pip install
    config = parsed_config([command, "--config", name])
    expected = shipped_values("demo-tiny")
    assert (config.max_steps, config.seq_len, config.lr, config.seed) == (
        expected["max_steps"], expected["seq_len"], expected["lr"], expected["seed"])


@pytest.mark.parametrize("local", ["demo-tiny", "demo-tiny.yaml"])
def test_a_file_of_that_name_in_the_working_directory_comes_first(local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / local).write_text("preset: tiny\nmax_steps: 7\n")  # an edited copy: s2hc configs NAME > NAME.yaml
    assert parsed_config(["train", "--config", "demo-tiny"]).max_steps == 7
    assert config_path("demo-tiny").resolve() == (tmp_path / local).resolve()


def test_study_takes_a_shipped_configs_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["study", "study-smoke", "--out", "smoke", "--print-commands"]) == 0
    out = capsys.readouterr().out
    families = shipped_values("study-smoke")["families"]
    assert all(f"runs/{family}" in out for family in families), out
    assert "# then: s2hc study study-smoke --out smoke" in out


@pytest.mark.parametrize("argv", [["train", "--config", "nope"], ["compare", "--config", "nope.yaml"],
                                  ["study", "nope", "--out", "out"]])
def test_a_name_that_is_neither_a_file_nor_shipped_is_one_line_listing_them(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"s2hc {argv[0]}: error: config file 'nope")
    assert "does not exist" in err and "demo-tiny" in err and "study-smoke" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_path_is_still_a_path(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("max_steps: 9\n")
    assert config_path(str(config)) == config
    assert parsed_config(["train", "--config", str(config)]).max_steps == 9


@pytest.mark.parametrize("argv", [["train", "--config", ""], ["compare", "--config", " "], ["study", "", "--out", "o"]])
def test_an_empty_config_is_refused_in_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, *(["--max-steps", "1", "--out", "run"] if argv[0] != "study" else [])]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"s2hc {argv[0]}: error: the config is empty" in err
    assert list(tmp_path.iterdir()) == []  # nothing trained


@pytest.mark.parametrize(("argv", "expected"), [
    (["train", "--config", "study-smoke"], "study-smoke is a study config: s2hc study study-smoke --out DIR"),
    (["compare", "--config", "study-smoke"], "study-smoke is a study config: s2hc study study-smoke --out DIR"),
    (["study", "demo-tiny", "--out", "o"], "demo-tiny is a training config: s2hc train --config demo-tiny"),
    (["train", "--config", "demo-tinyy"], "is not the name of a shipped config; did you mean 'demo-tiny'?"),
    (["train", "--set", "lrr=1"], "unknown config key(s) ['lrr'] (did you mean 'lr'?)"),
    (["study", "study-smoke", "--set", "max_step=3", "--out", "o"],
     "unknown config key(s) ['max_step'] (did you mean 'max_steps'?)"),
    (["study", "study-smoke", "--set", "family=mhc", "--out", "o"], "error: study-smoke: train sets ['family']"),
])
def test_a_config_of_the_other_kind_or_a_misspelt_name_says_what_was_meant(argv, expected, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert "site-packages" not in err and "/configs/" not in err  # a shipped config by its name, not its path
