"""Is a hand-fused backward pass faster than inductor's loops for it? One pass, measured side by side.

    python benchmarks/fused_pass_prototype.py [--tokens 2048] [--streams 4] [--dim 256] [--repeats 200]

The first backward pass of a connection (docs/benchmarks.md section 6b), per token, from the upstream gradient
``dX'`` ``(T, n, C)``, the streams ``X`` ``(T, n, C)``, the branch output ``F`` ``(T, C)``, ``H_post`` ``(T, n)`` and
``H_res`` ``(T, n, n)``::

    dF = Σᵢ H_post,i dX'ᵢ    dH_post,i = ⟨dX'ᵢ, F⟩    dH_res,ij = ⟨dX'ᵢ, Xⱼ⟩    G = H_resᵀ dX'

written twice: as the broadcast sums the compiled path uses, compiled by ``torch.compile`` (inductor emits one loop
nest per output shape), and as one C loop over tokens that reads each input once, blocks of 64 channels in L1
(compiled here with ``gcc -O3 -march=native -ffast-math``, called through ctypes). Both are checked against float64
first; the table is the median and minimum of interleaved calls at one thread, and the bytes the pass must move
(reads dX', X, F; writes G, dF) over the median time. A prototype for measuring only: nothing in s2hc uses it.
Needs gcc on PATH.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCE = r"""
void pass1(const float *dxp, const float *x, const float *f, const float *post, const float *res,
           float *df, float *dpost, float *dres, float *g, long T, long n, long C) {
    for (long t = 0; t < T; ++t) {
        const float *dt = dxp + t * n * C, *xt = x + t * n * C, *ft = f + t * C;
        const float *pt = post + t * n, *rt = res + t * n * n;
        float *dft = df + t * C, *gt = g + t * n * C;
        float acc_post[64] = {0}, acc_res[64 * 64];
        for (long k = 0; k < n * n; ++k) acc_res[k] = 0.f;
        for (long c0 = 0; c0 < C; c0 += 64) {          /* a 64-channel block of every stream, in L1 */
            long c1 = c0 + 64 < C ? c0 + 64 : C;
            for (long c = c0; c < c1; ++c) dft[c] = 0.f;
            for (long j = 0; j < n; ++j) for (long c = c0; c < c1; ++c) gt[j * C + c] = 0.f;
            for (long i = 0; i < n; ++i) {
                const float *di = dt + i * C;
                float p = pt[i], sp = 0.f;
                for (long c = c0; c < c1; ++c) { dft[c] += p * di[c]; sp += di[c] * ft[c]; }
                acc_post[i] += sp;
                for (long j = 0; j < n; ++j) {
                    const float *xj = xt + j * C;
                    float *gj = gt + j * C, r = rt[i * n + j], s = 0.f;
                    for (long c = c0; c < c1; ++c) { s += di[c] * xj[c]; gj[c] += r * di[c]; }
                    acc_res[i * n + j] += s;
                }
            }
        }
        for (long i = 0; i < n; ++i) dpost[t * n + i] = acc_post[i];
        for (long k = 0; k < n * n; ++k) dres[t * n * n + k] = acc_res[k];
    }
}
"""


def broadcast_pass(dxp, x, f, post, res):
    """The pass as the compiled path's autograd produces it: broadcast multiply-adds."""
    df = (post.unsqueeze(-1) * dxp).sum(-2)
    dpost = (dxp * f.unsqueeze(-2)).sum(-1)
    dres = (dxp.unsqueeze(-2) * x.unsqueeze(-3)).sum(-1)
    g = (res.unsqueeze(-1) * dxp.unsqueeze(-2)).sum(-3)
    return df, dpost, dres, g


def build(directory: Path):
    if shutil.which("gcc") is None:
        raise SystemExit("fused_pass_prototype.py needs gcc on PATH")
    (directory / "pass1.c").write_text(SOURCE)
    subprocess.run(["gcc", "-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", str(directory / "pass1.c"),
                    "-o", str(directory / "pass1.so")], check=True)
    return ctypes.CDLL(str(directory / "pass1.so"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--streams", type=int, default=4, choices=range(1, 65), metavar="{1..64}")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t, n, c = args.tokens, args.streams, args.dim
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(t, n, c, generator=g), torch.randn(t, n, c, generator=g), torch.randn(t, c, generator=g),
              torch.randn(t, n, generator=g), torch.randn(t, n, n, generator=g))
    with tempfile.TemporaryDirectory() as directory:
        lib = build(Path(directory))

        def fused():
            outs = torch.empty(t, c), torch.empty(t, n), torch.empty(t, n, n), torch.empty(t, n, c)
            pointers = [ctypes.c_void_p(tensor.data_ptr()) for tensor in (*inputs, *outs)]
            lib.pass1(*pointers, ctypes.c_long(t), ctypes.c_long(n), ctypes.c_long(c))
            return outs

        compiled = torch.compile(broadcast_pass)
        ways = {"hand-fused C": fused, "inductor": lambda: compiled(*inputs)}
        reference = broadcast_pass(*(tensor.double() for tensor in inputs))
        for name, way in ways.items():
            errors = [(a.double() - b).abs().max().item() / b.abs().max().item() for a, b in zip(way(), reference)]
            if max(errors) > 1e-5:
                raise SystemExit(f"{name} disagrees with float64: relative errors {errors}")
        times = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
    nbytes = 4 * t * (3 * n * c + 2 * c)
    print(f"T = {t}, n = {n}, C = {c}, one thread, {args.repeats} interleaved calls; "
          f"the pass moves {nbytes / 2**20:.1f} MiB")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:14s} median {median * 1e3:6.2f} ms  min {min(values) * 1e3:6.2f} ms  "
              f"{nbytes / median / 1e9:5.1f} GB/s at the median")


if __name__ == "__main__":
    main()
