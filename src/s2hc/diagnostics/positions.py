"""Which token positions the diagnostics measure, and on which device a model runs: what :mod:`.collect` and
:mod:`.depth` share."""

from __future__ import annotations

import torch
from torch import nn


def sample_positions(total: int, tokens: int | None, seed: int = 0) -> torch.Tensor | None:
    """Sorted flat indices of ``tokens`` positions out of ``total``, uniformly without replacement; None for all.

    Uses a private generator seeded with ``seed``, so the global RNG (and with it a training run) is untouched.
    """
    if tokens is None or tokens >= total:
        return None
    if tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1 or None, got {tokens!r}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=generator)[:tokens].sort().values


def model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
