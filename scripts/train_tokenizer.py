#!/usr/bin/env python3
"""Train the shipped tokenizer ``s2hc-bpe-4k`` (``src/s2hc/data/tokenizer.json``) on the embedded corpus.

A byte-level BPE (GPT-2 style pre-tokenisation, every one of the 256 bytes in the base alphabet, so any text
encodes without unknown tokens) of 4096 tokens in all: id 0 is the end-of-text token ``<|endoftext|>``, then
the 256 bytes, then 3839 merges. It is trained with Hugging Face ``tokenizers`` on the *train* split only (the
validation documents never shape the vocabulary). Training is single-pass and deterministic: the script trains
twice and refuses to write unless both results are identical, then writes atomically (temporary file, rename).

Usage::

    python scripts/train_tokenizer.py            # writes src/s2hc/data/tokenizer.json
    python scripts/train_tokenizer.py --check    # trains and compares with the shipped file; exit 1 if different
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from s2hc.data.corpus import load_corpus

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "s2hc" / "data" / "tokenizer.json"
VOCAB_SIZE = 4096
EOT = "<|endoftext|>"


def train(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A fresh byte-level BPE trained on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size or tok.token_to_id(EOT) != 0:
        raise SystemExit(f"unexpected result: vocab {tok.get_vocab_size()}, {EOT} at {tok.token_to_id(EOT)}")
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    parser.add_argument("--check", action="store_true", help="compare with the file at --out instead of writing")
    args = parser.parse_args(argv)

    texts = load_corpus("train")
    t0 = time.perf_counter()
    tok = train(texts)
    seconds = time.perf_counter() - t0
    data = tok.to_str(pretty=False)
    if train(texts).to_str(pretty=False) != data:
        raise SystemExit("tokenizer training is not deterministic here (two runs differ); nothing written")

    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == data
        print(f"{args.out}: {'identical to a fresh training' if same else 'DIFFERS from a fresh training'}")
        return 0 if same else 1

    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=args.out.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(tmp, args.out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

    stats = {"trained_in_s": round(seconds, 2), "vocab_size": tok.get_vocab_size(), "eot_id": 0, "file": str(args.out)}
    for split in ("train", "val"):
        docs = load_corpus(split)
        n_tok = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
        n_bytes = sum(len(d.encode("utf-8")) for d in docs)
        stats[f"{split}_tokens"] = n_tok
        stats[f"{split}_tokens_per_byte"] = round(n_tok / n_bytes, 4)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
