"""Data as it comes: ``.json`` arrays, ``datasets.save_to_disk`` folders (a Dataset or a DatasetDict), ``hf:json``
with local ``data_files``, and the data options of ``TrainConfig`` (``text_field``, ``validation_data``,
``validation_fraction``, ``max_documents``, ``max_tokens``, ``data_split``, ``data_files``) reaching every caller
through ``TrainConfig.source_spec()``. The references are independent: the documents are read here from what
the test wrote, split by hand (every 20th record held out at the default fraction) and tokenised with the
tokenizer directly. Offline: ``hf:json`` reads local files with ``datasets``' packaged builder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import OFFLINE_ENV, small_config

from s2hc import cli
from s2hc.data import get_tokenizer, iter_documents, prepare_tokens
from s2hc.data.sources import SourceSpec, resolve_files, source_identity, spec_for
from s2hc.extras import MissingExtra
from s2hc.train import TrainConfig, train


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("s2hc-bpe-4k")


@pytest.fixture(scope="module")
def docs(corpus_file) -> list[str]:
    """About 40 kB of real paragraphs (some 100 documents): a few training steps' worth, quick to tokenise."""
    paragraphs, total = [], 0
    for paragraph in Path(corpus_file).read_text().split("\n\n"):
        if paragraph.strip() and total < 40_000:
            paragraphs.append(paragraph)
            total += len(paragraph)
    assert len(paragraphs) > 60
    return paragraphs


def reference(tok, documents) -> np.ndarray:
    """The ids the cache should hold for ``documents``: end-of-text before each, then its tokens."""
    ids = []
    for encoded in tok.encode_batch(list(documents)):
        ids += [tok.eot_id, *encoded]
    return np.asarray(ids, dtype=np.int64)


def held_out(documents, every: int = 20) -> list[str]:
    return [d for i, d in enumerate(documents) if i % every == every - 1]


def kept(documents, every: int = 20) -> list[str]:
    return [d for i, d in enumerate(documents) if i % every != every - 1]


def val_tokens(config: TrainConfig, tok) -> np.ndarray:
    return np.asarray(prepare_tokens(config.data, tok, config.cache_dir, "val", progress=False,
                                     spec=config.source_spec()))


def train_documents(config: TrainConfig) -> list[str]:
    return list(iter_documents(config.data, "train", spec=config.source_spec()))


def cache_entries(config: TrainConfig) -> set[Path]:
    return set(Path(config.cache_dir).iterdir())


def write_jsonl(path: Path, documents, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(documents)))
    return path


def assert_trained_on_its_split(config: TrainConfig, result, tok, expected_val: list[str], whole: bool = True) -> None:
    """The run finished, and the validation split of its options is ``expected_val``; ``whole``: the run tokenised
    that split whole, so its shard is found in the run's cache, not made again."""
    assert math.isfinite(result.val_loss) and result.step == config.max_steps
    before = cache_entries(config)
    np.testing.assert_array_equal(val_tokens(config, tok), reference(tok, expected_val))
    if whole:
        assert cache_entries(config) == before  # the shard the run made: source_spec() is the run's key


# ------------------------------------------------------------------------------------------ .json


@pytest.fixture(scope="module")
def json_run(corpus_file, docs, tmp_path_factory):
    root = tmp_path_factory.mktemp("json-run")
    path = root / "docs.json"
    path.write_text(json.dumps([{"content": d, "id": i} for i, d in enumerate(docs)]))
    config = small_config(corpus_file, root, data=str(path), text_field="content")
    return config, train(config)


def test_a_json_array_of_records_trains_with_its_text_field(json_run, docs, tok):
    config, result = json_run
    assert_trained_on_its_split(config, result, tok, held_out(docs))
    assert train_documents(config) == kept(docs)


def test_eval_scores_the_runs_own_split_and_reads_another_source_with_its_text_field(json_run, docs, tok, tmp_path):
    from s2hc.evaluate import checkpoint_perplexity

    config, _ = json_run
    windows = (len(reference(tok, held_out(docs))) - 1) // config.seq_len
    own = checkpoint_perplexity(config.out, data=config.data, device="cpu", progress=False)
    assert own.tokens == windows * config.seq_len
    other = write_jsonl(tmp_path / "other.jsonl", docs[::-1], field="content")  # the run's field: "content"
    result = checkpoint_perplexity(config.out, data=str(other), cache_dir=str(tmp_path / "c"), device="cpu",
                                   progress=False)
    windows = (len(reference(tok, held_out(docs[::-1]))) - 1) // config.seq_len
    assert result.tokens == windows * config.seq_len and math.isfinite(result.loss)


def test_a_json_array_of_strings_and_json_files_in_a_directory(tmp_path):
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.json").write_text(json.dumps([f"string {i}" for i in range(30)]))
    write_jsonl(folder / "a.jsonl", [f"line {i}" for i in range(10)])
    (folder / "sub" / "c.json").write_text("\ufeff" + json.dumps([{"text": "with a byte-order mark"}]))
    everything = [f"line {i}" for i in range(10)] + [f"string {i}" for i in range(30)] + ["with a byte-order mark"]
    assert resolve_files(folder) == [folder / "a.jsonl", folder / "b.json", folder / "sub" / "c.json"]
    assert list(iter_documents(folder, "val")) == held_out(everything)
    assert list(iter_documents(folder, "train")) == kept(everything)


# ------------------------------------------------------------------------------------------ save_to_disk


@pytest.mark.parametrize("kind", ["dataset", "dataset_dict"])
def test_a_save_to_disk_folder_trains(kind, corpus_file, docs, tok, tmp_path):
    datasets = pytest.importorskip("datasets", reason="save_to_disk folders need the data extra")
    table = datasets.Dataset.from_dict({"body": docs, "n": list(range(len(docs)))})
    folder, split = tmp_path / "saved", "train"
    if kind == "dataset":
        table.save_to_disk(str(folder))
    else:  # the other split holds other text: reading it instead would change every token
        other = datasets.Dataset.from_dict({"body": [d.upper() for d in docs], "n": list(range(len(docs)))})
        datasets.DatasetDict({"train": other, "validation": table}).save_to_disk(str(folder))
        split = "validation"
    config = small_config(corpus_file, tmp_path, data=str(folder), text_field="body", data_split=split)
    assert_trained_on_its_split(config, train(config), tok, held_out(docs))
    assert train_documents(config) == kept(docs)
    # the split of a DatasetDict enters the cache key; a Dataset has one split, and the key ignores it
    differs = source_identity(folder, SourceSpec(hf_split="train")) != source_identity(folder,
                                                                                      SourceSpec(hf_split="validation"))
    assert differs == (kind == "dataset_dict")


def test_a_save_to_disk_folder_inside_a_directory_is_one_source(tmp_path):
    datasets = pytest.importorskip("datasets", reason="save_to_disk folders need the data extra")
    folder = tmp_path / "data"
    folder.mkdir()
    table = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(25)]})
    datasets.DatasetDict({"train": table}).save_to_disk(str(folder / "a-saved"))
    (folder / "b.json").write_text(json.dumps([f"string {i}" for i in range(15)]))
    # its dataset_dict.json, state.json and dataset_info.json are not read as documents
    assert resolve_files(folder) == [folder / "a-saved", folder / "b.json"]
    everything = [f"row {i}" for i in range(25)] + [f"string {i}" for i in range(15)]
    assert list(iter_documents(folder, "val")) == held_out(everything)


# ------------------------------------------------------------------------------------------ hf: with data_files


def test_hf_json_with_local_data_files_trains(corpus_file, docs, tok, tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="hf: sources need the data extra")
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    half = len(docs) // 2
    a = write_jsonl(tmp_path / "a.jsonl", docs[:half])
    b = write_jsonl(tmp_path / "b.jsonl", docs[half:])
    config = small_config(corpus_file, tmp_path, data="hf:json", data_files=f"{a},{b}")
    # an hf: source is streamed by the run (s2hc.data.stream): its validation windows are in another cache entry
    assert_trained_on_its_split(config, train(config), tok, held_out(docs), whole=False)
    assert train_documents(config) == kept(docs)
    # another split name reads the same files (they are that split); a glob reads them in sorted order
    assert list(iter_documents("hf:json", "val", data_files=str(tmp_path / "*.jsonl"), hf_split="x")) == held_out(docs)
    # the files enter the key: an edited file is tokenised again
    before = source_identity("hf:json", SourceSpec(data_files=f"{a},{b}"))
    write_jsonl(a, docs[: half - 1])
    assert source_identity("hf:json", SourceSpec(data_files=f"{a},{b}")) != before


# ------------------------------------------------------------------------------------------ the options


def test_validation_data_and_fraction_change_the_validation_tokens(corpus_file, docs, tok, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    separate = write_jsonl(tmp_path / "v.jsonl", [d.upper() for d in docs[:9]])
    default = small_config(corpus_file, tmp_path, data=str(data))
    tenth = default.replace(validation_fraction=0.1)
    apart = default.replace(validation_data=str(separate))
    np.testing.assert_array_equal(val_tokens(default, tok), reference(tok, held_out(docs)))
    np.testing.assert_array_equal(val_tokens(tenth, tok), reference(tok, held_out(docs, 10)))
    np.testing.assert_array_equal(val_tokens(apart, tok), reference(tok, [d.upper() for d in docs[:9]]))
    assert train_documents(tenth) == kept(docs, 10) and train_documents(apart) == docs
    assert len(cache_entries(default)) == 3  # three keys


def test_validation_data_with_another_text_field(corpus_file, docs, tok, tmp_path):
    """A separate validation source whose text is in another field: ``validation_text_field`` reads it; the
    training data keeps ``text_field``, and runs without the setting keep their token cache's key."""
    data = write_jsonl(tmp_path / "d.jsonl", docs, field="content")
    separate = write_jsonl(tmp_path / "v.jsonl", docs[:9], field="body")
    config = small_config(corpus_file, tmp_path, data=str(data), text_field="content",
                          validation_data=str(separate), validation_text_field="body")
    np.testing.assert_array_equal(val_tokens(config, tok), reference(tok, docs[:9]))
    assert train_documents(config) == docs
    same_field = small_config(corpus_file, tmp_path, data=str(data), text_field="content", validation_data=str(data))
    same_spec = same_field.source_spec()  # without the setting, the identity (the cache key) is that of before it
    assert same_spec.val_text_field is None and "val_text_field" not in source_identity(data, same_spec)
    with pytest.raises(ValueError, match=r"v\.jsonl:1: no field text_field='content' \(found \['body', 'id'\]\)"):
        val_tokens(config.replace(validation_text_field=None), tok)
    with pytest.raises(ValueError, match=r"^validation_text_field='body' names the text field of validation_data, "
                                         r"which is not given"):
        small_config(corpus_file, tmp_path, data=str(data), text_field="content", validation_text_field="body")


def test_max_documents_and_max_tokens_cap_what_is_tokenised(corpus_file, docs, tok, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    config = small_config(corpus_file, tmp_path, data=str(data))
    few = config.replace(max_documents=3)
    short = config.replace(max_tokens=100)
    assert train_documents(few) == kept(docs)[:3]
    np.testing.assert_array_equal(val_tokens(few, tok), reference(tok, held_out(docs)[:3]))
    np.testing.assert_array_equal(val_tokens(short, tok), reference(tok, held_out(docs))[:100])
    assert len(cache_entries(config)) == 2


def test_the_run_options_apply_to_its_own_data_only(tmp_path, monkeypatch):
    run = SourceSpec(text_field="content", val_source="v.jsonl", val_fraction=0.1, max_documents=5, hf_split="test",
                     data_files=None, max_tokens=100, streaming="always")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("")
    assert spec_for("d.jsonl", str(tmp_path / "d.jsonl"), run) == run  # the same file, named two ways
    assert spec_for("other.jsonl", str(tmp_path / "d.jsonl"), run) == SourceSpec(
        text_field="content", hf_split="test", val_fraction=0.1, streaming="always")
    assert spec_for("embedded", str(tmp_path / "d.jsonl"), run) == SourceSpec(streaming="always")
    assert spec_for("hf:org/ds", "hf:org/ds", run) == run


def test_check_extras_checks_the_validation_data(tmp_path, monkeypatch):
    from s2hc import extras

    (tmp_path / "v.parquet").write_bytes(b"")
    write_jsonl(tmp_path / "d.jsonl", ["a"])
    config = TrainConfig(data=str(tmp_path / "d.jsonl"), validation_data=str(tmp_path / "v.parquet"))
    monkeypatch.setattr(extras, "is_available", lambda module: module != "pyarrow")
    with pytest.raises(MissingExtra, match="validation_data="):
        config.check_extras()
    config.replace(validation_data=None).check_extras()


# ------------------------------------------------------------------------------------------ mistakes, in one line


def one_line_error(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_each_mistake_is_one_exact_line(tmp_path):
    datasets = pytest.importorskip("datasets", reason="save_to_disk folders need the data extra")
    records = tmp_path / "x.json"
    records.write_text(json.dumps([{"content": "a", "id": 1}]))
    assert one_line_error(lambda: list(iter_documents(records))) == (
        f"record 1 of {str(records)!r} has no field 'text'; its fields: ['content', 'id']; set --text-field")

    whole = tmp_path / "object.json"
    whole.write_text(json.dumps({"version": 1, "data": [{"text": "a"}]}))
    assert one_line_error(lambda: list(iter_documents(whole))) == (
        f"{str(whole)!r} holds a JSON object (keys: ['data', 'version']), not an array of records or of strings; "
        "write its documents as a JSON array, or one record per line as .jsonl")
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps(["a", 2]))
    assert one_line_error(lambda: list(iter_documents(mixed))) == (
        f"element 2 of {str(mixed)!r} is a JSON number, not a record (an object) or a string")
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert one_line_error(lambda: list(iter_documents(lines))) == (
        f"{str(lines)!r} holds more than one JSON value (Extra data at line 2 column 1): a file of one object per "
        "line is JSON Lines, rename it .jsonl")

    saved = tmp_path / "saved"
    table = datasets.Dataset.from_dict({"content": ["a", "b"], "id": [1, 2]})
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(saved))
    assert one_line_error(lambda: iter_documents(f"hf:{saved}")) == (  # at the call, the Hub not blamed
        f"source 'hf:{saved}': {str(saved)!r} is a datasets.save_to_disk folder: pass the path itself as --data, "
        "not hf:")
    assert one_line_error(lambda: iter_documents(saved, hf_split="validation")) == (
        f"{str(saved)!r} is a datasets.save_to_disk DatasetDict without the split data_split='validation'; "
        "its splits: ['train', 'test']; set --data-split")
    assert one_line_error(lambda: list(iter_documents(saved))) == (
        f"{str(saved)!r} has no field 'text'; its fields: ['content', 'id']; set --text-field")

    assert one_line_error(lambda: iter_documents(records, data_files="a.jsonl")) == (
        f"data_files='a.jsonl' is for an hf: source (e.g. hf:json); source {str(records)!r} is not one: pass local "
        "files as the source itself")
    missing = str(tmp_path / "nothing-*.jsonl")
    assert one_line_error(lambda: iter_documents("hf:json", data_files=missing)).startswith(
        f"source 'hf:json': data_files entry {missing!r} matches no file")


def test_the_cli_trains_on_a_json_file_with_its_flags(corpus_file, docs, tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"content": d, "id": i} for i, d in enumerate(docs)]))
    common = ["train", "--preset", "tiny", "--set", "model_overrides=" + json.dumps({"dim": 32, "n_layers": 2,
              "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}), "--seq-len", "32", "--batch-size", "4",
              "--max-steps", "2", "--warmup-steps", "1", "--eval-batches", "1", "--no-progress",
              "--cache-dir", str(tmp_path / "cache"), "--data", str(path)]
    assert cli.main([*common, "--out", str(tmp_path / "refused")]) == 2  # no field 'text'
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"s2hc train: error: record 1 of {str(path)!r} has no field 'text'; its fields: ['content', 'id']; "
        "set --text-field")
    out = tmp_path / "run"
    argv = [*common, "--text-field", "content", "--validation-fraction", "0.1", "--max-documents", "1000",
            "--max-tokens", "1000000", "--data-split", "train", "--out", str(out)]
    assert cli.main(argv) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["text_field"], saved["validation_fraction"], saved["max_documents"]) == ("content", 0.1, 1000)


# ------------------------------------------------------------------------------ validation data, in one line


def test_validation_data_that_is_the_training_data_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [f"document {i}" for i in range(40)])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "d.jsonl").symlink_to(data)
    write_jsonl(folder / "other.jsonl", ["other text"])
    remedy = ("a validation loss on training data measures nothing; name other data as validation_data, or leave "
              "it out to hold out validation_fraction of the training data")
    for val_source, how in ((data, "is"), (tmp_path / ".." / tmp_path.name / "d.jsonl", "is"),
                            (copy, "is a copy of"), (folder, f"shares the file {str(folder / 'd.jsonl')!r} with")):
        for split in ("train", "val"):  # refused at the call, whichever split is read first
            assert one_line_error(lambda s=split, v=val_source: iter_documents(data, s, val_source=v)) == (
                f"validation source {str(val_source)!r} {how} the training data {str(data)!r}: {remedy}")
    other = write_jsonl(tmp_path / "other.jsonl", [f"document {i}" for i in range(39)])  # same start, not a copy
    assert list(iter_documents(data, "val", val_source=other)) == [f"document {i}" for i in range(39)]


def test_empty_validation_data_is_refused_by_name(tmp_path, corpus_file):
    data = write_jsonl(tmp_path / "d.jsonl", [f"document {i}" for i in range(40)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    for val_source in (empty, blank):
        assert one_line_error(lambda v=val_source: list(iter_documents(data, "val", val_source=v))) == (
            f"validation source {str(val_source)!r} holds no documents (empty files, no records, or only empty "
            "texts): nothing to validate on; give validation data that holds text, or leave validation_data out "
            "to hold out validation_fraction of the training data")
    config = small_config(corpus_file, tmp_path, data=str(data), validation_data=str(empty))
    with pytest.raises(ValueError, match=r"^validation source .*empty\.jsonl' holds no documents"):
        train(config)


def test_too_few_records_for_a_validation_split_says_the_numbers(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [f"document {i}" for i in range(7)])
    assert one_line_error(lambda: list(iter_documents(data, "val"))) == (
        f"source {str(data)!r} has 7 records, too few for a validation split: every 20th record is held out "
        "(validation_fraction=0.05), so it needs at least 20; give more records, a larger validation_fraction "
        "(at most 0.5: every 2nd), or validation_data")
    assert len(list(iter_documents(data, "train"))) == 7  # the training split is all of them
    assert list(iter_documents(data, "val", val_fraction=0.5)) == ["document 1", "document 3", "document 5"]
    with pytest.raises(ValueError, match=r"has 7 records, too few for a validation split"):
        prepare_tokens(data, "s2hc-bpe-4k", tmp_path / "cache", "val", progress=False)


def test_a_save_to_disk_folder_without_its_state_file_is_named(tmp_path):
    datasets = pytest.importorskip("datasets", reason="save_to_disk folders need the data extra")
    table = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(25)]})
    single, split_of = tmp_path / "single", tmp_path / "dict"
    table.save_to_disk(str(single))
    datasets.DatasetDict({"train": table}).save_to_disk(str(split_of))
    (single / "state.json").unlink()
    (split_of / "train" / "state.json").unlink()
    remedy = "copy the whole folder, or save the dataset again with save_to_disk"
    expected = (f"{str(single)!r} holds the .arrow files of a datasets.save_to_disk folder but not its state.json; "
                f"{remedy}")
    assert one_line_error(lambda: iter_documents(single)) == expected  # at the call
    folder = tmp_path / "folder"
    folder.mkdir()
    (single).rename(folder / "single")
    assert one_line_error(lambda: iter_documents(folder)) == expected.replace(str(single), str(folder / "single"))
    assert one_line_error(lambda: iter_documents(split_of)) == (
        f"{str(split_of / 'train')!r}, the split 'train' of a datasets.save_to_disk DatasetDict, has no state.json; "
        f"{remedy}")


@pytest.mark.parametrize(("name", "content", "defect"), [
    ("bad.jsonl", '{"text": "a"}\n{"text": "b"\n', "is not valid JSON Lines (line 2: Expecting ',' delimiter)"),
    ("bad.json", '[{"text": "a"}, {"text": ', "is not valid JSON (Expecting value at line 1 column 26)"),
    ("deep.json", "[" * 100_000, "is not valid JSON (arrays or objects nested too deep to read"),
])
def test_a_malformed_local_data_file_of_hf_json_is_named_not_the_hub(name, content, defect, tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="hf: sources need the data extra")
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / name
    path.write_text(content)
    message = one_line_error(lambda: list(iter_documents("hf:json", data_files=str(path))))
    assert message.startswith(f"source 'hf:json': the data_files file {str(path)!r} {defect}"), message
    assert message.endswith("; fix it or remove it from data_files")
    assert "Hub" not in message and "unreachable" not in message


def test_the_cli_refuses_validation_data_that_is_the_training_data_in_one_line(corpus_file, docs, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    argv = ["train", "--preset", "tiny", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--no-progress", "--data", str(data), "--validation-data", str(data),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"s2hc train: error: validation source {str(data)!r} is the training data {str(data)!r}: a validation loss "
        "on training data measures nothing; name other data as validation_data, or leave it out to hold out "
        "validation_fraction of the training data")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
