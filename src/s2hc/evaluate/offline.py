"""Offline lm-eval tasks built from the embedded corpus's held-out split, shipped with their data.

- ``s2hc_nextline`` (multiple choice, ``acc`` / ``acc_norm``): the text before a line (up to ~300 characters of
  a play, a poem or a book of the Bible) and four candidate next lines, the true one and three lines of
  similar length drawn from elsewhere in the same document. Prose paragraphs (the Bible) are cut into clauses
  at ``. ; : ? !``. 1 000 examples; chance is 25 %.
- ``s2hc_ppl`` (``loglikelihood_rolling``: ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``): 128
  passages of at most 2 000 characters, cut at blank lines and spread evenly over the held-out documents,
  scored with lm-eval's rolling windows (every token predicted once, with as much context as fits).
- ``s2hc_offline``: a group of both.

The YAML files and the gzipped JSON-lines data sit in ``s2hc/evaluate/tasks/``; :func:`tasks_dir` is the
``include_path`` to give lm-eval. The data are a deterministic function of the corpus: ``python -m
s2hc.evaluate.offline`` rebuilds them (``tests/test_evaluate.py`` checks the shipped files against a rebuild).
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
from importlib import resources
from pathlib import Path
from typing import Any

from ..data.corpus import load_documents
from ..extras import require

TASKS = ("s2hc_nextline", "s2hc_ppl")
GROUPS = ("s2hc_offline",)
DATA_FILES = {"s2hc_nextline": "nextline.jsonl.gz", "s2hc_ppl": "ppl.jsonl.gz"}

SEED = 2603
NEXTLINE_EXAMPLES = 1000
CONTEXT_CHARS = 300
UNIT_MIN, UNIT_MAX, LINE_MAX = 25, 110, 120
N_DISTRACTORS = 3
PPL_PASSAGES = 128
PASSAGE_CHARS = 2000

_LINE_NUMBER = re.compile(r"[ \t]{2,}\d+[ \t]*$", re.MULTILINE)  # Milton's margin line numbers
_CLAUSE_END = re.compile(r"(?<=[.;:?!])\s+")


def tasks_dir() -> Path:
    """The directory of the shipped task YAMLs and data (lm-eval's ``include_path``)."""
    return Path(str(resources.files(__package__).joinpath("tasks")))


# ---- loading (called by lm-eval through `custom_dataset: !function s2hc.evaluate.offline.load_...`) -------


def read_jsonl_gz(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _dataset(task: str):
    datasets = require("datasets", f"the shipped task {task!r}")

    rows = read_jsonl_gz(tasks_dir() / DATA_FILES[task])
    return {"test": datasets.Dataset.from_list(rows)}


def load_nextline(**_: Any):
    """``{"test": datasets.Dataset}`` of ``s2hc_nextline`` (lm-eval passes model args as keywords; ignored)."""
    return _dataset("s2hc_nextline")


def load_ppl(**_: Any):
    """``{"test": datasets.Dataset}`` of ``s2hc_ppl``."""
    return _dataset("s2hc_ppl")


# ---- building ---------------------------------------------------------------------------------------------


def _segments(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every line of ``text`` (leading spaces excluded), lines longer than ``LINE_MAX``
    cut into clauses; empty lines skipped."""
    spans = []
    offset = 0
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped:
            start = offset + len(line) - len(line.lstrip())
            if len(stripped) <= LINE_MAX:
                spans.append((start, start + len(stripped)))
            else:
                piece = 0
                body = line[start - offset :].rstrip()
                for match in _CLAUSE_END.finditer(body):
                    spans.append((start + piece, start + match.start()))
                    piece = match.end()
                spans.append((start + piece, start + len(body)))
        offset += len(line) + 1
    return [(a, b) for a, b in spans if b > a]


def _is_candidate(unit: str) -> bool:
    return (
        UNIT_MIN <= len(unit) <= UNIT_MAX
        and len(unit.split()) >= 4
        and any(c.islower() for c in unit)
        and not unit.startswith("[")
    )


def build_nextline(documents: list[dict[str, Any]], n_examples: int = NEXTLINE_EXAMPLES, seed: int = SEED):
    """The ``s2hc_nextline`` examples from ``documents`` (dicts with ``id`` and ``text``)."""
    rng = random.Random(seed)
    pool = []  # (doc index, segment index)
    per_doc = []
    for d, doc in enumerate(documents):
        text = _LINE_NUMBER.sub("", doc["text"])
        segments = _segments(text)
        units = [text[a:b] for a, b in segments]
        candidates = [i for i, unit in enumerate(units) if _is_candidate(unit)]
        per_doc.append((text, segments, units, candidates))
        pool += [(d, i) for i in candidates if segments[i][0] >= CONTEXT_CHARS // 3]
    chosen = sorted(rng.sample(pool, min(n_examples * 2, len(pool))))
    examples = []
    for d, i in chosen:
        text, segments, units, candidates = per_doc[d]
        start = segments[i][0]
        target = units[i]
        low, high = len(target) / 1.5, len(target) * 1.5
        seen = {target.lower()}
        distractors = []
        for j in rng.sample(candidates, len(candidates)):
            unit = units[j]
            if abs(j - i) > 3 and low <= len(unit) <= high and unit.lower() not in seen:
                distractors.append(unit)
                seen.add(unit.lower())
                if len(distractors) == N_DISTRACTORS:
                    break
        if len(distractors) < N_DISTRACTORS:
            continue
        first = i
        while first > 0 and start - segments[first - 1][0] <= CONTEXT_CHARS:
            first -= 1
        if first == i:
            first = i - 1
        context = text[segments[first][0] : start]
        choices = distractors + [target]
        rng.shuffle(choices)
        examples.append(
            {
                "id": f"{documents[d]['id']}:{start}",
                "source": documents[d]["id"],
                "context": context,
                "choices": choices,
                "label": choices.index(target),
            }
        )
    rng.shuffle(examples)  # any prefix (lm-eval's --limit) is a random sample of all documents
    return examples[:n_examples]


def _passages(text: str, limit: int = PASSAGE_CHARS) -> list[str]:
    """``text`` cut at blank lines into passages of at most ``limit`` characters (a longer paragraph is cut at
    line or clause ends)."""
    pieces = []
    for paragraph in text.split("\n\n"):
        paragraph = paragraph.strip("\n")
        if not paragraph.strip():
            continue
        while len(paragraph) > limit:
            window = paragraph[:limit]
            cut = max(window.rfind("\n"), max((m.end() for m in _CLAUSE_END.finditer(window)), default=-1))
            cut = cut if cut > 0 else limit
            pieces.append(paragraph[:cut].rstrip())
            paragraph = paragraph[cut:].lstrip()
        if paragraph:
            pieces.append(paragraph)
    passages, current = [], ""
    for piece in pieces:
        if current and len(current) + 2 + len(piece) > limit:
            passages.append(current)
            current = ""
        current = piece if not current else current + "\n\n" + piece
    if current:
        passages.append(current)
    return passages


def build_ppl(documents: list[dict[str, Any]], n_passages: int = PPL_PASSAGES) -> list[dict[str, Any]]:
    """The ``s2hc_ppl`` passages from ``documents``: ``n_passages`` spread evenly over all of them."""
    every = [(doc["id"], p) for doc in documents for p in _passages(doc["text"])]
    n = min(n_passages, len(every))
    picked = [(k, every[(k * len(every)) // n]) for k in range(n)]
    random.Random(SEED).shuffle(picked)  # any prefix (lm-eval's --limit) samples all documents
    return [{"id": f"{source}:{k}", "source": source, "text": text} for k, (source, text) in picked]


def _write_jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> None:
    raw = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as handle:
        handle.write(raw)
    path.write_bytes(buffer.getvalue())


def build(out_dir: str | Path | None = None) -> dict[str, Path]:
    """Rebuild the data files of the offline tasks from the embedded corpus into ``out_dir`` (default: the
    shipped ``tasks`` directory); returns ``{task: path}``."""
    documents = load_documents("val")
    out = Path(out_dir) if out_dir is not None else tasks_dir()
    out.mkdir(parents=True, exist_ok=True)
    rows = {"s2hc_nextline": build_nextline(documents), "s2hc_ppl": build_ppl(documents)}
    paths = {}
    for task, data in rows.items():
        paths[task] = out / DATA_FILES[task]
        _write_jsonl_gz(paths[task], data)
    return paths


if __name__ == "__main__":  # pragma: no cover
    for task, path in build().items():
        print(f"{task}: {len(read_jsonl_gz(path))} examples -> {path}")
