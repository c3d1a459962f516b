"""``s2hc export``: a checkpoint as a Hugging Face ``transformers`` model directory (:func:`s2hc.hf.export`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..extras import check_available
from .common import add_step_option, deprecated, resolve_step

SUMMARY = {"export": "write a checkpoint as a Hugging Face transformers model directory"}


def register(subparsers) -> None:
    from ..devices import DTYPES  # torch: imported when this command's parser is built (s2hc.cli's start time)

    parser = subparsers.add_parser(
        "export", help=SUMMARY["export"],
        description="Write --out DIR from CHECKPOINT: config.json, model.safetensors, the tokenizer and two loader "
        "modules, so that AutoModelForCausalLM.from_pretrained(DIR) (after `import s2hc.hf`, or with "
        "trust_remote_code=True) and AutoTokenizer.from_pretrained(DIR) load it; generate() uses a KV cache. "
        "Needs the hf extra (transformers).",
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="run directory (its latest checkpoint, or --step's) or checkpoint file"
    )
    add_step_option(parser)
    parser.add_argument("--out", metavar="DIR",
                        help="directory to write: built beside it and swapped in whole; an earlier export there "
                        "is refused unless --overwrite, a directory holding other files always")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in DIR (without it, a DIR that holds one is refused)")
    parser.add_argument("out_dir", nargs="?", metavar="OUT_DIR", help="deprecated spelling of --out DIR")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="weights' dtype (default: as saved, float32)")
    parser.add_argument("--native", action="store_true",
                        help="a residual run as transformers' own class for its architecture (LlamaForCausalLM, "
                        "Qwen3ForCausalLM), which loads without s2hc")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    parser = args.subparser
    if args.out_dir is not None:
        if args.out is not None:
            parser.error(f"the output directory is given twice: --out {args.out!r} and OUT_DIR {args.out_dir!r}; "
                         "give --out alone")
        deprecated("the positional OUT_DIR", "--out OUT_DIR")
        args.out = args.out_dir
    if args.out is None:
        parser.error("the following arguments are required: --out")
    check_available(("transformers", "safetensors"))
    from ..hf import export  # the hf extra: imported on use

    try:
        _check_not_exported(args.out, args.overwrite)
        resolve_step(args)  # --step N|best: that checkpoint of the run directory
        with _quiet_progress_bars():
            out = export(args.checkpoint, args.out, dtype=args.dtype, native=args.native)
    except ValueError as error:
        parser.error(str(error))
    print(f"exported {args.checkpoint} to {out}")
    if args.native:
        print(f"load it with: AutoModelForCausalLM.from_pretrained({str(out)!r}) (transformers' own class)")
        return 0
    print(f"load it with: import s2hc.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}) "
          "(or trust_remote_code=True without the import)")
    return 0


def _check_not_exported(out: str, overwrite: bool) -> None:
    """ValueError, as ``s2hc train`` refuses a directory that already holds a run, when ``out`` holds an export
    and ``overwrite`` was not given (a directory of other files is :func:`s2hc.hf.export`'s to refuse)."""
    from ..hf.export import is_export_file

    target = Path(out).expanduser()
    found = sorted(os.listdir(target)) if target.is_dir() else []
    if found and all(map(is_export_file, found)) and not overwrite:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"{out!r} already holds an export ({shown}); pass --overwrite to replace it, or choose "
                         "another --out")


@contextlib.contextmanager
def _quiet_progress_bars():
    """transformers' progress bars ("Writing model shards ... 100%|███") off while exporting, unless both outputs are
    terminals: in a log file or a pipe each redraw would stay."""
    from transformers.utils import logging as hf_logging

    quiet = not (sys.stdout.isatty() and sys.stderr.isatty()) and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
