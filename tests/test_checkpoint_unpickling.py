"""Loading a sharded checkpoint never runs code the files name.

torch.distributed.checkpoint unpickles ``checkpoint.dcp/.metadata`` with ``pickle.load`` and non-tensor values
with ``torch.load(weights_only=False)``. These tests craft run directories that would run code through either
(a ``__reduce__`` creating a marker file), with extra.pt's checksums rewritten to match as an attacker would,
and load them through every public loader: each is refused with one line naming the file, the marker never
appears. A damaged or foreign ``checkpoint.dcp/`` is refused with one line too; a genuine one still loads.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import small_config

from s2hc.cli import main
from s2hc.rundir import load_checkpoint, load_model
from s2hc.rundir.checksums import file_digest, with_checksum
from s2hc.rundir.sharded import _METADATA_GLOBALS, load_sharded_into, read_sharded_metadata
from s2hc.train import train

REFUSED = r"checkpoint\.dcp/\.metadata': refuses to load pickled class '{}' " \
          r"\(not a torch\.distributed\.checkpoint metadata class\)"


class Touch:
    """Unpickled, creates ``marker`` (``pathlib.Path.touch``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


class Exec(Touch):
    """Unpickled, creates ``marker`` through ``builtins.exec``: a builtin, but no data."""

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class System(Touch):
    """Unpickled, creates ``marker`` through ``os.system``."""

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.fixture(scope="module")
def sharded_config(corpus_file, tmp_path_factory):
    """The config of a real sharded run (FSDP2 in one process, 2 steps), trained once for the module."""
    root = tmp_path_factory.mktemp("sharded")
    config = small_config(corpus_file, root, parallel="fsdp", max_steps=2, checkpoint_every=2)
    train(config)
    return config


@pytest.fixture()
def run(sharded_config, tmp_path) -> Path:
    """A fresh copy of the sharded run directory, for a test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(sharded_config.out, copy)
    return copy


@pytest.fixture()
def marker(tmp_path) -> Path:
    return tmp_path / "code-ran"


def reseal(directory: Path) -> None:
    """Rewrite extra.pt's shard digests and checksum for the files now in ``directory``: what anyone able to
    write the directory can do (a checksum is no signature)."""
    payload = torch.load(directory / "extra.pt", weights_only=True)
    payload.pop("checksum")
    payload["shards"] = {p.name: file_digest(p) for p in sorted(directory.iterdir())
                         if p.is_file() and p.name != "extra.pt"}
    torch.save(with_checksum(payload), directory / "extra.pt")


def genuine_metadata(directory: Path):
    """The genuine Metadata object of ``directory`` (a test may unpickle its own files with pickle)."""
    return pickle.loads((directory / ".metadata").read_bytes())


def write_metadata(directory: Path, metadata) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(directory)


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# --------------------------------------------------------------------------- .metadata: pickled globals


def refused_name(payload) -> str:
    """``module.name`` of the callable ``payload``'s pickle names (os.system is posix.system on Linux)."""
    function = payload.__reduce__()[0]
    return f"{function.__module__}.{function.__qualname__}"


@pytest.mark.parametrize("payload", [Touch, Exec, System])
def test_a_metadata_pickle_that_would_run_code_is_refused_by_every_loader(run, marker, payload, capsys):
    evil = payload(marker)
    write_metadata(run / "checkpoint.dcp", evil)
    refused = REFUSED.format(refused_name(evil).replace(".", r"\."))
    for attempt in (lambda: load_model(run), lambda: load_checkpoint(run),
                    lambda: load_sharded_into(run / "checkpoint.dcp", {})):
        with pytest.raises(ValueError, match=refused):
            attempt()
    assert not marker.exists()


@pytest.mark.parametrize("command", [
    ["eval", "{run}", "--no-progress"], ["generate", "{run}", "--prompt", "To be", "--max-new-tokens", "2"],
    ["diagnose", "{run}"], ["export", "{run}", "--out", "{run}-exported"],
])
def test_the_commands_refuse_it_in_one_line_and_run_nothing(run, marker, command, capsys):
    write_metadata(run / "checkpoint.dcp", Touch(marker))
    assert main([part.format(run=run) for part in command]) == 2
    line = error_line(capsys)
    assert f"{run / 'checkpoint.dcp' / '.metadata'}': refuses to load pickled class 'pathlib.Path.touch'" in line
    assert not marker.exists()


def test_resume_and_init_from_refuse_it(run, sharded_config, marker):
    write_metadata(run / "checkpoint.dcp", Touch(marker))
    with pytest.raises(ValueError, match=REFUSED.format(r"pathlib\.Path\.touch")):
        train(sharded_config.replace(out=str(run), max_steps=4), resume=True)
    with pytest.raises(ValueError, match=REFUSED.format(r"pathlib\.Path\.touch")):
        train(sharded_config.replace(out=str(run) + "-new", init_from=str(run)))
    assert not marker.exists()


def test_code_hidden_deep_inside_genuine_metadata_is_refused(run, marker):
    """Not only the first class counts: the payload sits in a real Metadata's planner_data."""
    metadata = genuine_metadata(run / "checkpoint.dcp")
    metadata.planner_data["model.embed.weight"] = Touch(marker)
    write_metadata(run / "checkpoint.dcp", metadata)
    with pytest.raises(ValueError, match=REFUSED.format(r"pathlib\.Path\.touch")):
        load_model(run)
    assert not marker.exists()


# ------------------------------------------------------------------ shard files: values and file names


def test_a_pickled_value_in_a_shard_that_would_run_code_is_refused_on_resume(run, sharded_config, marker):
    """dcp loads non-tensor values (the optimizer's param_groups) with torch.load(weights_only=False): the
    learning rate's bytes are replaced by a pickle that creates the marker."""
    directory = run / "checkpoint.dcp"
    metadata = genuine_metadata(directory)
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    buffer = io.BytesIO()
    torch.save(Touch(marker), buffer)
    shard = directory / info.relative_path
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + buffer.getvalue())
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    write_metadata(directory, metadata)
    with pytest.raises(ValueError, match=rf"{shard}': refuses to load the value of "
                                         r"'optimizer\.param_groups\.0\.lr': it pickles '[^']+', which is not data"):
        train(sharded_config.replace(out=str(run), max_steps=4), resume=True)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp", ".."])
def test_a_shard_file_outside_the_directory_is_refused(run, name):
    metadata = genuine_metadata(run / "checkpoint.dcp")
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in metadata.storage_data.items()}
    write_metadata(run / "checkpoint.dcp", metadata)
    with pytest.raises(ValueError, match=rf"\.metadata' names shard file '{name}'; shard files are plain file names"):
        load_model(run)


# ---------------------------------------------------------------------- damaged or foreign checkpoint.dcp/


def test_garbage_metadata_is_refused_in_one_line(run, capsys):
    (run / "checkpoint.dcp" / ".metadata").write_bytes(b"\x80\x04garbage, not a pickle")
    reseal(run / "checkpoint.dcp")
    with pytest.raises(ValueError, match=r"\.metadata' is not torch\.distributed\.checkpoint metadata, or is "
                                         r"damaged \(could not be read: \w+\)"):
        load_model(run)
    assert main(["eval", str(run), "--no-progress"]) == 2
    assert "is not torch.distributed.checkpoint metadata, or is damaged" in error_line(capsys)


def test_metadata_of_another_type_is_refused(run):
    write_metadata(run / "checkpoint.dcp", {"not": "metadata"})
    with pytest.raises(ValueError, match=r"\.metadata' is not torch\.distributed\.checkpoint metadata "
                                         r"\(it holds a dict\)"):
        load_model(run)


def test_a_missing_shard_is_refused_in_one_line(run, capsys):
    (run / "checkpoint.dcp" / "__0_0.distcp").unlink()
    reseal(run / "checkpoint.dcp")
    with pytest.raises(ValueError, match=r"\.metadata' names shard file '__0_0\.distcp', which is missing"):
        load_model(run)
    assert main(["diagnose", str(run)]) == 2
    assert "which is missing" in error_line(capsys)


def test_a_foreign_sharded_checkpoint_is_refused_in_one_line(run, capsys):
    """A real torch.distributed.checkpoint directory holding other tensors: dcp's own CheckpointException (a
    BaseException, with a traceback per rank in its message) becomes one ValueError line."""
    import torch.distributed.checkpoint as dcp

    directory = run / "checkpoint.dcp"
    for file in directory.iterdir():
        if file.name != "extra.pt":
            file.unlink()
    dcp.save({"model": {"other.weight": torch.zeros(3)}}, checkpoint_id=str(directory), no_dist=True)
    reseal(directory)
    with pytest.raises(ValueError, match=rf"sharded checkpoint '{directory}' is damaged or not s2hc's "
                                         r"\(torch\.distributed\.checkpoint could not read it: \w+: .+\)$"):
        load_model(run)
    assert main(["eval", str(run), "--no-progress"]) == 2
    assert "is damaged or not s2hc's" in error_line(capsys)


# ---------------------------------------------------------------------------- genuine checkpoints still load


def test_a_genuine_sharded_checkpoint_loads_exactly_what_dcp_itself_reads(run, sharded_config):
    import torch.distributed.checkpoint as dcp

    model, config = load_model(run)
    reference = {"model": {name: torch.zeros_like(t) for name, t in model.state_dict().items()}}
    dcp.load(reference, checkpoint_id=str(run / "checkpoint.dcp"), no_dist=True)  # torch's own, unrestricted
    loaded = model.state_dict()
    assert set(loaded) == set(reference["model"])
    assert all(torch.equal(loaded[name], reference["model"][name]) for name in loaded)
    assert any(t.abs().sum() > 0 for t in loaded.values())
    assert config.max_steps == 2
    train(sharded_config.replace(out=str(run), max_steps=4), resume=True)  # the optimizer's values, too
    assert load_checkpoint(run, with_model=False).step == 4


def test_the_allowlist_is_what_genuine_metadata_references(run):
    """Every global a genuine .metadata names is admitted, and every admitted name exists in this torch."""
    import importlib

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(run / "checkpoint.dcp" / ".metadata", "rb") as handle:
        Recorder(handle).load()
    admitted = {(m, n) for m, names in _METADATA_GLOBALS.items() for n in names}
    dtypes_layouts_paths = {(m, n) for m, n in seen if m in ("torch", "pathlib") and n != "Size"}
    assert seen - dtypes_layouts_paths <= admitted
    for module, name in admitted:
        assert hasattr(importlib.import_module(module), name), (module, name)
    assert type(read_sharded_metadata(run / "checkpoint.dcp")).__name__ == "Metadata"


# ------------------------------------------------- every other file s2hc loads: checkpoint.pt, extra.pt, YAML


def test_a_single_file_checkpoint_or_extra_pt_that_would_run_code_is_refused(run, tiny_checkpoint, tmp_path,
                                                                             marker, capsys):
    single = tmp_path / "single"
    shutil.copytree(tiny_checkpoint, single)
    for crafted in (single / "checkpoint.pt", run / "checkpoint.dcp" / "extra.pt"):
        torch.save({"step": 1, "model": Touch(marker)}, crafted)  # torch.load(weights_only=True) refuses it
        with pytest.raises(ValueError):
            load_model(crafted.parent if crafted.name == "checkpoint.pt" else run)
        assert main(["eval", str(crafted.parent if crafted.name == "checkpoint.pt" else run), "--no-progress"]) == 2
        assert "Traceback" not in capsys.readouterr().err
        assert not marker.exists()


YAML_THAT_RUNS_CODE = "lr: !!python/object/apply:pathlib.Path.touch [{marker}]\n"


def test_yaml_that_would_run_code_is_refused_as_config_study_grid_and_run_config(tiny_checkpoint, tmp_path,
                                                                                 marker, capsys):
    from s2hc.rundir import read_config
    from s2hc.study import load_spec

    crafted = tmp_path / "crafted.yaml"
    crafted.write_text(YAML_THAT_RUNS_CODE.format(marker=marker))
    assert main(["train", "--config", str(crafted), "--out", str(tmp_path / "t")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    with pytest.raises(ValueError):
        load_spec(crafted)
    copy = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, copy)
    (copy / "config.yaml").write_text(YAML_THAT_RUNS_CODE.format(marker=marker))
    with pytest.raises(ValueError):
        read_config(copy)
    assert not marker.exists()
