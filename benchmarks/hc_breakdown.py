"""Where one HyperConnection's time goes: coefficient path, read + mix + write, per implementation.

    python benchmarks/hc_breakdown.py [--mixers s2hc,mhc] [--streams 4] [--dim 256] [--tokens 2048] [--repeats 7]

Each piece runs forward + backward on random streams of the ``small`` preset's shape (8 x 256 tokens,
C = 256) with an identity branch, interleaved over repetitions; prints the median in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from s2hc import HyperConnection
from s2hc.connection import read_and_mix


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixers", default="s2hc,mhc")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n, c = args.streams, args.dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 1, n, c, generator=g).requires_grad_()
    f = torch.randn(args.tokens, 1, c, generator=g)
    cases = {}
    for name in args.mixers.split(","):
        hc = HyperConnection(c, n, mixer=name)
        with torch.no_grad():
            hc.projection.normal_(0, 0.1, generator=g)
        for fused in (False, True):
            tag = f"{name} {'fast' if fused else 'reference'}"

            def coeff(hc=hc, fused=fused):
                pre, post, res = hc._coefficients(x, fused)
                (pre.sum() + post.sum() + res.sum()).backward()

            def streams(hc=hc, fused=fused):
                pre, post, res = (t.detach().requires_grad_() for t in hc._coefficients(x, fused))
                if fused:
                    h, mixed = read_and_mix(x, pre, res)
                    out = torch.addcmul(mixed, post.unsqueeze(-1), (h + f).unsqueeze(-2))
                else:
                    m = {"pre": pre, "post": post, "res": res}
                    out = hc.write(x, m, hc.read(x, m) + f)
                out.sum().backward()

            def whole(hc=hc, fused=fused):
                hc.fused = fused
                hc(x, lambda h: h + f).sum().backward()

            cases[f"{tag}: coefficients"] = coeff
            cases[f"{tag}: read+mix+write"] = streams
            cases[f"{tag}: whole connection"] = whole
    for fn in cases.values():
        fn()
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    print(f"one connection, forward + backward, {args.tokens} tokens, n = {n}, C = {c} (median [min] ms)")
    for key, values in times.items():
        print(f"  {key:40s} {statistics.median(values) * 1e3:7.2f}  [{min(values) * 1e3:6.2f}]")


if __name__ == "__main__":
    main()
