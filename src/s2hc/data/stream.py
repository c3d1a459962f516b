"""Streamed token shards: a split tokenised in bounded chunks as training reads it, each chunk cached once.

:func:`s2hc.data.shards.prepare_tokens` tokenises a whole split before the first step; for a dataset of billions
of tokens (``hf:HuggingFaceFW/fineweb-edu:sample-100BT``) that takes days and the whole dataset's tokens on disk.
A :class:`ChunkStream` instead reads the split's documents in order and tokenises them chunk by chunk, only as far
as it is asked (or ``prefetch`` chunks ahead, in a background thread), so the first chunk is ready in seconds
whatever the dataset's size and the cache grows only with what was read.

The token stream is the one ``prepare_tokens`` writes (``eot`` before every document, ``max_tokens`` cutting the
last one), cut at document ends into chunks: chunk ``k`` holds the documents from its first one on until it has
at least :func:`chunk_target` tokens (``first_chunk_tokens · 2^k``, at most ``chunk_tokens``: small first chunks
make the first step quick, later ones are large). A chunk is therefore fixed by its index, its first document
and its first token's position alone, and a later run, a resume or a re-tokenisation after the cache was deleted
makes exactly the same chunks.

Layout: ``cache_dir/stream-<key>/meta.json`` (what made them: the source's identity and options, the tokenizer,
the chunk sizes, the dtype) and per split ``cache_dir/stream-<key>/<split>/`` with ``NNNNNNNN.bin`` (chunk
``N``'s token ids, ``uint16`` below 65536 tokens else ``uint32``, native little-endian) and ``NNNNNNNN.json``
(its first and end document, its first token, its number of tokens, the sha256 of the ``.bin``, the stream's
key, split and dtype, and a ``checksum``: the sha256 of all of these), and ``end.json`` once the split was read
to its end (its number of chunks, documents and tokens, the key and split, and their ``checksum``). The ``.bin``
is written to a temporary file and renamed first, the ``.json`` after it the same way: a chunk is trusted only
when its ``.json`` is there, is a plain file (not a symbolic link), matches its checksum, is this stream's and
split's chunk at this position, and the ``.bin`` (a plain file too) matches its size and hash. So a run killed
at any moment leaves no chunk a later run trusts half-written, and a chunk truncated, edited (its ``doc_end``
as well as its tokens: every field that decides the data is checksummed), copied from another stream or
linked to a file elsewhere is never trained on: it is tokenised again, and the stream says so in one line on
stderr. A damaged ``end.json`` is ignored the same way (the split is read on to its real end).

Several processes (torchrun) may read the same split: each reads the documents itself where a chunk is not in
the cache; one that is told to ``wait_s`` first waits that long for another process (rank 0) to write the chunk,
and stops waiting for good once a wait was in vain (a cache that is not shared between nodes).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io import WriteError, atomic_write_bytes, atomic_write_json, check_output_dir, temporary_pattern
from .shards import CACHE_ARGUMENT, default_cache_dir, prepare_tokens, token_dtype
from .sources import (
    EMBEDDED,
    HF_PREFIX,
    STREAMING_CHOICES,
    SourceSpec,
    identity_hash,
    iter_documents,
    make_spec,
    resolve_files,
    source_identity,
)
from .tokenizer import Tokenizer, get_tokenizer

FORMAT_VERSION = 1
#: ``streaming``'s values (:data:`s2hc.data.sources.STREAMING_CHOICES`): ``auto`` streams ``hf:`` sources and local
#: ones above this many bytes.
AUTO_STREAM_BYTES = 1 << 30
#: The largest chunk (tokens; a chunk ends at the first document end at or after its target) and the first one.
CHUNK_TOKENS = 1 << 22
FIRST_CHUNK_TOKENS = 1 << 18
_ENCODE_DOCS = 64  # documents per encode_batch call
_ENCODE_CHARS = 1 << 20
_STALE_TEMPORARY_S = 3600  # temporary files older than this are a killed run's: removed when a stream opens
_POLL_S = 0.05


def should_stream(streaming: str, source) -> bool:
    """Whether ``source`` is streamed (:class:`ChunkStream`) rather than tokenised whole
    (:func:`~s2hc.data.shards.prepare_tokens`): ``"always"``, ``"never"``, or ``"auto"``: ``hf:`` sources, and
    local sources whose files hold more than :data:`AUTO_STREAM_BYTES` bytes; never the embedded corpus.
    ``ValueError`` naming ``streaming`` when it is none of :data:`STREAMING_CHOICES`."""
    if streaming not in STREAMING_CHOICES:
        raise ValueError(f"streaming={streaming!r} is not allowed; use one of {list(STREAMING_CHOICES)}")
    if streaming != "auto":
        return streaming == "always"
    if isinstance(source, str) and source == EMBEDDED:
        return False
    if isinstance(source, str) and source.startswith(HF_PREFIX):
        return True
    return local_bytes(source) > AUTO_STREAM_BYTES


def local_bytes(source) -> int:
    """Bytes on disk of the files a local source reads (a folder entry, e.g. a ``save_to_disk`` one: its files)."""
    total = 0
    for entry in resolve_files(source):
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total


def chunk_target(index: int, chunk_tokens: int | None = None, first_chunk_tokens: int | None = None) -> int:
    """The tokens chunk ``index`` holds at least (it ends at the first document end from there on, or where the
    split ends): ``first_chunk_tokens · 2^index``, at most ``chunk_tokens`` (defaults :data:`FIRST_CHUNK_TOKENS`,
    :data:`CHUNK_TOKENS`)."""
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    first_chunk_tokens = FIRST_CHUNK_TOKENS if first_chunk_tokens is None else first_chunk_tokens
    return min(chunk_tokens, first_chunk_tokens << min(index, 62))


@dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` of a split: ``tokens`` (1-D ``uint16``/``uint32``, read-only) are the documents
    ``[doc_start, doc_end)`` of the split, starting at token ``token_start`` of its stream."""

    index: int
    doc_start: int
    doc_end: int
    token_start: int
    tokens: np.ndarray

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.tokens)


def stream_key(source, tokenizer: Tokenizer, spec: SourceSpec, *, chunk_tokens: int,
               first_chunk_tokens: int) -> tuple[str, dict]:
    """``(key, identity)``: the cache directory name (``stream-`` and 20 hex digits) of this source read as
    ``spec`` says (its ``max_tokens`` the cap), tokenizer and chunk sizes, and what it hashes."""
    identity = {
        "layout": "stream",
        "format_version": FORMAT_VERSION,
        "source": source_identity(source, spec),
        "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
        "max_tokens": spec.max_tokens,
        "chunk_tokens": chunk_tokens,
        "first_chunk_tokens": first_chunk_tokens,
    }
    return "stream-" + identity_hash(identity)[:20], identity


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def record_checksum(record: dict) -> str:
    """The sha256 of a chunk's or an end's record, every field but ``checksum`` itself (keys sorted)."""
    fields = {key: value for key, value in record.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()


def _with_checksum(record: dict) -> dict:
    return {**record, "checksum": record_checksum(record)}


class ChunkStream:
    """The chunks of one split of ``source``, read from the cache or tokenised as they are asked for.

    ``get(k)`` returns chunk ``k`` (a :class:`Chunk`), or None when the split ends before it; chunks are asked
    for in order from where :meth:`seek` put the stream (chunk 0 at first), so that the documents are read
    once, in order. ``seek(k, doc_start, token_start)`` moves to chunk ``k``, whose first document and token
    are given (by a checkpoint's loader state, or the end of chunk ``k - 1``): a chunk in the cache is read,
    one that is not is tokenised from document ``doc_start`` on (skipping the documents before it).

    ``tokenizer``: a :class:`~s2hc.data.tokenizer.Tokenizer` or a spec. ``cache_dir``: default
    :func:`~s2hc.data.shards.default_cache_dir`. ``spec``: how the source is read
    (:class:`~s2hc.data.sources.SourceSpec`, for :func:`~s2hc.data.sources.iter_documents`), its ``max_tokens``
    where the split ends (the last document cut); ``options``: any of its fields by name, replacing the spec's.
    ``chunk_tokens`` / ``first_chunk_tokens``: :func:`chunk_target` (None: the module's
    :data:`CHUNK_TOKENS` / :data:`FIRST_CHUNK_TOKENS` at the call). ``prefetch``: chunks
    tokenised ahead of the last one asked for, in a background thread (0: none; chunks are tokenised in
    ``get``). ``wait_s``: before tokenising a chunk that is not in the cache, wait up to this long for another
    process to write it (see the module docstring). Close it (:meth:`close`, or ``with``) to stop its thread.

    Errors: those of the source and the tokenizer (raised by ``get``, from whichever thread met them),
    ``ValueError`` when the split has no documents, or fewer than a seek says it has (the source changed),
    :class:`~s2hc.io.WriteError` naming the chunk when the disk refuses it."""

    def __init__(self, source, tokenizer: Tokenizer | str, cache_dir=None, split: str = "train", *,
                 chunk_tokens: int | None = None, first_chunk_tokens: int | None = None, prefetch: int = 0,
                 wait_s: float = 0.0, spec: SourceSpec | None = None, **options):
        spec = make_spec(spec, **options)
        chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
        first_chunk_tokens = FIRST_CHUNK_TOKENS if first_chunk_tokens is None else first_chunk_tokens
        for name, value in (("chunk_tokens", chunk_tokens), ("first_chunk_tokens", first_chunk_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; use a positive integer")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r} is not allowed; use an integer >= 0")
        self.tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        iter_documents(source, split, spec=spec)  # validates split, path and options now, reads nothing
        self.source, self.split, self.spec = source, split, spec
        self.max_tokens, self.chunk_tokens, self.first_chunk_tokens = spec.max_tokens, chunk_tokens, first_chunk_tokens
        self.key, self.identity = stream_key(source, self.tokenizer, spec, chunk_tokens=chunk_tokens,
                                             first_chunk_tokens=first_chunk_tokens)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        check_output_dir(root, CACHE_ARGUMENT)  # a file, no permission, read-only: one line, before any work
        self.directory = root / self.key / split
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self._write_meta(root / self.key / "meta.json")
        self._remove_stale_temporaries()
        self.prefetch, self.wait_s = prefetch, float(wait_s)
        self._following = self.wait_s > 0
        # counters (for tests and reports): documents taken from the source (read or skipped), chunks made
        self.documents_pulled = 0
        self.chunks_tokenised = 0
        self.chunks_read = 0
        self.damaged: list[str] = []  # the cache files found damaged (each said once, then tokenised again)
        # the producer's cursor: the next chunk, its first document and token (touched by the producer only)
        self._k, self._doc, self._token = 0, 0, 0
        self._docs: Iterator[str] | None = None
        self._carry: collections.deque[np.ndarray] = collections.deque()  # tokenised documents not in a chunk yet
        self._next_doc = 0  # index of the document _carry[0] (or the iterator's next one) is
        # the consumer <-> producer hand-over
        self._cond = threading.Condition()
        self._generation = 0
        self._pending: tuple[int, int, int] | None = None
        self._wanted = -1
        self._ready: dict[int, Chunk | None] = {}
        self._finished = False
        self._end_index: int | None = None  # the chunk index the split ends at, once the producer met it
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ the consumer

    def seek(self, index: int, doc_start: int, token_start: int) -> None:
        """Continue at chunk ``index``, which starts at document ``doc_start`` and token ``token_start``."""
        with self._cond:
            self._generation += 1
            self._pending = (int(index), int(doc_start), int(token_start))
            self._wanted = int(index) - 1
            self._ready.clear()
            self._finished = False
            self._end_index = None
            self._cond.notify_all()

    def get(self, index: int) -> Chunk | None:
        """Chunk ``index`` (the one after the last returned, or the one :meth:`seek` named), or None at the end."""
        if self.prefetch == 0:
            self._apply_pending()
            if index != self._k:
                raise RuntimeError(f"chunk {index} asked for, but the stream is at chunk {self._k}; seek first")
            return self._produce()
        with self._cond:
            if self._closed:
                raise RuntimeError("the chunk stream is closed")
            self._start_thread()
            self._wanted = max(self._wanted, index)
            self._cond.notify_all()
            while index not in self._ready and self._error is None and not self._closed and not (
                    self._end_index is not None and index >= self._end_index):
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if self._closed and index not in self._ready:
                raise RuntimeError("the chunk stream is closed")
            return self._ready.pop(index, None)

    def _start_thread(self) -> None:  # under self._cond
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._work, name=f"s2hc-stream-{self.split}", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the background thread (after the chunk it is writing, if any)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ the producer

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._pending is None and (
                        self._finished or self._k > self._wanted + self.prefetch):
                    self._cond.wait()
                if self._closed:
                    return
                self._apply_pending()
                generation, index = self._generation, self._k
            try:
                chunk = self._produce()
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                if generation == self._generation:  # else a seek came meanwhile: the chunk stays in the cache only
                    self._ready[index] = chunk
                    self._finished = chunk is None
                    if chunk is None:
                        self._end_index = index
                    self._cond.notify_all()

    def _apply_pending(self) -> None:
        if self._pending is not None:
            self._k, self._doc, self._token = self._pending
            self._pending = None

    def _produce(self) -> Chunk | None:
        """The chunk at the cursor (read, waited for, or tokenised), the cursor moved past it; None at the end."""
        k, doc, token = self._k, self._doc, self._token
        if self._at_end(k, doc, token):
            return None
        chunk = self._read(k, doc, token)
        if chunk is None and self._following:
            deadline = time.monotonic() + self.wait_s
            while chunk is None and time.monotonic() < deadline and not self._at_end(k, doc, token):
                time.sleep(_POLL_S)
                chunk = self._read(k, doc, token)
            if chunk is None and self._at_end(k, doc, token):
                return None
            self._following = chunk is not None  # a wait in vain: the cache is not shared, tokenise from now on
        if chunk is None:
            chunk = self._tokenise(k, doc, token)
            if chunk is None:
                return None
        else:
            self.chunks_read += 1
        self._k, self._doc, self._token = k + 1, chunk.doc_end, chunk.token_end
        return chunk

    def _bin(self, k: int) -> Path:
        return self.directory / f"{k:08d}.bin"

    def _json(self, k: int) -> Path:
        return self.directory / f"{k:08d}.json"

    def _at_end(self, k: int, doc: int, token: int) -> bool:
        end = self._record(self.directory / "end.json")
        return end is not None and (end.get("n_chunks"), end.get("n_documents"), end.get("n_tokens")) == (k, doc, token)

    def _damaged(self, path: Path, why: str) -> None:
        """Say once, in one line, that a cache file is not trusted (it is tokenised again, never trained on)."""
        if str(path) in self.damaged:
            return
        self.damaged.append(str(path))
        print(f"s2hc: token cache file {str(path)!r} is not trusted ({why}); tokenising that part of split "
              f"{self.split!r} again", file=sys.stderr, flush=True)

    def _record(self, path: Path) -> dict | None:
        """The record of a chunk's ``.json`` or of ``end.json`` when it is there and trusted: a plain file, JSON,
        matching its checksum, of this stream and split. None (said once when it is there but damaged) else."""
        if path.is_symlink():
            self._damaged(path, f"a symbolic link to {os.readlink(path)!r}, not a file the stream wrote")
            return None
        if not path.exists():
            return None
        record = _read_json(path)
        if record is None:
            self._damaged(path, "not a JSON object: cut short or overwritten")
        elif "checksum" not in record:
            self._damaged(path, "it has no checksum: written by an older s2hc, or by hand")
        elif record.get("checksum") != record_checksum(record):
            self._damaged(path, "its fields do not match its checksum: edited or damaged")
        elif (record.get("key"), record.get("split")) != (self.key, self.split):
            self._damaged(path, f"it belongs to stream {record.get('key')!r} split {record.get('split')!r}, not "
                                f"{self.key!r} split {self.split!r}: copied from another cache")
        else:
            return record
        return None

    def _read(self, k: int, doc: int, token: int) -> Chunk | None:
        """Chunk ``k`` from the cache if it is there, trusted (:meth:`_record`), starts at ``doc`` and ``token``,
        and its ``.bin`` matches; else None."""
        path = self._json(k)
        meta = self._record(path)
        if meta is None:
            return None
        if (meta.get("chunk"), meta.get("doc_start"), meta.get("token_start")) != (k, doc, token):
            self._damaged(path, f"it is chunk {meta.get('chunk')!r} from document {meta.get('doc_start')!r}, token "
                                f"{meta.get('token_start')!r}, not chunk {k} from document {doc}, token {token}")
            return None
        n, doc_end = meta.get("n_tokens"), meta.get("doc_end")
        if not (isinstance(n, int) and n > 0 and isinstance(doc_end, int) and doc_end > doc
                and meta.get("dtype") == self.dtype.name):
            self._damaged(path, "its token count, end document or dtype is not possible")
            return None
        bin_path = self._bin(k)
        if bin_path.is_symlink():
            self._damaged(bin_path, f"a symbolic link to {os.readlink(bin_path)!r}, not a file the stream wrote")
            return None
        try:
            data = bin_path.read_bytes()
        except OSError as error:
            self._damaged(bin_path, f"it cannot be read: {error.strerror or error}")
            return None
        if len(data) != n * self.dtype.itemsize:
            self._damaged(bin_path, f"{len(data)} bytes, not the {n * self.dtype.itemsize} of its {n} tokens: "
                                    "truncated or replaced")
            return None
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            self._damaged(bin_path, "its tokens do not match their sha256: damaged or replaced")
            return None
        return Chunk(k, doc, doc_end, token, np.frombuffer(data, dtype=self.dtype))

    def _tokenise(self, k: int, doc: int, token: int) -> Chunk | None:
        """Tokenise chunk ``k`` from document ``doc`` (token ``token``) on and write it; None (and ``end.json``)
        when the split has no document left there."""
        self._skip_to(doc)
        target, cap = chunk_target(k, self.chunk_tokens, self.first_chunk_tokens), self.max_tokens
        parts, n, ended = [], 0, False
        while n < target:
            if cap is not None and token + n >= cap:
                ended = True
                break
            ids = self._next_document()
            if ids is None:
                ended = True
                break
            if cap is not None and token + n + len(ids) > cap:
                ids = ids[: cap - token - n]
            parts.append(ids)
            n += len(ids)
        ended = ended or (cap is not None and token + n >= cap)
        if not parts:
            if k == 0:
                raise ValueError(
                    f"source {os.fspath(self.source)!r} split {self.split!r} has no documents (empty files, no "
                    "records, or a cap of zero): nothing to tokenise"
                )
            self._write_end(k, doc, token)
            return None
        tokens = np.concatenate(parts).astype(self.dtype)
        data = tokens.tobytes()
        atomic_write_bytes(self._bin(k), lambda f: f.write(data))
        chunk = Chunk(k, doc, doc + len(parts), token, tokens)
        atomic_write_json(self._json(k), _with_checksum({
            "chunk": k, "doc_start": doc, "doc_end": chunk.doc_end, "token_start": token, "n_tokens": len(tokens),
            "sha256": hashlib.sha256(data).hexdigest(), "key": self.key, "split": self.split,
            "dtype": self.dtype.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }))
        self.chunks_tokenised += 1
        if ended:
            self._write_end(k + 1, chunk.doc_end, chunk.token_end)
        return chunk

    def _write_end(self, n_chunks: int, n_documents: int, n_tokens: int) -> None:
        atomic_write_json(self.directory / "end.json", _with_checksum({
            "n_chunks": n_chunks, "n_documents": n_documents, "n_tokens": n_tokens, "key": self.key,
            "split": self.split}))

    def _skip_to(self, doc: int) -> None:
        """Position the documents so that the next one is document ``doc`` of the split (reading from the start
        again when it lies behind, skipping the documents before it)."""
        if self._docs is None or self._next_doc > doc:
            self._docs = iter_documents(self.source, self.split, spec=self.spec)
            self._carry.clear()
            self._next_doc = 0
        while self._carry and self._next_doc < doc:
            self._carry.popleft()
            self._next_doc += 1
        while self._next_doc < doc:  # the carry is empty: skip documents of the source
            if next(self._docs, None) is None:
                raise ValueError(
                    f"source {os.fspath(self.source)!r} split {self.split!r} has {self._next_doc} documents, fewer "
                    f"than the token cache or the checkpoint says were read ({doc}): the source changed; train "
                    "on it anew, or restore it"
                )
            self.documents_pulled += 1
            self._next_doc += 1

    def _next_document(self) -> np.ndarray | None:
        """The next document's ids (``eot`` first, int64), or None when the split ends."""
        if not self._carry:
            batch, chars = [], 0
            for text in self._docs:
                batch.append(text)
                chars += len(text)
                if len(batch) >= _ENCODE_DOCS or chars >= _ENCODE_CHARS:
                    break
            if not batch:
                return None
            self.documents_pulled += len(batch)
            tok = self.tokenizer
            for ids in tok.encode_batch(batch):
                arr = np.empty(len(ids) + 1, dtype=np.int64)
                arr[0] = tok.eot_id
                arr[1:] = ids
                if arr.min() < 0 or arr.max() >= tok.vocab_size:
                    raise ValueError(f"tokenizer {tok.name!r} produced an id outside [0, {tok.vocab_size})")
                self._carry.append(arr)
        self._next_doc += 1
        return self._carry.popleft()

    # ------------------------------------------------------------------------------------------ the cache

    def _write_meta(self, path: Path) -> None:
        meta = {
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "identity": self.identity,
            "source": os.fspath(self.source),
            "tokenizer": {"name": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size,
                          "eot_id": self.tokenizer.eot_id},
            "dtype": self.dtype.name,
        }
        if _read_json(path) != meta:
            try:
                atomic_write_json(path, meta)
            except WriteError:
                if _read_json(path) != meta:  # another process wrote the same at the same moment: fine
                    raise

    def _remove_stale_temporaries(self) -> None:
        """Remove the temporary files a killed run left (never trusted: only renamed files are read)."""
        now = time.time()
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith(".") and name.endswith(".tmp"):
                target = name[1:].split(".s2hc-")[0]
                if temporary_pattern(target).fullmatch(name):
                    try:
                        if now - path.stat().st_mtime > _STALE_TEMPORARY_S:
                            path.unlink()
                    except OSError:
                        pass


def first_tokens(source, tokenizer: Tokenizer | str, cache_dir=None, split: str = "val", n_tokens: int = 1, *,
                 spec: SourceSpec | None = None, chunk_tokens: int | None = None,
                 first_chunk_tokens: int | None = None) -> np.ndarray:
    """The first ``n_tokens`` tokens of ``split`` of ``source`` read as ``spec`` says (all of them when it has
    fewer), as :func:`~s2hc.data.shards.prepare_tokens` would make them, read through the stream's cache (only the
    first chunks are tokenised): a bounded, fixed validation set of a streamed source. 1-D ``uint16``/``uint32``."""
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} is not allowed; use a positive integer")
    stream = ChunkStream(source, tokenizer, cache_dir, split, chunk_tokens=chunk_tokens,
                         first_chunk_tokens=first_chunk_tokens, spec=spec)
    parts, have, k = [], 0, 0
    while have < n_tokens:
        chunk = stream.get(k)
        if chunk is None:
            break
        parts.append(chunk.tokens)
        have += chunk.n_tokens
        k += 1
    return np.concatenate(parts)[:n_tokens]


def validation_tokens(source, tokenizer: Tokenizer | str, cache_dir=None, *, spec: SourceSpec | None = None,
                      seq_len: int, batch_size: int, eval_batches: int, progress: bool = False) -> np.ndarray:
    """The validation tokens a run with these settings evaluates on (``spec``: how the source is read, a
    :class:`~s2hc.data.sources.SourceSpec`, ``val_source`` and ``streaming`` among them): the whole validation
    split (``prepare_tokens``) unless the validation source streams (:func:`should_stream` with the spec's
    ``streaming``), else its first ``eval_batches × batch_size`` windows of ``seq_len`` (:func:`first_tokens`), so
    that a streamed dataset's validation set is fixed and bounded. For every caller that evaluates a run's data
    the way training does."""
    spec = SourceSpec() if spec is None else spec
    if should_stream(spec.streaming, spec.val_source or source):
        needed = max(eval_batches, 1) * batch_size * seq_len + 1
        return first_tokens(source, tokenizer, cache_dir, "val", needed, spec=spec)
    return prepare_tokens(source, tokenizer, cache_dir, "val", progress=progress, spec=spec)
