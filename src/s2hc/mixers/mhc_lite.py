"""``mhc-lite``: an exact doubly stochastic matrix as a convex mix of all n! permutations."""

from __future__ import annotations

import itertools
import math
import numbers

import torch
from torch import nn

from ..checks import check_bool
from ..counts import Count, count
from .base import Guarantees, Mixer, scale_parameter
from .mhc import OFF_DIAGONAL_BIAS

#: Largest n built without ``allow_large=True``: n! inputs per token grow to 5 040 at n = 7 and 40 320 at 8.
MAX_PERMUTATION_STREAMS = 6
#: Largest permutation mixture built for real, whatever ``allow_large`` says: its table holds size! x size² floats,
#: 2.6 M (10 MB) at 8, 29 M (117 MB) at 9, 4.8 G (19 GB) at 11 and 69 G (276 GB) at 12, once per connection, and K =
#: size! inputs per token widen every projection alike. On the meta device (``s2hc params``) only the table's shape
#: is made, so counting goes further: :data:`MAX_COUNTED_PERMUTATION_SIZE`.
MAX_BUILT_PERMUTATION_SIZE = 8
#: Largest permutation mixture counted on the meta device (12! = 479 001 600 inputs per token); beyond it the
#: counts stop meaning anything and overflow 64-bit sizes.
MAX_COUNTED_PERMUTATION_SIZE = 12


def permutation_matrices(n: int) -> torch.Tensor:
    """All n! permutation matrices ``(n!, n, n)`` in lexicographic order; index 0 is the identity."""
    perms = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long)
    return torch.eye(n)[perms]


def permutation_size_limit(built: bool) -> int:
    """The largest permutation mixture s2hc makes: :data:`MAX_BUILT_PERMUTATION_SIZE` when its table is listed
    (``built``), :data:`MAX_COUNTED_PERMUTATION_SIZE` when only its shape is (the meta device)."""
    return MAX_BUILT_PERMUTATION_SIZE if built else MAX_COUNTED_PERMUTATION_SIZE


def permutation_limit_error(what: str, size: int, built: bool) -> ValueError | None:
    """The error for a mixture of ``size`` streams beyond :func:`permutation_size_limit` (``what`` names it, e.g.
    ``"mhc-lite at n_streams=12"``), else None; ``allow_large`` never lifts this limit."""
    limit = permutation_size_limit(built)
    if size <= limit:
        return None
    return ValueError(
        f"{what} mixes {size}! = {math.factorial(size):,} permutations per token; s2hc stops at mixtures of {limit} "
        f"streams ({limit}! = {math.factorial(limit):,}{', built' if built else ', counted'}) whatever allow_large "
        "says: choose fewer streams or another family"
    )


def check_permutation_size(n: int, allow_large: bool, what: str) -> None:
    """ValueError for a mixture of ``n`` streams s2hc does not build: above :func:`permutation_size_limit` always
    (the meta device's larger limit when building there), above :data:`MAX_PERMUTATION_STREAMS` without
    ``allow_large`` (which must be True or False)."""
    check_bool("allow_large", allow_large)
    error = permutation_limit_error(f"{what}={n}", n, built=torch.empty(0).device.type != "meta")
    if error is not None:
        raise error
    if n > MAX_PERMUTATION_STREAMS and not allow_large:
        raise ValueError(
            f"{what}={n} needs {math.factorial(n)} inputs per token; allowed without allow_large=True: "
            f"<= {MAX_PERMUTATION_STREAMS}"
        )


#: The ``off_identity_bias`` value that scales the papers' −8 with the mixture's size.
N_INDEPENDENT = "n-independent"


def n_independent_off_identity_bias(size: int) -> float:
    """``−8 − ln(size! − 1)``: all non-identity permutations together weigh ``e⁻⁸/(1 + e⁻⁸)`` at init, at any size.

    With the papers' −8 per permutation the off-identity weight grows with size! (0.8 % at n = 4, 19 % at n = 6,
    93 % at n = 8), so ``H_res`` starts far from ``I`` for larger n. For 2 × 2 factors both are exactly −8.
    """
    return OFF_DIAGONAL_BIAS - math.log(max(math.factorial(size) - 1, 1))


def resolve_off_identity_bias(value: object, size: int) -> float:
    """The bias of every non-identity permutation of a mixture of ``size!`` permutations.

    ``value`` is the ``off_identity_bias`` option: a finite number (the papers' −8.0 by default) or
    ``"n-independent"`` (:func:`n_independent_off_identity_bias`); ValueError naming the option otherwise.
    """
    if value == N_INDEPENDENT:
        return n_independent_off_identity_bias(size)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"off_identity_bias must be a finite number or {N_INDEPENDENT!r}, got {value!r}")
    return float(value)


class PermutationMixture(nn.Module):
    """``Σ_r softmax(α · d + b)_r P_r`` over all ``size!`` permutations: exactly doubly stochastic.

    ``b`` is 0 for the identity and ``off_identity_bias`` for every other permutation: the papers' −8.0 by
    default (the mHC-lite and KromHC code), or ``"n-independent"`` for ``−8 − ln(size! − 1)``, which keeps the
    mix within ``e⁻⁸`` of ``I`` at any size (see :func:`resolve_off_identity_bias`). The permutation matrices are a
    buffer: built once at construction and moved with the module, never rebuilt per call.
    Input ``(..., size!)``; output ``(..., size, size)`` in the input's dtype.

    Above 720 permutations (size ≥ 7) the softmax and the sum over permutations run in float64: in float32
    the normaliser of 5 040 or 40 320 terms rounds, and every row and column sum is off by up to ~3e-5.
    """

    @staticmethod
    def flops(size: int) -> Count:
        """``softmax(α d + b) @ P``: the logits and softmax of size! inputs, a ``(size!) @ (size!, size²)`` product."""
        k = math.factorial(size)
        return count(2 * k * size * size, 2 * k + 4 * k)

    def __init__(self, size: int, alpha: float = 0.01, off_identity_bias: float | str = OFF_DIAGONAL_BIAS):
        super().__init__()
        self.size = size
        self.num_inputs = math.factorial(size)
        self.alpha = scale_parameter(alpha)
        bias = torch.full((self.num_inputs,), resolve_off_identity_bias(off_identity_bias, size))
        bias[0] = 0.0
        self.bias = nn.Parameter(bias)
        # 0/1 entries are exact in every dtype, so an ordinary buffer may follow the model's casts. Built on the
        # meta device (s2hc params counts there), only its shape is made: the n! permutations are never listed.
        if torch.empty(0).device.type == "meta":
            table = torch.empty(self.num_inputs, size * size)
        else:
            table = permutation_matrices(size).flatten(1)
        self.register_buffer("permutations", table, persistent=False)
        self.accumulate_in_float64 = size > MAX_PERMUTATION_STREAMS

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if self.accumulate_in_float64 else d.dtype
        logits = self.alpha.to(dtype) * d.to(dtype) + self.bias.to(dtype)
        weights = torch.softmax(logits, dim=-1)
        h = (weights @ self.permutations.to(dtype)).to(d.dtype)
        return h.unflatten(-1, (self.size, self.size))


class PermutationMixer(Mixer):
    """Shared frame of ``mhc-lite`` and ``kromhc``, the families built from :class:`PermutationMixture` s:
    their :meth:`permutation_sizes` say which, and a mixture above :data:`MAX_PERMUTATION_STREAMS` streams
    needs ``allow_large=True``. A convex combination of permutation matrices is doubly stochastic (Birkhoff), and so
    are products and Kronecker products of such: the guarantees both families share."""

    guarantees = Guarantees(row_sums_one=True, col_sums_one=True, nonnegative=True, spectral_norm_at_most_one=True,
                            closed_under_products=True)

    @classmethod
    def options_for_size(cls, n_streams: int) -> dict[str, object]:
        """``{"allow_large": True}`` when a mixture built at ``n_streams`` is above :data:`MAX_PERMUTATION_STREAMS`
        (the limits of :func:`permutation_size_limit` hold whatever it says), else ``{}``."""
        if max(cls.permutation_sizes(n_streams), default=0) > MAX_PERMUTATION_STREAMS:
            return {"allow_large": True}
        return {}


class MHCLiteMixer(PermutationMixer):
    """``mhc-lite`` (arXiv 2601.05732): ``H_res`` a softmax-weighted mix of all n! permutations. K = n!.

    Exactly doubly stochastic and non-negative by construction (Birkhoff–von Neumann), but K grows
    factorially: n > 6 is refused unless ``allow_large=True``.

    Options:
      off_identity_bias: bias of every non-identity permutation at initialisation (the identity's is 0).
        The paper's −8.0 by default; ``"n-independent"`` for ``−8 − ln(n! − 1)`` (see :class:`PermutationMixture`).
      allow_large: build n > 6 (K = 5 040 at n = 7, 40 320 at n = 8); never above
        :data:`MAX_BUILT_PERMUTATION_SIZE` (8).
      alpha.
    """

    name = "mhc-lite"

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        return math.factorial(n_streams), PermutationMixture.flops(n_streams)

    def __init__(
        self,
        n_streams: int,
        alpha: float = 0.01,
        allow_large: bool = False,
        off_identity_bias: float | str = OFF_DIAGONAL_BIAS,
    ):
        super().__init__(n_streams)
        resolve_off_identity_bias(off_identity_bias, n_streams)  # refused before n! permutations are built
        check_permutation_size(n_streams, allow_large, "n_streams")
        self.mixture = PermutationMixture(n_streams, alpha, off_identity_bias)
        self.num_inputs = self.mixture.num_inputs

    @classmethod
    def permutation_sizes(cls, n_streams: int) -> list[int]:
        """``[n_streams]``: one mixture of all n! permutations."""
        return [n_streams]

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        return self.mixture(d_res)
