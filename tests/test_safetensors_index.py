"""A sharded safetensors checkpoint's index reads only files inside its directory (path traversal, the sibling of
tests/test_checkpoint_unpickling.py's unpickling), and a malformed index is refused.

``model.safetensors.index.json`` maps tensor names to shard files; s2hc joined them to the directory unchecked,
so ``"../other/model.safetensors"`` or an absolute path made ``diagnose --static`` and ``upcycle`` read another
model's weights. Here the file outside always is a valid safetensors file holding exactly the tensors wanted, so
only the check stands between the index and it; the recorded ``safe_open`` calls show it is never opened.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from s2hc.cli import main  # noqa: E402
from s2hc.hf.weights import INDEX, read_safetensors  # noqa: E402

TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4)}


@pytest.fixture()
def opened(monkeypatch) -> list[str]:
    """Every path ``safetensors.safe_open`` is asked to open, in order."""
    calls, real = [], safetensors.safe_open

    def recording(path, *args, **kwargs):
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    return calls


def write_index(directory, weight_map) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture()
def outside(tmp_path):
    """Another model's directory beside the one under test, holding a valid file with the wanted tensors."""
    other = tmp_path / "other"
    other.mkdir()
    save_file(TENSORS, str(other / "model.safetensors"))
    return other / "model.safetensors"


# ------------------------------------------------------------------------------------------- traversal


@pytest.mark.parametrize("shard, rule", [
    ("../other/model.safetensors", r"shard files must stay inside '.+/model' \('\.\.' leaves it\)"),
    ("sub/../../other/model.safetensors", r"shard files must stay inside '.+/model' \('\.\.' leaves it\)"),
    ("{outside}", r"shard files must be relative paths inside '.+/model', not absolute ones"),
])
def test_an_index_naming_a_file_outside_its_directory_is_refused_and_it_is_never_opened(
        shard, rule, outside, opened, tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)  # so that, unchecked, every one of these names would open `outside`
    shard = shard.format(outside=outside)
    write_index(model, dict.fromkeys(TENSORS, shard))
    with pytest.raises(ValueError, match=rf"'{model / INDEX}' names shard '{shard}': {rule}"):
        read_safetensors(model)
    assert opened == []


def test_a_symlink_leading_out_of_the_directory_is_refused(outside, opened, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(outside)
    (model / "sub").symlink_to(outside.parent, target_is_directory=True)
    for shard in ("model.safetensors", "sub/model.safetensors"):
        write_index(model, dict.fromkeys(TENSORS, shard))
        with pytest.raises(ValueError, match=rf"names shard '{shard}': shard files must stay inside "
                                             r"'.+/model' \(a symlink leads out of it\)"):
            read_safetensors(model / INDEX)
    assert opened == []


def test_shards_inside_the_directory_still_load_symlinks_within_it_and_a_hub_cache_snapshot_too(
        opened, tmp_path):
    model = tmp_path / "model"
    (model / "part").mkdir(parents=True)
    save_file({"a.weight": TENSORS["a.weight"]}, str(model / "part" / "one.safetensors"))
    save_file({"b.weight": TENSORS["b.weight"]}, str(model / "two.safetensors"))
    (model / "alias.safetensors").symlink_to(model / "two.safetensors")
    write_index(model, {"a.weight": "part/one.safetensors", "b.weight": "alias.safetensors"})
    tensors, files, directory = read_safetensors(model)
    assert directory == model and set(tensors) == set(TENSORS)
    assert all(torch.equal(tensors[name], TENSORS[name]) for name in TENSORS)
    assert files == opened == [str(model / "part" / "one.safetensors"), str(model / "alias.safetensors")]

    # huggingface_hub's cache: snapshots/REVISION/ holds symlinks to ../../blobs/, the model's own folder
    repo = tmp_path / "hub" / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    save_file(TENSORS, str(blobs / "9f86d08"))
    (snapshot / "model.safetensors").symlink_to("../../blobs/9f86d08")
    write_index(snapshot, dict.fromkeys(TENSORS, "model.safetensors"))
    assert set(read_safetensors(snapshot)[0]) == set(TENSORS)


# --------------------------------------------------------------------------------------- malformed indexes


@pytest.mark.parametrize("content, message", [
    ({"weight_map": ["a.weight", "model.safetensors"]}, "weight_map is an array; it must be an object mapping "
                                                         "tensor names to shard file names"),
    ({"weight_map": 3}, "weight_map is a number; it must be an object"),
    ({"weight_map": None}, "weight_map is null; it must be an object"),
    ({"weight_map": {"a.weight": 1}}, r"weight_map maps 'a.weight' to a number \(1\); shard file names are strings"),
    ({"weight_map": {"a.weight": ["x"]}}, r"weight_map maps 'a.weight' to an array \(\['x'\]\); shard file names"),
    ({"weight_map": {"a.weight": ""}}, r"names shard '': shard files must be relative paths"),
    ({"metadata": {}}, "is not a safetensors index: it has no weight_map"),
    (["weight_map"], "is not a safetensors index: it holds an array, not an object with a weight_map"),
    ("model.safetensors", "is not a safetensors index: it holds a string, not an object with a weight_map"),
])
def test_a_malformed_index_is_refused_in_one_line_naming_it(content, message, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / INDEX).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=rf"^'{model / INDEX}'.*{message}"):
        read_safetensors(model)
    assert main(["diagnose", "--static", str(model), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(model / INDEX) in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_an_index_that_is_not_json_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / INDEX).write_text("{not json")
    with pytest.raises(ValueError, match=rf"'{model / INDEX}' is not a safetensors index \(Expecting"):
        read_safetensors(model)


# ------------------------------------------------------------------------------------------ the commands


def test_diagnose_static_refuses_an_index_reading_another_models_export(opened, tmp_path, capsys):
    """The other directory is a real s2hc export; with the index pointing there (and its config.json copied),
    diagnose --static would report that model's connections as this one's."""
    pytest.importorskip("transformers")
    from test_static_diagnose import hyper_model, save

    other = save(hyper_model("s2hc"), tmp_path / "other")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(other / "config.json", model / "config.json")
    names = list(safetensors.safe_open(str(other / "model.safetensors"), framework="pt").keys())
    opened.clear()
    capsys.readouterr()  # save_pretrained's progress bar
    write_index(model, dict.fromkeys(names, "../other/model.safetensors"))
    assert main(["diagnose", "--static", str(model), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{model / INDEX}' names shard '../other/model.safetensors'" in err
    assert opened == [] and not (tmp_path / "out").exists()


def test_upcycle_refuses_an_index_reading_another_models_weights(opened, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from test_hf_parity import hf_config

    other, model = tmp_path / "other", tmp_path / "model"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config("qwen3")).save_pretrained(other)
    model.mkdir()
    shutil.copy(other / "config.json", model / "config.json")
    names = list(safetensors.safe_open(str(other / "model.safetensors"), framework="pt").keys())
    opened.clear()
    capsys.readouterr()  # save_pretrained's progress bar
    write_index(model, dict.fromkeys(names, str(other / "model.safetensors")))
    args = ["upcycle", str(model), "--family", "mhc", "--out", str(tmp_path / "run"), "--tokenizer", "s2hc-bpe-4k"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "shard files must be relative paths inside" in err
    assert opened == [] and not (tmp_path / "run").exists()
