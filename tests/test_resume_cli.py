"""``s2hc train --out RUN --resume`` reads the run's own settings: alone it continues exactly; what is given with it
is checked against the run's settings, not the defaults (flags, --set and --config alike)."""

from __future__ import annotations

import pytest
import yaml
from helpers import at_logged_step, ctrl_c, small_config

from s2hc.cli import main
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import Interrupted, resume_config, train


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


# ------------------------------------------------------------------- the schedule of a resume to more steps


def _lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}


def _rate(config, step: int, span: int) -> float:
    """The learning rate of the 1-based ``step`` on a cosine schedule of ``span`` steps."""
    from s2hc.train import learning_rate

    return learning_rate(step - 1, peak=config.lr, warmup_steps=config.warmup, max_steps=span,
                         min_ratio=config.min_lr_ratio)


@pytest.fixture
def short_run(corpus_file, tmp_path):
    """A 4-step run (one warmup step, then the cosine down to the floor 1e-4 at step 4), as a config file."""
    config = small_config(corpus_file, tmp_path, max_steps=4, lr=1e-3, log_every=1, checkpoint_every=2, eval_every=0)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in config.to_dict().items() if k != "out"}))
    return config, path


def test_extending_a_finished_run_holds_the_floor_lr_and_says_so(short_run, capsys):
    config, path = short_run
    out = config.out
    assert main(["train", "--config", str(path), "--out", out]) == 0
    capsys.readouterr()
    assert main(["train", "--out", out, "--resume", "--max-steps", "8"]) == 0
    err = capsys.readouterr().err
    assert ("s2hc: extending " + out + " from 4 to 8 steps: the cosine schedule ended at step 4; steps 5-8 continue at "
            "its floor lr 1.0e-04 (set --schedule-steps 8 to restart the schedule over the new length)") in err
    lrs, floor = _lrs(out), config.min_lr_ratio * config.lr
    assert [lrs[step] for step in range(1, 5)] == [_rate(config, step, 4) for step in range(1, 5)]  # as trained
    assert [lrs[step] for step in range(5, 9)] == [floor] * 4  # no jump: the floor the schedule reached, held
    assert _rate(config, 5, 8) > 3 * floor  # what recomputing the cosine over 8 steps would have jumped to
    assert load_checkpoint(out, with_model=False).config["schedule_steps"] == 4  # recorded: later resumes keep it
    # a later resume to more steps keeps it too, and says which steps it adds
    assert main(["train", "--out", out, "--resume", "--max-steps", "9"]) == 0
    assert "steps 9-9 continue at its floor lr 1.0e-04" in capsys.readouterr().err and _lrs(out)[9] == floor


def test_extending_a_running_schedule_finishes_it_then_holds_the_floor(short_run, monkeypatch, capsys):
    config, _ = short_run
    with monkeypatch.context() as patch:
        at_logged_step(patch, 2, ctrl_c)
        with pytest.raises(Interrupted, match="stopped by signal 2 after step 2"):
            train(config)
    train(config.replace(max_steps=6), resume=True)  # the Python form keeps the schedule as the CLI does
    assert "the cosine schedule ends at step 4; steps 5-6 continue at its floor lr 1.0e-04" in capsys.readouterr().err
    assert list(_lrs(config.out).values()) == [_rate(config, step, 4) for step in range(1, 7)]


def test_schedule_steps_asks_for_another_schedule_and_the_resume_names_the_change(short_run, capsys):
    config, path = short_run
    out = config.out
    assert main(["train", "--config", str(path), "--out", out, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", out, "--resume", "--max-steps", "8", "--schedule-steps", "8"]) == 0
    stretched = config.replace(max_steps=8)
    assert (f"s2hc: {out}: the cosine schedule spans 8 steps, no longer 2: step 3 runs at lr "
            f"{_rate(stretched, 3, 8):.1e} (the old schedule's {_rate(config, 3, 2):.1e})") in capsys.readouterr().err
    assert [_lrs(out)[step] for step in range(3, 9)] == [_rate(stretched, step, 8) for step in range(3, 9)]


def test_a_resume_keeps_the_runs_warmup_and_a_run_configured_before_the_default_changed_keeps_its_own(
        corpus_file, tmp_path):
    from s2hc.config import TrainConfig, completed_settings, schedule_of

    # a run configured when the default warmup was 100 steps recorded it: it resumes with 100, not a tenth
    old = {**TrainConfig().to_dict(), "warmup_steps": 100, "max_steps": 300}
    del old["schedule_steps"]  # written before schedule_steps existed: its schedule spans its max_steps
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert resume_config(tmp_path, max_steps=600).warmup_steps == 100
    assert schedule_of(completed_settings(old)) == (300, 100)
    # settings that leave the warmup unset (a config file, a study's run config) resume with the run's warmup
    config = small_config(corpus_file, tmp_path, max_steps=2, warmup_steps=2)
    train(config)
    train(config.replace(max_steps=3, warmup_steps=None), resume=True)
    assert load_checkpoint(config.out, with_model=False).config["warmup_steps"] == 2


def test_the_readme_and_training_md_quote_what_extending_the_readme_run_prints():
    """README's `--resume --max-steps 2000` of its 1000-step run: the line it prints, as both documents quote it."""
    from pathlib import Path

    from s2hc.config import TrainConfig
    from s2hc.train.loop import _kept_schedule, _schedule_notice

    before = TrainConfig(max_steps=1000, out="runs/s2hc").to_dict()
    config = _kept_schedule(before, TrainConfig(max_steps=2000, out="runs/s2hc"), 1000)
    assert (config.schedule_steps, config.warmup) == (1000, 100)
    line = _schedule_notice(before, config, 1000)
    assert line.startswith("extending runs/s2hc from 1000 to 2000 steps")
    root = Path(__file__).resolve().parents[1]
    for name in ("README.md", "docs/training.md"):
        assert f"`{line}`" in " ".join((root / name).read_text().split()), name


# ------------------------------------------------------ parameters that never get a gradient, and a resume


@pytest.mark.parametrize("family, n, parallel", [("s2hc", 2, "none"), ("isometric", 2, "none"),
                                                 ("orthogonal", 1, "none"), ("s2hc", 2, "fsdp")])
def test_a_family_whose_parameters_get_no_gradient_resumes_exactly(corpus_file, tmp_path, monkeypatch, capsys,
                                                                   family, n, parallel):
    """s2hc and isometric at 2 streams and orthogonal at 1 leave parameters out of every product: the optimizer
    keeps no state for them, and a resume must take the checkpoint as it is (no "Missing optimizer state")."""
    config = small_config(corpus_file, tmp_path, family=family, n_streams=n, parallel=parallel, max_steps=3,
                          log_every=1, checkpoint_every=3, eval_every=0)
    reference = config.replace(out=str(tmp_path / "reference"))
    train(reference)
    with monkeypatch.context() as patch:
        at_logged_step(patch, 2, ctrl_c)
        with pytest.raises(Interrupted, match="resume with"):
            train(config)
    saved = load_checkpoint(config.out)
    if parallel == "none":
        names = dict(saved.model).keys() - set(saved.optimizer["state"])
        assert names and all("." in name for name in names)  # some parameters have no optimizer state
    capsys.readouterr()
    assert main(["train", "--out", config.out, "--resume"]) == 0, capsys.readouterr().err
    assert _losses(config.out) == _losses(reference.out)  # bit-equal: the same run


# ------------------------------------------------------------- RUN/config.yaml edited by hand, and what may change


BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{b}' if b else 'x'] * 9)}]\n"
               for a, b in zip("abcdefgh", ["", *"abcdefg"]))  # 9**8 values from a few hundred bytes

EDITS = {  # what is done to the file -> what the line must name
    "a wrong type": (lambda text: text.replace("lr: 0.0006", "lr: fast"), "lr must be a finite number"),
    "a list for a number": (lambda text: text.replace("seq_len: 32", "seq_len: [32, 64]"), "seq_len must be"),
    "an unknown key": (lambda text: text + "learning_rate: 0.1\n", "unknown key 'learning_rate'"),
    "an unknown family option": (lambda text: text.replace("family_options: {}", "family_options: {speed: 2}"),
                                 "unknown family_options ['speed']"),
    "the family swapped": (lambda text: text.replace("family: s2hc", "family: mhc"),
                           "sets family: 'mhc', but the run's checkpoint was trained with family: 's2hc'"),
    "the model changed": (lambda text: text.replace("dim: 32", "dim: 48"), "sets model_overrides: {'dim': 48"),
    "an alias bomb": (lambda text: BOMB + text, "is damaged: not valid YAML"),
    "not a mapping": (lambda text: "- " + text.replace("\n", "\n  "), "is damaged: not a mapping"),
}


@pytest.fixture
def two_steps(corpus_file, tmp_path):
    """A 2-step s2hc run, a checkpoint after each step."""
    config = small_config(corpus_file, tmp_path, max_steps=2, log_every=1, checkpoint_every=1, eval_every=0)
    train(config)
    return config


def _listing(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_config_yaml_edited_by_hand_is_refused_in_one_line_naming_it_and_the_key_before_anything_is_written(
        two_steps, capsys, edit):
    from pathlib import Path

    change, named = EDITS[edit]
    out = Path(two_steps.out)
    path = out / "config.yaml"
    path.write_text(change(path.read_text()))
    before = _listing(out)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"s2hc train: error: {str(path)!r}"), err
    assert named in err and len(err) < 500, err
    assert _listing(out) == before  # the checkpoint, the metrics and the file itself as they were
    with pytest.raises(ValueError, match=str(path)):
        resume_config(out)  # the Python form: the same refusal
    path.unlink()  # the remedy the line gives where the run has a checkpoint: its own settings
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "3"]) == 0


def test_a_changed_cache_dir_resumes_the_same_run(two_steps, tmp_path, corpus_file):
    """The remedy of a full disk under the token cache: another --cache-dir, the data tokenised there again."""
    reference = two_steps.replace(max_steps=3, out=str(tmp_path / "reference"))
    train(reference)
    assert main(["train", "--out", two_steps.out, "--resume", "--max-steps", "3", "--cache-dir",
                 str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere").is_dir()
    assert _losses(two_steps.out) == _losses(reference.out)


def test_a_boolean_setting_on_in_the_run_can_be_turned_off_on_resume(two_steps, capsys):
    from s2hc.config import option_fields

    out = two_steps.out
    assert main(["train", "--out", out, "--resume", "--max-steps", "3", "--keep-best", "--eval-every", "1"]) == 0
    assert load_checkpoint(out, with_model=False).config["keep_best"] is True
    assert main(["train", "--out", out, "--resume", "--max-steps", "4", "--no-keep-best"]) == 0
    assert load_checkpoint(out, with_model=False).config["keep_best"] is False
    capsys.readouterr()
    flags = {f.name for f in option_fields() if f.type == "bool"}
    assert {"keep_best", "compile", "activation_checkpointing", "progress"} <= flags
    main(["train", "--help"])
    shown = capsys.readouterr().out.split()
    for name in flags:  # every boolean has both flags: a resume keeps the run's value unless one is given
        assert f"--{name.replace('_', '-')}" in shown and f"--no-{name.replace('_', '-')}" in shown
