"""The ``s2hc`` command (also ``python -m s2hc``): a dispatcher over one module per subcommand.

  params    parameter counts of the hyper-connections of a model shape, per family  (:mod:`.params`)
  train     pretrain a language model with one residual family (resumable)          (:mod:`.train`)
  compare   train the same model with several families and write a report           (:mod:`.train`)
  eval      perplexity and lm-evaluation-harness benchmarks of a checkpoint         (:mod:`.evaluate`)
  generate  sample continuations of a prompt from a checkpoint                      (:mod:`.evaluate`)
  export    write a checkpoint as a Hugging Face transformers model directory       (:mod:`.export`)
  diagnose  measure the residual matrices of a checkpoint, or of synthetic inputs   (:mod:`.diagnose`)
  bench     step time, peak memory and coefficient-path cost per family             (:mod:`.bench`)

Each module has ``register(subparsers)``, which adds its parsers with ``func`` (``args -> exit status``) and
``subparser`` set as defaults. To add a subcommand, write such a module and list it in :data:`COMMANDS`.
Nothing else in s2hc imports this package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import bench, diagnose, evaluate, export, params, train

COMMANDS = (params, train, evaluate, export, diagnose, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s2hc", description="Multi-stream residual connections (hyper-connections): s²HC and its relatives."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``s2hc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 for bad input)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        args.argv = argv
        return args.func(args)
    except SystemExit as exit_:  # argparse's errors, --help and --version: an exit status, not an exception
        if exit_.code is None:
            return 0
        if isinstance(exit_.code, int):
            return exit_.code
        print(exit_.code, file=sys.stderr)
        return 1


__all__ = ["COMMANDS", "build_parser", "main"]
