"""``isometric``: s²HC with every deviation singular value fixed at 1 (the control the paper lacks)."""

from __future__ import annotations

import torch

from ..counts import Count, add, count
from .base import Guarantees, small_matmul
from .orthomaps import Rotation
from .s2hc import ZeroSumMixer


class IsometricMixer(ZeroSumMixer):
    """``H_res = J + U_Z U_core V_coreᵀ U_Zᵀ``: mean-preserving and orthogonal. K = 2 · m(m−1)/2.

    Separates what s²HC's selective attenuation adds from what mean preservation and rotation give.
    ``rotation`` as in ``s2hc``. Exactly ``I`` at initialisation.
    """

    name = "isometric"
    guarantees = Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        spectral_norm_at_most_one=True,
        orthogonal=True,
        closed_under_products=True,
    )

    @classmethod
    def flops(cls, n_streams: int, rotation: str = "cayley", **family_options: object) -> tuple[int, Count]:
        m = n_streams - 1
        core = count(2 * m**3)  # U Vᵀ
        rotations = Rotation.flops(m, rotation), Rotation.flops(m, rotation)
        return m * (m - 1), add(*rotations, core, cls.frame_flops(n_streams))

    def __init__(self, n_streams: int, rotation: str = "cayley", alpha: float = 0.01):
        super().__init__(n_streams, rotation, alpha)
        self.num_inputs = 2 * self.rotation_u.num_inputs

    def deviation_core(self, d_res: torch.Tensor, fused: bool = False) -> torch.Tensor:
        u, v, _ = self.rotations(d_res, fused)
        return (small_matmul if fused else torch.matmul)(u, v.transpose(-1, -2))
