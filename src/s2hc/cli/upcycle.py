"""``s2hc upcycle SOURCE --family F --streams N --out RUN_DIR``: a pretrained residual model with hyper-connections,
computing the same function at step 0 (:mod:`s2hc.upcycle`). Exit status 0, or 2 with one line for bad input
(an unsupported architecture, a family that cannot keep the function, a run directory that exists)."""

from __future__ import annotations

import argparse

from .common import positive_int

# The library is imported inside the functions (s2hc.cli's start time).

SUMMARY = {"upcycle": "turn a pretrained residual model into a hyper-connection model with the same function"}


def _spread(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def register(subparsers) -> None:
    from ..models.widen import DEFAULT_SPREAD, upcyclable_families

    parser = subparsers.add_parser(
        "upcycle", help=SUMMARY["upcycle"],
        description="Write RUN_DIR, a run directory at step 0 whose model computes what SOURCE computes (a Hugging "
        "Face Qwen3, Qwen2 / Qwen2.5, Gemma3, GPT-2, Llama (2, 3) or Mistral directory, config.json's model_type "
        "one of qwen3, qwen2, gemma3 (gemma3_text), gpt2, llama, mistral; or a residual s2hc run): the streams "
        "start as copies, "
        "the read is uniform, the writes sum to n without being uniform (so the streams separate and the mixing "
        "learns from the first step), and H_res keeps the streams' mean. Continue with `s2hc train --init-from "
        "RUN_DIR --out NEW ...`; eval, diagnose, export and generate work on RUN_DIR. See docs/upcycling.md.",
    )
    parser.add_argument("source", metavar="SOURCE", help="Hugging Face model directory or residual s2hc run")
    parser.add_argument("--family", required=True, help="one of " + ", ".join(upcyclable_families()))
    parser.add_argument("--streams", type=positive_int, default=4, help="streams n >= 2 (default 4)")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to write")
    parser.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the family, e.g. rotation=expm (repeatable)")
    parser.add_argument("--spread", type=_spread, default=DEFAULT_SPREAD,
                        help=f"how unequal the writes start: H_post is 1 + spread at the favoured stream and "
                        f"1 − spread/(n − 1) elsewhere (default {DEFAULT_SPREAD})")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer of the run (default: SOURCE's tokenizer.json, GPT-2's BPE, or the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in RUN_DIR")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from ..config import parse_assignment
    from ..upcycle import upcycle

    options = dict(parse_assignment(text, "--family-option") for text in args.family_option)
    path = upcycle(args.source, args.family, args.streams, args.out, family_options=options, spread=args.spread,
                   tokenizer=args.tokenizer, overwrite=args.overwrite)
    print(f"upcycled {args.source} to {args.family} with {args.streams} streams: {path}\n"
          f"continue with: s2hc train --init-from {args.out} --out RUN ...")
    return 0
