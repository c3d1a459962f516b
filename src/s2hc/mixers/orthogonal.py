"""``orthogonal``: the s²HC paper's ablation, a rotation of the whole stream space."""

from __future__ import annotations

import torch

from ..counts import Count
from .base import Guarantees, Mixer
from .orthomaps import Rotation


class OrthogonalMixer(Mixer):
    """``H_res = Cayley(A)`` with ``A`` skew over all n streams. K = n(n−1)/2.

    Orthogonal (no direction amplified or attenuated) but the mean over streams is NOT preserved.
    ``rotation`` as in ``s2hc``. Exactly ``I`` at initialisation.
    """

    name = "orthogonal"
    guarantees = Guarantees(spectral_norm_at_most_one=True, orthogonal=True, closed_under_products=True)

    @classmethod
    def upcycle_refusal(cls) -> str:
        """Refused: it would match the source at step 0 only because ``H_res`` starts at ``I``."""
        return ("an orthogonal H_res keeps norms, not sums (its columns do not sum to 1), so the streams' sum "
                "stops following the source's residual stream")

    @classmethod
    def flops(cls, n_streams: int, rotation: str = "cayley", **family_options: object) -> tuple[int, Count]:
        return n_streams * (n_streams - 1) // 2, Rotation.flops(n_streams, rotation)

    def __init__(self, n_streams: int, rotation: str = "cayley", alpha: float = 0.01):
        super().__init__(n_streams)
        self.rotation = Rotation(n_streams, rotation, alpha)
        self.num_inputs = self.rotation.num_inputs

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        return self.rotation(d_res)

    def mix_fused(self, d_res: torch.Tensor) -> torch.Tensor:
        return self.rotation(d_res, fused=True)
