"""Where documents come from: the embedded corpus, the user's files, or Hugging Face ``datasets``.

``iter_documents(source, split)`` yields the documents (str) of one split of a source, in a fixed order:

- ``"embedded"`` (the default): the shipped corpus (:mod:`s2hc.data.corpus`), with its own validation split.
- a ``.txt`` file, or a directory: each ``.txt`` file is one document (UTF-8, undecodable bytes replaced; a file
  that is mostly not text, or holds NUL bytes, is refused: :func:`check_text`).
  Without ``val_source``, the last ``val_fraction`` of every file (cut at a blank line, else at a line end,
  near that point) is the validation split and the rest the training split.
- a ``.jsonl`` / ``.jsonl.gz`` file: one JSON object per line, its ``text_field`` (default ``"text"``) a document.
- a ``.json`` file: a JSON array of records (objects; each one's ``text_field`` a document) or of strings (each a
  document; not both in one array), read by ``datasets``' JSON builder (needs the data extra). Unlike the others
  it is parsed whole, so it must fit in memory: use JSON Lines for large data.
- a ``.parquet`` file: its ``text_field`` column, read by ``datasets``' Parquet builder (needs the data extra).
- a ``datasets.save_to_disk`` folder (recognised by its ``dataset_info.json`` and ``state.json``, or by the
  ``dataset_dict.json`` of a ``DatasetDict``, whose split ``hf_split`` is read): its ``text_field`` column,
  read from the memory-mapped Arrow files (needs ``datasets``).
- a directory: every ``.txt``, ``.jsonl``, ``.jsonl.gz``, ``.json`` and ``.parquet`` file and every
  ``save_to_disk`` folder under it, sorted by path (the files inside a ``save_to_disk`` folder are its own).
- ``"hf:NAME"`` or ``"hf:NAME:CONFIG"``: ``datasets.load_dataset(NAME, CONFIG, split=hf_split, streaming=True)``
  (e.g. ``"hf:HuggingFaceFW/fineweb-edu:sample-10BT"``); needs the network (or the local Hub cache) and the
  ``datasets`` package. With ``data_files`` (a path, glob or list, or a comma-separated string of them), those
  files are read as the split ``hf_split``: ``"hf:json"`` / ``"hf:parquet"`` / ``"hf:csv"`` with local files
  (offline), or a Hub name with files of its repository.

For record sources (JSONL, JSON, Parquet, ``save_to_disk`` folders, ``hf:``) without ``val_source``, the
validation split is every ``k``-th record, ``k = round(1 / val_fraction)`` (records ``k-1, 2k-1, ...`` counted
over the whole source), and the training split the others: deterministic, interleaved, and computable while
streaming. With ``val_source`` (another source of any kind; ``data_files`` is not applied to it) the training
split is all of ``source`` and the validation split all of ``val_source``, which must hold documents and must not
be the training data (the same path, a copy of it, or a folder sharing a file with it). A record source too small
to hold out one record is refused naming its count. ``max_documents`` caps the number of
documents yielded (per split), ``max_chars`` their total characters (the last document is cut): the way to take a
slice of a huge streamed dataset. Everything but a ``.txt`` or ``.json`` file is read lazily, record by record.
"""

from __future__ import annotations

import contextlib
import filecmp
import glob
import gzip
import hashlib
import json
import numbers
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..extras import require
from ..hub import offline_if_unreachable
from ..io import json_loads
from .corpus import corpus_fingerprint, load_corpus

EMBEDDED = "embedded"
HF_PREFIX = "hf:"
SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet",)
#: The files a ``datasets.save_to_disk`` folder holds beside its Arrow files: a ``Dataset`` has both of the
#: first two, a ``DatasetDict`` the third (and a ``Dataset`` folder per split).
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")
SAVED_DATASET_DICT_FILE = "dataset_dict.json"
#: ``datasets``' packaged builders that read files (``hf:json`` etc.): their ``data_files`` are local paths.
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml")
_KINDS = ".txt, .jsonl, .jsonl.gz, .json or .parquet files or datasets.save_to_disk folders"
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}
#: The longest line of a ``.jsonl`` file read (characters): a record is one document; a longer line is a file that
#: is not JSON Lines (one huge array or object), and is refused before it fills the memory.
MAX_JSONL_LINE = 1 << 28
_SHOWN_KEYS = 10  # the fields of a record a message lists


#: ``SourceSpec.streaming``'s values: ``auto`` streams ``hf:`` sources and local ones above
#: :data:`s2hc.data.stream.AUTO_STREAM_BYTES` (:func:`s2hc.data.stream.should_stream`).
STREAMING_CHOICES = ("auto", "always", "never")
#: The largest share of a source's documents held out for validation (``val_fraction``, in ``(0, 0.5]``): every
#: ``round(1 / val_fraction)``-th record, so at most every second one.
MAX_VAL_FRACTION = 0.5


def _refuse(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed; use {allowed}")


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
        raise _refuse(name, value, "a positive integer or None")


def _name(name: str, value: Any, what: str, optional: bool = False) -> None:
    if not (optional and value is None) and (not isinstance(value, str) or not value.strip()):
        raise _refuse(name, value, f"the name of {what}" + (", or None" if optional else ""))


@dataclass(frozen=True)
class SourceSpec:
    """How a source is read and tokenised: every setting but the source itself, the split, the tokenizer and the
    cache. A run's is ``TrainConfig.source_spec()``; the functions that read a source take one (``spec=``):
    :func:`iter_documents`, :func:`source_identity`, :func:`s2hc.data.shards.prepare_tokens`,
    :class:`s2hc.data.stream.ChunkStream`, :func:`s2hc.data.stream.validation_tokens`, so that a run's splits
    are the same wherever they are read (training, ``eval``, ``diagnose``, a study's rows).

    ``text_field``: the JSON field / Parquet column / dataset field holding the text. ``val_source``: a separate
    validation source (then the source is all training data), whose text is in its field ``val_text_field``
    (default ``text_field``; only with ``val_source``). ``val_fraction``: the share held out otherwise, in
    ``(0, MAX_VAL_FRACTION]``. ``max_documents`` / ``max_chars``: caps on the documents read per split.
    ``hf_split``: the split of a Hugging Face dataset to stream, or of a ``save_to_disk`` DatasetDict (of
    ``val_source`` too). ``data_files``: the files of an ``hf:`` source (a path, glob or list, or a
    comma-separated string; a list is kept as a tuple), read as its split ``hf_split``. ``max_tokens``: tokenise
    at most this many tokens of each split (the last document cut). ``streaming``: whether the source is
    tokenised chunk by chunk as it is read, one of :data:`STREAMING_CHOICES`
    (:func:`s2hc.data.stream.should_stream`).

    Every value is checked when the spec is made: ValueError naming the field, its value and what is allowed.
    ``max_tokens`` and ``streaming`` do not decide the documents: :func:`source_identity` leaves them out (the
    token caches put ``max_tokens`` in their keys beside it)."""

    text_field: str = "text"
    val_source: str | os.PathLike | None = None
    val_text_field: str | None = None
    val_fraction: float = 0.05
    max_documents: int | None = None
    max_chars: int | None = None
    hf_split: str = "train"
    data_files: str | Sequence[str] | None = None
    max_tokens: int | None = None
    streaming: str = "auto"

    def __post_init__(self) -> None:
        _name("text_field", self.text_field, "the field that holds the text")
        if self.val_source is not None and not isinstance(self.val_source, (str, os.PathLike)):
            raise _refuse("val_source", self.val_source, "a source (a path, 'embedded' or 'hf:NAME[:CONFIG]') or None")
        _name("val_text_field", self.val_text_field, "the field of val_source that holds the text", optional=True)
        if self.val_text_field is not None and self.val_source is None:
            raise ValueError(f"val_text_field={self.val_text_field!r} names the text of a separate validation "
                             "source; without val_source the validation split is held out of source, read with "
                             "text_field")
        if (isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, numbers.Real)
                or not 0.0 < self.val_fraction <= MAX_VAL_FRACTION):
            raise _refuse("val_fraction", self.val_fraction, f"a number in (0, {MAX_VAL_FRACTION:g}]")
        for name in ("max_documents", "max_chars", "max_tokens"):
            _positive_or_none(name, getattr(self, name))
        _name("hf_split", self.hf_split, "a split of the dataset")
        parse_data_files(self.data_files)  # ValueError naming data_files
        if self.data_files is not None and not isinstance(self.data_files, (str, os.PathLike)):
            object.__setattr__(self, "data_files", tuple(self.data_files))  # a frozen spec holds no list
        if self.streaming not in STREAMING_CHOICES:
            raise _refuse("streaming", self.streaming, f"one of {list(STREAMING_CHOICES)}")

    @property
    def files(self) -> list[str] | None:
        """``data_files`` as a list (:func:`parse_data_files`), or None."""
        return parse_data_files(self.data_files)


def make_spec(spec: SourceSpec | None = None, **options: Any) -> SourceSpec:
    """``spec`` (default: :class:`SourceSpec`'s defaults) with the fields named in ``options`` replaced: how the
    functions that read a source take their settings, as a spec, by name, or both. TypeError for a name that is
    not a field, ValueError for a value the spec refuses."""
    spec = SourceSpec() if spec is None else spec
    if not isinstance(spec, SourceSpec):
        raise TypeError(f"spec must be an s2hc.data.sources.SourceSpec, got {type(spec).__name__}")
    return replace(spec, **options) if options else spec


def _keys(record: dict) -> str:
    """A record's fields for a message: the first :data:`_SHOWN_KEYS`, sorted, and how many more."""
    names = sorted(map(str, record))
    more = len(names) - _SHOWN_KEYS
    return str(names[:_SHOWN_KEYS]) + (f" and {more:,} more" if more > 0 else "")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def saved_dataset_kind(path: str | os.PathLike) -> str | None:
    """``"dataset"`` or ``"dataset_dict"`` when ``path`` is a folder written by ``datasets``' ``save_to_disk``
    (told by its files, without importing ``datasets``), else None."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return None
    if (path / SAVED_DATASET_DICT_FILE).is_file():
        return "dataset_dict"
    if all((path / name).is_file() for name in SAVED_DATASET_FILES):
        return "dataset"
    return None


def _check_incomplete_saved(path: Path) -> None:
    """ValueError naming the folder and the files it lacks when ``path`` holds the Arrow files of a
    ``datasets.save_to_disk`` Dataset (``*.arrow``) without both of :data:`SAVED_DATASET_FILES` (copied in part)."""
    if saved_dataset_kind(path) or not any(path.glob("*.arrow")):
        return
    missing = [name for name in SAVED_DATASET_FILES if not (path / name).is_file()]
    raise ValueError(
        f"{str(path)!r} holds the .arrow files of a datasets.save_to_disk folder but not its {' and '.join(missing)}; "
        "copy the whole folder, or save the dataset again with save_to_disk"
    )


def _entry_kind(path: Path) -> str | None:
    """What one entry of :func:`resolve_files` is: a file's kind, or ``"saved"`` for a save_to_disk folder."""
    if path.is_dir():
        return "saved" if saved_dataset_kind(path) else None
    return _kind(path)


def parse_hf(source: str) -> tuple[str, str | None]:
    """``"hf:NAME[:CONFIG]"`` -> ``(NAME, CONFIG or None)``."""
    rest = source[len(HF_PREFIX) :]
    name, _, config = rest.partition(":")
    if not name:
        raise ValueError(f"source={source!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG'")
    return name, (config or None)


def _is_hf(source) -> bool:
    return isinstance(source, str) and source.startswith(HF_PREFIX)


def resolve_files(source: str | os.PathLike) -> list[Path]:
    """The entries a local source reads, sorted: files, and ``save_to_disk`` folders (one entry each, whatever
    they hold). ``ValueError`` naming the path if it does not exist, or names a file of an unsupported kind, or
    a directory holding none of the supported files."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"source {os.fspath(source)!r} does not exist (expected 'embedded', 'hf:NAME[:CONFIG]', or a path to a "
            ".txt / .jsonl / .jsonl.gz / .json / .parquet file, a datasets.save_to_disk folder or a directory of them)"
        )
    if path.is_file():
        if _kind(path) is None:
            raise ValueError(
                f"source {os.fspath(source)!r}: unsupported file type; use .txt, .jsonl, .jsonl.gz, .json or .parquet"
            )
        return [path]
    if saved_dataset_kind(path):
        return [path]
    for folder in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        _check_incomplete_saved(folder)
    entries = sorted(p for p in path.rglob("*") if _entry_kind(p) is not None)
    saved = [p for p in entries if p.is_dir()]
    if saved:  # a save_to_disk folder's own .json files (and a DatasetDict's splits) are not documents
        entries = [p for p in entries if not any(folder in p.parents for folder in saved)]
    if not entries:
        raise ValueError(f"source {os.fspath(source)!r} is a directory with no {_KINDS}")
    return entries


def required_packages(source: str | os.PathLike | None) -> tuple[str, ...]:
    """The optional packages reading ``source`` needs (:mod:`s2hc.extras`), found without reading it: ``datasets``
    for ``hf:``, ``save_to_disk`` folders and ``.json`` files, ``datasets`` and its ``pyarrow`` for Parquet files.
    A path that does not exist needs nothing (it fails later, by name); nor does None (no source)."""
    if source is None or source == EMBEDDED:
        return ()
    if _is_hf(source):
        return ("datasets",)
    path = Path(source).expanduser()
    if path.is_file():
        return {"parquet": ("datasets", "pyarrow"), "json": ("datasets",)}.get(_kind(path), ())
    if saved_dataset_kind(path):
        return ("datasets",)
    if not path.is_dir():
        return ()
    needs = set()
    for p in path.rglob("*"):
        kind = _entry_kind(p)
        if kind == "parquet" and p.is_file():
            needs.update(("datasets", "pyarrow"))
        elif kind == "saved" or (kind == "json" and p.is_file()):
            needs.add("datasets")
    return tuple(name for name in ("datasets", "pyarrow") if name in needs)


def _val_every(val_fraction: float) -> int:
    """Every how many records one is held out for validation (``val_fraction`` checked by :class:`SourceSpec`)."""
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
        lineno = 0
        while line := f.readline(MAX_JSONL_LINE + 2):  # a line at most this long (and its newline) is read whole
            lineno += 1
            if len(line.rstrip("\r\n")) > MAX_JSONL_LINE:
                raise ValueError(
                    f"{path}:{lineno}: a line of more than {MAX_JSONL_LINE:,} characters: JSON Lines holds one "
                    "record (one document) per line; write the file one record per line"
                )
            if not line.strip():
                continue
            try:
                record = json_loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = _keys(record) if isinstance(record, dict) else f"a JSON {_json_name(record)}"
                raise ValueError(
                    f"{path}:{lineno}: no field text_field={text_field!r} (found {keys}); set --text-field"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is a JSON {_json_name(text)}, not a string")
            yield text


def _json_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


class _Unreadable(Exception):
    """What ``datasets`` raised reading a local file (None: it read something other than what the reader needs),
    for the reader to explain by name."""

    def __init__(self, error: BaseException | None):
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def _builder_quiet(builder: str) -> Iterator[None]:
    """``datasets``' packaged ``builder`` logs the error of a file it cannot read before raising it; the reader's
    one-line message names the file, so that log is dropped (that builder's error records only, meanwhile)."""
    import logging

    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")

    def drop(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _streamed(path: Path, builder: str, **options: Any):
    """The local file ``path`` as ``datasets``' packaged ``builder`` (``json``, ``parquet``) reads it:
    ``load_dataset(builder, data_files=path, streaming=True)``, read lazily and copied into no cache. MissingExtra
    without ``datasets``; _Unreadable for what it raises."""
    datasets = require("datasets", f"reading {str(path)!r}")
    try:
        with _builder_quiet(builder):
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    except (ImportError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise _Unreadable(e) from None


def _tables(dataset, builder: str) -> Iterator[Any]:
    """The rows of a :func:`_streamed` dataset as ``pyarrow`` tables of up to 1024 rows; _Unreadable for what
    ``datasets`` raises reading them."""
    with _builder_quiet(builder):
        tables = iter(dataset.with_format("arrow").iter(batch_size=1024))
        while True:
            try:
                table = next(tables)
            except StopIteration:
                return
            except (ImportError, KeyboardInterrupt):
                raise
            except Exception as e:
                raise _Unreadable(e) from None
            yield table


def _iter_json(path: Path, text_field: str) -> Iterator[str]:
    """The documents of a ``.json`` file: a JSON array of records (objects holding ``text_field``) or of strings,
    read by ``datasets``' JSON builder. The array is parsed whole (the file must fit in memory, several times
    over); JSON Lines (``.jsonl``) is read a line at a time.

    What the builder cannot read, or reads into other than strings (a record without the field, a value that is
    not a string, an array of both records and strings, not an array at all), is said by
    :func:`_json_array_defect`, naming the record (numbered from 1)."""
    with open(path, "rb") as f:
        head = f.read(103).removeprefix(b"\xef\xbb\xbf")[:100]  # a UTF-8 byte-order mark is allowed
    if not head.lstrip().startswith(b"["):  # an object, JSON Lines, not JSON or not UTF-8: said without datasets
        raise ValueError(_json_array_defect(path, text_field) or f"{str(path)!r} is not a JSON array")
    # datasets' JSON builder reads an array of strings as the column "text" (its test: no "{" before the first '"')
    column = text_field if b"{" in head.split(b'"', 1)[0] else "text"
    try:
        for table in _tables(_streamed(path, "json"), "json"):
            values = table.column(column) if column in table.column_names else None
            if values is None or not _holds_strings(values.type):
                raise _Unreadable(None)
            for text in values.to_pylist():
                if text is None:  # a record without the field, or with null
                    raise _Unreadable(None)
                yield text
    except _Unreadable as e:
        said = "" if e.error is None else f" ({type(e.error).__name__}: {_first_line(e.error)})"
        raise ValueError(_json_array_defect(path, text_field) or (
            f"{str(path)!r}: datasets could not read it as a JSON array of records or of strings{said}; write it "
            "as JSON Lines (.jsonl)")) from None


def _holds_strings(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _json_array_defect(path: Path, text_field: str) -> str | None:
    """What makes a ``.json`` file other than a JSON array of records holding ``text_field`` as a string, or of
    strings (the one-line message naming the file, and the record numbered from 1), or None when it is one.
    Parsed whole here (``datasets`` read it first: this is the explanation of what it could not)."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is allowed
            value = json_loads(f.read())
    except UnicodeDecodeError as e:
        return f"{str(path)!r} is not UTF-8 text ({e.encoding} cannot decode it: {e.reason}); convert it to UTF-8"
    except json.JSONDecodeError as e:
        where = f"{e.msg} at line {e.lineno} column {e.colno}"
        if e.msg == "Extra data":
            return (f"{str(path)!r} holds more than one JSON value ({where}): a file of one object per line is JSON "
                    "Lines, rename it .jsonl")
        return f"{str(path)!r} is not valid JSON ({where}); fix it or remove it from the source"
    if not isinstance(value, list):
        found = f"object (keys: {sorted(value)[:10]})" if isinstance(value, dict) else _json_name(value)
        return (f"{str(path)!r} holds a JSON {found}, not an array of records or of strings; write its documents as "
                "a JSON array, or one record per line as .jsonl")
    strings = bool(value) and isinstance(value[0], str)  # an array of strings, else of records: not both
    for number, item in enumerate(value, start=1):
        if isinstance(item, str) and not strings:
            return (f"element {number} of {str(path)!r} is a string but element 1 a record: an array holds records "
                    "or strings, not both")
        if isinstance(item, str):
            continue
        if not isinstance(item, dict):
            return (f"element {number} of {str(path)!r} is a JSON {_json_name(item)}, not a record (an object) or a "
                    "string")
        if strings:
            return (f"element {number} of {str(path)!r} is a record but element 1 a string: an array holds records "
                    "or strings, not both")
        if text_field not in item:
            return (f"record {number} of {str(path)!r} has no field {text_field!r}; its fields: {_keys(item)}; "
                    "set --text-field")
        text = item[text_field]
        if not isinstance(text, str):
            return f"record {number} of {str(path)!r}: field {text_field!r} is a JSON {_json_name(text)}, not a string"
    return None


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of a Parquet file, read by ``datasets``' Parquet builder in batches (that column
    only)."""
    try:
        dataset = _streamed(path, "parquet", columns=[text_field])
        if text_field not in (dataset.features or {}):
            names = _streamed(path, "parquet").column_names
            raise ValueError(f"{path}: no column text_field={text_field!r} (columns: {names}); set --text-field")
        for table in _tables(dataset, "parquet"):
            for text in table.column(text_field).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{path}: column {text_field!r} holds a JSON {_json_name(text)}, not strings")
                if text is not None:
                    yield text
    except _Unreadable as e:  # a truncated or foreign file
        raise ValueError(
            f"{str(path)!r} is not a readable Parquet file ({_first_line(e.error)}); rewrite it or remove it from "
            "the source"
        ) from None


def _saved_splits(path: Path) -> list[str] | None:
    """The splits a DatasetDict folder's ``dataset_dict.json`` names (None when it cannot be read)."""
    try:
        with open(path / SAVED_DATASET_DICT_FILE, encoding="utf-8") as f:
            splits = json_loads(f.read()).get("splits")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(s) for s in splits] if isinstance(splits, list) else None


def _check_saved_split(path: Path, hf_split: str) -> None:
    """ValueError naming the splits there when ``path`` is a DatasetDict folder without ``hf_split``."""
    if saved_dataset_kind(path) != "dataset_dict":
        return
    splits = _saved_splits(path)
    if splits is not None and hf_split not in splits:
        raise ValueError(
            f"{str(path)!r} is a datasets.save_to_disk DatasetDict without the split data_split={hf_split!r}; "
            f"its splits: {splits}; set --data-split"
        )
    folder = path / hf_split
    missing = [name for name in SAVED_DATASET_FILES if not (folder / name).is_file()]
    if splits is not None and missing:
        raise ValueError(
            f"{str(folder)!r}, the split {hf_split!r} of a datasets.save_to_disk DatasetDict, has no "
            f"{' and '.join(missing)}; copy the whole folder, or save the dataset again with save_to_disk"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _iter_saved(path: Path, text_field: str, hf_split: str) -> Iterator[str]:
    """The ``text_field`` column of a ``save_to_disk`` folder (of its split ``hf_split`` for a DatasetDict), read
    in batches from its memory-mapped Arrow files."""
    datasets = require("datasets", f"reading the datasets.save_to_disk folder {str(path)!r}")
    _check_saved_split(path, hf_split)
    try:
        ds = datasets.load_from_disk(str(path))
    except (ImportError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise ValueError(
            f"{str(path)!r} is not a readable datasets.save_to_disk folder ({type(e).__name__}: {_first_line(e)}); "
            "save it again or remove it from the source"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if hf_split not in ds:
            raise ValueError(
                f"{str(path)!r} is a datasets.save_to_disk DatasetDict without the split data_split={hf_split!r}; "
                f"its splits: {list(ds)}; set --data-split"
            )
        ds = ds[hf_split]
    names = list(ds.column_names)
    if text_field not in names:
        raise ValueError(f"{str(path)!r} has no field {text_field!r}; its fields: {names}; set --text-field")
    for batch in ds.select_columns([text_field]).with_format(None).iter(batch_size=1024):
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{str(path)!r}: field {text_field!r} holds a JSON {_json_name(text)}, not "
                                 "strings")
            if text is not None:
                yield text


def parse_data_files(data_files: str | Sequence[str] | None) -> list[str] | None:
    """``data_files`` as a list: a comma-separated string is split (blanks dropped), a list kept; None stays
    None. ``ValueError`` for an empty one."""
    if data_files is None:
        return None
    try:
        if isinstance(data_files, (str, os.PathLike)):
            files = [part.strip() for part in os.fspath(data_files).split(",") if part.strip()]
        else:
            files = [os.fspath(part) for part in data_files]
    except TypeError:
        files = []
    if not files or not all(isinstance(f, str) and f for f in files):
        raise ValueError(f"data_files={data_files!r} is not allowed; use a path, a glob or a comma-separated list")
    return [os.path.expanduser(f) for f in files]


def _local_matches(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else (
        [pattern] if os.path.exists(pattern) else [])


def _check_hf(source: str, hf_split: str, data_files: list[str] | None) -> None:
    """What can be refused about an ``hf:`` source before ``datasets`` is asked: a ``save_to_disk`` folder named
    as ``hf:PATH``, and ``data_files`` of a file builder (``hf:json``, ...) that match no local file."""
    name, _ = parse_hf(source)
    if saved_dataset_kind(name):
        raise ValueError(
            f"source {source!r}: {name!r} is a datasets.save_to_disk folder: pass the path itself as --data, not hf:"
        )
    if data_files is not None and name in FILE_BUILDERS:
        for pattern in data_files:
            if "://" not in pattern and not _local_matches(pattern):  # a URL is datasets' to fetch
                raise ValueError(
                    f"source {source!r}: data_files entry {pattern!r} matches no file (paths are relative to the "
                    f"working directory {os.getcwd()!r})"
                )


def _json_defect(path: Path) -> str | None:
    """What is wrong with a local ``.json`` / ``.jsonl`` file ``datasets``' JSON builder could not read (one JSON
    value, or one per line, is what it reads), or None when it parses."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start}: {e.reason})"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if path.name.lower().endswith(".gz"):
        return None  # compressed: datasets' own reading of it is all there is
    try:
        json_loads(text)
        return None
    except json.JSONDecodeError as whole:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    json_loads(line)
                except json.JSONDecodeError as e:
                    if lineno == 1 and whole.msg != "Extra data":  # one JSON value, broken where it says
                        return f"is not valid JSON ({whole.msg} at line {whole.lineno} column {whole.colno})"
                    return f"is not valid JSON Lines (line {lineno}: {e.msg})"
    return None


def _local_data_files_error(source: str, e: BaseException, data_files: list[str]) -> ValueError | None:
    """For a file builder (``hf:json``, ...) with local ``data_files``: the local file at fault and its defect, or
    what ``datasets`` said of the files; the Hub is not involved. None for other sources."""
    name, _ = parse_hf(source)
    if name not in FILE_BUILDERS:
        return None
    files = [Path(p) for pattern in data_files if "://" not in pattern for p in _local_matches(pattern)]
    if name == "json":
        for path in files:
            if path.is_file() and (defect := _json_defect(path)) is not None:
                return ValueError(f"source {source!r}: the data_files file {str(path)!r} {defect}; fix it or "
                                  "remove it from data_files")
    return ValueError(f"source {source!r}: datasets could not read the data_files {[str(p) for p in files]} "
                      f"({type(e).__name__}: {_first_line(e)}); check those files")


def _hf_error(source: str, e: BaseException, hf_split: str = "train", data_files=None) -> ValueError:
    if isinstance(e, ValueError) and str(e).startswith("Bad split"):
        return ValueError(f"source {source!r} has no split data_split={hf_split!r} ({_first_line(e)}); "
                          "set --data-split")
    if data_files is not None and isinstance(e, (FileNotFoundError, StopIteration)):
        return ValueError(f"source {source!r}: data_files={data_files} matched no file ({type(e).__name__}: "
                          f"{_first_line(e)})")
    if data_files is not None and (local := _local_data_files_error(source, e, data_files)) is not None:
        return local
    return ValueError(
        f"source {source!r}: the Hugging Face dataset could not be loaded ({type(e).__name__}): the Hub is "
        "unreachable or offline (HF_HUB_OFFLINE), the name or config does not exist, or it needs a login"
    )


def _iter_hf(source: str, text_field: str, hf_split: str, data_files: list[str] | None = None) -> Iterator[str]:
    datasets = require("datasets", f"source {source!r}")
    name, config = parse_hf(source)
    _check_hf(source, hf_split, data_files)
    options = {} if data_files is None else {"data_files": {hf_split: data_files}}  # the files are that split
    offline = contextlib.ExitStack()
    if data_files is None:  # a Hub dataset: without a network, the cache at once rather than five retries
        offline.enter_context(offline_if_unreachable())
    try:
        ds = datasets.load_dataset(name, config, split=hf_split, streaming=True, **options)
        # a streaming dataset fetches lazily: failures can surface on the first record as well
        for number, record in enumerate(ds, start=1):
            if text_field not in record:
                raise ValueError(
                    f"record {number} of source {source!r} has no field {text_field!r}; its fields: "
                    f"{sorted(record)}; set --text-field"
                )
            text = record[text_field]
            if text is not None and not isinstance(text, str):
                raise ValueError(f"record {number} of source {source!r}: field {text_field!r} holds a JSON "
                                 f"{_json_name(text)}, not a string")
            if text is not None:
                yield text
    except ValueError as e:
        if str(e).startswith((f"source {source!r}", "record ")):
            raise
        raise _hf_error(source, e, hf_split, data_files) from e
    except (ImportError, GeneratorExit, KeyboardInterrupt):
        raise
    except Exception as e:
        raise _hf_error(source, e, hf_split, data_files) from e
    finally:
        offline.close()


def _iter_entry(path: Path, text_field: str, hf_split: str) -> Iterator[str]:
    """The records of one entry of :func:`resolve_files` (a file, or a save_to_disk folder)."""
    kind = _entry_kind(path)
    if kind == "text":
        yield from _iter_text_file(path)
    elif kind == "jsonl":
        yield from _iter_jsonl(path, text_field)
    elif kind == "json":
        yield from _iter_json(path, text_field)
    elif kind == "saved":
        yield from _iter_saved(path, text_field, hf_split)
    else:
        yield from _iter_parquet(path, text_field)


def _iter_records(source: str | os.PathLike, text_field: str, hf_split: str, data_files=None) -> Iterator[str]:
    """All records of a record source or all files of a local source, in order, before any split."""
    if _is_hf(source):
        yield from _iter_hf(source, text_field, hf_split, data_files)
        return
    for path in resolve_files(source):
        yield from _iter_entry(path, text_field, hf_split)


def _split_source(source, split, *, text_field, val_fraction, hf_split, data_files=None) -> Iterator[str]:
    """One split of a source that has no separate validation source."""
    if isinstance(source, str) and source == EMBEDDED:
        yield from load_corpus(split)
        return
    every = _val_every(val_fraction)
    is_hf = _is_hf(source)
    index, with_text, held_text = 0, 0, False
    for path_or_none in [None] if is_hf else resolve_files(source):
        if path_or_none is not None and _entry_kind(path_or_none) == "text":
            # a text file is one (often the only) document: hold out its tail
            for text in _iter_text_file(path_or_none):
                held_text = True
                yield _split_text(text, split, val_fraction)
            continue
        records = (_iter_hf(source, text_field, hf_split, data_files) if is_hf
                   else _iter_entry(path_or_none, text_field, hf_split))
        for text in records:
            in_val = index % every == every - 1
            index += 1
            with_text += bool(text)
            if in_val == (split == "val"):
                yield text
    if split == "val" and with_text and index < every and not held_text:  # (no text at all: "no documents")
        raise ValueError(
            f"source {os.fspath(source)!r} has {index} record{'s' if index > 1 else ''}, too few for a validation "
            f"split: every {every}th record is held out (validation_fraction={val_fraction}), so it needs at least "
            f"{every}; give more records, a larger validation_fraction (at most 0.5: every 2nd), or validation_data"
        )


def _check_source(src, hf_split: str, data_files: list[str] | None) -> None:
    """Refuse at the call, before the first ``next()``: a missing path, a DatasetDict without ``hf_split``, a
    save_to_disk folder named as ``hf:PATH``, data_files matching no local file."""
    if isinstance(src, str) and src == EMBEDDED:
        return
    if _is_hf(src):
        _check_hf(src, hf_split, data_files)
        return
    for path in resolve_files(src):
        if path.is_dir():
            _check_saved_split(path, hf_split)


def iter_documents(
    source: str | os.PathLike = EMBEDDED,
    split: str = "train",
    *,
    spec: SourceSpec | None = None,
    **options: Any,
) -> Iterator[str]:
    """Yield the documents (non-empty str) of ``split`` (``"train"`` or ``"val"``) of ``source``; see the module
    docstring for the sources and how the validation split is held out.

    ``spec``: how the source is read (:class:`SourceSpec`: ``text_field``, ``val_source``, ``val_text_field``,
    ``val_fraction``, ``max_documents``, ``max_chars``, ``hf_split``, ``data_files``; its ``max_tokens`` and
    ``streaming`` are the tokenisers'); ``options``: any of its fields by name, replacing the spec's
    (:func:`make_spec`), e.g. ``iter_documents(path, "val", val_fraction=0.2)``. ``data_files`` is only for an
    ``hf:`` ``source`` (not applied to ``val_source``).

    Errors: ``ValueError`` naming the path for a missing or unsupported path or a damaged file (a ``.jsonl.gz``
    that is not gzip or is truncated, a ``.jsonl`` or ``.json`` that is not UTF-8 or not JSON, nested too deep to
    read, or a ``.jsonl`` line longer than :data:`MAX_JSONL_LINE`, a ``.json`` that is not an array of records or
    of strings, a text field that is not a string, a broken Parquet file, a ``.txt`` that is not text, a
    ``save_to_disk`` folder without its ``state.json`` or ``dataset_info.json``), naming the validation source
    when it is the training data or holds no documents, naming the record count when a held-out validation split
    would be empty, naming the local file (not the Hub) when ``datasets`` cannot read ``data_files``, naming the
    field and the fields found for a record without it, naming the splits there for a DatasetDict without
    ``hf_split``, for a
    ``save_to_disk`` folder given as ``hf:PATH``, and one sentence for a Hub dataset that cannot be reached;
    naming the field for a value :class:`SourceSpec` refuses.
    Paths, splits of DatasetDict folders and ``hf:`` names are checked at the call; damaged files fail when
    they are read, i.e. on iteration."""
    spec = make_spec(spec, **options)
    _check_split(split)
    files = spec.files
    if files is not None and not _is_hf(source):
        raise ValueError(
            f"data_files={spec.data_files!r} is for an hf: source (e.g. hf:json); source {os.fspath(source)!r} is "
            "not one: pass local files as the source itself"
        )
    hf_split, val_source = spec.hf_split, spec.val_source
    _check_source(source, hf_split, files)
    if val_source is not None:
        _check_source(val_source, hf_split, None)
    if val_source is None:
        docs = _split_source(source, split, text_field=spec.text_field, val_fraction=spec.val_fraction,
                             hf_split=hf_split, data_files=files)
    else:
        if EMBEDDED in (source, val_source):
            raise ValueError("source 'embedded' has its own validation split; do not combine it with val_source")
        _check_apart(source, val_source)
        docs = (_iter_records(source, spec.text_field, hf_split, files) if split == "train" else
                _not_empty(_iter_records(val_source, spec.val_text_field or spec.text_field, hf_split), val_source))
    return _capped(docs, spec.max_documents, spec.max_chars)


def _not_empty(docs: Iterator[str], val_source) -> Iterator[str]:
    """``docs``, and a ValueError naming ``val_source`` when it holds no document with text."""
    empty = True
    for text in docs:
        empty = empty and not text
        yield text
    if empty:
        raise ValueError(
            f"validation source {os.fspath(val_source)!r} holds no documents (empty files, no records, or only "
            "empty texts): nothing to validate on; give validation data that holds text, or leave validation_data "
            "out to hold out validation_fraction of the training data"
        )


def _check_apart(source, val_source) -> None:
    """ValueError when the validation source is the training source, or a copy of it, or shares a file with it:
    a validation loss on training data measures nothing."""
    def refuse(how: str) -> ValueError:
        return ValueError(
            f"validation source {os.fspath(val_source)!r} {how} the training data {os.fspath(source)!r}: a "
            "validation loss on training data measures nothing; name other data as validation_data, or leave it "
            "out to hold out validation_fraction of the training data"
        )

    if same_source(source, val_source):
        raise refuse("is")
    if any(isinstance(s, str) and (s == EMBEDDED or _is_hf(s)) for s in (source, val_source)):
        return
    train_entries, val_entries = resolve_files(source), resolve_files(val_source)
    train_files = {p.resolve(): p for p in train_entries}
    shared = [p for p in val_entries if p.resolve() in train_files]
    if shared:
        raise refuse(f"shares the file {str(shared[0])!r} with")
    if len(train_entries) == len(val_entries) and all(
            a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size
            and filecmp.cmp(a, b, shallow=False) for a, b in zip(train_entries, val_entries)):
        raise refuse("is a copy of")


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


def _file_stats(path: Path) -> list[list[Any]]:
    """``[resolved path, size, mtime_ns]`` of a file, or of every file under a folder (a save_to_disk one)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def source_identity(source: str | os.PathLike = EMBEDDED, spec: SourceSpec | None = None) -> dict[str, Any]:
    """A JSON-serialisable description of everything that decides the documents ``iter_documents(source, split,
    spec=spec)`` yields, for cache keys: local files by resolved path, size and modification time (an edited file
    changes it; a ``save_to_disk`` folder by every file in it, and the split ``hf_split`` of a DatasetDict), the
    embedded corpus by the sha256 of its file, ``hf:`` sources by name, split and ``data_files`` (the local files
    these match by path, size and mtime; a dataset changed on the Hub is not noticed: delete the cache to
    refetch). Options that do not apply to a source are left out, so they do not change its key; so are the
    spec's ``max_tokens`` and ``streaming``, which decide no document."""
    spec = SourceSpec() if spec is None else spec
    hf_split = spec.hf_split

    def one(src, data_files=None) -> dict[str, Any]:
        if isinstance(src, str) and src == EMBEDDED:
            return {"kind": "embedded", "sha256": corpus_fingerprint()}
        if _is_hf(src):
            name, config = parse_hf(src)
            ident = {"kind": "hf", "name": name, "config": config, "hf_split": hf_split}
            if data_files is not None:
                ident["data_files"] = data_files
                ident["local_files"] = [s for pattern in data_files for p in _local_matches(pattern)
                                        for s in _file_stats(Path(p))]
            return ident
        entries = resolve_files(src)
        files = [s for p in entries for s in _file_stats(p)]
        ident = {"kind": "files", "path": str(Path(src).expanduser().resolve()), "files": files}
        if any(saved_dataset_kind(p) == "dataset_dict" for p in entries):
            ident["hf_split"] = hf_split
        return ident

    ident = {
        "source": one(source, spec.files),
        "text_field": spec.text_field,
        "max_documents": spec.max_documents,
        "max_chars": spec.max_chars,
    }
    if spec.val_source is not None:
        ident["val_source"] = one(spec.val_source)
        if spec.val_text_field is not None and spec.val_text_field != spec.text_field:  # left out otherwise: the
            ident["val_text_field"] = spec.val_text_field  # keys of before the setting
    elif not (isinstance(source, str) and source == EMBEDDED):
        ident["val_fraction"] = spec.val_fraction
    return ident


def spec_for(data: str | os.PathLike, run_data: str | os.PathLike, run_spec: SourceSpec) -> SourceSpec:
    """The spec to read ``data`` with, for a run that read ``run_data`` with ``run_spec``
    (``TrainConfig.source_spec()``).

    ``data`` the run's own source (the same string, or the same path resolved): ``run_spec`` itself, so its splits
    are exactly the run's (its validation source, fraction, caps and data_files). Another source: only how the
    run reads a source, ``text_field``, ``hf_split`` and ``val_fraction`` (a held-out share like the run's), and
    its ``streaming``; the run's ``val_source``, ``data_files``, ``max_documents`` and ``max_tokens`` describe
    its own data and are not applied. The embedded corpus takes none of them (it has its own splits) but the
    run's ``streaming``."""
    if same_source(data, run_data):
        return run_spec
    if isinstance(data, str) and data == EMBEDDED:
        return SourceSpec(streaming=run_spec.streaming)
    return SourceSpec(text_field=run_spec.text_field, hf_split=run_spec.hf_split, val_fraction=run_spec.val_fraction,
                      streaming=run_spec.streaming)


def same_source(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    """Whether two sources name the same data: equal strings, or local paths that resolve to the same place."""
    if a is None or b is None:
        return a is b
    if os.fspath(a) == os.fspath(b):
        return True
    special = [isinstance(s, str) and (s == EMBEDDED or _is_hf(s)) for s in (a, b)]
    if any(special):
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def identity_hash(obj: Any) -> str:
    """sha256 hex digest of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode("utf-8")).hexdigest()
