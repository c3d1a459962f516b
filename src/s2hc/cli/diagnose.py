"""``s2hc diagnose``: the measurements of docs/design.md section 2 for a checkpoint, for the static matrices
of a safetensors checkpoint (``--static``: the biases alone, no model built), or for synthetic matrices.

Exit status: 0 on success and
for a model without stream mixing (nothing to measure, said so); 2 for bad input (a missing, corrupt or
foreign file, wrong arguments), with one error line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..extras import check_available
from ..io import check_output_dir
from .common import add_step_option, nonnegative_float, output_directory, parse_families, positive_int, resolve_step

# The library (torch, the diagnostics, the run directory) is imported inside the functions (s2hc.cli's start time).

SUMMARY = {"diagnose": "measure what the residual matrices do (a checkpoint, or --synthetic)"}

DEFAULT_SYNTHETIC_OUT = "runs/diagnose-synthetic"
DEFAULT_STATIC_OUT = "runs/diagnose-static"
CHECKPOINT_ONLY = ("step", "data", "device", "cache_dir", "seq_len", "batch_size")
SYNTHETIC_ONLY = ("families", "layers", "streams", "logit_scale", "sweep")


def _scales(text: str) -> list[float]:
    return [nonnegative_float(part) for part in text.split(",") if part.strip()]


def register(subparsers) -> None:
    from ..diagnostics.synthetic import DEFAULT_SWEEP

    parser = subparsers.add_parser(
        "diagnose",
        help=SUMMARY["diagnose"],
        description=(
            "Measure the residual matrices of a trained model on real tokens (CHECKPOINT: a run directory or a "
            "checkpoint file); with --static the input-independent matrices (the biases alone, d = 0) of a "
            "safetensors checkpoint (CHECKPOINT: a .safetensors file or a directory, sharded or not; s2hc exports "
            "and DeepSeek-V4's layout), reading only the hyper-connection tensors; or with --synthetic each "
            "family's matrices from random inputs of logit scale S. Writes OUT/diagnostics.json (static.json), PNG "
            "figures and OUT/report.md. See docs/diagnostics.md."
        ),
    )
    parser.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help="run directory or checkpoint file")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: RUN/diagnostics for a checkpoint, RUN/diagnostics/"
                             f"step-00000100 or RUN/diagnostics/best with --step, {DEFAULT_STATIC_OUT}/NAME "
                             f"for --static, {DEFAULT_SYNTHETIC_OUT} for --synthetic)")
    parser.add_argument("--static", action="store_true",
                        help="CHECKPOINT is safetensors (file or directory): measure its matrices at d = 0, reading "
                             "only the hyper-connection tensors")
    parser.add_argument("--tokens", type=positive_int, default=1024, help="token positions measured (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sample / random inputs (default 0)")
    model = parser.add_argument_group("checkpoint")
    add_step_option(model)
    model.add_argument("--data", default=None,
                       help="text whose validation split is measured: 'embedded' (default), a .txt/.jsonl/.parquet "
                            "file or directory, or hf:NAME[:CONFIG]; tokenised with the run's tokenizer")
    model.add_argument("--cache-dir", default=None, help="token cache (default: the run's)")
    model.add_argument("--seq-len", type=positive_int, default=None, help="window length (default: the run's)")
    model.add_argument(
        "--batch-size", type=positive_int, default=None, help="windows per forward pass (default: the run's)"
    )
    model.add_argument("--device", default=None, help="'auto' (default), 'cpu', 'cuda' or 'cuda:N'")
    synthetic = parser.add_argument_group("synthetic")
    synthetic.add_argument(
        "--synthetic", action="store_true", help="no model: each family's matrices from random inputs"
    )
    synthetic.add_argument("--families", default=None, metavar="A,B,...",
                           help="families (default mhc,mhc-lite,kromhc,s2hc,hc)")
    synthetic.add_argument("--layers", type=positive_int, default=None, help="matrices composed per token (default 28)")
    synthetic.add_argument("--streams", type=positive_int, default=None, help="streams n (default 4)")
    synthetic.add_argument("--logit-scale", type=nonnegative_float, default=None, metavar="S",
                           help="standard deviation of alpha*d_res: every scale alpha set to S, d_res ~ N(0, 1) "
                                "(default 1)")
    synthetic.add_argument("--sweep", type=_scales, default=None, metavar="S1,S2,...",
                           help="logit scales for the sweep table and figure (default "
                                f"{','.join(f'{s:g}' for s in DEFAULT_SWEEP)}; '' for none)")
    parser.set_defaults(func=run, subparser=parser)


def _fail(message: str) -> int:
    print(f"s2hc diagnose: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.static and args.synthetic:
        args.subparser.error("--static and --synthetic exclude each other")
    if args.synthetic == (args.checkpoint is not None):
        args.subparser.error("give either CHECKPOINT or --synthetic (exactly one)")
    wrong = (CHECKPOINT_ONLY + SYNTHETIC_ONLY if args.static else
             CHECKPOINT_ONLY if args.synthetic else SYNTHETIC_ONLY)
    given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(args, name) is not None]
    if given:
        mode = "--static" if args.static else "--synthetic" if args.synthetic else "a CHECKPOINT"
        args.subparser.error(f"{', '.join(given)} do(es) not apply to {mode}")
    if args.static:
        return _static(args)
    return _synthetic(args) if args.synthetic else _checkpoint(args)


def _static(args: argparse.Namespace) -> int:
    check_available(("transformers", "safetensors"), "--static")  # s2hc.hf (the DeepSeek-V4 converters) needs both
    from ..diagnostics.report import REPORT_NAME
    from ..hf.static import diagnose_static, write_static

    name = Path(args.checkpoint).expanduser().resolve()
    name = name.stem if name.suffix == ".safetensors" else name.name
    try:
        result = diagnose_static(args.checkpoint)  # read first: bad input leaves no output directory behind
        with output_directory(args.out or Path(DEFAULT_STATIC_OUT) / name, "--out") as out:
            write_static(result, out)
    except ValueError as error:
        return _fail(str(error))
    if "learned_maps" in result:  # a one-stream design: its learned maps
        maps = result["learned_maps"]["connections"]
        print(f"{result['layout']} checkpoint as {result['family']}, {len(maps)} connections, "
              f"{result['tensors_read']} tensors read; no residual matrix, their learned maps measured")
        print(f"Report: {out / REPORT_NAME}")
        return 0
    if "depth_reads" in result:  # Attention Residuals: what its depth reads can do
        from ..hf.static_attn_res import line

        print(line(result))
        print(f"Report: {out / REPORT_NAME}")
        return 0
    head = result["headline"]
    print(
        f"{result['family']} (n = {result['n_streams']}, {result['layout']} layout), {result['depth']} connections, "
        f"{result.get('basis', 'biases alone (d = 0)')}, {result['tensors_read']} tensors read: worst column-sum error "
        f"{head['col_sum_error']:.3g}, worst ‖H‖₂ {head['spectral_norm']:.6g}, composite ‖P‖₂ "
        f"{head['composite_spectral_norm_at_depth']:.6g}, composite Amax forward {head['composite_forward_amax']:.4g} "
        f"/ backward {head['composite_backward_amax']:.4g}, largest ‖H − I‖_F "
        f"{max(result['identity_distance']['mean']):.4g}"
    )
    weights = result.get("stream_weights")
    if weights is not None:  # the gated residual: what its weights say per stream (not usage)
        tops = (f"{key} stream {top['stream']} {top['share']:.1%} at {top['connection']}"
                for key, top in ((k, v["max_share"]) for k, v in weights["across_depth"].items()))
        print(f"Per-stream weight norms (not usage; 1/n = {1 / result['n_streams']:.1%}), largest share: "
              + "; ".join(tops))
    print(f"Report: {out / REPORT_NAME}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from ..data.sources import required_packages
    from ..diagnostics.report import (
        REPORT_NAME,
        default_out,
        diagnose_checkpoint,
        has_residual_matrix,
        nothing_message,
    )
    from ..rundir import resolve_checkpoint
    from ..rundir.layout import DIAGNOSTICS, kept_name

    check_available(required_packages(args.data or "embedded"), f"--data {args.data}")
    try:
        run_dir, step = args.checkpoint, args.step
        resolve_step(args)  # --step N|best: args.checkpoint is that checkpoint of the run directory
        resolve_checkpoint(args.checkpoint)  # a missing checkpoint is reported before its output is made
        default = default_out(args.checkpoint) if step is None else \
            Path(run_dir).expanduser() / DIAGNOSTICS / kept_name(step, sharded=False).removesuffix(".pt")
        with output_directory(args.out or default, "--out") as out:
            result = diagnose_checkpoint(
                args.checkpoint, data=args.data or "embedded", tokens=args.tokens, out=out, seed=args.seed,
                device=args.device or "auto", cache_dir=args.cache_dir, seq_len=args.seq_len,
                batch_size=args.batch_size,
            )
    except ValueError as error:
        return _fail(str(error))
    if result.get("nothing_to_measure"):
        print(nothing_message(result))
        print(f"Report: {out / REPORT_NAME}")
        return 0
    if "depth_attention" in result:  # AttnRes: its depth softmax
        reads = result["depth_attention"]["reads"]
        spread = ", ".join(f"{r['effective_sources']:.2f}/{r['sources']}" for r in reads)
        print(f"{result['family']}, {len(reads)} depth reads, {result['depth_attention']['tokens']} tokens: effective "
              f"sources (of the count) {spread}")
        print(f"Report: {out / REPORT_NAME}")
        return 0
    if "learned_maps" in result:  # a form without a residual matrix: its own maps (the wide residual's, the gates)
        maps = result["learned_maps"]["connections"]
        measured = ", ".join(key for key, value in maps[0].items() if isinstance(value, (int, float)))
        print(f"{result['family']} (n = {result['n_streams']}), {len(maps)} connections, no residual matrix; "
              f"their learned maps measured: {measured}")
        print(f"Report: {out / REPORT_NAME}")
        return 0
    if not has_residual_matrix(result):  # the gated residual: what it reads and writes
        usage = result.get("read_depth_effective_streams"), result.get("write_depth_effective_streams")
        reads = "" if None in usage else (f": effective streams read {usage[0]:.2f}, written {usage[1]:.2f} "
                                          f"(of {result['n_streams']}, interior connections)")
        print(f"{result['family']} (n = {result['n_streams']}), {result['depth']} connections, no residual matrix"
              f"{reads}")
        print(f"Report: {out / REPORT_NAME}")
        return 0
    if "depth_reads" in result:  # Attention Residuals: what its depth reads can do
        from ..hf.static_attn_res import line

        print(line(result))
        print(f"Report: {out / REPORT_NAME}")
        return 0
    head = result["headline"]
    print(
        f"{result['family']} (n = {result['n_streams']}), {result['depth']} connections, {result['tokens']} tokens: "
        f"worst column-sum error {head['col_sum_error']:.3g}, worst ‖H‖₂ {head['spectral_norm']:.6g}, "
        f"composite ‖P‖₂ {head['composite_spectral_norm_at_depth']:.6g}, "
        f"composite Amax forward {head['composite_forward_amax']:.4g} / backward {head['composite_backward_amax']:.4g}"
    )
    print(_mixing_line(head))
    failed = [c["property"] for c in result.get("guarantees", []) if not c["holds"]]
    if failed:
        print(f"claimed but not measured within tolerance: {'; '.join(failed)}")
    print(f"Report: {out / REPORT_NAME}")
    return 0


def _mixing_line(head: dict) -> str:
    """What the matrices do, over the connections whose H_res can change the output (the headline's interior
    values; "none" when every connection is one that cannot, as in a one-block model)."""

    def value(key: str, unit: str = "") -> str:
        return "none" if head.get(key) is None else f"{head[key]:.3g}{unit}"

    return (f"connections that can change the output: largest ‖H − I‖_F {value('identity_distance_mean')}, "
            f"rotation angle {value('rotation_angle_mean', '°')}, spectrum slope 1 − σ² "
            f"{value('spectrum_slope_mean')}, negative entries below −1e-3 {value('negative_share_mean')}")


def _synthetic(args: argparse.Namespace) -> int:
    from ..checks import check_streams
    from ..diagnostics.report import REPORT_NAME, diagnose_synthetic
    from ..diagnostics.synthetic import DEFAULT_SWEEP

    try:
        families = parse_families(args.families or "mhc,mhc-lite,kromhc,s2hc,hc")
        if args.streams is not None:
            check_streams("argument --streams", args.streams)
        out = check_output_dir(args.out or DEFAULT_SYNTHETIC_OUT, "--out")
        diagnose_synthetic(
            families, n_streams=args.streams or 4, layers=args.layers or 28, tokens=args.tokens,
            logit_scale=1.0 if args.logit_scale is None else args.logit_scale, seed=args.seed,
            sweep=DEFAULT_SWEEP if args.sweep is None else args.sweep, out=out,
        )
    except ValueError as error:
        return _fail(str(error))
    print((out / REPORT_NAME).read_text().split("## Guarantees")[0].rstrip())
    print(f"\nReport: {out / REPORT_NAME}")
    return 0
