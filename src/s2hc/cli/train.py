"""``s2hc train`` and ``s2hc compare``: their flags are :class:`~s2hc.config.TrainConfig`'s fields.

``s2hc compare`` is a study with one axis (:mod:`s2hc.study.comparison`): the families × seeds, each an ordinary
``s2hc train`` run under ``OUT/runs/``, and the study's report.

A setting comes from, lowest first: TrainConfig's default, ``--config FILE.yaml``, ``--set KEY=VALUE``, its
own flag (``--max-steps`` for ``max_steps``), then what the command fixes (``--family``, ``--streams``, ``--out``).
Exit status: 0 on success, 2 for bad input, 1 for a run that stopped (a non-finite value, a checkpoint that
could not be written; the last good checkpoint is kept), 128 + N after signal N (the run saved a checkpoint
first, or had not started its loop).

``s2hc train --out RUN --resume`` launches the run as it was trained: a run of several processes (its checkpoint
records how many) is resumed by as many again, through torchrun as ``--nproc`` does, unless ``--nproc`` is given
(:func:`resumed_processes`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TYPE_CHECKING

from .common import positive_int
from .params import parse_variants

# The library is imported inside the functions (s2hc.cli's start time): the flags need s2hc.config, the work
# s2hc.train and s2hc.study.

SUMMARY = {
    "train": "pretrain a language model with one residual family",
    "compare": "train the same model with several residual families and write a report",
}

if TYPE_CHECKING:
    from ..config import TrainConfig

_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "int | None": int, "float | None": float}


#: The help's sections, one per group of TrainConfig fields (s2hc.config.GROUPS), in that order.
GROUP_TITLES = {
    "model": "the model (a preset and what --set model_overrides changes)",
    "family": "the residual family (--family, --streams, --family-option)",
    "data": "the data and the tokenizer",
    "schedule": "the optimiser and its schedule",
    "run": "the run: evaluation, checkpoints, devices, logging",
}


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """``--config``, one flag per :func:`~s2hc.config.option_fields` field in a section per group of fields
    (:data:`GROUP_TITLES`), ``--family-option`` and ``--set``."""
    from ..config import GROUPS, TrainConfig, option_fields

    defaults = TrainConfig()
    sections = {group: parser.add_argument_group(GROUP_TITLES[group]) for group in GROUPS}
    parser.add_argument("--config", metavar="FILE.yaml|NAME",
                        help="YAML file of TrainConfig keys, or the name of a shipped one (`s2hc configs` lists them, "
                        "e.g. demo-tiny); a file of that name here comes first")
    for f in option_fields():
        flag, default, text = "--" + f.name.replace("_", "-"), getattr(defaults, f.name), f.metadata["help"]
        section = sections[f.metadata["group"]]
        if f.type == "bool":  # both ways: a run resumed with --resume keeps its own value unless one is given
            negative = f"--no-{f.name.replace('_', '-')}"
            section.add_argument(flag, dest=f.name, action="store_const", const=True, default=None,
                                 help=f"turn {negative} off again" if default else text)
            section.add_argument(negative, dest=f.name, action="store_const", const=False, default=None,
                                 help=f"no {text}" if default else f"turn {flag} off (a resumed run keeps its own "
                                 "setting otherwise)")
        else:
            section.add_argument(flag, dest=f.name, type=_TYPES[f.type], default=None,
                                 help=f"{text} (default {default!r})")
    sections["family"].add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the family, e.g. iterations=10 or rotation=expm (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other TrainConfig key, value parsed as YAML, e.g. model_overrides={dim: 64}")


def training_config(args: argparse.Namespace, resume: bool = False, family_options: bool = True,
                    **fixed) -> TrainConfig:
    """TrainConfig from defaults < --init-from's model settings < --config file < --set < explicit flags < ``fixed``
    (None values skipped). With ``resume``, the run's own settings (in its ``out``) take the place of the defaults
    and of --init-from's: what is given is a change to them. A ``family`` given as ``FAMILY:KEY=VALUE``
    (:func:`.params.parse_variants`, as ``s2hc bench`` and ``params`` read ``--families``) adds its options over
    ``--family-option``'s; ``family_options=False`` leaves ``--family-option`` out (``s2hc compare`` applies it to
    each family it compares)."""
    from ..config import TrainConfig, option_fields, parse_assignment
    from ..train.init_from import inherit_model_settings, resumed_settings
    from .configs import read_config

    values = read_config(args.config, "train")[0] if args.config is not None else {}
    values.update(parse_assignment(text) for text in args.set)
    for f in option_fields():
        if getattr(args, f.name) is not None:
            values[f.name] = getattr(args, f.name)
    if args.family_option and family_options:
        options = dict(parse_assignment(text, "--family-option") for text in args.family_option)
        values["family_options"] = {**values.get("family_options", {}), **options}
    if fixed.get("family") is not None and ":" in fixed["family"]:  # --family attn-res:block_size=2
        (fixed["family"], options), *more = parse_variants(fixed["family"], "--family")
        if more:
            raise ValueError(f"argument --family: one family, got {args.family!r} (s2hc compare --families takes "
                             "several)")
        values["family_options"] = {**values.get("family_options", {}), **options}
    values.update({k: v for k, v in fixed.items() if v is not None})
    if resume:
        values.setdefault("out", TrainConfig.out)  # where the run is now, whatever its config.yaml says
        return TrainConfig.from_dict(resumed_settings(values["out"], values))
    return TrainConfig.from_dict(inherit_model_settings(values))


def register(subparsers) -> None:
    from ..connection.forms import families

    parser = subparsers.add_parser(
        "train", help=SUMMARY["train"],
        description="Pretrain a decoder-only language model whose sublayers are wrapped by one residual family. "
        "Writes OUT/metrics.jsonl, OUT/config.yaml and OUT/checkpoint.pt; --resume continues exactly.",
    )
    parser.add_argument("--family", default=None, metavar="FAMILY[:KEY=VALUE]",
                        help="residual family: one of " + ", ".join(families()) + " (default 'residual'), optionally "
                        "with options, e.g. attn-res:block_size=2 or s2hc:rotation=expm:iterations=3")
    parser.add_argument("--streams", type=positive_int, default=None, help="streams n (default 1 for residual, else 4)")
    parser.add_argument("--out", default=None, help="run directory (default 'runs/train')")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in OUT from its checkpoint, with its own settings (OUT must hold a "
                        "run); flags given with it change those settings where a resume may (max_steps, eval_every, "
                        "logger, device, ...)")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove the run in OUT first (without it, an OUT that holds a run is refused)")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="launch N processes on this machine with torchrun (same as `torchrun "
                        "--nproc_per_node=N -m s2hc train ...`); default: this one process")
    add_training_options(parser)
    parser.set_defaults(func=run_train, subparser=parser)

    parser = subparsers.add_parser(
        "compare", help=SUMMARY["compare"],
        description="Train the same model on the same data, seed and token budget once per family (and seed), "
        "then write OUT/report.md with final losses, tokens/s, parameters and overhead against residual, the "
        "trained matrices and loss curves. A study with one axis (see `s2hc study`): each run is an ordinary "
        "`s2hc train` under OUT/runs/, one at a time, and the report is the study's.",
    )
    parser.add_argument("--families", default="residual,mhc,s2hc", metavar="A,B,...",
                        help="families to compare (default 'residual,mhc,s2hc'), each optionally FAMILY:KEY=VALUE with "
                        "options of its own, e.g. attn-res:block_size=2,mhc; --family-option applies to every one "
                        "that takes options (not the residual)")
    parser.add_argument("--family", action=_SaysFamilies, help=argparse.SUPPRESS)  # not --family-option's prefix
    parser.add_argument("--streams", type=positive_int, default=None,
                        help="streams n of every non-residual family (default 4)")
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds per family, seed, seed+1, ... (default 1)")
    parser.add_argument("--out", default="runs/compare", help="report directory (default 'runs/compare')")
    parser.add_argument("--resume", action="store_true",
                        help="keep finished runs in OUT, resume unfinished ones and start missing ones")
    parser.add_argument("--overwrite", action="store_true", help="start the runs in OUT again from scratch")
    add_training_options(parser)
    parser.set_defaults(func=run_compare, subparser=parser)


class _SaysFamilies(argparse.Action):
    """``s2hc compare --family X``: compare takes a list (``--families``); without this option argparse would take
    ``--family`` for the start of ``--family-option`` and refuse ``X`` as no KEY=VALUE."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"s2hc compare compares several families: did you mean --families "
                                     f"{values}? (the options of all of them: --family-option KEY=VALUE)")


def _run_training(args: argparse.Namespace, run) -> int:
    from ..train import Interrupted, TrainingError

    try:
        return run()
    except ValueError as error:
        args.subparser.error(str(error))
    except TrainingError as error:  # a run that started and stopped: its last good checkpoint is kept
        print(f"s2hc {args.command}: {error}", file=sys.stderr)
        return 1
    except Interrupted as error:
        print(f"s2hc {args.command}: {error}", file=sys.stderr)
        return 128 + error.signum


def resumed_processes(config: TrainConfig) -> tuple[int, int]:
    """``(processes that resume the run in config.out, processes that trained it)`` when no ``--nproc`` is given
    (``config``: the resumed settings): a run trained by several processes gets as many as keep its global batch at
    the batch size it resumes with (at its own batch size, its own count); 1 for a run trained by one process, one
    without a checkpoint yet, or a batch size that fits no count (the run then refuses it, naming the ``--nproc``
    to give)."""
    from pathlib import Path

    from ..config import completed_settings
    from ..rundir import checkpoint_paths, peek_checkpoint

    out = Path(config.out).expanduser()
    if not checkpoint_paths(out):
        return 1, 1
    saved = peek_checkpoint(out)
    sequences = completed_settings(saved.config)["batch_size"] * saved.world_size
    if saved.world_size == 1 or sequences % config.batch_size:
        return 1, saved.world_size
    return sequences // config.batch_size, saved.world_size


def run_train(args: argparse.Namespace) -> int:
    from ..train import train
    from ..train.distributed import launch, launched_by_torchrun

    if args.nproc is None and args.resume and not launched_by_torchrun():
        try:
            config = training_config(args, resume=True, family=args.family, n_streams=args.streams, out=args.out)
            nproc, trained = resumed_processes(config)
        except ValueError as error:
            args.subparser.error(str(error))
        if nproc > 1:
            why = (f"the {nproc} processes it was trained with" if nproc == trained else
                   f"which keep the global batch of its {trained} processes at batch_size={config.batch_size}")
            print(f"s2hc train: resuming {config.out} with --nproc {nproc}, {why} (give --nproc to choose another "
                  "count)", file=sys.stderr, flush=True)
            return launch(nproc, args.argv)
    if args.nproc is not None:
        if launched_by_torchrun():
            args.subparser.error("--nproc was given inside a torchrun launch; drop it or launch s2hc directly")
        return launch(args.nproc, _without_option(args.argv, "--nproc"))

    def run() -> int:
        config = training_config(args, resume=args.resume, family=args.family, n_streams=args.streams, out=args.out)
        result = train(config, resume=args.resume, overwrite=args.overwrite)
        if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the job
            return 0
        val = "n/a" if result.val_loss is None else f"{result.val_loss:.4f}"
        print(f"step {result.step}: train loss {result.train_loss:.4f}, validation loss {val}, "
              f"{result.tokens_per_s:,.0f} tokens/s; run in {result.out}")
        return 0

    return _run_training(args, run)


def run_compare(args: argparse.Namespace) -> int:
    from ..study import StudyFailed, StudyInterrupted, compare
    from ..train.distributed import launched_by_torchrun

    if launched_by_torchrun():
        args.subparser.error("s2hc compare starts each run as its own `s2hc train`: launch it directly, not under "
                             "torchrun (for several processes per run, use `s2hc study` with nproc: N)")

    def run() -> int:
        from ..config import parse_assignment

        variants = parse_variants(args.families)
        options = dict(parse_assignment(text, "--family-option") for text in args.family_option)
        base = training_config(args, family_options=False)
        try:
            report = compare(base, variants, seeds=args.seeds, out=args.out, n_streams=args.streams,
                             resume=args.resume, overwrite=args.overwrite, family_options=options,
                             log=lambda line: print(f"s2hc compare: {line}", file=sys.stderr, flush=True))
        except StudyInterrupted as error:  # the runs saved checkpoints; --resume goes on from them
            print(f"s2hc compare: stopped by signal {error.signum}; the runs saved their checkpoints: go on with "
                  f"{_resume_hint(args.argv)}", file=sys.stderr)
            return 128 + error.signum
        except StudyFailed as error:
            print(f"s2hc compare: {error} with --resume: {_resume_hint(args.argv)}", file=sys.stderr)
            return 1
        print(report.read_text())
        print(f"Report: {report}")
        return 0

    return _run_training(args, run)


def _resume_hint(argv: list[str]) -> str:
    """The command that goes on with a comparison ``s2hc <argv>`` stopped: the same, with ``--resume`` in place of
    ``--overwrite``, in full (to copy); and, under make (``make demo``), the make variable that does it."""
    words = [word for word in argv if word != "--overwrite"]
    command = "`s2hc " + shlex.join(words + ([] if "--resume" in words else ["--resume"])) + "`"
    if os.environ.get("MAKELEVEL"):  # started by make: `make demo` goes on with DEMO_RESUME=1
        command += " (from `make demo`: the same make command with DEMO_RESUME=1)"
    return command


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE``."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            kept.append(item)
    return kept
