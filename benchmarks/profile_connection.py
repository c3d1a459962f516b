"""What one compiled connection costs over a plain residual add, forward + backward, without the model around it.

    python benchmarks/profile_connection.py [--families s2hc,mhc] [--streams 4] [--dim 256] [--tokens 2048]
                                            [--layers 4] [--repeats 7] [--profile] [--option KEY=VALUE]

A stack of ``--layers`` connections (``HyperConnection``, layer index = position) around a cheap branch
(``h * w``, a learned per-channel scale: it keeps a gradient through the branch but costs one pass over C), between
``expand_streams`` and ``reduce_streams`` as in the model, compiled as a whole (``torch.compile``, float32, one
thread), forward and backward with a random upstream gradient; ``residual`` is the same stack with ``x + h * w``.
The stacks run interleaved; the table gives the median and minimum step in ms and the extra per connection over
residual. ``--profile`` adds torch.profiler's self CPU time of the compiled kernels per family (inductor's kernel
profiling on). To see the generated code, run it with ``TORCH_LOGS=output_code`` (and ``aot_graphs`` for what the
partitioner saves for backward).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch.profiler import ProfilerActivity, profile

from s2hc import Connections


class Stack(nn.Module):
    """``layers`` connections of ``family`` around ``h * w``: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, family: str, dim: int, streams: int, layers: int, options: dict):
        super().__init__()
        residual = family == "residual"
        self.hcs = Connections(dim, layers, family, n_streams=None if residual else streams, sublayers_per_layer=1,
                               **({} if residual else options))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(dim)) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.hcs.expand(h)
        for hc, w in zip(self.hcs, self.scales):
            x = hc(x, lambda b, w=w: b * w)
        return self.hcs.reduce(x)


def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="s2hc")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--option", action="append", default=[], help="a connection option KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = args.profile  # names inductor's kernels in the profile
    options = dict(parse_option(o) for o in args.option)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens // 256 or 1, min(args.tokens, 256), args.dim, generator=g).requires_grad_()
    grad = torch.randn(h.shape, generator=g)
    steps = {}
    for family in ["residual", *args.families.split(",")]:
        torch.manual_seed(0)
        stack = Stack(family, args.dim, args.streams, args.layers, options)
        with torch.no_grad():
            for hc in stack.hcs:
                if hasattr(hc, "projection"):  # a hyper-connection's, away from its zero start
                    hc.projection.normal_(0, 0.02, generator=g)
        compiled = torch.compile(stack)

        def step(compiled=compiled, stack=stack):
            compiled(h).backward(grad)
            h.grad = None
            stack.zero_grad(set_to_none=True)

        start = time.perf_counter()
        step(), step()
        print(f"compiled {family} in {time.perf_counter() - start:.0f} s", flush=True)
        steps[family] = step
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(args.repeats):
        for key, fn in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            cpu[key].append(time.process_time() - start_cpu)
            times[key].append(time.perf_counter() - start)
    base, base_cpu = statistics.median(times["residual"]), statistics.median(cpu["residual"])
    print(f"{args.layers} connections, n = {args.streams}, C = {args.dim}, {args.tokens} tokens, compiled, "
          "forward + backward: wall and process CPU time (median [min] ms; extra per connection over residual; "
          "the CPU time does not count waiting for a core on a shared machine)")
    for key in steps:
        med, med_cpu = statistics.median(times[key]), statistics.median(cpu[key])
        print(f"  {key:20s} wall {med * 1e3:8.2f} [{min(times[key]) * 1e3:8.2f}] "
              f"+{(med - base) * 1e3 / args.layers:6.2f}/connection   "
              f"cpu {med_cpu * 1e3:8.2f} [{min(cpu[key]) * 1e3:8.2f}] "
              f"+{(med_cpu - base_cpu) * 1e3 / args.layers:6.2f}/connection")
    if args.profile:
        for key, fn in steps.items():
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                fn()
            print(f"\n{key}:")
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40,
                                                                     max_name_column_width=70))


if __name__ == "__main__":
    main()
