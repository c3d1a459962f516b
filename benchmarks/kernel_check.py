"""The Triton kernels of ``s2hc.connection.kernels`` on the device: correct against float64, and their time and
achieved bandwidth against a device-to-device copy and the PyTorch fast path of the same pieces.

    python benchmarks/kernel_check.py [--tokens T] [--dim C] [--streams 4,8,16] [--dtypes float32,bfloat16]
                                      [--families s2hc,mhc] [--jsonl FILE] [--no-timing]

The pieces, each forward and backward, for streams ``X`` ``(T, n, C)`` in ``dtype`` (float32 coefficients,
as the connection gives them):

- ``read``: ``H_pre X`` ``(T, C)``;
- ``write``: ``H_res X + H_postᵀ F`` ``(T, n, C)``;
- ``norm_project``: ``RMSNorm(vec X) W`` ``(T, K)`` with ``W`` ``(nC, K)``, K of each family at n (s2hc:
  17, 65, 257 at n = 4, 8, 16; mhc: 24, 80, 288);
- ``call``: the three as a connection call runs them, joined by a ``Link`` (one dX, dW from the same pass):
  ``d = RMSNorm(vec X) W``, the matrices from ``d`` by a fixed small map, ``X' = H_res X + H_postᵀ (H_pre X · F)``,
  with K of each family; its bytes are those of ``benchmarks/kernel_bytes.py``'s model.

**Correctness** (every case): the outputs and the gradients of ``Σ outputs · G`` (random ``G``) of the Triton
kernels and of the PyTorch fast path (:class:`s2hc.connection.fused.EagerPath`, what ``kernels="torch"``
runs outside ``torch.compile``) against the same formulas in float64 on the same values, as
``‖a − ref‖ / ‖ref‖`` and ``max |a − ref| / max |ref|``; for the kernels both must be under 5e-5 for float32
(exact float32 accumulation; TF32 tensor-core products land near 3e-4, so they fail) and 1e-2 for bfloat16
(bf16 outputs round at 2^-8 = 3.9e-3); the fast path, the comparison, within 4 times that (in bf16 it also
rounds the coefficients to bf16).
Every value must be finite (the outputs' memory is filled with NaN first where the caching allocator reuses
it, so an unwritten element shows), and two runs of the kernels must agree bit for bit (a race shows as a
difference). Fresh random inputs for every case; never zeros.

**Time** (CUDA only): the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) of
each forward (no autograd graph) and each backward (``torch.autograd.grad`` over a kept graph) of both
implementations, the bytes each must move at the least (each n-wide input read once and each output written
once, the small coefficient tensors included; for ``call`` the two-pass floor of ``kernel_bytes.py`` and, as
``model_*_bytes``, what its model says the kernels move), and achieved GB/s = bytes / time, against a measured
device-to-device copy (``Tensor.copy_`` of 1 GiB, bytes read + written) and a copy of ``X`` itself. Launch
overhead is included (``T = 8192`` tokens keeps each call well above it on an H200).

Without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before triton
is imported), at tiny sizes by default (T = 3, C = 40): the correctness checks are real, the times are not
(a wall clock over one call, marked ``"meaningful": false``), which is how ``gpu_check.sh --dry-run`` tries
this script. One JSON line per result on stdout's companion ``--jsonl FILE`` (``kind``: ``environment``,
``copy``, ``case``, ``done``), appended as each is produced; one text line per result on stdout. Exit status
0 when every case passed, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before triton is imported: its decorators read it
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # s2hc from this tree, as gpu_check.sh runs it
    sys.path.insert(0, str(ROOT / "src"))
if str(ROOT / "benchmarks") not in sys.path:  # kernel_bytes, beside this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

TOLERANCE = {"float32": 5e-5, "bfloat16": 1e-2}
# The PyTorch fast path is the comparison, not what is checked: in bf16 it rounds the coefficients to bf16 too
# (EagerPath casts them to the streams' dtype), about doubling its error, so it is held to 4 x the tolerance.
TORCH_SLACK = 4
# A call's branch (F = h · f) is a PyTorch multiply in the streams' dtype: in bf16 its output F and its gradients dh
# and df are rounded once more each, in both implementations (df lands near 1e-2 in both), so a bf16 call is held to
# twice the tolerance.
CALL_SLACK = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = 1e-6
COPY_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------ cases


def make_inputs(piece: str, n: int, c: int, k: int | None, tokens: int, dtype: torch.dtype, device, seed: int):
    """Random inputs of ``piece`` (never zeros): the streams in ``dtype``, the coefficients in float32."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, to=torch.float32):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(to)

    def rand(*shape, scale=1.0):
        return torch.rand(*shape, generator=g, device=device) * scale

    if piece == "read":
        return [randn(tokens, n, c, to=dtype), rand(tokens, n, scale=2.0 / n)]
    if piece == "write":
        return [randn(tokens, n, c, to=dtype), randn(tokens, n, n, scale=n**-0.5), rand(tokens, n, scale=2.0),
                randn(tokens, c, to=dtype)]
    if piece == "call":
        return [randn(tokens, n, c, to=dtype), randn(n * c, k, scale=(n * c) ** -0.5), randn(tokens, c, to=dtype)]
    return [randn(tokens, n * c, to=dtype), randn(n * c, k, scale=(n * c) ** -0.5)]


def coefficients(d: torch.Tensor, n: int):
    """``(H_pre, H_post, H_res)`` from ``d`` ``(T, K)``: a fixed small map standing in for a family's (the kernels
    do not depend on which)."""
    pre, post = torch.sigmoid(d[:, :n]) / n, 2 * torch.sigmoid(d[:, n:2 * n])
    res = torch.tanh(d[:, :n, None] * d[:, None, n:2 * n]) / n + torch.eye(n, dtype=d.dtype, device=d.device)
    return pre, post, res


def implementations(piece: str, kernels) -> dict[str, Callable]:
    """``{"triton", "torch", "reference"}`` functions of ``piece``'s inputs; the reference is the formula, for
    float64 inputs."""
    from s2hc.connection.fused import EagerPath

    fast = EagerPath()

    def mix(x, res):
        return torch.einsum("tij,tjc->tic", res.to(x.dtype), x)

    if piece == "read":
        return {
            "triton": kernels.read, "torch": lambda x, pre: (pre.to(x.dtype).unsqueeze(-2) @ x).squeeze(-2),
            "reference": lambda x, pre: (pre.unsqueeze(-1) * x).sum(-2),
        }  # fmt: skip
    if piece == "write":
        return {"triton": kernels.write, "torch": lambda x, res, post, f: fast.write(mix(x, res), post, f),
                "reference": lambda x, res, post, f: mix(x, res) + post.unsqueeze(-1) * f.unsqueeze(-2)}  # fmt: skip
    if piece == "call":

        def triton_call(x, w, f):
            link, n = kernels.Link(), x.shape[1]
            pre, post, res = coefficients(kernels.norm_project(x.flatten(-2), w, EPS, link), n)
            return kernels.write(x, res, post, kernels.read(x, pre, link) * f, link)

        def torch_call(x, w, f):
            pre, post, res = coefficients(fast.norm_project(x.flatten(-2), None, w, EPS), x.shape[1])
            h, mixed = fast.read_mix(x, pre, res)
            return fast.write(mixed, post, h * f)

        def reference_call(x, w, f):
            d = torch.nn.functional.rms_norm(x.flatten(-2), (x.shape[-2] * x.shape[-1],), eps=EPS) @ w
            pre, post, res = coefficients(d, x.shape[1])
            return mix(x, res) + post.unsqueeze(-1) * ((pre.unsqueeze(-1) * x).sum(-2) * f).unsqueeze(-2)

        return {"triton": triton_call, "torch": torch_call, "reference": reference_call}
    return {
        "triton": lambda x, w: kernels.norm_project(x, w, EPS),
        "torch": lambda x, w: fast.norm_project(x, None, w, EPS),
        "reference": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=EPS) @ w,
    }  # fmt: skip


OUTPUTS = {"read": ("h",), "write": ("out",), "norm_project": ("d",), "call": ("out",)}
INPUTS = {"read": ("x", "pre"), "write": ("x", "res", "post", "f"), "norm_project": ("x", "weight"),
          "call": ("x", "weight", "f")}


def as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def poison(like: list[torch.Tensor]) -> None:
    """Fill device memory of the sizes of ``like`` with NaN and free it, so outputs of those sizes allocated next
    (the CUDA caching allocator hands back a freed block of the size asked) show any element a kernel leaves
    unwritten as NaN. Best effort: nothing on a CPU, where the allocator gives no such promise."""
    if like and like[0].device.type == "cuda":
        blocks = [torch.full_like(t, math.nan) for t in like]
        torch.cuda.synchronize()
        del blocks


def run(fn: Callable, inputs: list[torch.Tensor], grads_out: list[torch.Tensor]):
    """Outputs of ``fn(*inputs)`` and the gradients of ``Σ outputs · grads_out`` with respect to every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outputs = as_tuple(fn(*leaves))
    grads = torch.autograd.grad(outputs, leaves, [g.to(o.dtype) for o, g in zip(outputs, grads_out)])
    return [o.detach() for o in outputs], list(grads)


def errors(actual: list[torch.Tensor], expected: list[torch.Tensor], names: list[str]) -> dict[str, dict]:
    """Per result: ``rel`` ‖a − ref‖ / ‖ref‖, ``max`` max|a − ref| / max|ref|, ``finite``, ``dtype``."""
    result = {}
    for name, a, r in zip(names, actual, expected):
        diff = a.double() - r
        ref_norm, ref_max = r.norm().item(), r.abs().max().item()
        result[name] = {
            "rel": diff.norm().item() / ref_norm if ref_norm else diff.norm().item(),
            "max": diff.abs().max().item() / ref_max if ref_max else diff.abs().max().item(),
            "finite": bool(torch.isfinite(a).all().item()), "dtype": str(a.dtype).replace("torch.", ""),
        }  # fmt: skip
    return result


# ------------------------------------------------------------------------------------------ bytes


def min_bytes(piece: str, n: int, c: int, k: int | None, tokens: int, size: int) -> tuple[int, int]:
    """The fewest bytes (forward, backward) ``piece`` must move: every input read once, every output written
    once; ``size`` bytes per stream element, 4 per coefficient (float32). For ``call``, the two-pass floor of
    ``kernel_bytes.py`` (the streams do not stay in cache across the branch), with W and dW."""
    t, wide, narrow = tokens, tokens * n * c * size, tokens * c * size
    if piece == "read":
        small = t * n * 4  # pre (its gradient the same again backward)
        return wide + small + narrow, wide + narrow + wide + small  # bwd: X, dh -> dX, dpre
    if piece == "write":
        small = t * n * 4 + t * n * n * 4  # post, res
        return wide + narrow + wide + small, wide + wide + narrow + narrow + wide + small  # bwd: dX', X, F -> dF, dX
    w = n * c * k * 4
    if piece == "call":
        return (3 * wide + 2 * narrow + w + t * k * 4,  # X, h | X, F, X'
                5 * wide + 3 * narrow + 2 * w + t * k * 4)  # dX', X, F, dF | dX', dh, X, dX; W, dW
    return wide + w + t * k * 4, wide + t * k * 4 + w + wide + w  # bwd: X, dd, W -> dX, dW


def model_bytes(n: int, c: int, k: int, tokens: int, dtype_name: str) -> tuple[int, int]:
    """(forward, backward) bytes a ``call`` moves by ``kernel_bytes.py``'s model of the kernels (``dram_bytes`` of
    every access: the streams, the coefficients, W and dW)."""
    import kernel_bytes

    accesses = kernel_bytes.model(n, c, k, tokens, dtype_name)
    phases = ("forward", "backward")
    return tuple(sum(kernel_bytes.dram_bytes(a) for a in accesses if a.phase == phase) for phase in phases)


# ------------------------------------------------------------------------------------------ timing


def timer(device: torch.device) -> Callable[[Callable], float]:
    """``time(fn)`` in milliseconds: do_bench's median on CUDA; one wall-clock call elsewhere (not a measurement)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=40, return_mode="median"))

    def wall(fn: Callable) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def time_piece(fn: Callable, inputs: list[torch.Tensor], grads_out: list[torch.Tensor], measure) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn``: the forward without autograd, the backward over one kept graph."""
    with torch.no_grad():
        forward = measure(lambda: fn(*inputs))
    leaves = [t.detach().requires_grad_() for t in inputs]
    outputs = as_tuple(fn(*leaves))
    grads = [g.to(o.dtype) for o, g in zip(outputs, grads_out)]
    backward = measure(lambda: torch.autograd.grad(outputs, leaves, grads, retain_graph=True))
    return forward, backward


def copy_ms(nbytes: int, device: torch.device, measure) -> float:
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src))


def gbs(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else nbytes / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------ main


def check_case(piece, family, n, c, k, tokens, dtype_name, device, kernels, measure, timing, seed):
    """One case: correctness of both implementations against float64, then (``timing``) their times."""
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(piece, n, c, k, tokens, dtype, device, seed)
    fns = implementations(piece, kernels)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        shapes = [o.shape for o in as_tuple(fns["reference"](*[t.double() for t in inputs]))]
    # the output gradients, rounded to each output's dtype, so that every implementation gets the same values
    out_dtypes = [torch.float32] if piece == "norm_project" else [dtype] * len(shapes)  # (call: X' only)
    grads_out = [torch.randn(s, generator=g, device=device).to(d).double() for s, d in zip(shapes, out_dtypes)]
    names = [*OUTPUTS[piece], *(f"d{name}" for name in INPUTS[piece])]
    ref_out, ref_grads = run(fns["reference"], [t.double() for t in inputs], grads_out)
    reference = ref_out + ref_grads
    tol = TOLERANCE[dtype_name] * (CALL_SLACK if piece == "call" and dtype_name == "bfloat16" else 1)
    case: dict[str, Any] = {
        "kind": "case", "piece": piece, "family": family, "n": n, "dim": c, "K": k, "tokens": tokens,
        "dtype": dtype_name, "tolerance": tol, "device": device.type,
    }  # fmt: skip
    started = time.perf_counter()
    first = sum(run(fns["triton"], inputs, grads_out), [])
    case["triton_first_call_s"] = time.perf_counter() - started  # compilation included on a cold cache
    poison(first)  # the second run's outputs land in memory full of NaN
    second = sum(run(fns["triton"], inputs, grads_out), [])
    case["deterministic"] = all(torch.equal(a, b) for a, b in zip(first, second))
    fast = sum(run(fns["torch"], inputs, grads_out), [])
    case["errors"] = {"triton": errors(second, reference, names), "torch": errors(fast, reference, names)}
    worst = {impl: max(max(e["rel"], e["max"]) for e in errs.values()) for impl, errs in case["errors"].items()}
    finite = all(e["finite"] for errs in case["errors"].values() for e in errs.values())
    case["worst_error"] = worst
    problems = []
    if not finite:
        problems.append("non-finite values")
    for impl, value in worst.items():
        bound = tol * (TORCH_SLACK if impl == "torch" else 1)
        if not value <= bound:
            problems.append(f"{impl} error {value:.2e} > {bound:g}")
    if not case["deterministic"]:
        problems.append("two runs of the kernels differ")
    case["ok"], case["problems"] = not problems, problems
    del first, second, fast, reference, ref_out, ref_grads
    if timing:
        size = torch.finfo(dtype).bits // 8
        fwd_bytes, bwd_bytes = min_bytes(piece, n, c, k, tokens, size)
        tri_f, tri_b = time_piece(fns["triton"], inputs, grads_out, measure)
        torch_f, torch_b = time_piece(fns["torch"], inputs, grads_out, measure)
        case["timing"] = {
            "meaningful": device.type == "cuda", "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes,
            **(dict(zip(("model_fwd_bytes", "model_bwd_bytes"), model_bytes(n, c, k, tokens, dtype_name)))
               if piece == "call" else {}),
            "triton_fwd_ms": tri_f, "triton_bwd_ms": tri_b, "torch_fwd_ms": torch_f, "torch_bwd_ms": torch_b,
            "triton_fwd_gbs": gbs(fwd_bytes, tri_f), "triton_bwd_gbs": gbs(bwd_bytes, tri_b),
            "torch_fwd_gbs": gbs(fwd_bytes, torch_f), "torch_bwd_gbs": gbs(bwd_bytes, torch_b),
        }  # fmt: skip
    return case


def describe(case: dict[str, Any], copy_gbs: float | None) -> str:
    what = f"{case['piece']}" + (f" ({case['family']}, K={case['K']})" if case["K"] else "")
    line = (f"{'ok  ' if case.get('ok') else 'FAIL'} {what:28} n={case['n']:<2} {case['dtype']:8} "
            f"errors triton {case['worst_error']['triton']:.1e} torch {case['worst_error']['torch']:.1e}")  # fmt: skip
    timing = case.get("timing")
    if timing:

        def frac(value: float | None) -> str:
            return "" if not (value and copy_gbs) else f" ({value / copy_gbs:.0%})"

        line += (f" | fwd triton {timing['triton_fwd_ms']:.3f} ms {timing['triton_fwd_gbs'] or 0:,.0f} GB/s"
                 f"{frac(timing['triton_fwd_gbs'])}, torch {timing['torch_fwd_ms']:.3f} ms"
                 f" | bwd triton {timing['triton_bwd_ms']:.3f} ms {timing['triton_bwd_gbs'] or 0:,.0f} GB/s"
                 f"{frac(timing['triton_bwd_gbs'])}, torch {timing['torch_bwd_ms']:.3f} ms")  # fmt: skip
        if not timing["meaningful"]:
            line += " [interpreter: times not meaningful]"
    if case.get("problems"):
        line += " -- " + "; ".join(case["problems"])
    return line


def parse_list(text: str, kind: Callable, name: str, allowed=None) -> list:
    values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        raise SystemExit(f"kernel_check.py: error: argument {name}: {text!r}; allowed: {', '.join(allowed or ['...'])}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens T (default 8192 on CUDA, 3 interpreted)")
    parser.add_argument("--dim", type=int, default=None, help="features per stream C (default 768 on CUDA, 40)")
    parser.add_argument("--streams", default="4,8,16", help="stream counts n (default 4,8,16)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="stream dtypes (default float32,bfloat16)")
    parser.add_argument("--families", default="s2hc,mhc", help="families whose K norm_project runs at (s2hc,mhc)")
    parser.add_argument("--jsonl", type=Path, default=None, help="append one JSON line per result to this file")
    parser.add_argument("--no-timing", action="store_true", help="correctness only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    streams = parse_list(args.streams, int, "--streams")
    dtypes = parse_list(args.dtypes, str, "--dtypes", list(DTYPES))
    families = parse_list(args.families, str, "--families")

    from s2hc.connection import kernels, projection_width

    device = torch.device("cuda" if torch.cuda.is_available() and not kernels.interpreted() else "cpu")
    if device.type == "cpu" and not kernels.interpreted():
        print("kernel_check.py: no CUDA and TRITON_INTERPRET was set to 0: nothing can run", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    tokens = args.tokens or (8192 if gpu else 3)
    dim = args.dim or (768 if gpu else 40)
    measure = timer(device)
    started = time.perf_counter()

    def emit(record: dict[str, Any]) -> None:
        if args.jsonl is not None:
            with args.jsonl.open("a") as stream:
                stream.write(json.dumps(record) + "\n")

    import triton

    env = {"kind": "environment", "device": device.type, "interpreted": kernels.interpreted(),
           "gpu": torch.cuda.get_device_name() if gpu else None, "torch": torch.__version__,
           "triton": triton.__version__, "tokens": tokens, "dim": dim, "streams": streams, "dtypes": dtypes,
           "families": families, "tolerance": TOLERANCE,
           "allow_tf32": torch.backends.cuda.matmul.allow_tf32}  # fmt: skip
    emit(env)
    print(f"kernel check on {env['gpu'] or 'the CPU (Triton interpreter: correctness only, times not meaningful)'}"
          f"; torch {env['torch']}, triton {env['triton']}; T = {tokens}, C = {dim}", flush=True)  # fmt: skip
    copy_gbs = None
    if not args.no_timing:
        nbytes = COPY_BYTES if gpu else 1 << 20
        ms = copy_ms(nbytes, device, measure)
        copy_gbs = gbs(2 * nbytes, ms)
        emit({"kind": "copy", "bytes": 2 * nbytes, "ms": ms, "gbs": copy_gbs, "meaningful": gpu,
              "what": f"Tensor.copy_ of {nbytes / 2**20:,.0f} MiB, bytes read + written"})  # fmt: skip
        print(f"device copy: {nbytes / 2**20:,.0f} MiB in {ms:.3f} ms = {copy_gbs:,.0f} GB/s (read + written)",
              flush=True)  # fmt: skip
    failed = total = 0
    seed = args.seed
    for n in streams:
        widths = {}
        for family in families:
            try:
                width = projection_width(family, n)
            except ValueError as error:
                print(f"skip norm_project ({family}, n={n}): {error}", flush=True)
                continue
            if width is None:
                print(f"skip norm_project ({family}, n={n}): no n·C-wide projection (HC's per-stream form)", flush=True)
            else:
                widths[family] = width
        for dtype_name in dtypes:
            x_copy = None
            if not args.no_timing:
                size = torch.finfo(DTYPES[dtype_name]).bits // 8
                x_bytes = tokens * n * dim * size
                ms = copy_ms(max(4, x_bytes), device, measure)
                x_copy = {"kind": "copy", "what": f"X (T, n, C) {dtype_name}", "n": n, "dtype": dtype_name,
                          "bytes": 2 * x_bytes, "ms": ms, "gbs": gbs(2 * x_bytes, ms), "meaningful": gpu}  # fmt: skip
                emit(x_copy)
            # the joined call first: what a connection runs, and what a time limit should not cut
            cases = [("call", family, k) for family, k in widths.items()]
            cases += [("read", None, None), ("write", None, None)]
            cases += [("norm_project", family, k) for family, k in widths.items()]
            for piece, family, k in cases:
                seed += 2
                total += 1
                try:
                    case = check_case(piece, family, n, dim, k, tokens, dtype_name, device, kernels, measure,
                                      not args.no_timing, seed)  # fmt: skip
                except Exception as error:  # a compile error, out of memory: recorded, and the next case runs
                    case = {"kind": "case", "piece": piece, "family": family, "n": n, "dim": dim, "K": k,
                            "tokens": tokens, "dtype": dtype_name, "ok": False, "device": device.type,
                            "problems": [f"raised {type(error).__name__}: {str(error)[:500]}"],
                            "worst_error": {"triton": math.nan, "torch": math.nan}}  # fmt: skip
                    if gpu:
                        torch.cuda.empty_cache()
                if x_copy and case.get("timing"):
                    case["timing"]["x_copy_ms"] = x_copy["ms"]
                failed += not case["ok"]
                emit(case)
                print(describe(case, copy_gbs), flush=True)
    seconds = time.perf_counter() - started
    emit({"kind": "done", "cases": total, "failed": failed, "seconds": seconds})
    print(f"kernel check: {total - failed}/{total} cases passed in {seconds:.1f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
