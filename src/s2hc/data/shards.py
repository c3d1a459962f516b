"""Token shards: a source tokenised once into a flat memory-mapped array on disk, reused on every later run.

(A dataset too large to tokenise before training starts is streamed instead, chunk by chunk as training reads
it: :mod:`s2hc.data.stream`.)

Layout: ``cache_dir/<key>/<split>.bin`` (the raw token ids, native little-endian ``uint16`` when the vocabulary
has fewer than 65536 tokens, else ``uint32``) and ``cache_dir/<key>/meta.json`` (what made them, and per split
the number of tokens and documents). ``key`` is a hash of the format version, the source's identity
(:func:`s2hc.data.sources.source_identity`: files by path, size and mtime; the embedded corpus by its sha256;
``hf:`` datasets by name) and how it is read (a :class:`~s2hc.data.sources.SourceSpec`), the tokenizer's
fingerprint, and the spec's ``max_tokens``. Every document is
preceded by the end-of-text token, so ``eot`` separates documents (and opens the stream).

Files are written to a temporary name and renamed, so a killed run never leaves a half-written shard that a
later run would trust. In a distributed run, call it on rank 0, wait at a barrier, then call it on the other
ranks (they find the shard and only map it).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..io import WriteError, atomic_write_json, check_output_dir, json_loads
from .corpus import load_corpus
from .sources import EMBEDDED, SourceSpec, identity_hash, iter_documents, make_spec, source_identity
from .tokenizer import Tokenizer, get_tokenizer

FORMAT_VERSION = 1
CACHE_ARGUMENT = "--cache-dir"  # the token cache: TrainConfig.cache_dir, --cache-dir, or $S2HC_CACHE_DIR
_BATCH_DOCS = 256
_BATCH_CHARS = 8_000_000


def default_cache_dir() -> Path:
    """``$S2HC_CACHE_DIR/tokens`` if set, else ``~/.cache/s2hc/tokens``."""
    root = os.environ.get("S2HC_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "s2hc") / "tokens"


def stored_cache_dir(stored: str | os.PathLike | None) -> Path | None:
    """The token cache to use for a checkpoint that recorded ``stored`` as its run's ``cache_dir``: that path when
    it is an existing directory this process can write on this machine, else None (:func:`default_cache_dir`).
    A shared checkpoint's cache path belongs to another machine; tokens are never written there blindly."""
    if stored is None:
        return None
    path = Path(stored).expanduser()
    return path if path.is_dir() and os.access(path, os.W_OK | os.X_OK) else None


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` for vocabularies below 65536 tokens, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size < 2**16 else np.dtype(np.uint32)


def shard_key(source, tokenizer: Tokenizer, spec: SourceSpec | None = None) -> tuple[str, dict]:
    """``(key, identity)``: the cache directory name for this source read as ``spec`` says (its ``max_tokens``
    the cap), and this tokenizer, and what it hashes."""
    spec = SourceSpec() if spec is None else spec
    identity = {
        "format_version": FORMAT_VERSION,
        "source": source_identity(source, spec),
        "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
        "max_tokens": spec.max_tokens,
    }
    return identity_hash(identity)[:20], identity


def _read_meta(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json_loads(f.read())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION else None


def _existing(directory: Path, split: str) -> tuple[np.dtype, int] | None:
    """(dtype, n_tokens) of a complete shard of ``split`` in ``directory``, or None."""
    meta = _read_meta(directory / "meta.json")
    path = directory / f"{split}.bin"
    if meta is None or split not in meta.get("splits", {}) or not path.is_file():
        return None
    dtype = np.dtype(meta["dtype"])
    n = int(meta["splits"][split]["n_tokens"])
    if n <= 0 or path.stat().st_size != n * dtype.itemsize:
        return None
    return dtype, n


def _batches(docs, max_docs: int = _BATCH_DOCS, max_chars: int = _BATCH_CHARS):
    batch, chars = [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def prepare_tokens(
    source: str | os.PathLike = EMBEDDED,
    tokenizer: Tokenizer | str = "s2hc-bpe-4k",
    cache_dir: str | os.PathLike | None = None,
    split: str = "train",
    *,
    progress: bool = True,
    spec: SourceSpec | None = None,
    **options,
) -> np.memmap:
    """The token ids of one split of ``source`` as a read-only 1-D ``np.memmap`` (``uint16`` or ``uint32``).

    Tokenises on the first call (``eot`` before every document; unless ``progress=False``, a tqdm progress bar
    where stderr is a terminal, else a plain line before and one after, which a log file keeps as they are)
    into ``cache_dir/<key>/<split>.bin``; later calls with the same source, options and tokenizer map that file
    without tokenising. ``tokenizer``: a :class:`~s2hc.data.tokenizer.Tokenizer` or a spec for
    :func:`~s2hc.data.tokenizer.get_tokenizer`. ``cache_dir``: default :func:`default_cache_dir`.
    ``spec``: how the source is read (:class:`~s2hc.data.sources.SourceSpec`, for
    :func:`~s2hc.data.sources.iter_documents`: ``text_field``, ``val_source``, ``val_fraction``,
    ``max_documents``, ``max_chars``, ``hf_split``, ...), its ``max_tokens`` where to stop (the last document
    cut); ``options``: any of its fields by name, replacing the spec's (e.g. ``max_tokens=1000``).

    Errors: ``ValueError`` when the split has no documents (nothing is written), naming the field for a value the
    spec refuses, and the errors of the source and the tokenizer."""
    spec = make_spec(spec, **options)
    max_tokens = spec.max_tokens
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    docs = iter_documents(source, split, spec=spec)  # validates split, path and options first
    key, identity = shard_key(source, tok, spec)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    directory = root / key
    found = _existing(directory, split)
    if found is not None:  # a read-only cache that already holds the shard is fine
        dtype, n = found
        return np.memmap(directory / f"{split}.bin", dtype=dtype, mode="r", shape=(n,))

    check_output_dir(root, CACHE_ARGUMENT)  # a file, a path under a file, no permission, read-only: one line
    directory.mkdir(exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    total = _known_total(source, split, spec)
    n_tokens = n_docs = n_chars = 0
    t0 = time.perf_counter()
    shard = directory / f"{split}.bin"

    def written(operation, *arguments):  # a full disk names the shard (s2hc.io.WriteError), not a source file
        try:
            return operation(*arguments)
        except OSError as error:
            raise WriteError(shard, error) from error

    fd, tmp = written(tempfile.mkstemp, f"{split}.bin.", ".tmp", directory)
    try:
        from tqdm.auto import tqdm

        bar_shown = progress and sys.stderr.isatty()  # a log file would keep every '\r' redraw of a bar
        if progress and not bar_shown:
            print(f"tokenising {split} of {os.fspath(source)} into {directory}", file=sys.stderr, flush=True)
        with (
            os.fdopen(fd, "wb", buffering=0) as f,  # unbuffered: every failed write surfaces at its call
            tqdm(total=total, unit="doc", desc=f"tokenising {split}", disable=not bar_shown, dynamic_ncols=True) as bar,
        ):
            for batch in _batches(docs):
                for ids in tok.encode_batch(batch):
                    arr = np.empty(len(ids) + 1, dtype=np.int64)
                    arr[0] = tok.eot_id
                    arr[1:] = ids
                    if max_tokens is not None and n_tokens + len(arr) > max_tokens:
                        arr = arr[: max_tokens - n_tokens]
                    if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
                        raise ValueError(f"tokenizer {tok.name!r} produced an id outside [0, {tok.vocab_size})")
                    written(_write_all, f, arr.astype(dtype).tobytes())
                    n_tokens += len(arr)
                    n_docs += 1
                    if max_tokens is not None and n_tokens >= max_tokens:
                        break
                n_chars += sum(len(d) for d in batch)
                bar.update(len(batch))
                bar.set_postfix(tokens=f"{n_tokens:,}")
                if max_tokens is not None and n_tokens >= max_tokens:
                    break
            written(os.fsync, f.fileno())
        if n_docs == 0:
            raise ValueError(
                f"source {os.fspath(source)!r} split {split!r} has no documents (empty files, no records, or a "
                "cap of zero): nothing to tokenise"
            )
        written(os.chmod, tmp, 0o644)
        written(os.replace, tmp, shard)
        if progress and not bar_shown:
            print(f"tokenised {split}: {n_docs:,} documents, {n_tokens:,} tokens in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

    meta = _read_meta(directory / "meta.json") or {}
    meta.update(
        {
            "format_version": FORMAT_VERSION,
            "key": key,
            "identity": identity,
            "source": os.fspath(source),
            "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "dtype": dtype.name,
        }
    )
    meta.setdefault("splits", {})[split] = {
        "n_tokens": n_tokens,
        "n_documents": n_docs,
        "n_characters": n_chars,
        "seconds": round(time.perf_counter() - t0, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(directory / "meta.json", meta)
    return np.memmap(directory / f"{split}.bin", dtype=dtype, mode="r", shape=(n_tokens,))


def _write_all(file, data: bytes) -> None:
    """Write all of ``data`` to an unbuffered file (a raw write may take only part of it, e.g. on a disk filling up)."""
    view = memoryview(data)
    while view:
        view = view[file.write(view) :]


def _known_total(source, split: str, spec: SourceSpec) -> int | None:
    """Number of documents of the embedded corpus's ``split`` (a total for the progress bar); None otherwise."""
    if isinstance(source, str) and source == EMBEDDED and not spec.max_documents:
        return len(load_corpus(split))
    return None
