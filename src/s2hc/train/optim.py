"""AdamW with weight decay on matrices only, and the cosine schedule with warmup and a floor."""

from __future__ import annotations

import math

import torch
from torch import nn


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (embeddings, linear weights, hyper-connection projections) decay;
    vectors and scalars (norm weights, biases, the α / b / γ of the mixers) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    # The fused CPU/GPU kernel is numerically the same update; foreach is the portable default.
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas)


def learning_rate(step: int, *, peak: float, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The rate for optimizer step ``step`` (0-based): linear warmup to ``peak`` over ``warmup_steps``, then a
    cosine decay to ``min_ratio × peak`` at ``max_steps``, and that floor afterwards."""
    floor = min_ratio * peak
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if step >= max_steps:
        return floor
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
