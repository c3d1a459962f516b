"""One owner for each piece of knowledge: the TrainConfig field metadata, the checkpoint schema, the run directory's
entries. The lists the rest of s2hc used to keep by hand are computed from them; these tests hold an independent
statement of each and check what the lists are used for."""

from __future__ import annotations

import ast
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from s2hc.config import (
    GROUPS,
    TrainConfig,
    family_fields,
    fields_of,
    grid_fields,
    inherited_fields,
    model_fields,
    resumable_fields,
    shown_fields,
)
from s2hc.rundir import Checkpoint, History, layout, load_checkpoint, load_model
from s2hc.rundir.checkpoint import save_checkpoint
from s2hc.rundir.guard import clear_run
from s2hc.rundir.schema import VERSION
from s2hc.train import train

FIXTURE = Path(__file__).parent / "fixtures" / "format2-run"

# --------------------------------------------------------------------------------------- TrainConfig fields


def test_every_field_declares_its_group_and_roles():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["group"] in GROUPS, f.name
        assert {"help", "flag", "resumable", "grid", "inherited"} <= set(f.metadata), f.name
    assert sorted(sum((fields_of(g) for g in GROUPS), ())) == sorted(f.name for f in dataclasses.fields(TrainConfig))


def test_the_computed_lists_say_what_each_field_is():
    # what the run's computation does not depend on: may change on --resume
    assert set(resumable_fields()) == {"max_steps", "schedule_steps", "eval_every", "checkpoint_every", "log_every",
                                       "progress", "out", "compile", "device", "parallel", "diagnostics_every",
                                       "connection", "logger",
                                       "logger_dir", "logger_group", "keep_checkpoints", "keep_best",
                                       "activation_checkpointing", "cache_dir"}
    assert family_fields() == ("family", "n_streams", "family_options")
    assert set(model_fields()) == {"preset", "model_overrides", "tokenizer", "family", "n_streams", "family_options"}
    assert set(grid_fields()) == {"family", "family_options", "n_streams", "seed", "out"}
    assert set(shown_fields()) == {"progress", "logger", "logger_dir", "logger_group"}
    # what names the run itself, or where its loggers write
    assert set(TrainConfig().to_dict()) - set(inherited_fields()) == {"out", "init_from", "logger_dir", "logger_group"}
    with pytest.raises(ValueError, match=r"group must be one of \['model', 'family', 'data', 'schedule', 'run'\], "
                                         r"got 'optimiser'"):
        fields_of("optimiser")


def test_resume_refuses_a_field_the_schema_does_not_call_resumable(corpus_file, tmp_path):
    config = TrainConfig(data=str(corpus_file), out=str(tmp_path / "run"), max_steps=2, seq_len=16, batch_size=2,
                         eval_every=2, eval_batches=1, checkpoint_every=2, progress=False, device="cpu",
                         model_overrides={"dim": 16, "n_layers": 1, "n_heads": 1})
    train(config)
    train(config.replace(max_steps=3, log_every=1), resume=True)  # resumable: accepted
    with pytest.raises(ValueError, match=r"different configuration \(lr: 0.0006 -> 0.001\)"):
        train(config.replace(max_steps=4, lr=1e-3), resume=True)


# -------------------------------------------------------------------------------------------- checkpoints


def test_a_committed_format_2_run_still_loads_and_resumes(tmp_path):
    """tests/fixtures/format2-run was written by s2hc before checkpoint version 3 (2 steps of a tiny s2hc model);
    it must load, rebuild its model and continue exactly where it stopped."""
    old = load_checkpoint(FIXTURE)
    assert old.step == 2 and old.written_by is None and old.world_size == 1
    assert len(old.history.step_times) == 2 and old.optimizer is not None and old.loader is not None
    model, config = load_model(FIXTURE)
    assert config.family == "s2hc" and model.num_connection_params() > 0
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    assert torch.isfinite(model(x)).all()

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    result = train(config.replace(out=str(run), max_steps=3, data="embedded"), resume=True)
    assert result.step == 3
    new = load_checkpoint(run)
    assert new.written_by.startswith("s2hc ") and new.history.step_times[:2] == old.history.step_times
    assert torch.load(run / "checkpoint.pt", weights_only=True)["version"] == VERSION


def test_a_checkpoint_round_trips_through_its_file(tmp_path):
    checkpoint = Checkpoint(config={"lr": 1e-3}, model_config={"dim": 8}, step=7,
                            history=History(step_times=[0.5, 0.25], train_loss=2.0, val_loss=None),
                            model={"w": torch.arange(3.0)}, loader={"position": 4}, upcycled_from="src")
    save_checkpoint(tmp_path / "c.pt", checkpoint)
    read = load_checkpoint(tmp_path / "c.pt")
    assert read.path == str(tmp_path / "c.pt") and read.written_by.startswith("s2hc ")
    assert dataclasses.replace(read, written_by=None, model=None) == dataclasses.replace(checkpoint, model=None)
    assert torch.equal(read.model["w"], checkpoint.model["w"]) and read.optimizer is None and read.rng is None


@pytest.mark.parametrize("payload, problem", [
    ({"step": 1, "config": {}}, r"missing \['model_config'\]"),
    ({"step": 1, "config": {}, "model_config": {}, "weights": 1}, r"unknown \['weights'\]"),
    ({"step": -1, "config": {}, "model_config": {}}, r"'step' must be an integer >= 0, got -1"),
    ({"step": 1, "config": [], "model_config": {}}, r"'config' must be a mapping, got list"),
    ({"step": 1, "config": {}, "model_config": {}, "history": {"losses": []}}, r"'history' must be a mapping"),
])
def test_a_tagged_file_that_breaks_the_schema_is_refused_by_name(tmp_path, payload, problem):
    path = tmp_path / "odd.pt"
    torch.save({"format": "s2hc-checkpoint", "version": 1, **payload}, path)
    with pytest.raises(ValueError, match=rf"'{path}'.*{problem}"):
        load_checkpoint(path)


def test_version_2_files_may_not_carry_later_entries(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save({"format": "s2hc-checkpoint", "version": 1, "step": 1, "config": {}, "model_config": {},
                "written_by": "s2hc 9"}, path)
    with pytest.raises(ValueError, match=r"unknown \['written_by'\]"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------ run directory entries


def test_the_run_directory_lists_are_computed_from_its_entries(tmp_path):
    assert layout.RUN_FILES == ("config.yaml", "metrics.jsonl", "checkpoint.pt", "checkpoint.dcp", "checkpoints")
    assert layout.DERIVED == ("diagnostics", "metrics.csv", "loggers.json", "tensorboard", "wandb", "mlflow.db",
                              "mlartifacts")
    assert layout.ATOMIC_FILES == ("config.yaml", "metrics.jsonl", "checkpoint.pt", "metrics.csv", "loggers.json")
    assert layout.is_run_entry(".lock") and layout.is_run_entry(".checkpoint.pt.s2hc-abcd1234.tmp")
    assert not layout.is_run_entry("notes.txt") and not layout.is_run_entry(".notes.s2hc-abcd1234.tmp")
    for name in (*layout.RUN_FILES, *layout.DERIVED):  # --overwrite removes every run and derived entry
        target = tmp_path / name
        target.mkdir() if name in ("checkpoint.dcp", "checkpoints", "diagnostics", "tensorboard", "wandb") \
            else target.write_text("x")
    (tmp_path / "notes.txt").write_text("mine")
    clear_run(tmp_path, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# Modules whose string lists share names with TrainConfig fields without being lists of its fields.
NOT_FIELD_LISTS = {
    "cli/diagnose.py": "CHECKPOINT_ONLY names diagnose's own flags (data, device, cache_dir, ...)",
}


def _string_lists(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            yield node.lineno, [e.value for e in node.elts]


def test_no_module_but_config_lists_trainconfig_fields_by_hand():
    """Adding a field touches config.py alone: a tuple, list or set of three or more field names anywhere else
    in src is a hand-kept copy of what the metadata says."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    source = Path(__file__).resolve().parents[1] / "src" / "s2hc"
    found = [f"{path.relative_to(source)}:{line}: {values}"
             for path in sorted(source.rglob("*.py")) if path != source / "config.py"
             and path.relative_to(source).as_posix() not in NOT_FIELD_LISTS
             for line, values in _string_lists(ast.parse(path.read_text()))
             if len(names.intersection(values)) >= 3]
    assert not found, "\n".join(found)


def test_the_field_list_scan_sees_a_hand_kept_list():
    tree = ast.parse('KEYS = ("family", "n_streams", "family_options")\nOTHER = ["a", "b"]')
    assert [values for _, values in _string_lists(tree)] == [["family", "n_streams", "family_options"], ["a", "b"]]
