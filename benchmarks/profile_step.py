"""Profile one training step (forward, cross-entropy, backward, AdamW) of a preset.

    python benchmarks/profile_step.py --preset small --family s2hc --streams 4 [--option rotation=expm] [--steps 3]

Prints the median step time and torch.profiler's top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from s2hc.config import parse_assignment
from s2hc.models import Transformer, get_preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--family", default="s2hc")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--option", action="append", default=[], help="family option KEY=VALUE (value parsed as YAML)")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    options = dict(parse_assignment(o, "--option") for o in args.option)
    n = 1 if args.family == "residual" else args.streams
    torch.manual_seed(0)
    cfg = get_preset(args.preset, family=args.family, n_streams=n, family_options=options)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median, fastest = sorted(times)[len(times) // 2], min(times)
    print(f"{args.preset} {args.family} n={n} {options}: step {median * 1e3:.0f} ms (min {fastest * 1e3:.0f})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
