"""The ``s2hc`` command (also ``python -m s2hc``).

Subcommands:
  params   parameter counts of the hyper-connections of a model shape, per mixing family.

Each subcommand is one ``add_<name>_parser`` function that registers its arguments and one
``cmd_<name>(args) -> int`` that runs it; :func:`build_parser` wires them together.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from . import __version__
from .connection import methods


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
        "--mixers",
        default=None,
        metavar="A,B,...",
        help=f"comma-separated families (default: all of {','.join(methods())})",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.set_defaults(func=cmd_params, subparser=parser)
    return parser


def parse_mixers(text: str | None) -> list[str]:
    """``"mhc, s2hc"`` -> ``["mhc", "s2hc"]``; ValueError naming ``--mixers`` for unknown or no names."""
    if text is None:
        return methods()
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError(f"argument --mixers: no family named in {text!r}; allowed: {','.join(methods())}")
    unknown = [name for name in names if name not in methods()]
    if unknown:
        raise ValueError(
            f"argument --mixers: unknown mixer(s) {','.join(unknown)}; allowed: {','.join(methods())}"
        )
    return names


def format_params_table(rows: list[dict]) -> str:
    """The rows of :func:`s2hc.params.param_table` as a Markdown table, with a one-line caption."""
    first = rows[0]
    n_values = sorted({row["n_streams"] for row in rows if row["mixer"] != "residual"})
    streams = f"n = {n_values[0]} streams" if len(n_values) == 1 else "n = 1 stream"
    if any(row["mixer"] == "residual" for row in rows) and n_values:
        streams += " (residual: 1)"
    lines = [
        f"Hyper-connection parameters: {first['layers']} layers x {first['sublayers_per_layer']} sublayers = "
        f"{first['sublayers']} connections, C = {first['dim']}, {streams}",
        "",
        "| mixer | K | per sublayer | total | vs mHC |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        per = row["per_sublayer"]
        per_text = f"{human(per)} ({per:,})" if isinstance(per, int) else f"{human(per)} ({per:,.1f})"
        ratio = "-" if row["vs_mhc"] is None else f"{row['vs_mhc']:.2f}x"
        lines.append(
            f"| {row['mixer']} | {row['K']:,} | {per_text} | {human(row['aux_params'])} ({row['aux_params']:,}) "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def cmd_params(args: argparse.Namespace) -> int:
    from .params import param_table  # imported here: other subcommands need not pay for it

    try:
        rows = param_table(
            parse_mixers(args.mixers),
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


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s2hc", description="Multi-stream residual connections (hyper-connections): s²HC and its relatives."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_params_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``s2hc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
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
