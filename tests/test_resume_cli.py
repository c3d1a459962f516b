"""``s2hc train --out RUN --resume`` reads the run's own settings: alone it continues exactly; what is given with it
is checked against the run's settings, not the defaults (flags, --set and --config alike)."""

from __future__ import annotations

import pytest
import yaml
from helpers import at_logged_step, ctrl_c, small_config

from s2hc.cli import main
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import resume_config, train


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture
def setup(corpus_file, tmp_path):
    """A config file of a small mhc run (not s2hc's defaults in any way that matters), and its uninterrupted run."""
    config = small_config(corpus_file, tmp_path, family="mhc", n_streams=3, max_steps=6, lr=1e-3, log_every=1,
                          checkpoint_every=2, eval_every=3, family_options={"iterations": 7})
    path = tmp_path / "run.yaml"
    values = config.to_dict()
    values.pop("out")
    path.write_text(yaml.safe_dump(values))
    reference = config.replace(out=str(tmp_path / "reference"))
    train(reference)
    return path, tmp_path / "run", _losses(reference.out)


def test_resume_alone_continues_the_run_exactly(setup, monkeypatch, capsys):
    path, out, reference = setup
    with monkeypatch.context() as patch:
        at_logged_step(patch, 3, ctrl_c)
        assert main(["train", "--config", str(path), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"stopped by signal 2 after step 3; resume with `s2hc train --out {out} --resume`" in err
    assert load_checkpoint(out, with_model=False).step == 3
    assert main(["train", "--out", str(out), "--resume"]) == 0  # no other flag: the run's own settings
    assert _losses(out) == reference  # bit-equal: the same run
    saved = load_checkpoint(out, with_model=False).config
    assert (saved["family"], saved["n_streams"], saved["family_options"], saved["lr"]) == ("mhc", 3, {"iterations": 7},
                                                                                          1e-3)


def test_flags_with_resume_are_changes_to_the_run_and_must_be_resumable(setup, capsys):
    path, out, reference = setup
    assert main(["train", "--config", str(path), "--out", str(out), "--max-steps", "4"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--lr", "0.002"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"s2hc train: error: the run in {str(out)!r} was trained with a different configuration (lr: 0.001 "
                   "-> 0.002); resume with the same settings, or choose another --out")
    assert main(["train", "--out", str(out), "--resume", "--family-option", "iterations=8"]) == 2
    assert "family_options: {'iterations': 7} -> {'iterations': 8}" in capsys.readouterr().err
    # the same value as the run's is no change; max_steps and eval_every may change
    assert main(["train", "--out", str(out), "--resume", "--family", "mhc", "--max-steps", "6", "--eval-every", "2",
                 "--set", "lr=0.001"]) == 0
    assert len(_losses(out)) == 6
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [3, 4, 6]  # every 3, then every 2


def test_a_config_file_with_resume_is_checked_against_the_run(setup, tmp_path, capsys):
    path, out, _ = setup
    assert main(["train", "--config", str(path), "--out", str(out), "--max-steps", "2"]) == 0
    changed = yaml.safe_load(path.read_text())
    changed.update(max_steps=4, seed=7)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(changed))
    capsys.readouterr()
    assert main(["train", "--config", str(other), "--out", str(out), "--resume"]) == 2
    assert "(seed: 1337 -> 7)" in capsys.readouterr().err
    changed["seed"] = 1337
    other.write_text(yaml.safe_dump(changed))
    assert main(["train", "--config", str(other), "--out", str(out), "--resume"]) == 0
    assert load_checkpoint(out, with_model=False).step == 4


def test_resume_config_is_the_python_form(setup):
    path, out, reference = setup
    assert main(["train", "--config", str(path), "--out", str(out), "--max-steps", "6"]) == 0
    config = resume_config(out, max_steps=8)
    assert (config.family, config.n_streams, config.lr, config.max_steps, config.out) == ("mhc", 3, 1e-3, 8, str(out))
    assert train(config, resume=True).step == 8


def test_resume_of_a_directory_without_a_run_is_refused_in_one_line(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("s2hc train: error: ") and "\n" not in err and "nothing" in err


def test_a_run_configured_before_a_field_existed_reads_as_what_it_computed(tmp_path):
    from s2hc.config import BEFORE_FIELD, TrainConfig, completed_settings
    from s2hc.train.init_from import run_settings

    old = TrainConfig(data="hf:some/dataset").to_dict()
    del old["streaming"]  # written before streaming existed: that s2hc tokenised every source whole
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_settings(tmp_path)["streaming"] == "never" == BEFORE_FIELD["streaming"]
    assert completed_settings({"max_steps": 7})["max_steps"] == 7
    assert completed_settings({"max_steps": 7})["lr"] == TrainConfig().lr  # other new fields: their defaults
