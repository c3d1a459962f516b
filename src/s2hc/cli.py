"""The ``s2hc`` command (also ``python -m s2hc``).

Subcommands:
  params   parameter counts of the hyper-connections of a model shape, per mixing family.
  train    pretrain a language model with one residual family (resumable).
  compare  train the same model with several families and write a report.
  eval     perplexity and lm-evaluation-harness benchmarks of a checkpoint.
  generate sample continuations of a prompt from a checkpoint.
  export   write a checkpoint as a Hugging Face transformers model directory.
  diagnose measure the residual matrices of a checkpoint, or of synthetic inputs.
  bench    step time, peak memory and coefficient-path cost per family, as ratios to residual.

Each subcommand is one ``add_<name>_parser`` function that registers its arguments and one
``cmd_<name>(args) -> int`` that runs it; :func:`build_parser` wires them together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from . import __version__
from .connection import families


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the argument in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def human(count: float) -> str:
    """``25693808 -> '25.7 M'``, ``2029400632 -> '2.03 B'``: three significant digits, K/M/B/T."""
    if count < 1000:
        return f"{count:g}"
    for scale, unit in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = f"{count / scale:.3g}"
        if float(text) < 1000 or unit == "T":
            return f"{text} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


# ---------------------------------------------------------------------------------------------- params


def add_params_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "params",
        help="parameter counts of the hyper-connections of a model shape",
        description=(
            "Count the parameters of the hyper-connections of a model with LAYERS layers of width DIM and "
            "N streams, one connection per wrapped sublayer, for each mixing family. The modules are built "
            "on the meta device (nothing is allocated), so large families such as mhc-lite at n = 7 are cheap."
        ),
    )
    parser.add_argument("--layers", type=positive_int, default=28, help="transformer layers (default 28)")
    parser.add_argument("--dim", type=positive_int, default=1024, help="width C of one stream (default 1024)")
    parser.add_argument(
        "--streams", type=positive_int, default=4, help="number of streams n (default 4; residual always uses 1)"
    )
    parser.add_argument(
        "--sublayers-per-layer",
        type=positive_int,
        default=2,
        help="wrapped sublayers per layer (default 2: attention and MLP)",
    )
    parser.add_argument(
        "--families",
        default=None,
        metavar="A,B,...",
        help=f"comma-separated families (default: all of {','.join(families())})",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.set_defaults(func=cmd_params, subparser=parser)
    return parser


def parse_families(text: str | None) -> list[str]:
    """``"mhc, s2hc"`` -> ``["mhc", "s2hc"]``; ValueError naming ``--families`` for unknown or no names."""
    if text is None:
        return families()
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError(f"argument --families: no family named in {text!r}; allowed: {','.join(families())}")
    unknown = [name for name in names if name not in families()]
    if unknown:
        raise ValueError(
            f"argument --families: unknown family(s) {','.join(unknown)}; allowed: {','.join(families())}"
        )
    return names


def format_params_table(rows: list[dict]) -> str:
    """The rows of :func:`s2hc.params.param_table` as a Markdown table, with a one-line caption."""
    first = rows[0]
    n_values = sorted({row["n_streams"] for row in rows if row["family"] != "residual"})
    streams = f"n = {n_values[0]} streams" if len(n_values) == 1 else "n = 1 stream"
    if any(row["family"] == "residual" for row in rows) and n_values:
        streams += " (residual: 1)"
    lines = [
        f"Hyper-connection parameters: {first['layers']} layers x {first['sublayers_per_layer']} sublayers = "
        f"{first['sublayers']} connections, C = {first['dim']}, {streams}",
        "",
        "| family | K | per sublayer | total | vs mHC |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        per = row["per_sublayer"]
        per_text = f"{human(per)} ({per:,})" if isinstance(per, int) else f"{human(per)} ({per:,.1f})"
        ratio = "-" if row["vs_mhc"] is None else f"{row['vs_mhc']:.2f}x"
        lines.append(
            f"| {row['family']} | {row['K']:,} | {per_text} | {human(row['hc_params'])} ({row['hc_params']:,}) "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def cmd_params(args: argparse.Namespace) -> int:
    from .params import param_table  # imported here: other subcommands need not pay for it

    try:
        rows = param_table(
            parse_families(args.families),
            layers=args.layers,
            dim=args.dim,
            n_streams=args.streams,
            sublayers_per_layer=args.sublayers_per_layer,
        )
    except ValueError as error:
        args.subparser.error(str(error))  # "s2hc params: error: ...", exit 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_params_table(rows))
    return 0


# ------------------------------------------------------------------------------------------ train, compare

# (flag, TrainConfig field, type, help). Every flag defaults to None: only what is given overrides the
# config file, which overrides TrainConfig's defaults (shown in --help).
TRAINING_FLAGS = [
    ("--preset", "preset", str, "model preset (s2hc.models.PRESETS)"),
    ("--max-steps", "max_steps", positive_int, "optimizer steps"),
    ("--seed", "seed", int, "seed of initialisation and data order"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--batch-size", "batch_size", positive_int, "sequences per micro-step (per process)"),
    ("--grad-accum", "grad_accum", positive_int, "micro-steps per optimizer step"),
    ("--seq-len", "seq_len", positive_int, "tokens per sequence"),
    ("--data", "data", str, "'embedded', a .txt/.jsonl/.parquet file or directory, or hf:NAME[:CONFIG]"),
    ("--tokenizer", "tokenizer", str, "'s2hc-bpe-4k', 'gpt2', a tokenizer.json path or a Hub name"),
    ("--cache-dir", "cache_dir", str, "where token shards are cached (None: $S2HC_CACHE_DIR/tokens or ~/.cache/s2hc/tokens)"),
    ("--eval-every", "eval_every", int, "steps between validation losses (0: only at the end)"),
    ("--checkpoint-every", "checkpoint_every", int, "steps between checkpoints (0: only at the end)"),
    ("--log-every", "log_every", positive_int, "steps between metrics lines"),
    ("--diagnostics-every", "diagnostics_every", int, "steps between hyper-connection diagnostics in metrics.jsonl (0: off)"),
    ("--device", "device", str, "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("--parallel", "parallel", str, "'auto' (DDP with several processes), 'none', 'ddp' or 'fsdp' (FSDP2)"),
    ("--dtype", "dtype", str, "'auto' (bfloat16 autocast where supported, else float32), 'float32', 'bfloat16'"),
]


def add_training_options(parser: argparse.ArgumentParser) -> None:
    from .train.config import TrainConfig

    defaults = TrainConfig()
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of TrainConfig keys (see configs/)")
    for flag, name, kind, text in TRAINING_FLAGS:
        parser.add_argument(flag, dest=name, type=kind, default=None, help=f"{text} (default {getattr(defaults, name)!r})")
    parser.add_argument("--compile", action="store_const", const=True, default=None, help="torch.compile the model")
    parser.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                        help="no progress bar")
    parser.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the mixing family, e.g. iterations=10 or rotation=expm (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other TrainConfig key, value parsed as YAML, e.g. model_overrides={dim: 64}")


def training_config(args: argparse.Namespace, **fixed) -> "TrainConfig":
    """TrainConfig from defaults < --config file < --set < explicit flags < ``fixed``."""
    from .train.config import TrainConfig, load_yaml_config, parse_assignment

    values = load_yaml_config(args.config) if args.config else {}
    values.update(parse_assignment(text) for text in args.set)
    for _, name, _, _ in TRAINING_FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("compile", "progress"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.family_option:
        values["family_options"] = {**values.get("family_options", {}), **dict(map(parse_assignment, args.family_option))}
    values.update({k: v for k, v in fixed.items() if v is not None})
    return TrainConfig.from_dict(values)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="pretrain a language model with one residual family",
        description="Pretrain a decoder-only language model whose sublayers are wrapped by one residual family. "
        "Writes OUT/metrics.jsonl, OUT/config.yaml and OUT/checkpoint.pt; --resume continues exactly.",
    )
    parser.add_argument("--family", default=None, help="residual family: one of " + ", ".join(families()) + " (default 'residual')")
    parser.add_argument("--streams", type=positive_int, default=None, help="streams n (default 1 for residual, else 4)")
    parser.add_argument("--out", default=None, help="run directory (default 'runs/train')")
    parser.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint if there is one")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="launch N processes on this machine with torchrun (same as `torchrun "
                        "--nproc_per_node=N -m s2hc train ...`); default: this one process")
    add_training_options(parser)
    parser.set_defaults(func=cmd_train, subparser=parser)
    return parser


def _run_training(args: argparse.Namespace, run) -> int:
    from .train import Interrupted, TrainingError

    try:
        return run()
    except ValueError as error:
        args.subparser.error(str(error))
    except TrainingError as error:
        print(f"s2hc {args.command}: {error}", file=sys.stderr)
        return 3
    except Interrupted as error:
        print(f"s2hc {args.command}: {error}", file=sys.stderr)
        return 128 + error.signum


def cmd_train(args: argparse.Namespace) -> int:
    from .train import train

    if args.nproc is not None:
        from .train.distributed import launch, launched_by_torchrun

        if launched_by_torchrun():
            args.subparser.error("--nproc was given inside a torchrun launch; drop it or launch s2hc directly")
        return launch(args.nproc, _without_option(args.argv, "--nproc"))

    def run() -> int:
        config = training_config(args, family=args.family, n_streams=args.streams, out=args.out)
        result = train(config, resume=args.resume)
        if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the job
            return 0
        val = "n/a" if result.val_loss is None else f"{result.val_loss:.4f}"
        print(f"step {result.step}: train loss {result.train_loss:.4f}, validation loss {val}, "
              f"{result.tokens_per_s:,.0f} tokens/s; run in {result.out}")
        return 0

    return _run_training(args, run)


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare", help="train the same model with several residual families and write a report",
        description="Train the same model on the same data, seed and token budget once per family (and seed), "
        "then write OUT/report.md with final losses, tokens/s, parameters and overhead against residual, "
        "OUT/loss_curves.png and each run's directory.",
    )
    parser.add_argument("--families", default="residual,mhc,s2hc", metavar="A,B,...",
                        help="families to compare (default 'residual,mhc,s2hc')")
    parser.add_argument("--streams", type=positive_int, default=None, help="streams n of every non-residual family (default 4)")
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds per family, seed, seed+1, ... (default 1)")
    parser.add_argument("--out", default="runs/compare", help="report directory (default 'runs/compare')")
    parser.add_argument("--resume", action="store_true", help="keep finished runs in OUT and resume unfinished ones")
    add_training_options(parser)
    parser.set_defaults(func=cmd_compare, subparser=parser)
    return parser


def cmd_compare(args: argparse.Namespace) -> int:
    from .train import compare

    def run() -> int:
        mixers = parse_families(args.families)
        base = training_config(args)
        report = compare(base, mixers, seeds=args.seeds, out=args.out, n_streams=args.streams, resume=args.resume)
        print(report.read_text())
        print(f"Report: {report}")
        return 0

    return _run_training(args, run)


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s2hc", description="Multi-stream residual connections (hyper-connections): s²HC and its relatives."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_params_parser(subparsers)
    add_train_parser(subparsers)
    add_compare_parser(subparsers)
    # Each of these modules imports helpers from this one, so they are imported here, not at the top.
    from .bench.cli import add_bench_parser
    from .diagnostics.cli import add_diagnose_parser
    from .evaluate.cli import add_eval_parser, add_export_parser, add_generate_parser

    add_eval_parser(subparsers)
    add_generate_parser(subparsers)
    add_export_parser(subparsers)
    add_diagnose_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
