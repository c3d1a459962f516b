"""What every subcommand's arguments share: argparse types and the family-list parser.

A value argparse cannot convert gets ``argparse.ArgumentTypeError`` (argparse names the argument and exits 2);
a value the library refuses raises ValueError, which a command turns into ``parser.error`` (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

from ..io import check_output_dir


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a count where 0 means none)."""
    return _int_at_least(text, 0)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def parse_families(text: str | None, argument: str = "--families", extra: tuple[str, ...] = ()) -> list[str]:
    """``"mhc, s2hc"`` -> ``["mhc", "s2hc"]`` (None: every family); ValueError naming ``argument`` for an
    unknown name or an empty list. ``extra`` names accepted besides the families (the bench's peer)."""
    from ..connection.forms import check_family, families  # torch: on use (see s2hc.cli's start time)

    if text is None:
        return families()
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError(f"argument {argument}: no family named in {text!r}; allowed: {','.join(families())}")
    for name in names:
        if name not in extra:
            check_family(name, f"argument {argument}")
    return names


def deprecated(old: str, new: str) -> None:
    """Say on stderr that ``old`` (a flag or argument a command still accepts) is now spelled ``new``."""
    print(f"s2hc: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


def add_renamed_option(parser: argparse.ArgumentParser, name: str, old: str, **kwargs) -> None:
    """``parser.add_argument(name, old, **kwargs)``, where ``old`` is the option's former spelling: still accepted,
    with a :func:`deprecated` line when used (every command names its output directory ``--out``)."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string == old:
                deprecated(old, name)
            setattr(namespace, self.dest, values)

    parser.add_argument(name, old, action=Renamed, **kwargs)


@contextlib.contextmanager
def output_directory(path, argument: str):
    """The output directory ``path`` of a command, checked (and created) by :func:`s2hc.io.check_output_dir` with
    the error naming ``argument``, for the work in the ``with`` block; when that work fails, the directories it
    created are removed again if still empty, so a refused command leaves nothing behind."""
    target = Path(path).expanduser()
    created = [p for p in (target, *target.parents) if not os.path.lexists(p)]  # deepest first
    directory = check_output_dir(path, argument)
    try:
        yield directory
    except BaseException:
        for made in created:
            try:
                made.rmdir()
            except OSError:  # not empty (or gone): keep it and everything above it
                break
        raise


class _NotAStep(str):
    """A ``--step`` value that is no step: refused by :func:`resolve_step`, which can name the steps kept."""


def checkpoint_step(text: str):
    """argparse type of ``--step``: a step number or ``best`` (:func:`s2hc.rundir.parse_step`); anything else is
    kept as given, for :func:`resolve_step` to refuse naming the steps the run directory keeps."""
    from ..rundir import parse_step  # rundir imports torch and the models: on use

    try:
        return parse_step(text)
    except ValueError:
        return _NotAStep(text)


def add_step_option(parser: argparse.ArgumentParser) -> None:
    """``--step N|best``, the same on every command that reads a run's checkpoint (eval, generate, export,
    diagnose): which of the run directory's checkpoints (:func:`s2hc.rundir.resolve_checkpoint`)."""
    parser.add_argument("--step", type=checkpoint_step, default=None, metavar="N|best",
                        help="the run directory's checkpoint of step N (kept by --keep-checkpoints, or the latest) "
                             "or its best one (--keep-best); default: the latest")


def resolve_step(args: argparse.Namespace) -> None:
    """With ``--step``: ``args.checkpoint`` replaced by that checkpoint's path (ValueError in one line, naming
    the steps kept, when there is none); without it, unchanged."""
    step = getattr(args, "step", None)
    if isinstance(step, _NotAStep):
        from pathlib import Path

        from ..rundir.checkpoint import is_sharded, kept_steps

        problem = f"--step {str(step)!r}: must be a step number >= 0 or 'best'"
        run_dir = Path(args.checkpoint).expanduser()
        if run_dir.is_dir() and not is_sharded(run_dir):
            problem += f"; run directory {str(run_dir)!r} {kept_steps(run_dir).removeprefix('it ')}"
        raise ValueError(problem)
    if step is not None:
        from ..rundir import resolve_checkpoint

        args.checkpoint = str(resolve_checkpoint(args.checkpoint, step=step))
