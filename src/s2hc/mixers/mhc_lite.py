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


def default_off_identity_bias(size: int) -> float:
    """``−8 − ln(size! − 1)``: all non-identity permutations together weigh ``e⁻⁸/(1 + e⁻⁸)`` at init.

    With the literal −8 per permutation the off-identity weight grows with size! (0.8 % at n = 4, 93 % at
    n = 8), so ``H_res`` would start far from ``I`` for larger n. For 2 × 2 factors this is exactly −8.
    """
    return OFF_DIAGONAL_BIAS - math.log(max(math.factorial(size) - 1, 1))


class PermutationMixture(nn.Module):
    """``Σ_r softmax(α · d + b)_r P_r`` over all ``size!`` permutations: exactly doubly stochastic.

    ``b`` is 0 for the identity and ``off_identity_bias`` for every other permutation (default:
    :func:`default_off_identity_bias`, so the mix starts within ``e⁻⁸`` of ``I`` at any size; pass −8.0 for
    the literal constant of the mHC-lite paper). The permutation matrices are a buffer: built once at
    construction and moved with the module, never rebuilt per call. Input ``(..., size!)``;
    output ``(..., size, size)``.
    """

    def __init__(self, size: int, alpha: float = 0.01, off_identity_bias: float | None = None):
        super().__init__()
        self.size = size
        self.num_inputs = math.factorial(size)
        self.alpha = scale_parameter(alpha)
        if off_identity_bias is None:
            off_identity_bias = default_off_identity_bias(size)
        bias = torch.full((self.num_inputs,), float(off_identity_bias))
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
    factorially: n > 6 is refused unless ``allow_large=True``. ``off_identity_bias``: see
    :class:`PermutationMixture`.
    """

    name = "mhc-lite"
    guarantees = Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        closed_under_products=True,
    )

    def __init__(
        self,
        n_streams: int,
        alpha: float = 0.01,
        allow_large: bool = False,
        off_identity_bias: float | None = None,
    ):
        super().__init__(n_streams)
        check_permutation_size(n_streams, allow_large, "n_streams")
        self.mixture = PermutationMixture(n_streams, alpha, off_identity_bias)
        self.num_inputs = self.mixture.num_inputs

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        return self.mixture(d_res)
