"""Small inputs that expand hugely: a kilobyte of YAML aliases ("billion laughs") and JSON nested a hundred
thousand deep. Every YAML reader of s2hc (``--config``, ``--set``, ``--family-option``, a study's config, a run's
``config.yaml`` on ``--resume``) refuses the first at once, in one line that does not print the expansion; every
JSON reader a user can feed refuses the second in one line instead of a RecursionError."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import yaml
from test_faults_cli import assert_error, run_cli

from s2hc.config import MAX_YAML_VALUES, YAMLRefused, load_yaml, parse_assignment
from s2hc.io import read_json_object

SRC = Path(__file__).resolve().parents[1] / "src" / "s2hc"
QUICK_S = 20  # generous for a loaded 2-core machine: expanding the bomb would take hours and all the memory


def bomb(levels: int = 9, flow: bool = False) -> str:
    """``levels`` lists of 9 aliases of the one before: 9^levels values from a few hundred bytes."""
    items = ['"lol"'] * 9
    lines = [f"l0: &l0 [{', '.join(items)}]"]
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]")
    return "{" + ", ".join(lines) + "}" if flow else "\n".join(lines) + "\n"


def assert_short(line: str) -> None:
    assert len(line) < 400 and line.count("lol") <= 1, line  # the expansion is never printed


# ------------------------------------------------------------------------------------------ the reader itself


def test_an_alias_bomb_is_refused_at_once():
    assert len(bomb()) < 1024
    started = time.perf_counter()
    with pytest.raises(YAMLRefused, match=rf"expand to more than {MAX_YAML_VALUES:,} values"):
        load_yaml(bomb())
    with pytest.raises(YAMLRefused, match="refers to a value that contains it"):
        load_yaml("a: &a [1, *a]")
    with pytest.raises(YAMLRefused, match="nests values too deep"):
        load_yaml("[" * 5000 + "]" * 5000)
    assert time.perf_counter() - started < QUICK_S


def test_ordinary_anchors_and_merge_keys_still_read():
    text = "base: &base {lr: 0.001, seed: 1}\nrun:\n  <<: *base\n  seed: 2\nlist: [*base, *base]\n"
    assert load_yaml(text) == yaml.safe_load(text)
    values = "[" + ", ".join(["1"] * (MAX_YAML_VALUES - 1)) + "]"  # just within the limit, no alias at all
    assert len(load_yaml(values)) == MAX_YAML_VALUES - 1


def test_parse_assignment_refuses_a_bomb_without_printing_it():
    with pytest.raises(ValueError) as error:
        parse_assignment("model_overrides=" + bomb(flow=True))
    assert str(error.value).startswith("--set: the value of 'model_overrides' is refused: its aliases")
    assert_short(str(error.value))


def test_no_yaml_is_read_but_through_load_yaml():
    """A new reader that called yaml.safe_load directly would hang on a bomb again."""
    readers = re.compile(r"yaml\.(safe_load|load|full_load|unsafe_load|safe_load_all|load_all)\(")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if readers.search(line)]
    reader = (SRC / "yaml_safety.py").read_text().splitlines()
    assert found == [f"yaml_safety.py:{n}" for n, line in enumerate(reader, 1)
                     if "yaml.load(text, Loader=_SafeLoader)" in line], found


# ------------------------------------------------------------------------------------------ every command reader


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    return path


@pytest.mark.parametrize("reader", ["--config", "--set", "--family-option", "study"])
def test_every_command_line_reader_refuses_a_bomb_in_one_line(reader, tmp_path, capsys):
    command = "study" if reader == "study" else "train"
    argv = {
        "--config": ["train", "--config", str(_config_file(tmp_path))],
        "--set": ["train", "--set", "model_overrides=" + bomb(flow=True)],
        "--family-option": ["train", "--family", "s2hc", "--family-option", "rotation=" + bomb(flow=True)],
        "study": ["study", str(_config_file(tmp_path))],
    }[reader]
    started = time.perf_counter()
    code, _, line = run_cli([*argv, "--out", str(tmp_path / "out")], capsys)
    assert time.perf_counter() - started < QUICK_S
    assert code == 2
    assert_error(line, command, "is refused: its aliases (*name) expand to more than")
    assert_short(line)
    assert not (tmp_path / "out").exists()


def test_a_run_config_yaml_turned_into_a_bomb_is_refused_on_resume(tiny_checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, run)
    (run / "config.yaml").write_text(bomb())
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    started = time.perf_counter()
    code, _, line = run_cli(["train", "--out", str(run), "--resume"], capsys)
    assert time.perf_counter() - started < QUICK_S
    assert code == 2
    assert_error(line, "train", str(run / "config.yaml"), "expand to more than")
    assert_short(line)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name in before} == before


# ------------------------------------------------------------------------------------------ JSON nested too deep


DEEP_JSON = '{"a": ' * 100_000 + "1" + "}" * 100_000


def test_json_nested_too_deep_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(DEEP_JSON)
    with pytest.raises(ValueError) as error:
        read_json_object(path, "a Hugging Face config.json is a JSON object")
    assert str(error.value) == (f"{str(path)!r} is not JSON (arrays or objects nested too deep to read at line 1 "
                                "column 1); a Hugging Face config.json is a JSON object")


def test_upcycle_of_a_model_whose_config_json_nests_too_deep_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(DEEP_JSON)
    code, _, line = run_cli(["upcycle", str(model), "--family", "s2hc", "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert_error(line, "upcycle", str(model / "config.json"), "nested too deep to read")
    assert "RecursionError" not in line


def _metrics(tmp_path: Path):
    from s2hc.rundir import read_metrics

    (tmp_path / "metrics.jsonl").write_text(DEEP_JSON + '\n{"step": 1, "loss": 2.0}\n')
    return tmp_path / "metrics.jsonl", lambda: read_metrics(tmp_path)


def _safetensors_index(tmp_path: Path):
    from s2hc.hf.weights import _read_index

    path = tmp_path / "model.safetensors.index.json"
    path.write_text(DEEP_JSON)
    return path, lambda: _read_index(path)


def _static_config(tmp_path: Path):
    from s2hc.hf.static import _config

    (tmp_path / "config.json").write_text(DEEP_JSON)
    return tmp_path / "config.json", lambda: _config(tmp_path)


def _study_results(tmp_path: Path):
    from s2hc.study.report import write_report

    (tmp_path / "results.json").write_text(DEEP_JSON)
    return tmp_path / "results.json", lambda: write_report(tmp_path, strict=False)


@pytest.mark.parametrize("reader", [_metrics, _safetensors_index, _static_config, _study_results])
def test_every_json_reader_says_nested_too_deep_in_one_line(reader, tmp_path):
    path, read = reader(tmp_path)
    with pytest.raises(ValueError) as error:
        read()
    message = str(error.value)
    assert str(path) in message and "nested too deep to read" in message and "\n" not in message, message
