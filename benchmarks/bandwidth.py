"""Measured memory bandwidth of this machine as torch sees it: a large out-of-cache copy and add.

    python benchmarks/bandwidth.py [--threads 1] [--mib 256]

Prints GB/s counted as bytes read + bytes written (the number the bytes-per-token floor in
docs/benchmarks.md is divided by).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.mib * 2**20 // 4
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    for name, fn, moved in (("copy", lambda: out.copy_(a), 2), ("add", lambda: torch.add(a, b, out=out), 3)):
        fn()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best, median = min(times), statistics.median(times)
        print(f"{name}: {moved * 4 * n / best / 1e9:.1f} GB/s best, {moved * 4 * n / median / 1e9:.1f} GB/s median "
              f"({args.threads} thread(s), {args.mib} MiB per operand)")


if __name__ == "__main__":
    main()
