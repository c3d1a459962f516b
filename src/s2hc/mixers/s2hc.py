"""``s2hc``: Spectral-Sphere-Constrained Hyper-Connections (arXiv 2603.20896)."""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_bool
from ..counts import Count, add, count
from .base import Guarantees, Mixer, scale_parameter, small_matmul
from .orthomaps import Rotation, helmert_basis

SPECTRUM_BIAS = 4.0


def reflect_into_unit_interval(z: torch.Tensor) -> torch.Tensor:
    """A triangle wave of period 4 with peak 1 at ``z = 0``: ``s = 1 − |z|`` folded back into ``[−1, 1]``.

    Used by ``exact_identity_init``: any smooth bounded map reaches its maximum 1 with zero slope, which
    would freeze the spectrum at exactly 1 for ever. This map is piecewise linear with slope ±1
    everywhere; at ``z = 0`` it takes the one-sided slope −1, so the spectrum learns from the first step.
    """
    w = torch.remainder(z + 2.0, 4.0) - 2.0  # in [−2, 2), equal to z near 0
    sign = torch.where(w >= 0, 1.0, -1.0).to(w.dtype)
    return 1.0 - w * sign


class ZeroSumMixer(Mixer):
    """Shared frame of ``s2hc`` and ``isometric``: ``H_res = I + U_Z (M − I) U_Zᵀ``.

    ``U_Z`` ``(n, m)``, m = n − 1, is the truncated Helmert basis. Since ``J + U_Z U_Zᵀ = I`` this equals the
    paper's ``J + U_Z M U_Zᵀ``; written around ``I`` it is exactly ``I`` when ``M = I`` and loses no
    precision near the identity. ``J`` and the deviation act on orthogonal subspaces, so rows and columns
    sum to 1 and ``‖H_res‖₂ = max(1, ‖M‖₂)``.
    """

    @staticmethod
    def frame_flops(n_streams: int) -> Count:
        """``I + U_Z (M − I) U_Zᵀ``: a batched ``(n, m) @ (m, m)`` and an ``(n, m) @ (m, n)``."""
        n, m = n_streams, n_streams - 1
        return count(2 * n * m * m + 2 * n * m * n, m * m + n * n)

    def __init__(self, n_streams: int, rotation: str = "cayley", alpha: float = 0.01):
        super().__init__(n_streams)
        self.m = n_streams - 1
        self.register_constant("basis", helmert_basis(n_streams, torch.float64))
        self.rotation_u = Rotation(self.m, rotation, alpha)
        self.rotation_v = Rotation(self.m, rotation, alpha)

    def deviation_core(self, d_res: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``M`` ``(..., m, m)`` from ``d_res`` ``(..., K)``; ``‖M‖₂ ≤ 1`` for every family built on this."""
        raise NotImplementedError  # pragma: no cover

    def rotations(
        self, d_res: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U_core, V_core, rest)``: the two rotations and the inputs left after theirs."""
        k = self.rotation_u.num_inputs
        d_u, d_v, rest = d_res.split([k, k, d_res.shape[-1] - 2 * k], dim=-1)
        return self.rotation_u(d_u, fused=fused), self.rotation_v(d_v, fused=fused), rest

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        basis = self.basis.to(d_res.dtype)
        core = self.deviation_core(d_res)
        eye_m = torch.eye(self.m, dtype=d_res.dtype, device=d_res.device)
        eye_n = torch.eye(self.n_streams, dtype=d_res.dtype, device=d_res.device)
        return eye_n + basis @ (core - eye_m) @ basis.T

    def mix_fused(self, d_res: torch.Tensor) -> torch.Tensor:
        """:meth:`mix` without batched tiny products: the per-token products are broadcast
        multiply-adds, and the fixed-basis conjugation is two GEMMs over all tokens at once
        (``(M − I) U_Zᵀ``, then ``(U_Z Y)ᵀ = Yᵀ U_Zᵀ``, each a matrix with a shared right operand)."""
        basis_t = self.basis.to(d_res.dtype).T  # (m, n)
        core = self.deviation_core(d_res, fused=True)
        eye_m = torch.eye(self.m, dtype=d_res.dtype, device=d_res.device)
        eye_n = torch.eye(self.n_streams, dtype=d_res.dtype, device=d_res.device)
        y = (core - eye_m) @ basis_t  # (..., m, n)
        return eye_n + (y.transpose(-1, -2) @ basis_t).transpose(-1, -2)


class S2HCMixer(ZeroSumMixer):
    """``H_res = J + U_Z U_core diag(s) V_coreᵀ U_Zᵀ``: mean preserved, no direction amplified. K = m².

    ``d_res`` ``(..., m²)`` splits into k = m(m−1)/2 inputs for each rotation (``U_core``, then ``V_core``)
    and m for the signed spectrum ``s = tanh(α · d + 4)`` (|s| ≤ 1; ≈ 0.9993 at init, so ``H_res`` is near
    but not exactly ``I``, as in the paper's code). Rows and columns of ``H_res`` sum to 1, ``‖H_res‖₂ = 1``,
    and products of such matrices keep both properties.

    Options:
      rotation: ``"cayley"`` (default, the paper's chart; closed form for m ≤ 4, no solver) or ``"expm"``
        (matrix exponential: reaches all of SO(m), including rotations with eigenvalue −1).
      exact_identity_init: ``H_res = I`` exactly at initialisation; the spectrum then uses a reflecting
        piecewise-linear map with bias 0 (see :func:`reflect_into_unit_interval`) so its gradient is
        non-zero there. Off by default (paper-faithful).
    """

    name = "s2hc"
    guarantees = Guarantees(
        row_sums_one=True, col_sums_one=True, spectral_norm_at_most_one=True, closed_under_products=True
    )

    @classmethod
    def flops(cls, n_streams: int, rotation: str = "cayley", **family_options: object) -> tuple[int, Count]:
        m = n_streams - 1
        spectrum = count(0, 3 * m + m * m)  # tanh(α d + b), then U · diag(s)
        core = count(2 * m**3)  # (U diag(s)) Vᵀ
        rotations = Rotation.flops(m, rotation), Rotation.flops(m, rotation)
        return m * m, add(*rotations, spectrum, core, cls.frame_flops(n_streams))

    def __init__(
        self,
        n_streams: int,
        rotation: str = "cayley",
        exact_identity_init: bool = False,
        alpha: float = 0.01,
    ):
        super().__init__(n_streams, rotation, alpha)
        self.exact_identity_init = check_bool("exact_identity_init", exact_identity_init)
        self.num_inputs = self.m * self.m
        self.spectrum_alpha = scale_parameter(alpha)
        bias = 0.0 if self.exact_identity_init else SPECTRUM_BIAS
        self.spectrum_bias = nn.Parameter(torch.full((self.m,), bias))

    def spectrum(self, d_s: torch.Tensor) -> torch.Tensor:
        """Signed diagonal ``s`` ``(..., m)`` with ``|s| ≤ 1`` from its raw inputs ``(..., m)``."""
        z = self.spectrum_alpha.to(d_s.dtype) * d_s + self.spectrum_bias.to(d_s.dtype)
        return reflect_into_unit_interval(z) if self.exact_identity_init else torch.tanh(z)

    def deviation_core(self, d_res: torch.Tensor, fused: bool = False) -> torch.Tensor:
        u, v, d_s = self.rotations(d_res, fused)
        matmul = small_matmul if fused else torch.matmul
        return matmul(u * self.spectrum(d_s).unsqueeze(-2), v.transpose(-1, -2))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, exact_identity_init={self.exact_identity_init}"
