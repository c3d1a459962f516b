"""``identity``: n streams, no mixing (the s²HC paper's ablation "fixed identity")."""

from __future__ import annotations

import torch

from ..counts import Count, count
from .base import Guarantees, Mixer


class IdentityMixer(Mixer):
    """``H_res = I``: the streams talk only through ``H_pre`` and ``H_post``. K = 0.

    Input ``d_res`` ``(..., 0)``; output ``(..., n, n)``.
    """

    name = "identity"
    guarantees = Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        orthogonal=True,
        closed_under_products=True,
    )

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        return 0, count()

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(self.n_streams, dtype=d_res.dtype, device=d_res.device)
        return eye.expand(*d_res.shape[:-1], self.n_streams, self.n_streams)
