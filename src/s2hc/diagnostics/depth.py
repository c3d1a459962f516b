"""What Attention Residuals' depth softmax does: the weight each sublayer gives its sources (the embedding, each
block's sum), the diagnostic of ``family="attn-res"`` in place of the matrices' measures it does not have.

Per sublayer, on the sampled token positions: ``weights`` (mean over tokens of the softmax weight of each source,
in source order: the embedding first), ``embedding_weight`` (the first of them), ``effective_sources`` (``exp`` of
the softmax's entropy, averaged over tokens: 1 when one source takes everything, S when the read is uniform, as it
starts) and ``sources`` (S). The model's output read (its last query) is reported the same way. A read of several
queries (Inkling-2's query, key and value reads, ``qkv_reads``) is reported as one read per query, named
``{module} query {q}``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..connection import Connection, ConnectionModule
from .positions import model_device, sample_positions


def depth_modules(model: nn.Module) -> list[tuple[str, ConnectionModule]]:
    """``(name, module)`` of every depth-attention read in ``model`` (AttnRes's connections and its output query),
    in module order (the output query last)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, ConnectionModule) and module.depth_read]


def _summary(weights: torch.Tensor) -> dict[str, Any]:
    """``weights`` ``(N, S)`` (one softmax per sampled token) -> the per-read summary."""
    weights = weights.double()
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1)
    mean = weights.mean(0)
    return {"sources": int(weights.shape[-1]), "weights": [float(w) for w in mean],
            "embedding_weight": float(mean[0]), "effective_sources": float(entropy.exp().mean())}


def depth_attention(model: nn.Module, input_ids: torch.Tensor, tokens: int | None = None, seed: int = 0,
                    batch_size: int | None = None, autocast_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Run ``model`` on ``input_ids`` ``(B, T)`` (no_grad, eval mode, restored after) and summarise every depth
    read on ``tokens`` positions drawn with ``seed`` (all when None): ``{"reads": [{"name", "sources",
    "weights", "embedding_weight", "effective_sources"}, ...], "tokens": N}``. ValueError when the model has no
    depth-attention read (it is not an AttnRes model)."""
    modules = depth_modules(model)
    if not modules:
        raise ValueError("the model has no depth-attention read (family 'attn-res'): nothing to measure")
    B, T = input_ids.shape
    positions = sample_positions(B * T, tokens, seed)
    rows = batch_size or B
    gathered: dict[str, list[torch.Tensor]] = {}  # in the order the reads first run: module order
    selected: list[torch.Tensor | None] = [None]

    def hook(name):
        def record(module, args):
            weights = module.weights(tuple(args[0])).flatten(0, 1)  # (B·T, S), or (B·T, Q, S) for Q queries
            weights = weights if selected[0] is None else weights[selected[0]]
            reads = {name: weights} if weights.dim() == 2 else {
                f"{name} query {q}": weights[:, q] for q in range(weights.shape[1])}
            for key, value in reads.items():
                gathered.setdefault(key, []).append(value)
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules]
    device, was_training = model_device(model), model.training
    model.eval()
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None))
            for start in range(0, B, rows):
                stop = min(start + rows, B)
                if positions is not None:
                    inside = positions[(positions >= start * T) & (positions < stop * T)]
                    if inside.numel() == 0:
                        continue
                    selected[0] = inside - start * T
                model(input_ids[start:stop].to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    reads = [{"name": name, **_summary(torch.cat(weights))} for name, weights in gathered.items()]
    return {"reads": reads, "tokens": B * T if positions is None else int(positions.numel())}


def depth_lines(result: dict[str, Any]) -> list[str]:
    """The report's section: one row per read, its effective number of sources against its count, the weight on
    the embedding and the largest weight's source."""
    from ..reports import table

    rows = []
    for read in result["reads"]:
        weights = read["weights"]
        top = max(range(len(weights)), key=weights.__getitem__)
        rows.append([f"`{read['name']}`", str(read["sources"]), f"{read['effective_sources']:.2f}",
                     f"{read['embedding_weight']:.3f}", f"{top} ({weights[top]:.3f})"])
    lines = ["## Depth attention", "",
             f"Each sublayer's softmax over its sources (source 0 the embedding, then each block's sum), mean over "
             f"{result['tokens']:,} token positions. Effective sources: exp of the softmax's entropy (the source "
             "count when uniform, as AttnRes starts; 1 when one source takes all).", ""]
    return lines + table(["read", "sources", "effective sources", "embedding weight", "largest (source, weight)"],
                         rows, align="lrrrr")


def training_record(model: nn.Module, input_ids: torch.Tensor, tokens: int, seed: int,
                    autocast_dtype: torch.dtype | None) -> dict[str, Any]:
    """The compact ``metrics.jsonl`` record of an AttnRes model: ``layers`` (its connections' names) and per read
    its effective sources and embedding weight (lists in depth order, the output query last, which the loggers
    name ``output``)."""
    result = depth_attention(model, input_ids, tokens=tokens, seed=seed, autocast_dtype=autocast_dtype)
    reads = result["reads"]
    connections = [name for name, module in depth_modules(model) if isinstance(module, Connection)]
    return {"tokens": result["tokens"], "layers": connections,  # the output query's read comes last: "output"
            "depth_effective_sources": [round(r["effective_sources"], 6) for r in reads],
            "depth_embedding_weight": [round(r["embedding_weight"], 6) for r in reads],
            "depth_uniform_sources": [r["sources"] for r in reads]}


__all__ = ["depth_attention", "depth_lines", "depth_modules", "training_record"]
