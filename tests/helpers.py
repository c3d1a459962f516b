"""Shared helpers: which (family, n) pairs are tested, and how to randomise a module's parameters."""

from __future__ import annotations

import torch

from s2hc import mixers

STREAMS = (2, 3, 4, 5, 8)
MAX_N = {"mhc-lite": 6}


def family_sizes(families=None):
    """Every (family, n) the guarantees are tested at: n in {2, 3, 4, 5, 8}, mhc-lite up to 6."""
    pairs = []
    for name in families or mixers.available():
        sizes = [n for n in STREAMS if n <= MAX_N.get(name, 99)]
        if name == "mhc-lite":
            sizes.append(6)
        if name == "kromhc":
            sizes += [6, 12]  # mixed prime factors
        pairs += [(name, n) for n in sizes]
    return pairs


def randomize_(module: torch.nn.Module, generator: torch.Generator, spread: float) -> None:
    """Move every parameter far from its initialisation: p += spread · N(0, 1), α and γ included."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(spread * torch.randn(p.shape, generator=generator, dtype=p.dtype))
