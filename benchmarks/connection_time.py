"""One connection, forward + backward, timed on the device against the memory-traffic floor of its shape: s²HC,
mHC and the residual add, float32 and bf16 streams, on each compute path (the GPU check's first measuring step).

    python benchmarks/connection_time.py [--tokens 16384] [--dim 4096] [--streams 4] [--families s2hc,mhc,residual]
                                         [--dtypes float32,bfloat16] [--paths torch,triton,compiled]
                                         [--repeats 25] [--warmup 3] [--compile-backend inductor] [--jsonl FILE]

**What is timed.** One connection call ``X' = conn(X, branch)`` on streams ``X`` ``(1, T, n, C)`` in the stream
dtype (the connection's parameters in float32, as under autocast), then ``torch.autograd.grad`` of ``Σ X' · G``
(random ``G``) with respect to ``X`` and every parameter: fresh gradients, nothing accumulated. The branch is the
identity, kept out of any compiled graph (``torch.compiler.disable``), so the time is the connection's alone and
a compiled connection is two graphs around an opaque branch, as around attention or an MLP: ``h`` is written
and ``F`` read back, as the floor below counts. The paths: ``torch`` (the default fast path, eager),
``triton`` (``kernels="triton"``; not for the residual add, which has no kernels) and ``compiled``
(``torch.compile`` of the connection module, ``--compile-backend``; inductor on the GPU). Per path, dtype and
family (the eager ``torch`` path of every case first, then ``triton``, then ``compiled``, so a run cut by its time
limit has the cheap paths): the first call's seconds (compilation included), ``--warmup`` calls, then
``--repeats`` calls each timed with CUDA events (start, after the forward, after the backward): the median
forward + backward, its forward and backward parts, min and max.

**The floor.** Bytes the connection must move at the least, from ``benchmarks/kernel_bytes.py``: ``floor(n)``
vectors of C per token (one pass each way ``5n + 3``; two passes, the streams not staying in cache across the
branch, ``8n + 5``: the floor a real layer can approach) times ``T · C`` times the stream dtype's size; and, as
``model_bytes``, what its model of the Triton kernels says they move (every access, W and the coefficients
included) when the model covers today's kernels. The residual add's floor is 6 vectors of C per token: forward
``X`` and ``F`` read, ``X'`` written; backward ``dX'`` and ``dh`` read, ``dX`` written. Each is reported in
milliseconds at the device's copy bandwidth, measured first in the same run (``Tensor.copy_`` of 1 GiB, bytes
read + written, the median of CUDA-event times after a warm-up that brings the clocks up), and at the H200's
datasheet 4.8 TB/s; ``x_floor`` is the measured time over the two-pass floor's.

**A sanity check, not the correctness tests.** Each path's output and gradients against the eager ``torch``
path's on the same values, as ``‖a − ref‖ / ‖ref‖``: a time is only reported as a time of the right function
(float32 within 1e-3, bf16 within 5e-2 on the n-wide results: out, dX, dprojection, dnorm_weight; the gates'
gradients, sums over every token, are reported but not judged). Every value must be finite.

Without CUDA it runs on the CPU (the GPU check's ``--dry-run``) at whatever size it is given, the Triton kernels
under the interpreter (``TRITON_INTERPRET=1``, set here before triton is imported): the checks are real, the times
are not (``"meaningful": false``). One JSON line per result in ``--jsonl FILE`` as it is produced (``kind``:
``environment``, ``copy``, ``floor``, ``case``, ``done``); one text line per result on stdout. Exit status 0 when
every case ran and matched, 1 when one failed (an error, a mismatch, a non-finite value), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before triton is imported: its decorators read it
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT / "src", ROOT / "benchmarks"):  # s2hc from this tree, kernel_bytes beside this script
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import kernel_bytes  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = ("torch", "triton", "compiled")
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
JUDGED = ("out", "dX", "dprojection", "dnorm_weight")  # n-wide results; the gates' sums over T are reported only
RESIDUAL_VECTORS = 6  # X, F -> X'; dX', dh -> dX
COPY_BYTES = 1 << 30


@torch.compiler.disable
def identity_branch(h: torch.Tensor) -> torch.Tensor:
    """The branch: ``F = h``, opaque to torch.compile (a graph break), as attention or an MLP is to the connection."""
    return h


# ------------------------------------------------------------------------------------------ timing


class Timer:
    """Times ``fn`` (forward, then backward): CUDA events on a GPU, the wall clock elsewhere (not a measurement)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def between(self, start, end) -> float:
        """Milliseconds from ``start`` to ``end`` (after they have happened: synchronise first)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer, repeats: int) -> dict[str, Any]:
    """The device's copy bandwidth: ``dst.copy_(src)`` of ``nbytes``, bytes read + written over the median time,
    after copies for about half a second (the clocks come up from idle)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    started = time.perf_counter()
    while time.perf_counter() - started < (0.5 if timer.cuda else 0.05):
        dst.copy_(src)
        timer.sync()
    times = []
    for _ in range(repeats):
        start = timer.mark()
        dst.copy_(src)
        end = timer.mark()
        timer.sync()
        times.append(timer.between(start, end))
    ms = statistics.median(times)
    return {"kind": "copy", "bytes": 2 * nbytes, "ms": ms, "gbs": 2 * nbytes / (ms * 1e-3) / 1e9,
            "meaningful": timer.cuda, "what": f"Tensor.copy_ of {nbytes / 2**20:,.0f} MiB, bytes read + written"}


# ------------------------------------------------------------------------------------------ cases


def build(family: str, n: int, c: int, tokens: int, dtype: torch.dtype, device: torch.device, seed: int):
    """The connection (float32 parameters, the projection drawn so that ``d`` is of order one), the streams ``X`` and
    the output gradient ``G`` in ``dtype``; random, never zeros."""
    import s2hc

    streams = 1 if family == "residual" else n
    torch.manual_seed(seed)
    conn = s2hc.Connections(c, 1, family=family, n_streams=streams)[0].to(device)
    with torch.no_grad():
        if hasattr(conn, "projection"):
            conn.projection.normal_(0, (streams * c) ** -0.5)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, tokens, streams, c, generator=g, device=device).to(dtype)
    grad_out = torch.randn(1, tokens, streams, c, generator=g, device=device).to(dtype)
    return conn, x, grad_out


def result_names(conn: torch.nn.Module) -> list[str]:
    return ["out", "dX", *(f"d{name}" for name, p in conn.named_parameters() if p.requires_grad)]


def floors(family: str, n: int, c: int, k: int | None, tokens: int, dtype_name: str) -> dict[str, Any]:
    """The floor's bytes for one case (module docstring): one pass, two passes, and the Triton model's when it
    covers today's kernels."""
    size = kernel_bytes.SIZES[dtype_name]
    per_vector = tokens * c * size
    if family == "residual":
        return {"vectors_one_pass": RESIDUAL_VECTORS, "vectors_two_pass": RESIDUAL_VECTORS,
                "one_pass_bytes": RESIDUAL_VECTORS * per_vector, "two_pass_bytes": RESIDUAL_VECTORS * per_vector,
                "model_bytes": None, "model_note": "no kernels: one add"}  # fmt: skip
    vectors = kernel_bytes.floor(n)
    result = {"vectors_one_pass": vectors["one_pass"], "vectors_two_pass": vectors["two_pass"],
              "one_pass_bytes": vectors["one_pass"] * per_vector, "two_pass_bytes": vectors["two_pass"] * per_vector,
              "model_bytes": None, "model_note": None}  # fmt: skip
    try:
        accesses = kernel_bytes.model(n, c, k, tokens, dtype_name)
        result["model_bytes"] = kernel_bytes.total_bytes(accesses)
        result["model_vectors"] = kernel_bytes.vectors_of_c(accesses, c, tokens, dtype_name)
    except (NotImplementedError, ValueError) as error:  # the model of the kernels being rewritten: floor only
        result["model_note"] = f"kernel_bytes.model: {type(error).__name__}: {error}"
    return result


def run_once(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor):
    out = fn()
    return [out, *torch.autograd.grad(out, inputs, grad_out)]


def time_path(fn, inputs, grad_out, timer: Timer, warmup: int, repeats: int) -> dict[str, Any]:
    """The first call's seconds, then the median (min, max) of ``repeats`` timed calls after ``warmup``; each call
    split into its forward and backward by a mark between them."""
    started = time.perf_counter()
    run_once(fn, inputs, grad_out)
    timer.sync()
    first = time.perf_counter() - started
    for _ in range(warmup):
        run_once(fn, inputs, grad_out)
    timer.sync()
    totals, forwards, backwards = [], [], []
    for _ in range(repeats):
        start = timer.mark()
        out = fn()
        middle = timer.mark()
        torch.autograd.grad(out, inputs, grad_out)
        end = timer.mark()
        del out
        timer.sync()
        totals.append(timer.between(start, end))
        forwards.append(timer.between(start, middle))
        backwards.append(timer.between(middle, end))
    return {"first_call_s": first, "ms": statistics.median(totals), "fwd_ms": statistics.median(forwards),
            "bwd_ms": statistics.median(backwards), "min_ms": min(totals), "max_ms": max(totals),
            "repeats": repeats, "warmup": warmup}  # fmt: skip


def relative_errors(actual: list[torch.Tensor], expected: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    errors = {}
    for name, a, r in zip(names, actual, expected):
        a, r = a.detach().float(), r.detach().float()
        ref = r.norm().item()
        diff = (a - r).norm().item()
        errors[name] = diff / ref if ref else diff
    return errors


def path_function(conn, path: str, backend: str, compiled: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> conn(x, branch)`` on ``path``; the compiled module is made once per connection and kept."""
    conn.set_options(kernels="triton" if path == "triton" else "torch")
    if path != "compiled":
        return lambda x: conn(x, identity_branch)
    if id(conn) not in compiled:
        compiled[id(conn)] = torch.compile(conn, backend=backend)
    module = compiled[id(conn)]
    return lambda x: module(x, identity_branch)


def triton_usable(device: torch.device) -> str | None:
    """None when ``kernels="triton"`` can run on ``device``, else why not."""
    try:
        from s2hc.connection import kernels
    except ImportError as error:
        return f"triton is not importable ({error})"
    if device.type != "cuda" and not kernels.interpreted():
        return "no GPU and TRITON_INTERPRET was not set before triton was imported"
    if device.type == "cuda" and kernels.interpreted():
        return "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled"
    return None


def describe(case: dict[str, Any]) -> str:
    head = f"{case['family']:8} {case['dtype']:8} {case['path']:8}"
    if case.get("skipped"):
        return f"skip {head} {case['skipped']}"
    if "ms" not in case:
        return f"FAIL {head} {'; '.join(case.get('problems', []))}"
    line = (f"{'ok  ' if case['ok'] else 'FAIL'} {head} {case['ms']:9.3f} ms (fwd {case['fwd_ms']:.3f}, bwd "
            f"{case['bwd_ms']:.3f}; first call {case['first_call_s']:.1f} s)")  # fmt: skip
    if case.get("x_floor"):
        line += f" = {case['x_floor']:.2f} x the two-pass floor"
    if case.get("worst_error") is not None:
        line += f"; vs eager {case['worst_error']:.1e}"
    if not case["meaningful"]:
        line += " [CPU: times not meaningful]"
    if case.get("problems"):
        line += " -- " + "; ".join(case["problems"])
    return line


# ------------------------------------------------------------------------------------------ main


def parse_list(text: str, name: str, allowed) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in allowed for v in values):
        raise SystemExit(f"connection_time.py: error: argument {name}: {text!r}; allowed: {', '.join(allowed)}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens B·T (default 16384)")
    parser.add_argument("--dim", type=int, default=4096, help="features per stream C (default 4096)")
    parser.add_argument("--streams", type=int, default=4, help="streams n of the hyper-connections (default 4)")
    parser.add_argument("--families", default="s2hc,mhc,residual")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="stream dtypes (default float32,bfloat16)")
    parser.add_argument("--paths", default=",".join(PATHS), help="compute paths (default torch,triton,compiled)")
    parser.add_argument("--repeats", type=int, default=25, help="timed calls per case (default 25)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after the first (default 3)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled path (inductor; aot_eager: no code generation)")
    parser.add_argument("--jsonl", type=Path, default=None, help="append one JSON line per result to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import s2hc

    families = parse_list(args.families, "--families", s2hc.families())
    dtypes = parse_list(args.dtypes, "--dtypes", list(DTYPES))
    paths = parse_list(args.paths, "--paths", PATHS)
    if min(args.tokens, args.dim, args.streams, args.repeats) < 1 or args.warmup < 0:
        parser.error("--tokens, --dim, --streams and --repeats must be positive, --warmup not negative")
    from s2hc.connection import projection_width

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device)
    # the connections of both families share HyperConnection.forward: room for the graphs of every family and dtype
    config = importlib.import_module("torch._dynamo").config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(64, getattr(config, name)))
            break

    def emit(record: dict[str, Any]) -> None:
        print(record.pop("line", None) or json.dumps(record), flush=True)
        if args.jsonl is not None:
            with args.jsonl.open("a") as stream:
                stream.write(json.dumps(record) + "\n")

    started = time.perf_counter()
    n, c, tokens = args.streams, args.dim, args.tokens
    triton_why = triton_usable(device) if "triton" in paths else None
    emit({"kind": "environment", "device": device.type, "meaningful": timer.cuda,
          "gpu": torch.cuda.get_device_name() if timer.cuda else None, "torch": torch.__version__,
          "triton": _version("triton"), "tokens": tokens, "dim": c, "streams": n, "families": families,
          "dtypes": dtypes, "paths": paths, "compile_backend": args.compile_backend, "repeats": args.repeats,
          "warmup": args.warmup, "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "triton_unusable": triton_why,
          "line": f"connection timing on {torch.cuda.get_device_name() if timer.cuda else 'the CPU (not timed)'}: "
                  f"B·T = {tokens}, C = {c}, n = {n}; {', '.join(families)}; {', '.join(dtypes)}; "
                  f"{', '.join(paths)}"})
    copy = copy_bandwidth(device, COPY_BYTES if timer.cuda else 8 << 20, timer, 25 if timer.cuda else 3)
    emit(dict(copy, line=f"device copy: {copy['gbs']:,.0f} GB/s (read + written, {copy['what']})"))
    bandwidth = copy["gbs"] * 1e9

    cases: dict[tuple[str, str], dict[str, Any]] = {}  # per (family, dtype): module, inputs, eager results
    for dtype_name in dtypes:
        for family in families:
            k = None if family == "residual" else projection_width(family, n)
            floor = floors(family, n, c, k, tokens, dtype_name)
            record = {"kind": "floor", "family": family, "dtype": dtype_name, "n": 1 if family == "residual" else n,
                      "K": k, "tokens": tokens, "dim": c, **floor, "copy_gbs": copy["gbs"],
                      "two_pass_ms": floor["two_pass_bytes"] / bandwidth * 1e3,
                      "one_pass_ms": floor["one_pass_bytes"] / bandwidth * 1e3,
                      "model_ms": None if floor["model_bytes"] is None else floor["model_bytes"] / bandwidth * 1e3,
                      "two_pass_ms_at_4_8_tbs": floor["two_pass_bytes"] / kernel_bytes.H200_BANDWIDTH * 1e3}
            model = ("" if floor["model_bytes"] is None
                     else f", the Triton model {floor['model_bytes'] / 1e9:.2f} GB = {record['model_ms']:.3f} ms")
            record["line"] = (f"floor {family} {dtype_name}: two passes {floor['vectors_two_pass']} vectors of C = "
                              f"{floor['two_pass_bytes'] / 1e9:.2f} GB = {record['two_pass_ms']:.3f} ms at the copy "
                              f"bandwidth (one pass {record['one_pass_ms']:.3f} ms){model}")  # fmt: skip
            emit(record)
            cases[(family, dtype_name)] = {"floor": record, "K": k}

    compiled: dict[int, torch.nn.Module] = {}
    failed = 0
    for path in paths:
        for dtype_name in dtypes:
            for family in families:
                state = cases[(family, dtype_name)]
                case: dict[str, Any] = {"kind": "case", "family": family, "dtype": dtype_name, "path": path,
                                        "n": 1 if family == "residual" else n, "K": state["K"], "tokens": tokens,
                                        "dim": c, "meaningful": timer.cuda, "ok": True, "problems": []}  # fmt: skip
                if path == "triton" and family == "residual":
                    case["skipped"] = "the residual add has no kernels (one add on every path)"
                elif path == "triton" and triton_why:
                    case["skipped"] = triton_why
                elif path != "torch" and "reference" not in state and "torch" in paths:
                    case["skipped"] = "its eager case failed: nothing to compare with"
                if case.get("skipped"):
                    emit(dict(case, line=describe(case)))
                    continue
                try:
                    if "conn" not in state:
                        state["conn"], state["x"], state["grad_out"] = build(
                            family, n, c, tokens, DTYPES[dtype_name], device, args.seed)
                    conn, x, grad_out = state["conn"], state["x"], state["grad_out"]
                    leaf = x.detach().requires_grad_()
                    inputs = [leaf, *(p for p in conn.parameters() if p.requires_grad)]
                    fn = path_function(conn, path, args.compile_backend, compiled)
                    case.update(time_path(lambda fn=fn, leaf=leaf: fn(leaf), inputs, grad_out, timer, args.warmup,
                                          args.repeats))  # fmt: skip
                    results = run_once(lambda fn=fn, leaf=leaf: fn(leaf), inputs, grad_out)
                    names = result_names(conn)
                    case["finite"] = all(bool(torch.isfinite(r).all()) for r in results)
                    if not case["finite"]:
                        case["problems"].append("non-finite values")
                    if path == "torch":
                        state["reference"] = [r.detach() for r in results]
                    elif "reference" in state:
                        errors = relative_errors(results, state["reference"], names)
                        case["errors"] = errors
                        judged = [v for name, v in errors.items() if name in JUDGED]
                        case["worst_error"] = max(judged) if judged else None
                        bound = TOLERANCE[dtype_name]
                        if judged and not max(judged) <= bound:
                            case["problems"].append(f"differs from the eager path by {max(judged):.1e} > {bound:g}")
                    del results
                    floor = state["floor"]
                    case["x_floor"] = case["ms"] / floor["two_pass_ms"] if floor["two_pass_ms"] else None
                    case["floor_gbs"] = floor["two_pass_bytes"] / (case["ms"] * 1e-3) / 1e9 if case["ms"] else None
                    if floor["model_bytes"] is not None:
                        case["model_gbs"] = floor["model_bytes"] / (case["ms"] * 1e-3) / 1e9 if case["ms"] else None
                except Exception as error:  # a compile error, out of memory: recorded, and the next case runs
                    case["problems"].append(f"raised {type(error).__name__}: {str(error)[:500]}")
                    if timer.cuda:
                        torch.cuda.empty_cache()
                case["ok"] = not case["problems"]
                failed += not case["ok"]
                emit(dict(case, line=describe(case)))
    seconds = time.perf_counter() - started
    emit({"kind": "done", "failed": failed, "seconds": seconds,
          "line": f"connection timing: {failed} failed cases, {seconds:.1f} s"})
    return 1 if failed else 0


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
