"""``s2hc export``: a checkpoint as a Hugging Face ``transformers`` model directory (:func:`s2hc.hf.export`)."""

from __future__ import annotations

import argparse

from ..devices import DTYPES
from ..extras import check_available


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint as a Hugging Face transformers model directory",
        description="Write OUT_DIR from CHECKPOINT: config.json, model.safetensors, the tokenizer and two loader "
        "modules, so that AutoModelForCausalLM.from_pretrained(OUT_DIR) (after `import s2hc.hf`, or with "
        "trust_remote_code=True) and AutoTokenizer.from_pretrained(OUT_DIR) load it; generate() uses a KV cache. "
        "Needs the hf extra (transformers).",
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="run directory (its latest checkpoint) or checkpoint file"
    )
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="directory to write: built beside it and swapped in whole; an earlier export there "
                        "is replaced, a directory holding other files is refused")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="weights' dtype (default: as saved, float32)")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    parser = args.subparser
    check_available(("transformers", "safetensors"))
    from ..hf import export  # the hf extra: imported on use

    try:
        out = export(args.checkpoint, args.out_dir, dtype=args.dtype)
    except ValueError as error:
        parser.error(str(error))
    print(f"exported {args.checkpoint} to {out}")
    print(f"load it with: import s2hc.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}) "
          "(or trust_remote_code=True without the import)")
    return 0
