"""``s2hc params``: parameter counts of the hyper-connections of a model shape, per family."""

from __future__ import annotations

import argparse
import json
import sys

from .common import parse_families, positive_int

# The library is imported inside the functions (s2hc.cli's start time).

SUMMARY = {"params": "parameter counts of the hyper-connections of a model shape"}


def parse_variants(text: str | None, argument: str = "--families") -> list[tuple[str, dict]]:
    """``"mhc,gated-residual:rank=16"`` -> ``[("mhc", {}), ("gated-residual", {"rank": 16})]`` (None: every family),
    read as ``s2hc bench --families`` reads them (:func:`s2hc.bench.measure.parse_variant`: ``FAMILY:KEY=VALUE``,
    several options separated by colons, ``s2hc:rotation=expm:fused=false``); what ``s2hc params``, ``train
    --family`` and ``compare --families`` take. ValueError naming ``argument`` for an unknown family (the bench's
    peer included) or an option without ``=``."""
    from ..bench.measure import parse_variant
    from ..connection.forms import check_family, families

    if text is None:
        return [(name, {}) for name in families()]
    try:
        variants = [parse_variant(entry, n_streams=1) for entry in text.split(",") if entry.strip()]
        if not variants:
            parse_families(text)  # says that no family is named
        for variant in variants:
            check_family(variant.family, "argument --families")  # the peer is no family to count
    except ValueError as error:  # the bench names its own argument
        raise ValueError(str(error).replace("argument --families", f"argument {argument}")) from None
    return [(variant.family, variant.options) for variant in variants]


def register(subparsers) -> None:
    from ..connection.forms import families

    parser = subparsers.add_parser(
        "params",
        help=SUMMARY["params"],
        description=(
            "Count the parameters of the hyper-connections of a model with LAYERS layers of width DIM and "
            "N streams, one connection per wrapped sublayer, for each family. The modules are built "
            "on the meta device (nothing is allocated), so large families such as mhc-lite at n = 7 are cheap. "
            "Limits: n <= 64, layers <= 10000, and permutation mixtures (mhc-lite, kromhc's prime factors) of at "
            "most 12 streams (8 for a model that is trained)."
        ),
    )
    parser.add_argument("--layers", type=positive_int, default=28, help="transformer layers (default 28)")
    parser.add_argument("--dim", type=positive_int, default=1024, help="width C of one stream (default 1024)")
    parser.add_argument(
        "--streams", type=positive_int, default=4, help="number of streams n (default 4; residual always uses 1)"
    )
    parser.add_argument(
        "--sublayers-per-layer", type=positive_int, default=2,
        help="wrapped sublayers per layer (default 2: attention and MLP)",
    )  # fmt: skip
    parser.add_argument(
        "--families", default=None, metavar="A,B,...",
        help=f"comma-separated families, optionally NAME:KEY=VALUE with a family option, e.g. gated-residual:rank=16 "
             f"(default: all of {','.join(families())})",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.set_defaults(func=run, subparser=parser)


def check_as_trained(family: str, options: dict, *, layers: int, dim: int, n_streams: int) -> dict:
    """``options`` of ``family`` checked as ``s2hc train`` checks a run's (:func:`s2hc.config.check_family_options`,
    then the model's own checks, :class:`~s2hc.models.ModelConfig`: the stream count the family takes, its options,
    the options the model's sizes bound such as AttnRes's ``block_size``), at ``layers`` layers of width ``dim``
    (``n_streams`` of a one-stream family is 1); ValueError in one line otherwise. Returns the checked options. The
    one check left to the count is the size of a permutation mixture: counted up to 12 streams, as the description
    says, where a trained model stops at 8 (and needs ``allow_large=True`` past 6, which the count takes as given:
    :func:`s2hc.params.build_options`)."""
    from ..config import check_family_options
    from ..connection import forms
    from ..models import ModelConfig
    from ..params import build_options, check_countable

    options = build_options(family, **options)
    n_streams = 1 if forms.get(family).max_streams == 1 else n_streams
    try:
        check_countable(family, n_streams, built=True)
    except ValueError:  # a mixture larger than a trained model's, counted all the same
        pass
    else:
        options = check_family_options(family, n_streams, options)
    ModelConfig(dim=dim, n_layers=layers, n_heads=1, head_dim=2, family=family, n_streams=n_streams,
                family_options=options)  # a head of 2: the connections' checks, whatever dim is
    return options


def run(args: argparse.Namespace) -> int:
    from ..checks import MAX_LAYERS, check_int, check_streams
    from ..params import format_table, param_table

    left_out = []
    try:
        check_streams("argument --streams", args.streams)
        check_int("layers", args.layers, maximum=MAX_LAYERS)  # the table's own bounds first: no family would pass
        variants = []
        for family, options in parse_variants(args.families):
            try:
                check_as_trained(family, options, layers=args.layers, dim=args.dim, n_streams=args.streams)
            except ValueError as error:
                if args.families is not None:  # a family asked for: refused as `s2hc train` refuses it
                    raise ValueError(f"{family}: {error} (as `s2hc train` refuses it)") from None
                left_out.append(f"{family} ({error})")  # the default table: the families that can be trained
                continue
            variants.append((family, options))
        rows = param_table(
            variants, layers=args.layers, dim=args.dim, n_streams=args.streams,
            sublayers_per_layer=args.sublayers_per_layer,
        )  # fmt: skip
    except ValueError as error:
        args.subparser.error(str(error))  # "s2hc params: error: ...", exit 2
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if left_out:
        print(f"s2hc params: left out, as `s2hc train` refuses them here: {'; '.join(left_out)}", file=sys.stderr)
    return 0
