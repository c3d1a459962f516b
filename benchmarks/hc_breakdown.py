"""Where one HyperConnection's time goes: coefficient path, read + mix + write, per implementation.

    python benchmarks/hc_breakdown.py [--families s2hc,mhc] [--streams 4] [--dim 256] [--tokens 2048]
                                      [--repeats 7] [--device auto|cpu|cuda]

Each piece runs forward + backward on random streams ``(tokens, 1, n, C)`` of the ``small`` preset's
shape (8 x 256 tokens, C = 256) with an identity branch, interleaved over repetitions; prints the median
and minimum in ms. Implementations: ``reference`` (``fused=False``), ``fast`` (the default), and
``triton`` (``kernels="triton"``) when triton is installed and the device is CUDA or the kernels run
under Triton's interpreter (``TRITON_INTERPRET=1``, slow: for checking, not timing). ``--device auto``
picks CUDA when available; on CUDA every timing is synchronised.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch

from s2hc import HyperConnection
from s2hc.bench.measure import timed
from s2hc.devices import resolve_device


def triton_kernels_for(device: torch.device):
    """:mod:`s2hc.connection.kernels` when its kernels can run on ``device``, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from s2hc.connection import kernels as triton_kernels

    return triton_kernels if device.type == "cuda" or triton_kernels.interpreted() else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="s2hc,mhc")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    args = parser.parse_args()
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    kernels = triton_kernels_for(device)
    implementations = ["reference", "fast"] + (["triton"] if kernels is not None else [])
    n, c = args.streams, args.dim
    g = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on every device
    x = torch.randn(args.tokens, 1, n, c, generator=g).to(device).requires_grad_()
    f = torch.randn(args.tokens, 1, c, generator=g).to(device)
    cases = {}
    for name in args.families.split(","):
        hc = HyperConnection(c, n, family=name)
        with torch.no_grad():
            hc.projection.normal_(0, 0.1, generator=g)
        hc.to(device)
        for impl in implementations:

            def use(hc=hc, impl=impl):  # every case sets its implementation: the module is shared
                hc.set_options(fused=impl != "reference", kernels="triton" if impl == "triton" else "torch")

            def coeff(hc=hc, use=use):
                use()
                pre, post, res = hc.coefficients(x)
                (pre.sum() + post.sum() + res.sum()).backward()

            def streams(hc=hc, use=use):
                use()
                pre, post, res = (t.detach().requires_grad_() for t in hc.coefficients(x))
                path = hc.compute_path(x)  # the connection's own read_mix and write, as forward runs them
                h, mixed = path.read_mix(x, pre, res)
                path.write(mixed, post, h + f).sum().backward()

            def whole(hc=hc, use=use):
                use()
                hc(x, lambda h: h + f).sum().backward()

            cases[f"{name} {impl}: coefficients"] = coeff
            cases[f"{name} {impl}: read+mix+write"] = streams
            cases[f"{name} {impl}: whole connection"] = whole
    for fn in cases.values():
        fn()
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for key, fn in cases.items():
            times[key].append(timed(fn, device))
    where = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    print(f"one connection, forward + backward, {args.tokens} tokens, n = {n}, C = {c}, on {where} (median [min] ms)")
    if kernels is None:
        print("  (no triton case: needs the triton package and CUDA, or TRITON_INTERPRET=1 on a CPU)")
    for key, values in times.items():
        print(f"  {key:40s} {statistics.median(values) * 1e3:7.2f}  [{min(values) * 1e3:6.2f}]")


if __name__ == "__main__":
    main()
