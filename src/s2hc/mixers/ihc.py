"""``ihc``: Hy4's independent hyper-connections (Tencent HunYuan, transformers' ``HYV4HyperConnection``).

DeepSeek-V4's connection without ``comb``: no mixing and no Sinkhorn, ``H_res = I``; the streams talk only through
the read and the write, whose gates are DeepSeek-V4's with a magnitude and an ``hc_eps`` on both (docs/mixers.md,
"Hy4's independent HC"; converters: :mod:`s2hc.hf.hy_v4`).
"""

from __future__ import annotations

import math

import torch

from ..checks import check_float
from ..counts import Count, count
from .identity import IdentityMixer

#: Hy4's ``hc_eps`` and ``hc_magnitude`` (``HYV4Config``'s defaults), the family's defaults.
HY_V4_EPS = 1e-6
HY_V4_MAGNITUDE = 2.0


def start_bias(n_streams: int) -> float:
    """``−log(max(n − 1, 1))``, Hy4's initial read bias (``base[:n]`` and the head's ``hc_base``): ``σ(b) = 1/n``
    for n ≥ 2, so the read starts as the streams' mean (plus ``hc_eps``); 0 (a read of 0.5) for one stream."""
    return -math.log(max(n_streams - 1, 1))


class IHCMixer(IdentityMixer):
    """``H_res = I``, with Hy4's gates: ``H_pre = σ(α_pre d_pre + b_pre) + ε`` and
    ``H_post = m · σ(α_post d_post + b_post) + ε`` (``m = hc_magnitude``, default 2.0; ``ε = hc_eps``, default
    1e-6), from an RMSNorm over the n·C features without a weight. K = 0.

    The gates start where Hy4's ``_init_weights`` puts them (``gate_init="papers"``, the default): ``b_pre =
    −log(n − 1)`` (a read of ``1/n + ε`` per stream), ``b_post = 0`` (a write of ``m/2 + ε``); ``α = 0.01``; and a
    model's final read is Hy4's learned head by default (``stream_reduce="head"``, its bias ``−log(n − 1)`` too).
    Input ``d_res`` ``(..., 0)``; output ``(..., n, n)``, the identity.
    """

    name = "ihc"  # the identity's H_res and guarantees (its mix, too); its own gates, norm and start
    weighted_norm = False
    default_stream_reduce = "head"

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        """No constraint map; the two ``+ hc_eps`` of the gates (n each), which the connection's gate count lacks."""
        return 0, count(0, 2 * n_streams)

    @classmethod
    def head_bias(cls, n_streams: int) -> float:
        return start_bias(n_streams)

    def __init__(self, n_streams: int, hc_eps: float = HY_V4_EPS, hc_magnitude: float = HY_V4_MAGNITUDE):
        super().__init__(n_streams)
        self.hc_eps = check_float("hc_eps", hc_eps, minimum=0.0)
        self.hc_magnitude = check_float("hc_magnitude", hc_magnitude, positive=True)
        self.pre_offset = self.post_offset = self.hc_eps
        self.post_scale = self.hc_magnitude

    def start_biases(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hy4's: ``b_pre = −log(max(n − 1, 1))`` for every stream, ``b_post = 0``, whatever the layer."""
        n = self.n_streams
        return torch.full((n,), start_bias(n)), torch.zeros(n)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hc_eps={self.hc_eps}, hc_magnitude={self.hc_magnitude}"
