"""``kromhc``: a Kronecker product of small exactly doubly stochastic factors (KromHC)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..counts import Count, add, count
from .mhc import OFF_DIAGONAL_BIAS
from .mhc_lite import PermutationMixer, PermutationMixture, check_permutation_size, resolve_off_identity_bias


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n`` with multiplicity, ascending (``12 -> [2, 2, 3]``; ``1 -> []``)."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors


def kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched Kronecker product: ``(..., p, p) ⊗ (..., q, q) -> (..., pq, pq)``."""
    p, q = a.shape[-1], b.shape[-1]
    return torch.einsum("...ij,...kl->...ikjl", a, b).reshape(*a.shape[:-2], p * q, p * q)


class KromHCMixer(PermutationMixer):
    """``H_res = D_1 ⊗ D_2 ⊗ …``, one permutation-mixture factor ``D_i`` per prime factor of n.

    For n = 2^k every factor is the official 2 × 2 form ``w I + (1 − w) [[0, 1], [1, 0]]``; any other n is
    factored into primes p with a mix of all p! permutations each, so K = Σ p_i!. The product of
    doubly stochastic matrices is exactly doubly stochastic and non-negative.

    The reachable set is small: for n = 2^k it has only k degrees of freedom against (n − 1)² for the whole
    Birkhoff polytope (3 against 49 at n = 8), and every composite n is restricted to Kronecker-structured
    matrices; only for prime n is it the full mhc-lite set (at mhc-lite's factorial cost, so primes above 6
    need ``allow_large=True``).

    Options:
      off_identity_bias: bias of every non-identity permutation of each factor at initialisation (each
        identity's is 0). −8.0 by default, the official code's value for every factor (it accepts only
        n = 2^k); ``"n-independent"`` gives each factor of size p the bias ``−8 − ln(p! − 1)``: the same −8
        for 2 × 2 factors (n = 2^k is unchanged) but within ``e⁻⁸`` of ``I`` for factors 3, 5, 7 too.
      allow_large: build factors of size > 6 (K = 5 040 for a factor 7).
      alpha.
    """

    name = "kromhc"

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        factors = cls.permutation_sizes(n_streams)  # one mixture per prime factor of n
        counts, size = [PermutationMixture.flops(p) for p in factors], factors[0] if factors else 1
        for p in factors[1:]:  # the Kronecker products: an outer product (elementwise), size² · p² entries
            counts.append(count(0, (size * p) ** 2))
            size *= p
        return sum(math.factorial(p) for p in factors), add(count(), *counts)

    def __init__(self, n_streams: int, alpha: float = 0.01, allow_large: bool = False,
                 off_identity_bias: float | str = OFF_DIAGONAL_BIAS):  # mhc-lite's options, for each factor
        super().__init__(n_streams)
        resolve_off_identity_bias(off_identity_bias, 2)  # refused even at n = 1 (no factor)
        self.factor_sizes = self.permutation_sizes(n_streams)
        for p in self.factor_sizes:
            check_permutation_size(p, allow_large, f"prime factor of n_streams={n_streams}")
        self.factors = nn.ModuleList(PermutationMixture(p, alpha, off_identity_bias) for p in self.factor_sizes)
        self.num_inputs = sum(f.num_inputs for f in self.factors)

    @classmethod
    def permutation_sizes(cls, n_streams: int) -> list[int]:
        """The prime factors of ``n_streams``, one mixture each (``12 -> [2, 2, 3]``; none at n = 1)."""
        return prime_factors(n_streams)

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        if not self.factors:  # n = 1
            return d_res.new_ones(*d_res.shape[:-1], 1, 1)
        inputs = d_res.split([f.num_inputs for f in self.factors], dim=-1)
        h = self.factors[0](inputs[0])
        for factor, d in zip(self.factors[1:], inputs[1:]):
            h = kron(h, factor(d))
        return h

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, factors={self.factor_sizes}"
