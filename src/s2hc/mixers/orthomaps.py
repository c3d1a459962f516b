"""Orthogonal charts shared by the s²HC, orthogonal and isometric families.

Per token these build small (m × m) orthogonal matrices from m(m-1)/2 numbers. Millions of tokens
make a general solver per token slow (and torch's LU solvers refuse bfloat16 and float16: the mixers call
these in their coefficient dtype, at least float32), so sizes up to 4 use closed forms from the
Cayley–Hamilton theorem; larger sizes fall back to a batched solve, ``torch.linalg.solve_ex`` without its
error check, which would copy the LU status to the host (a device sync per call on CUDA).
"""

from __future__ import annotations

import math

import torch

from ..counts import Count, count
from .base import scale_parameter, small_matmul


def helmert_basis(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Truncated Helmert basis ``U_Z`` of shape ``(n, n-1)`` of the zero-sum subspace of ``R^n``.

    Column j (0-based) is ``(1, …, 1, -(j+1), 0, …, 0) / sqrt((j+1)(j+2))`` with j+1 ones: the columns are
    orthonormal and each is orthogonal to the all-ones vector, so ``U_Z U_Zᵀ = I - 11ᵀ/n``.
    """
    basis = torch.zeros(n, n - 1, dtype=torch.float64, device="cpu")  # exact values, even under a meta context
    for j in range(n - 1):
        basis[: j + 1, j] = 1.0
        basis[j + 1, j] = -(j + 1.0)
        basis[:, j] /= math.sqrt((j + 1.0) * (j + 2.0))
    return basis.to(dtype)


def skew_from_vector(z: torch.Tensor, m: int) -> torch.Tensor:
    """Skew-symmetric ``A`` of shape ``(..., m, m)`` whose strict upper triangle is ``z`` ``(..., m(m-1)/2)``.

    Filled row by row (the order of ``torch.triu_indices(m, m, 1)``); the lower triangle is the negation.
    """
    rows, cols = torch.triu_indices(m, m, offset=1, device=z.device)
    a = z.new_zeros(*z.shape[:-1], m, m)
    a[..., rows, cols] = z
    return a - a.transpose(-1, -2)


def _pfaffian4(a: torch.Tensor) -> torch.Tensor:
    """Pfaffian of a 4 × 4 skew matrix: ``a01 a23 - a02 a13 + a03 a12`` (its square is ``det A``)."""
    return a[..., 0, 1] * a[..., 2, 3] - a[..., 0, 2] * a[..., 1, 3] + a[..., 0, 3] * a[..., 1, 2]


def _dual4(a: torch.Tensor) -> torch.Tensor:
    """Hodge dual ``Ã`` of a 4 × 4 skew matrix ``A``: ``Ã_ij = ε_ijkl a_kl`` over the complementary pair k < l.

    A fixed signed rearrangement of A's six entries (``Ã01 = a23``, ``Ã02 = −a13``, ``Ã03 = a12``, ``Ã12 = a03``,
    ``Ã13 = −a02``, ``Ã23 = a01``), with ``A Ã = −Pf(A) I`` and ``A² + Ã² = −p I``, hence ``A³ + pA = Pf(A) Ã``.
    """
    a01, a02, a03 = a[..., 0, 1], a[..., 0, 2], a[..., 0, 3]
    a12, a13, a23 = a[..., 1, 2], a[..., 1, 3], a[..., 2, 3]
    zero = torch.zeros_like(a01)
    rows = (
        (zero, a23, -a13, a12),
        (-a23, zero, a03, -a02),
        (a13, -a03, zero, a01),
        (-a12, a02, -a01, zero),
    )
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def cayley(a: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Cayley transform ``(I + A)⁻¹ (I − A)`` of skew-symmetric ``A`` ``(..., m, m)``: a rotation in SO(m).

    For m ≤ 4 the characteristic polynomial of a skew matrix is ``λ⁴ + pλ² + q²`` (padding with zeros),
    ``p = ‖A‖_F² / 2``, ``q = Pf(A)``, which gives the closed form
    ``Q = [(1 + p − q²) I − 2(1 + p) A + 2A² − 2A³] / (1 + p + q²)``; for m ≤ 3 (q = 0, A³ = −pA) it
    reduces to ``Q = I + 2(A² − A) / (1 + p)``. At m = 4 the code uses ``A³ + pA = q Ã`` (``Ã`` the Hodge
    dual, :func:`_dual4`), ``Q = [(1 + p − q²) I − 2A − 2q Ã + 2A²] / (1 + p + q²)``: the same matrix without
    the cancellation between ``−2(1 + p) A`` and ``−2A³`` (each ~|A| after the division, their sum ~1/|A|),
    which cost float32 orthogonality ~1e-6 · |A| (2.8e-4 at entries ~500; now ≤ ~1e-6 at any size).
    Larger m use a batched linear solve without an error check (no host sync).
    The chart cannot reach rotations with eigenvalue −1 (use :func:`matrix_exp_rotation` for those).
    ``fused=True`` computes the powers of A with :func:`~s2hc.mixers.base.small_matmul` (same values).
    """
    matmul = small_matmul if fused else torch.matmul
    m = a.shape[-1]
    eye = torch.eye(m, dtype=a.dtype, device=a.device)
    if m == 1:
        return eye.expand_as(a).clone()
    a2 = matmul(a, a)
    p = 0.5 * a.square().sum(dim=(-1, -2))[..., None, None]
    if m <= 3:
        return eye + 2.0 * (a2 - a) / (1.0 + p)
    if m == 4:
        q = _pfaffian4(a)[..., None, None]
        q2 = q.square()
        return ((1.0 + p - q2) * eye - 2.0 * a - 2.0 * q * _dual4(a) + 2.0 * a2) / (1.0 + p + q2)
    # I + A is invertible for every real skew-symmetric A (its eigenvalues are 1 + iλ, λ real), so the singular
    # check torch.linalg.solve makes (reading the LU status on the host: a sync on CUDA) has nothing to find.
    return torch.linalg.solve_ex(eye + a, eye - a, check_errors=False).result


def matrix_exp_rotation(a: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``exp(A)`` of skew-symmetric ``A`` ``(..., m, m)``: reaches all of SO(m), including eigenvalue −1.

    On CUDA ``torch.linalg.matrix_exp`` picks its scaling from the norms on the host: a device sync per call,
    which the default chart (:func:`cayley`) does not make."""
    return torch.linalg.matrix_exp(a)


ROTATIONS = {"cayley": cayley, "expm": matrix_exp_rotation}


def rotation_map(name: str):
    """The chart called ``name`` (``"cayley"`` or ``"expm"``); ValueError for anything else."""
    if not isinstance(name, str) or name not in ROTATIONS:
        raise ValueError(f"rotation must be one of {sorted(ROTATIONS)}, got {name!r}")
    return ROTATIONS[name]


class Rotation(torch.nn.Module):
    """A per-token rotation in SO(m) from ``k = m(m-1)/2`` raw inputs, as in the s²HC paper.

    ``z = γ · tanh(α · d + b)`` fills the upper triangle of a skew matrix, then a chart (Cayley by default)
    maps it to a rotation. ``α`` starts at 0.01, ``b`` at 0 and the magnitude gate ``γ`` at 1, so the
    rotation is exactly ``I`` at initialisation.
    """

    @staticmethod
    def flops(size: int, chart: str = "cayley") -> Count:
        """Forward FLOPs per token of one rotation in SO(``size``) from its size(size−1)/2 inputs."""
        m, k = size, size * (size - 1) // 2
        gate = 4 * k + k  # γ · tanh(α d + b), and the skew matrix's lower triangle
        if m <= 1:
            return count(0, gate)
        if chart == "expm":  # torch's matrix exponential: a degree-18 Taylor/Padé form, ~8 m³ products (approximate)
            return count(0, gate + 8 * 2 * m**3)
        square = 2 * m**3  # the chart computes A² (a product) at every size
        if m <= 4:  # the closed form: ‖A‖², the combination (and at m = 4 the Pfaffian and the dual)
            return count(square, gate + 2 * m * m + 6 * m * m + (20 if m == 4 else 0))
        # a batched solve (I + A) Q = I − A: LU (2m³/3) and m triangular solves (2m³), approximate
        return count(square, gate + 2 * m * m + 8 * m**3 // 3)

    def __init__(self, size: int, chart: str = "cayley", alpha: float = 0.01):
        super().__init__()
        self.size = size
        self.num_inputs = size * (size - 1) // 2
        self.chart_name = chart
        self.chart = rotation_map(chart)
        self.alpha = scale_parameter(alpha)
        self.bias = torch.nn.Parameter(torch.zeros(self.num_inputs))
        self.gamma = scale_parameter(1.0)

    def forward(self, d: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``d`` ``(..., k)`` in the coefficient dtype -> rotation ``(..., m, m)`` in the same dtype.

        ``fused``: the chart's fused form (closed-form Cayley without batched tiny matrix products)."""
        alpha, bias, gamma = (p.to(d.dtype) for p in (self.alpha, self.bias, self.gamma))
        z = gamma * torch.tanh(alpha * d + bias)
        return self.chart(skew_from_vector(z, self.size), fused=fused)

    def extra_repr(self) -> str:
        return f"size={self.size}, chart={self.chart_name!r}"
