"""``mhc-lite``: an exact doubly stochastic matrix as a convex mix of all n! permutations."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from .base import Guarantees, Mixer, scale_parameter
from .mhc import OFF_DIAGONAL_BIAS

#: Largest n built without ``allow_large=True``: n! inputs per token grow to 5 040 at n = 7 and 40 320 at 8.
MAX_PERMUTATION_STREAMS = 6


def permutation_matrices(n: int) -> torch.Tensor:
    """All n! permutation matrices ``(n!, n, n)`` in lexicographic order; index 0 is the identity."""
    perms = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long)
    return torch.eye(n)[perms]


def check_permutation_size(n: int, allow_large: bool, what: str) -> None:
    if n > MAX_PERMUTATION_STREAMS and not allow_large:
        raise ValueError(
            f"{what}={n} needs {math.factorial(n)} inputs per token; allowed without allow_large=True: "
            f"<= {MAX_PERMUTATION_STREAMS}"
        )


class PermutationMixture(nn.Module):
    """``Σ_r softmax(α · d + b)_r P_r`` over all ``size!`` permutations: exactly doubly stochastic.

    ``b`` is 0 for the identity and −8 for every other permutation, so the mix starts near ``I``.
    The permutation matrices are a buffer: built once at construction and moved with the module,
    never rebuilt per call. Input ``(..., size!)``; output ``(..., size, size)``.
    """

    def __init__(self, size: int, alpha: float = 0.01):
        super().__init__()
        self.size = size
        self.num_inputs = math.factorial(size)
        self.alpha = scale_parameter(alpha)
        bias = torch.full((self.num_inputs,), OFF_DIAGONAL_BIAS)
        bias[0] = 0.0
        self.bias = nn.Parameter(bias)
        # 0/1 entries are exact in every dtype, so an ordinary buffer may follow the model's casts.
        self.register_buffer("permutations", permutation_matrices(size).flatten(1), persistent=False)

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.alpha.to(d.dtype) * d + self.bias.to(d.dtype), dim=-1)
        return (weights @ self.permutations.to(d.dtype)).unflatten(-1, (self.size, self.size))


class MHCLiteMixer(Mixer):
    """``mhc-lite`` (arXiv 2601.05732): ``H_res`` a softmax-weighted mix of all n! permutations. K = n!.

    Exactly doubly stochastic and non-negative by construction (Birkhoff–von Neumann), but K grows
    factorially: n > 6 is refused unless ``allow_large=True``.
    """

    name = "mhc-lite"
    guarantees = Guarantees(True, True, True, True, False, True)

    def __init__(self, n_streams: int, alpha: float = 0.01, allow_large: bool = False):
        super().__init__(n_streams)
        check_permutation_size(n_streams, allow_large, "n_streams")
        self.mixture = PermutationMixture(n_streams, alpha)
        self.num_inputs = self.mixture.num_inputs

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        return self.mixture(d_res)
