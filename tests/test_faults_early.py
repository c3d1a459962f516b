"""Settings that can only fail late are refused early, and what still fails at the first step leaves nothing that
blocks the corrected command."""

from __future__ import annotations

import pytest
from helpers import small_config

from s2hc.cli import main


def one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_seq_len_above_the_models_max_seq_len_is_refused_before_the_run_directory_is_made(corpus_file, tmp_path):
    with pytest.raises(ValueError, match=r"seq_len=64 is more than the model's max_seq_len=32"):
        small_config(corpus_file, tmp_path, seq_len=64, model_overrides={"max_seq_len": 32})


def test_a_seq_len_above_the_presets_max_seq_len_is_refused_naming_both_and_how_to_raise_it(tmp_path, capsys):
    """``--seq-len 100000`` used to raise the model's max_seq_len to match (and grow to 12 GB at the first step)."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--seq-len", "100000", "--out", str(out)]) == 2
    assert one_line(capsys) == (
        "s2hc train: error: seq_len=100000 is more than the model's max_seq_len=256 (preset 'tiny'); lower seq_len, "
        'or raise max_seq_len: --set "model_overrides={max_seq_len: 100000}"')
    assert not out.exists()
    # what it says works, and keeps the other overrides
    assert main(["train", "--preset", "tiny", "--seq-len", "300", "--set", "model_overrides={dim: 32}",
                 "--out", str(out)]) == 2
    hint = one_line(capsys).rpartition("--set ")[2]
    assert hint == '"model_overrides={dim: 32, max_seq_len: 300}"'
    from s2hc.config import TrainConfig

    assert TrainConfig(seq_len=300, model_overrides={"dim": 32, "max_seq_len": 300}).model_config().max_seq_len == 300


def test_a_run_trained_when_seq_len_raised_max_seq_len_still_reads_as_its_model():
    from s2hc.config import TrainConfig, completed_settings

    stored = {**TrainConfig().to_dict(), "seq_len": 512}  # the tiny preset's max_seq_len is 256
    settings = completed_settings(stored)
    assert settings["model_overrides"] == {"max_seq_len": 512}
    assert TrainConfig.from_dict(settings).model_config().max_seq_len == 512
    assert completed_settings(TrainConfig().to_dict())["model_overrides"] == {}  # within the preset: as it was


def refuse(self, *args, **kwargs):
    """A model's forward that raises what a setting only the first forward pass sees would."""
    raise ValueError("refused by the first forward pass")


def test_a_run_refused_at_its_first_step_leaves_nothing_and_the_retry_starts(corpus_file, tmp_path, monkeypatch):
    from s2hc.models import Transformer
    from s2hc.train import train

    config = small_config(corpus_file, tmp_path, max_steps=1)
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "forward", refuse)
        with pytest.raises(ValueError, match="first forward pass"):
            train(config)
    assert not (tmp_path / "run").exists()  # no config.yaml or empty metrics.jsonl to refuse the retry with
    assert train(config).step == 1  # the same command again, no --overwrite needed


def test_a_failed_resume_keeps_the_run_it_resumes(corpus_file, tmp_path, monkeypatch):
    from s2hc.models import Transformer
    from s2hc.train import train

    config = small_config(corpus_file, tmp_path, max_steps=1, checkpoint_every=1)
    train(config)
    monkeypatch.setattr(Transformer, "forward", refuse)
    with pytest.raises(ValueError, match="first forward pass"):
        train(config.replace(max_steps=2), resume=True)
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"config.yaml", "metrics.jsonl", "checkpoint.pt"}


def test_upcycling_with_a_tokenizer_larger_than_the_model_is_refused_before_writing(tiny_checkpoint, tmp_path,
                                                                                     capsys):
    pytest.importorskip("tiktoken")
    from s2hc.rundir import load_model
    from s2hc.train import train

    _, config = load_model(tiny_checkpoint)
    source = config.replace(family="residual", n_streams=1, max_steps=1, out=str(tmp_path / "residual"))
    train(source)
    capsys.readouterr()  # the run's own lines
    out = tmp_path / "upcycled"
    assert main(["upcycle", source.out, "--family", "s2hc", "--tokenizer", "gpt2", "--out", str(out)]) == 2
    line = one_line(capsys)
    assert "'gpt2' has 50257 tokens, more than the model's vocab_size=4096" in line
    assert not out.exists()


def test_a_study_with_a_bad_measuring_device_is_refused_before_anything(tmp_path, capsys):
    config = tmp_path / "smoke.yaml"
    assert main(["configs", "study-smoke"]) == 0
    config.write_text(capsys.readouterr().out)
    out = tmp_path / "study"
    assert main(["study", str(config), "--out", str(out), "--device", "tpu"]) == 2
    assert "--device: invalid choice 'tpu'" in one_line(capsys)
    assert not out.exists()


def test_a_non_finite_gradient_with_a_finite_loss_names_the_gradient(corpus_file, tmp_path, monkeypatch):
    import torch

    from s2hc.train import TrainingError, train

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf")))
    with pytest.raises(TrainingError, match=r"non-finite gradient \(norm inf\) at step 1, with a finite loss"):
        train(small_config(corpus_file, tmp_path, max_steps=2))


@pytest.mark.parametrize("key,value", [("diagnostics_tokens", 10**12), ("nproc", 10**6)])
def test_a_study_grid_bounds_its_own_counts(key, value, tmp_path, capsys):
    import yaml

    from s2hc.study import load_spec

    assert main(["configs", "study-smoke"]) == 0
    grid = yaml.safe_load(capsys.readouterr().out)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({**grid, key: value}))
    with pytest.raises(ValueError, match=rf"{key} must be an integer in \[1, \d+\], got {value}"):
        load_spec(path)
