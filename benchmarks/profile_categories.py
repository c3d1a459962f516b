"""Where a compiled training step's time goes, by category, for residual and the given families.

    python benchmarks/profile_categories.py [--preset gpt2-small] [--layers 2] [--families s2hc] [--repeats 3]

Builds each model (``torch.compile``, float32, one thread, batch 2 x 256), then profiles one training step
of every model per repetition, interleaved, with inductor's kernel profiling on, and prints the median
self CPU time in ms of: GEMMs (``mm``, ``addmm``, ``bmm``), inductor's fused kernels, AdamW's operators,
and the rest. docs/benchmarks.md (section 4) used it at the gpt2-small shape with 2 layers.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from s2hc.models import Transformer, get_preset

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm"}
ADAMW = {"aten::sqrt", "aten::div", "aten::mul_", "aten::addcdiv_", "aten::lerp_", "aten::addcmul_", "aten::add_"}


def make_step(preset: str, mixer: str, layers: int, streams: int):
    torch.manual_seed(0)
    config = get_preset(preset, family=mixer, n_streams=1 if mixer == "residual" else streams, n_layers=layers)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0))
    forward = torch.compile(model)

    def step():
        loss = F.cross_entropy(forward(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(), step()  # compile forward and backward
    return step


def categories(step) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    totals = dict.fromkeys(("GEMMs", "fused kernels", "AdamW", "other"), 0.0)
    for event in prof.key_averages():
        name, ms = event.key, event.self_cpu_time_total / 1e3
        if name in GEMMS:
            totals["GEMMs"] += ms
        elif "cpp_fused" in name or "triton_" in name:
            totals["fused kernels"] += ms
        elif name in ADAMW or "Optimizer" in name:
            totals["AdamW"] += ms
        else:
            totals["other"] += ms
    totals["total"] = sum(totals.values())
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--families", default="s2hc")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = True  # name inductor's kernels in the profile
    steps = {m: make_step(args.preset, m, args.layers, args.streams) for m in ["residual", *args.families.split(",")]}
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in steps}
    for _ in range(args.repeats):
        for mixer, step in steps.items():
            samples[mixer].append(categories(step))
    keys = list(next(iter(samples.values()))[0])
    print("| mixer | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for mixer, rows in samples.items():
        print(f"| {mixer} | " + " | ".join(f"{statistics.median(r[k] for r in rows):,.0f} ms" for k in keys) + " |")


if __name__ == "__main__":
    main()
