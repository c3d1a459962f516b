"""``s2hc bench``: training-step time and peak memory per family as ratios to residual, the coefficient
path alone, the ``hyper-connections`` package's mHC as a peer, and the parameter table.

Progress goes to stderr as it happens, with ``--json`` too (whose object alone is on stdout); ``--jsonl
FILE`` appends every event (settings, each model built, each repetition's times, each row) to FILE as one
JSON line when it happens, so a run cut short by a time limit still leaves what it finished.
"""

from __future__ import annotations

import argparse
import json
import sys

from .common import positive_int

# torch and the library are imported inside the functions (s2hc.cli's start time).

SUMMARY = {"bench": "step time, peak memory and coefficient-path cost per family, as ratios to residual"}


def register(subparsers) -> None:
    from ..bench.measure import PEER
    from ..connection.forms import families
    from ..devices import AUTOCAST_NAMES, DEVICE_NAMES

    parser = subparsers.add_parser(
        "bench",
        help=SUMMARY["bench"],
        description=(
            "Time training steps (forward, cross-entropy, backward, AdamW) of a preset with each family, "
            "interleaved with residual in every repetition, and report ratios (median and spread), tokens/s "
            "and peak tensor memory; then the coefficient path alone per token, and the parameter table. "
            f"The hyper-connections package's mHC ({PEER}) runs as a peer at n = 4 when it is importable. "
            "A family may carry options: s2hc:recompute=True, s2hc:fused=False, s2hc:kernels=triton (CUDA, or a CPU "
            "under TRITON_INTERPRET=1), s2hc:activation_checkpointing=True (whole blocks recomputed in backward). "
            "Runs on a CUDA GPU when there is one (--device). Never fails on a time."
        ),
    )
    parser.add_argument("--preset", default="small", help="model preset (default 'small')")
    parser.add_argument(
        "--streams", type=positive_int, default=4, help="streams n of the non-residual families (default 4)"
    )
    parser.add_argument(
        "--families", default="s2hc,mhc", metavar="A,B,...",
        help=f"families, optionally NAME:KEY=VALUE (default 's2hc,mhc'; residual is always added; allowed: "
        f"{','.join(families())},{PEER})",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="auto", metavar="|".join(DEVICE_NAMES),
        help="where models and data live: auto (cuda when torch.cuda.is_available(), else cpu; the default), "
        "cpu, cuda or cuda:N. On cuda, timings are synchronised and peak memory comes from torch.cuda's statistics",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="float32", choices=AUTOCAST_NAMES,
        help="precision, the names of `s2hc train --dtype`: float32 (the default; no autocast), bfloat16 (each "
        "forward pass under torch.autocast with bfloat16 on the device, float32 weights and loss, as training "
        "runs), auto (bfloat16 where the device supports it)",
    )  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="torch.compile each block, as s2hc train --compile does")
    parser.add_argument(
        "--activation-checkpointing", action="store_true",
        help="also time every variant with its blocks checkpointed (recomputed in the backward pass, as `s2hc train "
        "--activation-checkpointing` does), in the same repetitions; adds its step-time and peak-memory ratios to "
        "the same variant without it",
    )  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument(
        "--steps", type=positive_int, default=2, help="timed steps per variant and repetition (default 2)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--layers", type=positive_int, default=None, help="override the preset's layer count")
    parser.add_argument("--dim", type=positive_int, default=None, metavar="C",
                        help="override the preset's width C; its MLP width scales with it, its heads stay (how cost "
                        "grows with C)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads (default: torch's choice; 1 gives stable ratios on a shared machine)")
    parser.add_argument("--no-peer", action="store_true", help=f"leave out {PEER}")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    parser.add_argument("--no-coefficients", action="store_true", help="skip the coefficient-path table")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON object of lists instead of tables (progress still goes to stderr)")
    parser.add_argument(
        "--jsonl", default=None, metavar="FILE",
        help="append each event to FILE as one JSON line as it happens: the settings, each model built (seconds, "
        "compilation included), each repetition's step times, each row; a run cut short keeps what it finished",
    )  # fmt: skip
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench import measure
    from ..bench.run import format_report, run_bench
    from ..bench.settings import BenchSettings
    from ..devices import resolve_device

    try:
        variants = [measure.parse_variant(t, args.streams) for t in args.families.split(",") if t.strip()]
        settings = BenchSettings(
            preset=args.preset, overrides=_overrides(args),
            n_streams=args.streams, batch_size=args.batch_size, seq_len=args.seq_len, compile=args.compile,
            activation_checkpointing=args.activation_checkpointing, repeats=args.repeats, steps=args.steps,
            memory=not args.no_memory, coefficients=not args.no_coefficients, peer=not args.no_peer,
            device=resolve_device(args.device, "argument --device"), dtype=args.dtype,
        )  # fmt: skip
    except ValueError as error:
        args.subparser.error(str(error))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_bench(settings, variants, log=log, on_event=_event_writer(args.jsonl))
    except ValueError as error:  # bad options, kernels=triton where it cannot run
        args.subparser.error(str(error))
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def _overrides(args: argparse.Namespace) -> dict:
    """The ModelConfig fields ``--layers`` and ``--dim`` change: ``--dim`` keeps the preset's MLP ratio."""
    from ..models import get_preset

    overrides = {} if args.layers is None else {"n_layers": args.layers}
    if args.dim is not None:
        preset = get_preset(args.preset)
        overrides.update(dim=args.dim, ffn_dim=round(preset.ffn_dim * args.dim / preset.dim))
    return overrides


def log(text: str) -> None:
    """A progress line on stderr, flushed (with ``--json`` too: stdout holds only the JSON object)."""
    print(text, file=sys.stderr, flush=True)


def _event_writer(path: str | None):
    """``emit(event)`` appending ``event`` to ``path`` as one JSON line, the file opened and closed each time, so
    every finished line is on disk whatever stops the run (a no-op without a path). The file is opened once
    first, so an unwritable path fails before anything is measured (an OSError: the CLI's one-line error)."""
    if path is None:
        return lambda event: None
    with open(path, "a", encoding="utf-8"):
        pass

    def emit(event: dict) -> None:
        with open(path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(event) + "\n")

    return emit
