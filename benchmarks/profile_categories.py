"""Where a compiled training step's time goes, by category, for residual and the given families.

    python benchmarks/profile_categories.py [--preset gpt2-small] [--layers 2] [--families s2hc] [--repeats 3]
                                            [--steps 1] [--batch-size 2] [--seq-len 256] [--shapes]

Builds each model (``torch.compile``, float32, one thread, ``--batch-size`` x ``--seq-len`` tokens; ``--layers 0``
keeps the preset's own depth), then profiles ``--steps`` training steps of every model per repetition, interleaved, with
inductor's kernel profiling on, and prints the median self CPU time in ms of: GEMMs (``mm``, ``addmm``, ``bmm``),
inductor's fused kernels, AdamW's operators, and the rest, per step. ``--shapes`` also records input shapes and prints
every GEMM shape per model (median ms per step and calls per step), the extra over residual last: where a
family's projection products (``(tokens, nC) @ (nC, 2n + K)`` and their gradients) stand against the branch's.
docs/benchmarks.md used it at the gpt2-small shape with 2 layers (section 4) and at ``small`` as
``s2hc bench`` runs it, ``--preset small --layers 0 --batch-size 8 --steps 3 --shapes`` (section 6b).
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
CATEGORIES = ("GEMMs", "fused kernels", "AdamW", "other", "total")
ADAMW = {"aten::sqrt", "aten::div", "aten::mul_", "aten::addcdiv_", "aten::lerp_", "aten::addcmul_", "aten::add_"}


def make_step(preset: str, mixer: str, layers: int, streams: int, batch_size: int, seq_len: int):
    torch.manual_seed(0)
    depth = {"n_layers": layers} if layers else {}
    config = get_preset(preset, family=mixer, n_streams=1 if mixer == "residual" else streams, **depth)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    forward = torch.compile(model)

    def step():
        loss = F.cross_entropy(forward(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(), step()  # compile forward and backward
    return step


def gemm_key(name: str, input_shapes: list) -> str:
    """``"mm (T, nC) @ (nC, K)"``, ``"addmm (N,) + (T, C) @ (C, N)"``: the operands, not the ``out=`` buffer."""
    dims = [tuple(shape) for shape in input_shapes if shape]
    if name == "aten::addmm":
        return f"addmm {dims[0]} + {dims[1]} @ {dims[2]}"
    return f"{name.removeprefix('aten::')} {dims[0]} @ {dims[1]}"


def categories(step, shapes: bool, steps: int) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Self CPU ms per step of ``steps`` profiled calls of ``step``: by category, and (with ``shapes``, else empty)
    by GEMM shape as ``(ms, calls)`` per step."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
    totals = dict.fromkeys(CATEGORIES[:-1], 0.0)
    gemms: dict[str, tuple[float, float]] = {}
    for event in prof.key_averages(group_by_input_shape=shapes):
        name, ms = event.key, event.self_cpu_time_total / 1e3 / steps
        if name in GEMMS:
            totals["GEMMs"] += ms
            if shapes:
                key = gemm_key(name, event.input_shapes)
                before_ms, before_calls = gemms.get(key, (0.0, 0.0))
                gemms[key] = (before_ms + ms, before_calls + event.count / steps)
        elif "cpp_fused" in name or "triton_" in name:
            totals["fused kernels"] += ms
        elif name in ADAMW or "Optimizer" in name:
            totals["AdamW"] += ms
        else:
            totals["other"] += ms
    totals["total"] = sum(totals.values())
    return totals, gemms


def print_shapes(samples: dict[str, list[dict[str, tuple[float, float]]]]) -> None:
    """Every GEMM shape of every model, median ms and calls per step, and each family's extra over residual."""
    none = (0.0, 0.0)
    medians = {m: {key: tuple(statistics.median(r.get(key, none)[i] for r in rows) for i in (0, 1))
                   for key in {key for r in rows for key in r}}
               for m, rows in samples.items()}
    keys = sorted({key for m in medians.values() for key in m},
                  key=lambda key: -max(m.get(key, none)[0] for m in medians.values()))
    families = [m for m in medians if m != "residual"]
    print("\n| GEMM | " + " | ".join(f"{m} ms (calls)" for m in medians) + " | " +
          " | ".join(f"{m} - residual" for m in families) + " |")
    print("|---|" + "---:|" * (len(medians) + len(families)))
    for key in keys:
        cells = [f"{ms:,.1f} ({calls:.0f})" for ms, calls in (m.get(key, none) for m in medians.values())]
        base = medians["residual"].get(key, none)[0]
        extra = [f"{medians[m].get(key, none)[0] - base:+,.1f}" for m in families]
        print(f"| `{key}` | " + " | ".join(cells + extra) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--layers", type=int, default=2, help="layers (0: the preset's own; default 2)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--families", default="s2hc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="profiled steps per model and repetition")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--shapes", action="store_true", help="also every GEMM by input shape")
    args = parser.parse_args()
    for name in ("layers", "streams", "repeats", "steps", "batch_size", "seq_len"):
        value, least = getattr(args, name), 0 if name == "layers" else 1
        if value < least:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value}")
    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = True  # name inductor's kernels in the profile
    steps = {m: make_step(args.preset, m, args.layers, args.streams, args.batch_size, args.seq_len)
             for m in ["residual", *args.families.split(",")]}
    totals: dict[str, list[dict[str, float]]] = {m: [] for m in steps}
    gemms: dict[str, list[dict[str, tuple[float, float]]]] = {m: [] for m in steps}
    for _ in range(args.repeats):
        for mixer, step in steps.items():
            by_category, by_shape = categories(step, args.shapes, args.steps)
            totals[mixer].append(by_category)
            gemms[mixer].append(by_shape)
    print("| mixer | " + " | ".join(CATEGORIES) + " |")
    print("|---|" + "---:|" * len(CATEGORIES))
    for mixer, rows in totals.items():
        cells = [f"{statistics.median(r[k] for r in rows):,.0f} ms" for k in CATEGORIES]
        print(f"| {mixer} | " + " | ".join(cells) + " |")
    if args.shapes:
        print_shapes(gemms)


if __name__ == "__main__":
    main()
