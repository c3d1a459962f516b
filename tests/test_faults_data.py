"""Damaged inputs and impossible sizes: a damaged data file is refused with a ValueError
naming it and what is wrong (never a BadGzipFile, EOFError or UnicodeDecodeError traceback, never trained on
silently), and ``s2hc params`` counts factorial families without building the n! permutations."""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from s2hc import cli
from s2hc.data import iter_documents, prepare_tokens, sources
from s2hc.data.sources import MAX_NON_TEXT_SHARE
from s2hc.mixers import mhc_lite
from s2hc.params import MAX_PERMUTATION_SIZE, count_connection_params, param_table

# ------------------------------------------------------------------------------------------ damaged data files


def records(n: int = 2000) -> bytes:
    return b"".join(json.dumps({"text": f"line {i} of some text"}).encode() + b"\n" for i in range(n))


def write_damaged(kind: str, directory: Path) -> Path:
    """A file of ``kind``, damaged as ``kind`` says."""
    rng = random.Random(0)
    if kind == "jsonl.gz that is not gzip":
        path, data = directory / "a.jsonl.gz", records(10)
    elif kind == "truncated jsonl.gz":
        whole = gzip.compress(records())
        path, data = directory / "a.jsonl.gz", whole[: len(whole) // 2]
    elif kind == "jsonl that is not UTF-8":
        path, data = directory / "a.jsonl", '{"text": "café au lait"}\n'.encode("latin-1")
    elif kind == "broken parquet":
        path, data = directory / "a.parquet", b"PAR1" + bytes(rng.randrange(256) for _ in range(600))
    elif kind == "binary txt":
        path, data = directory / "a.txt", bytes(rng.randrange(256) for _ in range(4000))
    elif kind == "txt of high bytes":  # no NUL, but no text either
        path, data = directory / "a.txt", bytes(rng.randrange(128, 256) for _ in range(4000))
    else:  # "UTF-16 txt"
        path, data = directory / "a.txt", ("To be, or not to be: that is the question.\n" * 20).encode("utf-16")
    path.write_bytes(data)
    return path


DAMAGED = {  # kind: what the message says is wrong
    "jsonl.gz that is not gzip": "is not a gzip file",
    "truncated jsonl.gz": "is a truncated or damaged gzip file",
    "jsonl that is not UTF-8": "is not UTF-8 text",
    "broken parquet": "is not a readable Parquet file",
    "binary txt": "is not a UTF-8 text file",
    "txt of high bytes": "is not a UTF-8 text file",
    "UTF-16 txt": "is not a UTF-8 text file",
}


@pytest.mark.parametrize("kind", list(DAMAGED))
@pytest.mark.parametrize("split", ["train", "val"])
def test_a_damaged_file_is_refused_naming_it(kind, split, tmp_path):
    if kind == "broken parquet":
        pytest.importorskip("pyarrow")
    path = write_damaged(kind, tmp_path)
    with pytest.raises(ValueError) as error:
        list(iter_documents(str(path), split))
    assert str(path) in str(error.value) and DAMAGED[kind] in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["truncated jsonl.gz", "binary txt"])
def test_a_damaged_file_in_a_directory_is_named_and_nothing_is_cached(kind, tmp_path):
    source = tmp_path / "data"
    source.mkdir()
    (source / "good.txt").write_text("Good text, read first.\n" * 200)
    path = write_damaged(kind, source)
    path = path.rename(source / f"z-{path.name}")  # read after the good file
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=DAMAGED[kind]) as error:
        prepare_tokens(str(source), "s2hc-bpe-4k", cache, "train", progress=False)
    assert str(path) in str(error.value)
    assert not [p for p in cache.rglob("*") if p.is_file()]  # no partial shard, no temporary file


@pytest.mark.parametrize("kind", list(DAMAGED))
def test_eval_on_a_damaged_file_is_one_line_and_exit_2(kind, tiny_checkpoint, tmp_path, capsys):
    if kind == "broken parquet":
        pytest.importorskip("pyarrow")
    path = write_damaged(kind, tmp_path)
    argv = ["eval", str(tiny_checkpoint), "--data", str(path), "--cache-dir", str(tmp_path / "cache"),
            "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"s2hc eval: error: {str(path)!r} {DAMAGED[kind]}")


def test_train_on_a_damaged_file_is_one_line_and_exit_2(corpus_file, tmp_path, capsys):
    path = write_damaged("truncated jsonl.gz", tmp_path)
    argv = ["train", "--preset", "tiny", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--no-progress", "--data", str(path), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"s2hc train: error: {str(path)!r} is a truncated")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


LONG_LINE = 2000  # MAX_JSONL_LINE in these tests: a "huge" line without writing hundreds of megabytes
DEEP = 100_000  # levels of nesting: far past Python's recursion limit
DEFECTS = {  # kind: (file name, its bytes, what the message says is wrong)
    "malformed .json": ("a.json", b'[{"text": "a"}, {"text": ', "is not valid JSON (Expecting value at line 1"),
    "malformed .jsonl": ("a.jsonl", b'{"text": "a"}\n{"text": "b",}\n',
                         ":2: not a JSON object (Expecting property name"),
    ".json that is not UTF-8": ("a.json", '[{"text": "caf\u00e9"}]'.encode("latin-1"), "is not UTF-8 text"),
    ".json that is UTF-16": ("a.json", '[{"text": "a"}]'.encode("utf-16"), "is not UTF-8 text"),
    "huge single line": ("a.jsonl", b'[' + b'{"text": "word"}, ' * 400 + b']',
                         f":1: a line of more than {LONG_LINE:,} characters: JSON Lines holds one record"),
    "nested text field in .jsonl": ("a.jsonl", b'{"text": {"title": "a", "body": "b"}}\n',
                                    ":1: field 'text' is a JSON object, not a string"),
    "nested text field in .json": ("a.json", b'[{"text": ["a", "b"]}]',
                                   "record 1 of {path!r}: field 'text' is a JSON array, not a string"),
    "deeply nested .json": ("a.json", b"[" * DEEP + b"]" * DEEP, "is not valid JSON (arrays or objects nested too "
                            "deep to read"),
    "deeply nested .jsonl": ("a.jsonl", b'{"text": "a"}\n' + b'{"x": ' * DEEP + b"1" + b"}" * DEEP + b"\n",
                             ":2: not a JSON object (arrays or objects nested too deep to read)"),
}


def write_defect(kind: str, directory: Path, monkeypatch) -> tuple[Path, str]:
    """The file of ``kind`` in ``directory``, and what its message must say."""
    name, data, defect = DEFECTS[kind]
    if kind == "huge single line":
        monkeypatch.setattr(sources, "MAX_JSONL_LINE", LONG_LINE)
    path = directory / name
    path.write_bytes(data)
    return path, defect.format(path=str(path))


@pytest.mark.parametrize("kind", list(DEFECTS))
def test_a_malformed_data_file_is_one_line_naming_it_and_its_defect(kind, tmp_path, monkeypatch):
    path, defect = write_defect(kind, tmp_path, monkeypatch)
    started = time.perf_counter()
    with pytest.raises(ValueError) as error:
        list(iter_documents(str(path), "train"))
    message = str(error.value)
    assert str(path) in message and defect in message, message
    assert "\n" not in message and len(message) < 400 and time.perf_counter() - started < 10
    with pytest.raises(ValueError, match="nested too deep|not valid JSON|not UTF-8|not a JSON object|a line of|"
                                         "not a string"):  # a directory that holds it names the file too
        list(iter_documents(str(tmp_path), "val"))


@pytest.mark.parametrize("kind", ["malformed .json", "huge single line", "nested text field in .jsonl",
                                  "deeply nested .json"])
def test_train_on_a_malformed_data_file_is_one_line_and_exit_2(kind, tmp_path, capsys, monkeypatch):
    path, defect = write_defect(kind, tmp_path, monkeypatch)
    argv = ["train", "--preset", "tiny", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--no-progress", "--data", str(path), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("s2hc train: error: ") and str(path) in line and defect in line, line
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_nested_text_field_of_a_hub_dataset_is_refused_not_skipped(monkeypatch):
    """A Hub record whose text is a list or an object was skipped without a word (trained on nothing of it)."""
    datasets = pytest.importorskip("datasets", reason="hf: sources need the data extra")
    records = [{"text": "plain"}, {"text": None}, {"text": {"title": "a", "body": "b"}}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: iter(records))
    with pytest.raises(ValueError, match=r"^record 3 of source 'hf:org/nested': field 'text' holds a JSON object, "
                                         r"not a string$"):
        list(iter_documents("hf:org/nested", "train", val_fraction=0.5))


def test_a_text_file_with_a_few_bad_bytes_is_still_read(tmp_path):
    good = "Plain English text, with one stray byte.\n" * 100
    path = tmp_path / "mostly.txt"
    path.write_bytes(good.encode() + b"\xff\xfe")
    (text,) = iter_documents(str(path), "train", val_fraction=0.5)
    assert "\ufffd" not in text  # the stray bytes are in the tail (val), replaced
    (tail,) = iter_documents(str(path), "val", val_fraction=0.5)
    assert tail.endswith("\ufffd\ufffd")
    assert 2 / len(good) < MAX_NON_TEXT_SHARE


# --------------------------------------------------------------------------------------- counting, not allocating


def test_mhc_lite_at_12_streams_is_counted_without_building_its_permutations(monkeypatch):
    def never(n):
        raise AssertionError(f"the table of {n}! permutations was built")

    monkeypatch.setattr(mhc_lite, "permutation_matrices", never)
    started = time.perf_counter()
    rows = param_table(["mhc-lite", "kromhc"], layers=28, dim=1024, n_streams=12)
    assert time.perf_counter() - started < 60
    assert rows[0]["K"] == 479_001_600 and rows[1]["K"] == 2 + 2 + 6  # 12 = 2 · 2 · 3
    n, c, k = 12, 1024, 479_001_600  # nC(2n + K) + nC + 2n + 2 + (K + 1) per connection
    assert rows[0]["hc_params"] == 56 * (n * c * (2 * n + k) + n * c + 2 * n + 2 + k + 1)


@pytest.mark.parametrize(("family", "n"), [("mhc-lite", MAX_PERMUTATION_SIZE + 1), ("kromhc", 13), ("s2hc", 65),
                                           ("mhc", 100_000)])
def test_counting_past_the_stated_limits_is_refused(family, n):
    with pytest.raises(ValueError, match=r"s2hc stops at mixtures of 12 streams|n_streams must be at most 64"):
        count_connection_params(family, layers=1, dim=8, n_streams=n)


def _peak_rss_command(argv: list[str]) -> list[str]:
    code = ("import resource, sys; from s2hc.cli import main; status = main(sys.argv[1:]); "
            "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(status)")
    return [sys.executable, "-c", code, *argv]


def _limit_memory():  # 6 GiB of data: the old code needed 22 GB for n = 12 and was killed by the kernel
    resource.setrlimit(resource.RLIMIT_DATA, (6 << 30, 6 << 30))


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB and RLIMIT_DATA as on Linux")
def test_the_params_command_at_12_streams_stays_small_and_quick():
    started = time.perf_counter()
    done = subprocess.run(_peak_rss_command(["params", "--streams", "12", "--families", "mhc-lite", "--json"]),
                          capture_output=True, text=True, timeout=180, preexec_fn=_limit_memory,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout[: done.stdout.rindex("maxrss")])
    assert rows[0]["K"] == 479_001_600
    peak_kib = int(done.stdout.rsplit("maxrss", 1)[1])
    assert peak_kib < 2 * 1024 * 1024  # torch itself is a few hundred MB; the n! table alone would be 276 GB
    assert time.perf_counter() - started < 180
