"""Streamed data (s2hc.data.stream, StreamBatches): a split tokenised chunk by chunk as training reads it, cached
chunk by chunk, in an order that is deterministic and exactly resumable (across --resume, a kill, a deleted cache
and another process count). Offline: the Hub is replaced by ``datasets.IterableDataset.from_generator``."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import crash_after_checkpoint, small_config
from hypothesis import given
from hypothesis import strategies as st

from s2hc.data import TokenBatches, get_tokenizer, iter_documents, prepare_tokens
from s2hc.data import stream as stream_mod
from s2hc.data.loader import StreamBatches
from s2hc.data.stream import ChunkStream, chunk_target, first_tokens, should_stream
from s2hc.rundir import load_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bpe():
    return get_tokenizer("s2hc-bpe-4k")


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _docs(n: int) -> list[str]:
    return [f"Document {i} says {'word ' * (i % 29 + 1)}and ends." for i in range(n)]


def _all_chunks(stream: ChunkStream) -> list:
    stream.seek(0, 0, 0)
    chunks, k = [], 0
    while (chunk := stream.get(k)) is not None:
        chunks.append(chunk)
        k += 1
    return chunks


class CountingTokenizer:
    """A tokenizer that counts the documents it encodes."""

    def __init__(self, inner):
        self.inner, self.documents = inner, 0
        self.name, self.vocab_size, self.eot_id, self.fingerprint = (inner.name, inner.vocab_size, inner.eot_id,
                                                                    inner.fingerprint)

    def encode_batch(self, texts):
        self.documents += len(texts)
        return self.inner.encode_batch(texts)


def _join_stream_threads(timeout: float = 60) -> None:
    """Let the background tokenisers of collected loaders stop (they finish the chunk they are writing)."""
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith("s2hc-stream-"):
            thread.join(timeout)


# ------------------------------------------------------------------------------------------------ the chunks


@pytest.mark.parametrize("prefetch", [0, 2])
def test_chunks_are_the_whole_tokenisation_cut_at_document_ends(tmp_path, bpe, prefetch):
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(800))
    whole = prepare_tokens(source, bpe, tmp_path / "whole", "train", progress=False)
    tok = CountingTokenizer(bpe)
    with ChunkStream(source, tok, tmp_path / "c", "train", chunk_tokens=2000, first_chunk_tokens=300,
                     prefetch=prefetch) as stream:
        chunks = _all_chunks(stream)
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), whole)
    assert len(chunks) >= 6 and tok.documents == len(list(iter_documents(source, "train")))
    for chunk, after in zip(chunks, chunks[1:]):
        assert chunk.tokens[0] == bpe.eot_id and after.tokens[0] == bpe.eot_id  # cut where a document starts
        assert (after.index, after.doc_start, after.token_start) == (chunk.index + 1, chunk.doc_end, chunk.token_end)
        assert chunk.n_tokens >= chunk_target(chunk.index, 2000, 300)  # only the last may be short
        # the smallest count of whole documents that reaches the target: one document fewer would not
        last_document = int(np.flatnonzero(chunk.tokens == bpe.eot_id)[-1])
        assert last_document < chunk_target(chunk.index, 2000, 300)
    assert [chunk_target(k, 2000, 300) for k in range(5)] == [300, 600, 1200, 2000, 2000]

    # a second stream reads every chunk from the cache: not one document tokenised again
    again = CountingTokenizer(bpe)
    with ChunkStream(source, again, tmp_path / "c", "train", chunk_tokens=2000, first_chunk_tokens=300) as stream:
        reread = _all_chunks(stream)
    assert again.documents == 0 and stream.chunks_read == len(chunks) and stream.documents_pulled == 0
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(chunks, reread))
    (key_dir,) = (tmp_path / "c").iterdir()
    meta = json.loads((key_dir / "meta.json").read_text())
    assert key_dir.name.startswith("stream-") and meta["dtype"] == "uint16"
    end = json.loads((key_dir / "train" / "end.json").read_text())
    assert {k: end[k] for k in ("n_chunks", "n_documents", "n_tokens", "key", "split")} == {
        "n_chunks": len(chunks), "n_documents": chunks[-1].doc_end, "n_tokens": len(whole), "key": key_dir.name,
        "split": "train"}
    assert end["checksum"] == stream_mod.record_checksum(end)


def test_max_tokens_ends_the_stream_as_prepare_tokens_does(tmp_path, bpe):
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(300))
    capped = prepare_tokens(source, bpe, tmp_path / "whole", "train", progress=False, max_tokens=2345)
    with ChunkStream(source, bpe, tmp_path / "c", "train", max_tokens=2345, chunk_tokens=500,
                     first_chunk_tokens=500) as stream:
        chunks = _all_chunks(stream)
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), capped)
    assert first_tokens(source, bpe, tmp_path / "c", "val", 100).tolist() == prepare_tokens(
        source, bpe, tmp_path / "whole", "val", progress=False)[:100].tolist()


def test_a_damaged_or_half_written_chunk_is_never_trusted(tmp_path, bpe):
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(400))
    options = dict(chunk_tokens=1000, first_chunk_tokens=1000)
    with ChunkStream(source, bpe, tmp_path / "c", "train", **options) as stream:
        expected = np.concatenate([c.tokens for c in _all_chunks(stream)])
    split_dir = stream.directory
    with open(split_dir / "00000001.bin", "r+b") as f:  # truncated (copied by hand, a full disk)
        f.truncate(10)
    data = bytearray((split_dir / "00000002.bin").read_bytes())  # same size, one token changed
    data[4] ^= 1
    (split_dir / "00000002.bin").write_bytes(bytes(data))
    (split_dir / "00000003.json").unlink()  # killed between the .bin and its .json
    (split_dir / "end.json").unlink()
    (split_dir / ".00000004.bin.s2hc-0123abcd.tmp").write_bytes(b"half")  # a killed write's temporary file
    tok = CountingTokenizer(bpe)
    with ChunkStream(source, tok, tmp_path / "c", "train", **options) as again:
        chunks = _all_chunks(again)
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), expected)
    assert again.chunks_tokenised == 3 and again.chunks_read == len(chunks) - 3


def _edit_record(path: Path, **changes) -> None:
    """Change fields of a chunk's ``.json`` (or ``end.json``) by hand, its checksum left as it was."""
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


def _damage(kind: str, split_dir: Path, other_dir: Path, outside: Path) -> list[str]:
    """Damage the cache of a split as ``kind`` says; the files the stream must name."""
    chunk1, chunk2 = split_dir / "00000001", split_dir / "00000002"
    if kind == "doc_end edited":  # the next chunk would start at another document: other training data
        _edit_record(Path(f"{chunk1}.json"), doc_end=json.loads(Path(f"{chunk1}.json").read_text())["doc_end"] + 1)
        return [f"{chunk1}.json"]
    if kind == "end.json edited":  # the split would end after chunk 1
        end = json.loads((split_dir / "end.json").read_text())
        chunk2_record = json.loads(Path(f"{chunk2}.json").read_text())
        _edit_record(split_dir / "end.json", n_chunks=2, n_documents=chunk2_record["doc_start"],
                     n_tokens=chunk2_record["token_start"])
        assert end["n_chunks"] > 2
        return [str(split_dir / "end.json")]
    if kind == "bins swapped":  # the same size; each .json names the other's sha256
        a, b = Path(f"{chunk1}.bin").read_bytes(), Path(f"{chunk2}.bin").read_bytes()
        Path(f"{chunk1}.bin").write_bytes(b[: len(a)] if len(b) >= len(a) else b + a[len(b):])
        return [f"{chunk1}.bin"]
    if kind == "chunk of another stream":  # another run's cache (another source), its chunk 1 copied in
        (other,) = other_dir.rglob("train")
        for suffix in (".bin", ".json"):
            Path(f"{chunk1}{suffix}").write_bytes((other / f"00000001{suffix}").read_bytes())
        return [f"{chunk1}.json"]
    if kind == "truncated":
        with open(f"{chunk1}.bin", "r+b") as f:
            f.truncate(10)
        return [f"{chunk1}.bin"]
    if kind == "no checksum":  # a record written by hand, or by an older s2hc
        record = json.loads(Path(f"{chunk1}.json").read_text())
        del record["checksum"]
        Path(f"{chunk1}.json").write_text(json.dumps(record))
        return [f"{chunk1}.json"]
    # "symlink outside": the .bin and .json links to files elsewhere, even to the right bytes: never followed
    for suffix in (".bin", ".json"):
        target = outside / f"linked{suffix}"
        target.write_bytes(Path(f"{chunk1}{suffix}").read_bytes())
        Path(f"{chunk1}{suffix}").unlink()
        Path(f"{chunk1}{suffix}").symlink_to(target)
    return [f"{chunk1}.json"]


DAMAGES = ["doc_end edited", "end.json edited", "bins swapped", "chunk of another stream", "truncated",
           "no checksum", "symlink outside"]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_chunk_record_is_said_in_one_line_and_tokenised_again(kind, tmp_path, bpe, capfd):
    """Everything that decides the data is checked (a chunk's document range as well as its tokens, where the split
    ends, which stream a chunk is of, what a file is): a chunk that fails is named in one line, tokenised again and
    rewritten, and the tokens are those of a whole tokenisation; a file a link pointed to is left as it was."""
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(400))
    other = _write_jsonl(tmp_path / "other.jsonl", _docs(500)[100:])
    outside = tmp_path / "outside"
    outside.mkdir()
    options = dict(chunk_tokens=1000, first_chunk_tokens=1000)
    with ChunkStream(other, bpe, tmp_path / "other-cache", "train", **options) as stream:
        _all_chunks(stream)
    with ChunkStream(source, bpe, tmp_path / "c", "train", **options) as stream:
        expected = np.concatenate([c.tokens for c in _all_chunks(stream)])
    named = _damage(kind, stream.directory, tmp_path / "other-cache", outside)
    linked = {p.name: p.read_bytes() for p in outside.iterdir()}
    capfd.readouterr()
    with ChunkStream(source, bpe, tmp_path / "c", "train", **options) as again:
        chunks = _all_chunks(again)
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), expected)
    err = capfd.readouterr().err.strip().splitlines()
    assert again.damaged == named and len(err) == len(named), err
    for path, line in zip(named, err):
        assert line.startswith(f"s2hc: token cache file {path!r} is not trusted (") and line.endswith(
            "; tokenising that part of split 'train' again"), line
    assert again.chunks_tokenised >= (0 if kind == "end.json edited" else 1)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == linked  # the link's target untouched
    assert not any(p.is_symlink() for p in again.directory.iterdir())
    with ChunkStream(source, bpe, tmp_path / "c", "train", **options) as third:  # the cache is whole again
        assert np.array_equal(np.concatenate([c.tokens for c in _all_chunks(third)]), expected)
    assert third.chunks_tokenised == 0 and third.damaged == [] and capfd.readouterr().err == ""


def test_a_chunk_stream_killed_mid_write_leaves_only_whole_chunks(tmp_path, bpe):
    """SIGKILL while a process tokenises chunk after chunk: the next stream trusts only complete chunks and makes
    the same tokens as a whole tokenisation."""
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(2500))
    cache = tmp_path / "c"
    code = ("import sys; from s2hc.data.stream import ChunkStream\n"
            "s = ChunkStream(sys.argv[1], 's2hc-bpe-4k', sys.argv[2], 'train', chunk_tokens=512, "
            "first_chunk_tokens=512)\n"
            "k = 0\n"
            "while s.get(k) is not None: k += 1\n")
    process = subprocess.Popen([sys.executable, "-c", code, str(source), str(cache)], stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and len(list(cache.rglob("0*.json"))) < 8:
        time.sleep(0.02)
    assert process.poll() is None, process.communicate()[1].decode()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    written = len(list(cache.rglob("0*.json")))
    with ChunkStream(source, bpe, cache, "train", chunk_tokens=512, first_chunk_tokens=512) as stream:
        chunks = _all_chunks(stream)
    whole = prepare_tokens(source, bpe, tmp_path / "whole", "train", progress=False)
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), whole)
    assert stream.chunks_read >= written - 1 >= 7  # the one being written when killed may be incomplete


def test_streaming_rule(tmp_path, monkeypatch):
    source = _write_jsonl(tmp_path / "d.jsonl", _docs(50))
    assert should_stream("auto", "hf:HuggingFaceFW/fineweb-edu:sample-100BT")
    assert not should_stream("auto", "embedded") and not should_stream("auto", source)
    assert should_stream("always", source) and not should_stream("never", "hf:org/ds")
    monkeypatch.setattr(stream_mod, "AUTO_STREAM_BYTES", source.stat().st_size - 1)
    assert should_stream("auto", source) and should_stream("auto", tmp_path)  # a directory counts its files
    with pytest.raises(ValueError, match=r"^streaming='yes' is not allowed; use one of \['auto', 'always', 'never'\]$"):
        should_stream("yes", source)
    with pytest.raises(ValueError, match="does not exist"):
        should_stream("auto", tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------------ the loader


class ArangeStream:
    """A stand-in for ChunkStream: chunk ``k`` holds ``sizes[k]`` tokens numbered from where the last ended, so a
    window is known by its first token."""

    split, key = "train", "arange"

    def __init__(self, sizes):
        self.sizes, self.starts = sizes, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.position, self.gets = 0, []

    def seek(self, index, doc_start, token_start):
        assert doc_start == index and token_start == self.starts[index]
        self.position = index

    def get(self, index):
        assert index == self.position
        self.gets.append(index)
        if index >= len(self.sizes):
            return None
        self.position += 1
        tokens = np.arange(self.starts[index], self.starts[index + 1])
        return stream_mod.Chunk(index, index, index + 1, int(self.starts[index]), tokens)

    def close(self):
        pass


@given(
    sizes=st.lists(st.integers(1, 120), min_size=1, max_size=12),
    seq_len=st.integers(1, 9),
    batch_size=st.integers(1, 4),
    world_size=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    stop=st.integers(0, 40),
)
def test_stream_batches_property(sizes, seq_len, batch_size, world_size, seed, stop):
    """Every epoch takes each window of every chunk at most once, ranks split each global batch, and a loader
    restored from any rank's state at any step continues exactly (with another process count too)."""
    windows = [max(0, (n - 1) // seq_len) for n in sizes]
    global_batch = batch_size * world_size
    ranks = [StreamBatches(ArangeStream(sizes), seq_len, batch_size, seed, r, world_size) for r in range(world_size)]
    if sum(windows) < global_batch:
        with pytest.raises(ValueError, match="corpus too small"):
            next(ranks[0])
        return
    per_epoch = sum(windows) // global_batch
    starts = np.concatenate([[0], np.cumsum(sizes)])
    valid = {int(starts[k]) + j * seq_len for k, w in enumerate(windows) for j in range(w)}
    seen, state = [], None
    for step in range(2 * per_epoch + 1):
        if step == stop:
            state = json.loads(json.dumps(ranks[-1].state_dict()))
        parts = [next(r) for r in ranks]
        for x, y in parts:
            assert x.shape == (batch_size, seq_len) and torch.equal(y, x + 1)
        seen.append(torch.cat([x[:, 0] for x, _ in parts]).tolist())
    for epoch in (seen[:per_epoch], seen[per_epoch : 2 * per_epoch]):
        flat = [s for batch in epoch for s in batch]
        assert len(flat) == len(set(flat)) == per_epoch * global_batch and set(flat) <= valid
    if state is not None:  # one process with the whole global batch, from the state of the last rank
        single = StreamBatches(ArangeStream(sizes), seq_len, global_batch, seed)
        single.load_state_dict(state)
        assert [next(single)[0][:, 0].tolist() for _ in range(stop, len(seen))] == seen[stop:]


def test_stream_batches_read_only_the_chunks_from_the_state_on():
    sizes = [100] * 20
    loader = StreamBatches(ArangeStream(sizes), 10, 4, seed=1)
    batches = [next(loader)[0] for _ in range(30)]
    state = loader.state_dict()
    assert state["chunk"] == 30 * 4 // 9 and state["chunk_window"] == 9 * state["chunk"]
    assert state["chunk_token"] == 100 * state["chunk"] and state["chunk_document"] == state["chunk"]
    expected = [next(loader)[0] for _ in range(10)]
    fresh = ArangeStream(sizes)
    resumed = StreamBatches(fresh, 10, 4, seed=1)
    resumed.load_state_dict(state)
    fresh.gets.clear()
    assert all(torch.equal(next(resumed)[0], x) for x in expected)
    assert fresh.gets[0] == state["chunk"]  # the chunks before the position are not read again
    other_seed = StreamBatches(ArangeStream(sizes), 10, 4, seed=2)
    assert not all(torch.equal(next(other_seed)[0], x) for x in batches[:3])


def test_loader_states_do_not_mix():
    stream_state = StreamBatches(ArangeStream([500]), 10, 4, seed=1).state_dict()
    array = TokenBatches(np.arange(500), 10, 4, seed=1)
    with pytest.raises(ValueError, match="loader state is of a 'stream' loader"):
        array.load_state_dict(stream_state)
    loader = StreamBatches(ArangeStream([500]), 10, 4, seed=1)
    with pytest.raises(ValueError, match="loader state is of a whole-array loader"):
        loader.load_state_dict(array.state_dict())
    with pytest.raises(ValueError, match=r"seed: state 1, loader 2; global_batch: state 4, loader 8; stream_key: "
                                         r"state 'arange', loader 'other'"):
        other = ArangeStream([500])
        other.key = "other"
        StreamBatches(other, 10, 8, seed=2).load_state_dict(stream_state)
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({**stream_state, "chunk_window": 5})
    with pytest.raises(ValueError, match="streaming loader state version 9 is not 1"):
        loader.load_state_dict({**stream_state, "version": 9})


def test_global_batches_survive_another_process_count_and_a_deleted_cache(tmp_path, bpe):
    """1 process x 8 sequences, saved, resumed by 2 ranks x 4 (each with its own stream, rank 1 waiting for rank 0's
    chunks) after the cache was deleted: the same windows, in the same order, across the split's end."""
    import shutil

    source = _write_jsonl(tmp_path / "d.jsonl", _docs(300))
    options = dict(chunk_tokens=1500, first_chunk_tokens=400)

    def stream(cache, **more):
        return ChunkStream(source, bpe, tmp_path / cache, "train", **options, **more)

    single = StreamBatches(stream("a", prefetch=1), seq_len=16, batch_size=8, seed=5)
    reference = [next(single)[0] for _ in range(80)]
    assert single.epoch >= 1  # the split ended and the next epoch began
    single.stream.close()
    saved = StreamBatches(stream("b"), seq_len=16, batch_size=8, seed=5)
    for _ in range(11):
        next(saved)
    state = json.loads(json.dumps(saved.state_dict()))
    assert state["chunk"] >= 2
    shutil.rmtree(tmp_path / "b")
    ranks = [StreamBatches(stream("b", prefetch=2, wait_s=30.0 * r), seq_len=16, batch_size=4, seed=5, rank=r,
                           world_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for step, expected in enumerate(reference[11:]):
        assert torch.equal(torch.cat([next(loader)[0] for loader in ranks]), expected)
        if step == 0:  # tokenised again from the state's chunk on, not from the start
            assert min(p.name for p in (tmp_path / "b").rglob("0*.json")) == f"{state['chunk']:08d}.json"
    writer, follower = (loader.stream for loader in ranks)
    assert writer.chunks_tokenised > 0 and follower.chunks_tokenised == 0  # the follower read rank 0's chunks
    for loader in ranks:
        loader.stream.close()


# ------------------------------------------------------------------------------------------------ training


HUGE = 5_000_000  # documents the generator could yield


@pytest.fixture
def huge_hub_dataset(monkeypatch):
    """``hf:s2hc-test/huge`` as millions of synthetic documents from a generator; the list counts those pulled."""
    datasets = pytest.importorskip("datasets", reason="the hf: source needs the datasets package")
    pulled = [0]

    def documents(n):
        words = ("river", "stone", "light", "north", "quiet", "paper", "seven", "green", "storm", "glass")
        for i in range(n):
            pulled[0] += 1
            yield {"text": f"Record {i}: " + " ".join(words[(i * 7 + j * j) % 10] for j in range(5 + i % 40)) + "."}

    dataset = datasets.IterableDataset.from_generator(documents, gen_kwargs={"n": HUGE})
    calls = []

    def load_dataset(name, config=None, split=None, streaming=False, **options):
        calls.append((name, config, split, streaming))
        return dataset

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(stream_mod, "FIRST_CHUNK_TOKENS", 256)  # the checkpoint of step 2 lies beyond chunk 0
    monkeypatch.setattr(stream_mod, "CHUNK_TOKENS", 2048)
    yield pulled
    _join_stream_threads()
    assert calls and all(call[3] for call in calls)  # streamed


def _curve(run_dir) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)
            if "loss" in r or "val_loss" in r]


def test_training_streams_a_huge_dataset_and_resumes_exactly(huge_hub_dataset, tmp_path, monkeypatch, capsys):
    import s2hc.train.loop as loop
    from s2hc.train import train

    first_step = []
    real_step = loop._Run.optimizer_step

    def timed_step(self):
        if not first_step:
            first_step.append(time.perf_counter())
        return real_step(self)

    monkeypatch.setattr(loop._Run, "optimizer_step", timed_step)
    config = small_config("hf:s2hc-test/huge", tmp_path, max_steps=6, checkpoint_every=2, eval_every=3,
                          log_every=1, seq_len=32, batch_size=4)
    assert config.streaming == "auto"
    started = time.perf_counter()
    train(config)
    to_first_step = first_step[0] - started
    assert "streaming data='hf:s2hc-test/huge'" in capsys.readouterr().err
    with capsys.disabled():  # the measurement, for `pytest -s`
        print(f"\nstreamed hf: dataset of {HUGE:,} documents: {to_first_step:.2f} s to step 1, "
              f"{huge_hub_dataset[0]:,} documents pulled")
    assert huge_hub_dataset[0] < 5_000 < HUGE  # read what 6 steps of 4 x 32 tokens and the validation need
    assert to_first_step < 120  # seconds, on a loaded 2-core machine; tokenising it all would take hours
    bins = list(Path(config.cache_dir).rglob("*.bin"))
    assert sum(p.stat().st_size for p in bins) < 200_000  # 2 bytes a token: tens of thousands of tokens, no more
    assert any(p.parent.name == "train" for p in bins) and any(p.parent.name == "val" for p in bins)

    # interrupted right after the step-2 checkpoint (as a kill would), its cache kept or deleted: the resumed run's
    # losses and validation losses are the uninterrupted run's, step for step
    for keep_cache in (True, False):
        interrupted = config.replace(out=str(tmp_path / f"interrupted-{keep_cache}"),
                                     cache_dir=str(tmp_path / f"cache-{keep_cache}"))
        crash_after_checkpoint(interrupted, 2)
        _join_stream_threads()
        state = load_checkpoint(interrupted.out).loader
        assert state["kind"] == "stream" and state["step_in_epoch"] == 2 and state["chunk"] >= 1
        if not keep_cache:
            import shutil

            shutil.rmtree(interrupted.cache_dir)
        train(interrupted, resume=True)
        assert _curve(interrupted.out) == _curve(config.out)
        if not keep_cache:  # read again from the checkpoint's chunk on (the documents before it skipped)
            train_chunks = sorted(p.name for p in Path(interrupted.cache_dir).rglob("train/0*.json"))
            assert train_chunks[0] == f"{state['chunk']:08d}.json"
    assert all(math.isfinite(loss) for _, loss, _ in _curve(config.out) if loss is not None)


def test_streaming_never_and_always(tmp_path, corpus_file):
    """``streaming: never`` keeps the whole-array loader, ``always`` streams even a small local file; both train.
    A value that is neither is refused before the run starts."""
    from s2hc.train import train

    for streaming, kind, files in (("never", "array", {"train.bin", "val.bin"}),
                                   ("always", "stream", {"train/00000000.bin", "val/00000000.bin"})):
        config = small_config(corpus_file, tmp_path / streaming, streaming=streaming, max_steps=2)
        train(config)
        assert load_checkpoint(config.out).loader.get("kind", "array") == kind
        cache = Path(config.cache_dir)
        assert {p.relative_to(next(cache.iterdir())).as_posix() for p in cache.rglob("*.bin")} == files
    _join_stream_threads()
    with pytest.raises(ValueError, match=r"^streaming must be one of \['auto', 'always', 'never'\], got 'sometimes'$"):
        small_config(corpus_file, tmp_path / "bad", streaming="sometimes")  # refused with the config, before a run


@pytest.mark.slow
def test_streamed_training_resumes_with_another_process_count(tmp_path):
    """torchrun with 2 Gloo processes streams a file (each rank its own stream, rank 1 reading rank 0's chunks),
    saves after 4 steps, and 1 process resumes it: the loss curve is the one of 1 process from the start."""
    pytest.importorskip("torch.distributed")
    from s2hc.data.corpus import load_corpus

    paragraphs = [p for d in load_corpus("train")[:4] for p in d.split("\n\n") if p.strip()][:3000]
    source = _write_jsonl(tmp_path / "paragraphs.jsonl", paragraphs)

    def run(out, batch_size, max_steps, nproc=None, resume=False):
        argv = ["train", "--preset", "tiny", "--family", "s2hc", "--streams", "4",
                "--set", "model_overrides=" + json.dumps({"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
                                                          "ffn_dim": 64}),
                "--data", str(source), "--streaming", "always", "--cache-dir", str(tmp_path / "cache"),
                "--seq-len", "32", "--batch-size", str(batch_size), "--max-steps", str(max_steps),
                "--warmup-steps", "2", "--lr", "3e-3", "--set", "min_lr_ratio=1.0", "--eval-every", "0",
                "--set", "eval_batches=2", "--checkpoint-every", "2", "--log-every", "1", "--no-progress",
                "--out", str(out), *(["--resume"] if resume else []), *(["--nproc", str(nproc)] if nproc else [])]
        done = subprocess.run([sys.executable, "-m", "s2hc", *argv], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return [r["loss"] for r in read_metrics(out) if "loss" in r]

    reference = run(tmp_path / "single", batch_size=4, max_steps=6)
    run(tmp_path / "run", batch_size=2, max_steps=4, nproc=2)
    assert load_checkpoint(tmp_path / "run").loader["world_size"] == 2
    resumed = run(tmp_path / "run", batch_size=4, max_steps=6, resume=True)
    torch.testing.assert_close(resumed, reference, rtol=1e-5, atol=0)  # all-reduce order: a few ulps


def test_eval_of_a_streamed_run_scores_the_validation_set_training_scored(tmp_path, corpus_file):
    """A streamed validation split is ``eval_batches`` global batches: ``s2hc eval`` of a run trained by two
    processes scores twice the windows of one trained by one, as its training did (the checkpoint's
    ``world_size``), not the per-process batch's share."""
    from s2hc.evaluate.perplexity import checkpoint_perplexity
    from s2hc.rundir import resolve_checkpoint
    from s2hc.rundir.checkpoint import save_checkpoint
    from s2hc.train import train

    config = small_config(corpus_file, tmp_path / "run", streaming="always", max_steps=2, eval_batches=3,
                          batch_size=2)
    train(config)
    _join_stream_threads()
    one = checkpoint_perplexity(config.out, data=config.data, progress=False, device="cpu")
    assert one.windows == 3 * 2
    path = resolve_checkpoint(config.out)
    saved = load_checkpoint(path)
    saved.world_size = 2  # as a run of two processes at batch_size 2 records itself
    save_checkpoint(path, saved)
    two = checkpoint_perplexity(config.out, data=config.data, progress=False, device="cpu")
    assert two.windows == 3 * 2 * 2 and two.seq_len == config.seq_len
