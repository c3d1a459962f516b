"""Where documents come from: the embedded corpus, the user's files, or Hugging Face ``datasets``.

``iter_documents(source, split)`` yields the documents (str) of one split of a source, in a fixed order:

- ``"embedded"`` (the default): the shipped corpus (:mod:`s2hc.data.corpus`), with its own validation split.
- a ``.txt`` file, or a directory: each ``.txt`` file is one document (UTF-8, undecodable bytes replaced; a file
  that is mostly not text, or holds NUL bytes, is refused: :func:`check_text`).
  Without ``val_source``, the last ``val_fraction`` of every file (cut at a blank line, else at a line end,
  near that point) is the validation split and the rest the training split.
- a ``.jsonl`` / ``.jsonl.gz`` file: one JSON object per line, its ``text_field`` (default ``"text"``) a document.
- a ``.parquet`` file: its ``text_field`` column (needs ``pyarrow``).
- a directory: every ``.txt``, ``.jsonl``, ``.jsonl.gz`` and ``.parquet`` file under it, sorted by path.
- ``"hf:NAME"`` or ``"hf:NAME:CONFIG"``: ``datasets.load_dataset(NAME, CONFIG, split=hf_split, streaming=True)``
  (e.g. ``"hf:HuggingFaceFW/fineweb-edu:sample-10BT"``); needs the network (or the local Hub cache) and the
  ``datasets`` package.

For record sources (JSONL, Parquet, ``hf:``) without ``val_source``, the validation split is every
``k``-th record, ``k = round(1 / val_fraction)`` (records ``k-1, 2k-1, ...`` counted over the whole source), and
the training split the others: deterministic, interleaved, and computable while streaming. With ``val_source``
(another source of any kind) the training split is all of ``source`` and the validation split all of
``val_source``. ``max_documents`` caps the number of documents yielded (per split), ``max_chars`` their total
characters (the last document is cut): the way to take a slice of a huge streamed dataset.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..extras import require
from .corpus import corpus_fingerprint, load_corpus

EMBEDDED = "embedded"
HF_PREFIX = "hf:"
SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def parse_hf(source: str) -> tuple[str, str | None]:
    """``"hf:NAME[:CONFIG]"`` -> ``(NAME, CONFIG or None)``."""
    rest = source[len(HF_PREFIX) :]
    name, _, config = rest.partition(":")
    if not name:
        raise ValueError(f"source={source!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG'")
    return name, (config or None)


def resolve_files(source: str | os.PathLike) -> list[Path]:
    """The files a local source reads, sorted; ``ValueError`` naming the path if it does not exist, or names a
    file of an unsupported kind, or a directory holding none of the supported files."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"source {os.fspath(source)!r} does not exist (expected 'embedded', 'hf:NAME[:CONFIG]', or a path to a "
            ".txt / .jsonl / .jsonl.gz / .parquet file or a directory of them)"
        )
    if path.is_file():
        if _kind(path) is None:
            raise ValueError(
                f"source {os.fspath(source)!r}: unsupported file type; use .txt, .jsonl, .jsonl.gz or .parquet"
            )
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) is not None)
    if not files:
        raise ValueError(
            f"source {os.fspath(source)!r} is a directory with no .txt, .jsonl, .jsonl.gz or .parquet files"
        )
    return files


def required_packages(source: str | os.PathLike) -> tuple[str, ...]:
    """The optional packages reading ``source`` needs (:mod:`s2hc.extras`), found without reading it: ``datasets``
    for ``hf:``, ``pyarrow`` for Parquet files. A path that does not exist needs nothing (it fails later, by name)."""
    if isinstance(source, str) and source.startswith(HF_PREFIX):
        return ("datasets",)
    if source == EMBEDDED:
        return ()
    path = Path(source).expanduser()
    if path.is_file():
        return ("pyarrow",) if _kind(path) == "parquet" else ()
    if path.is_dir() and any(p.is_file() and _kind(p) == "parquet" for p in path.rglob("*")):
        return ("pyarrow",)
    return ()


def _val_every(val_fraction: float) -> int:
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction={val_fraction!r} is not allowed; use a number in (0, 0.5]")
    return max(2, round(1.0 / val_fraction))


def _split_text(text: str, split: str, val_fraction: float) -> str:
    """Head (train) or tail (val) of one text file, cut near ``1 - val_fraction`` at a paragraph or line end."""
    target = int(len(text) * (1.0 - val_fraction))
    cut = -1
    for sep in ("\n\n", "\n"):
        # search a window around the target so a huge paragraph does not move the cut far
        lo = max(0, target - max(2000, len(text) // 50))
        cut = text.rfind(sep, lo, target + 1)
        if cut >= 0:
            cut += len(sep)
            break
    if cut <= 0:
        cut = target
    return text[:cut] if split == "train" else text[cut:]


#: A .txt file is refused as not text when more than this share of its characters are undecodable bytes
#: or control characters (a binary file renamed .txt); fewer are replaced (U+FFFD) and the file is read.
MAX_NON_TEXT_SHARE = 0.05
_CONTROL = dict.fromkeys(c for c in range(32) if chr(c) not in "\t\n\r\f\v")


def _iter_text_file(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:  # universal newlines: \r\n -> \n
        text = f.read()
    check_text(text, path)
    yield text


def check_text(text: str, path: Path | str) -> None:
    """ValueError naming ``path`` when ``text`` (read from it with undecodable bytes replaced) is not text: it
    holds NUL characters (binary data, or UTF-16), or more than :data:`MAX_NON_TEXT_SHARE` of it is replaced
    bytes and control characters."""
    if "\x00" in text:
        raise ValueError(
            f"{str(path)!r} is not a UTF-8 text file (it contains NUL bytes: binary data, or UTF-16 text); "
            "convert it to UTF-8 text or remove it from the source"
        )
    if not text:
        return
    bad = text.count("\ufffd") + len(text) - len(text.translate(_CONTROL))
    if bad > MAX_NON_TEXT_SHARE * len(text):
        raise ValueError(
            f"{str(path)!r} is not a UTF-8 text file ({bad / len(text):.0%} of its characters are undecodable "
            "bytes or control characters); convert it to UTF-8 text or remove it from the source"
        )


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    compressed = path.name.lower().endswith(".gz")
    try:
        yield from _jsonl_records(path, text_field, compressed)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{str(path)!r} is not UTF-8 text ({e.encoding} cannot decode it: {e.reason}); convert it to UTF-8"
        ) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        what = "not a gzip file" if isinstance(e, gzip.BadGzipFile) else "a truncated or damaged gzip file"
        raise ValueError(f"{str(path)!r} is {what} ({e}); recompress it or remove it from the source") from None


def _jsonl_records(path: Path, text_field: str, compressed: bool) -> Iterator[str]:
    opener = gzip.open if compressed else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no field text_field={text_field!r} (found {keys})")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
            yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    pq = require("pyarrow.parquet", f"reading {path}")
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise ValueError(f"{path}: no column text_field={text_field!r} (columns: {names})")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{path}: column {text_field!r} holds {type(text).__name__}, not strings")
                if text is not None:
                    yield text
    except (pa.ArrowException, OSError, EOFError) as e:  # a truncated or foreign file: ArrowInvalid, ArrowIOError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{str(path)!r} is not a readable Parquet file ({first}); rewrite it or remove it from the source"
        ) from None


def _hf_error(source: str, e: BaseException) -> ValueError:
    return ValueError(
        f"source {source!r}: the Hugging Face dataset could not be loaded ({type(e).__name__}): the Hub is "
        "unreachable or offline (HF_HUB_OFFLINE), the name or config does not exist, or it needs a login"
    )


def _iter_hf(source: str, text_field: str, hf_split: str) -> Iterator[str]:
    datasets = require("datasets", f"source {source!r}")
    name, config = parse_hf(source)
    try:
        ds = datasets.load_dataset(name, config, split=hf_split, streaming=True)
        # a streaming dataset fetches lazily: failures can surface on the first record as well
        for record in ds:
            if text_field not in record:
                raise ValueError(
                    f"source {source!r}: records have no field text_field={text_field!r} (found {sorted(record)})"
                )
            text = record[text_field]
            if isinstance(text, str):
                yield text
    except ValueError as e:
        if str(e).startswith(f"source {source!r}"):
            raise
        raise _hf_error(source, e) from e
    except (ImportError, GeneratorExit, KeyboardInterrupt):
        raise
    except Exception as e:
        raise _hf_error(source, e) from e


def _iter_records(source: str | os.PathLike, text_field: str, hf_split: str) -> Iterator[str]:
    """All records of a record source or all files of a local source, in order, before any split."""
    if isinstance(source, str) and source.startswith(HF_PREFIX):
        yield from _iter_hf(source, text_field, hf_split)
        return
    for path in resolve_files(source):
        kind = _kind(path)
        if kind == "text":
            yield from _iter_text_file(path)
        elif kind == "jsonl":
            yield from _iter_jsonl(path, text_field)
        else:
            yield from _iter_parquet(path, text_field)


def _split_source(source, split, *, text_field, val_fraction, hf_split) -> Iterator[str]:
    """One split of a source that has no separate validation source."""
    if isinstance(source, str) and source == EMBEDDED:
        yield from load_corpus(split)
        return
    every = _val_every(val_fraction)
    is_hf = isinstance(source, str) and source.startswith(HF_PREFIX)
    index = 0
    for path_or_none in [None] if is_hf else resolve_files(source):
        if path_or_none is not None and _kind(path_or_none) == "text":
            # a text file is one (often the only) document: hold out its tail
            for text in _iter_text_file(path_or_none):
                yield _split_text(text, split, val_fraction)
            continue
        records = _iter_hf(source, text_field, hf_split) if is_hf else _iter_records(path_or_none, text_field, hf_split)
        for text in records:
            in_val = index % every == every - 1
            index += 1
            if in_val == (split == "val"):
                yield text


def iter_documents(
    source: str | os.PathLike = EMBEDDED,
    split: str = "train",
    *,
    text_field: str = "text",
    val_source: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    max_documents: int | None = None,
    max_chars: int | None = None,
    hf_split: str = "train",
) -> Iterator[str]:
    """Yield the documents (non-empty str) of ``split`` (``"train"`` or ``"val"``) of ``source``; see the module
    docstring for the sources and how the validation split is held out.

    ``text_field``: the JSON field / Parquet column / dataset field holding the text. ``val_source``: a separate
    validation source (then ``source`` is all training data). ``val_fraction``: the share held out otherwise,
    in (0, 0.5]. ``max_documents`` / ``max_chars``: caps on what is yielded. ``hf_split``: the split of a
    Hugging Face dataset to stream (of ``val_source`` too when that is an ``hf:`` source).

    Errors: ``ValueError`` naming the path for a missing or unsupported path or a damaged file (a ``.jsonl.gz``
    that is not gzip or is truncated, a ``.jsonl`` that is not UTF-8, a broken Parquet file, a ``.txt`` that is
    not text), naming the field for a record without it, and one sentence for a Hub dataset that cannot be
    reached. Damaged files fail when they are read, i.e. on iteration."""
    _check_split(split)
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents={max_documents!r} is not allowed; use a positive integer or None")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars={max_chars!r} is not allowed; use a positive integer or None")
    _val_every(val_fraction)
    for src in (source,) if val_source is None else (source, val_source):
        if not (isinstance(src, str) and (src == EMBEDDED or src.startswith(HF_PREFIX))):
            resolve_files(src)  # a missing path fails here, at the call, not at the first next()
    if val_source is None:
        docs = _split_source(source, split, text_field=text_field, val_fraction=val_fraction, hf_split=hf_split)
    else:
        chosen = source if split == "train" else val_source
        if EMBEDDED in (source, val_source):
            raise ValueError("source 'embedded' has its own validation split; do not combine it with val_source")
        docs = _iter_records(chosen, text_field, hf_split)
    return _capped(docs, max_documents, max_chars)


def _capped(docs: Iterator[str], max_documents: int | None, max_chars: int | None) -> Iterator[str]:
    n_docs = n_chars = 0
    for text in docs:
        if not text:
            continue
        if max_chars is not None and n_chars + len(text) > max_chars:
            text = text[: max_chars - n_chars]
        yield text
        n_docs += 1
        n_chars += len(text)
        if (max_documents is not None and n_docs >= max_documents) or (max_chars is not None and n_chars >= max_chars):
            return


def source_identity(
    source: str | os.PathLike = EMBEDDED,
    *,
    text_field: str = "text",
    val_source: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    max_documents: int | None = None,
    max_chars: int | None = None,
    hf_split: str = "train",
) -> dict[str, Any]:
    """A JSON-serialisable description of everything that decides the documents ``iter_documents`` yields, for
    cache keys: local files by resolved path, size and modification time (an edited file changes it), the
    embedded corpus by the sha256 of its file, ``hf:`` sources by name (a dataset changed on the Hub is not
    noticed: delete the cache to refetch)."""

    def one(src) -> dict[str, Any]:
        if isinstance(src, str) and src == EMBEDDED:
            return {"kind": "embedded", "sha256": corpus_fingerprint()}
        if isinstance(src, str) and src.startswith(HF_PREFIX):
            name, config = parse_hf(src)
            return {"kind": "hf", "name": name, "config": config, "hf_split": hf_split}
        files = []
        for p in resolve_files(src):
            st = p.stat()
            files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
        return {"kind": "files", "path": str(Path(src).expanduser().resolve()), "files": files}

    ident = {
        "source": one(source),
        "text_field": text_field,
        "max_documents": max_documents,
        "max_chars": max_chars,
    }
    if val_source is not None:
        ident["val_source"] = one(val_source)
    elif not (isinstance(source, str) and source == EMBEDDED):
        ident["val_fraction"] = val_fraction
    return ident


def identity_hash(obj: Any) -> str:
    """sha256 hex digest of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode("utf-8")).hexdigest()
