"""The ``s2hc`` command (also ``python -m s2hc``): a dispatcher over one module per subcommand.

  params    parameter counts of the hyper-connections of a model shape, per family  (:mod:`.params`)
  train     pretrain a language model with one residual family (resumable)          (:mod:`.train`)
  compare   train the same model with several families and write a report           (:mod:`.train`)
  study     a grid of families × streams × seeds, resumable, with statistics        (:mod:`.study`)
  upcycle   a pretrained residual model with hyper-connections, same function       (:mod:`.upcycle`)
  eval      perplexity and lm-evaluation-harness benchmarks of a checkpoint         (:mod:`.evaluate`)
  generate  sample continuations of a prompt from a checkpoint                      (:mod:`.evaluate`)
  export    write a checkpoint as a Hugging Face transformers model directory       (:mod:`.export`)
  diagnose  measure the residual matrices of a checkpoint, or of synthetic inputs   (:mod:`.diagnose`)
  bench     step time, peak memory and coefficient-path cost per family             (:mod:`.bench`)
  configs   list the shipped YAML configs, or print one to copy                     (:mod:`.configs`)

Each module has ``SUMMARY`` (the name and one-line help of each subcommand it adds, in order) and
``register(subparsers)``, which adds its parsers with ``func`` (``args -> exit status``) and ``subparser`` set as
defaults. To add a subcommand, write such a module and list it in :data:`COMMANDS`. Nothing else in s2hc imports
this package.

Start time: ``s2hc --version`` and ``s2hc --help`` import no torch, and a subcommand imports only what it uses.
The modules import the library inside ``register`` (what the options need: ``s2hc train``'s flags come from
:class:`~s2hc.config.TrainConfig`) and inside the command's function (the work), never at their top, and
:func:`main` builds in full only the parser of the subcommand named on the command line; the others are stubs
made from ``SUMMARY``, which is all the top-level usage and ``--help`` show
(``tests/test_cli_start.py``; ``benchmarks/cli_start.py`` measures it).

Errors: :func:`main` is the one funnel (wording and status: :mod:`.errors`). A user's mistake never ends in a
traceback: a ``ValueError`` from a command (a bad value, a damaged file, an unwritable path) becomes one line
``s2hc CMD: error: ...`` and exit status 2; an ``OSError`` too (exit 2), except a full disk, an exhausted quota
or an I/O error during the work (exit 1, a failed run), and running out of memory (exit 1); a missing optional
package (:class:`s2hc.extras.MissingExtra`) names its extra and the pip command (exit 2). Anything else is a
bug and raises. ``S2HC_TRACEBACK=1`` in the environment lets every error raise, for debugging.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from . import bench, configs, diagnose, evaluate, export, params, study, train, upcycle
from .errors import report_error

COMMANDS = (params, train, study, upcycle, evaluate, export, diagnose, bench, configs)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake in a subcommand's arguments is one line, ``s2hc train: error: ...`` (exit
    2), without the usage block: the usage is for ``--help``, and for the top-level parser (no subcommand, or an
    unknown one), where it lists the subcommands."""

    top_level = False

    def error(self, message: str):
        if self.top_level:
            super().error(message)  # exits
        hint = f" (`{self.prog} --help` lists them)" if message.startswith(_ABOUT_OPTIONS) else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no parser knows are the subcommand's error (argparse gives them to the
        top level, whose usage does not list them)."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = getattr(parsed, "subparser", self)
            _Parser.error(parser, f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


#: argparse's own messages about which arguments exist, where the options list helps.
_ABOUT_OPTIONS = ("unrecognized arguments", "the following arguments are required", "ambiguous option")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``s2hc`` with every subcommand's parser built in full; with ``only`` (a subcommand's name),
    that one's alone, the others stubs that name them and their help line (:func:`main`: a command starts without
    building, and importing for, the options of the others)."""
    parser = _Parser(
        prog="s2hc", description="Multi-stream residual connections (hyper-connections): s²HC and its relatives."
    )
    parser.top_level = True
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if only is None or only in command.SUMMARY:
            command.register(subparsers)
        else:
            for name, text in command.SUMMARY.items():
                subparsers.add_parser(name, help=text)
    return parser


def _subcommand(argv: Sequence[str]) -> str:
    """The subcommand ``argv`` names: its first word that is not an option (the top level takes no values)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``s2hc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 for bad input, 1 for a
    run that failed on a full disk or out of memory)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_subcommand(argv))
    command = "s2hc"
    try:
        args = parser.parse_args(argv)
        args.argv, command = argv, f"s2hc {args.command}"
        return args.func(args)
    except SystemExit as exit_:  # argparse's errors, --help and --version: an exit status, not an exception
        if exit_.code is None:
            return 0
        if isinstance(exit_.code, int):
            return exit_.code
        print(exit_.code, file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`s2hc configs | head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, RuntimeError, ImportError) as error:
        if os.environ.get("S2HC_TRACEBACK", "") not in ("", "0"):
            raise
        return report_error(command, error)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "build_parser", "main"]
