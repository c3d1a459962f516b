"""``hc``: unconstrained Hyper-Connections (Zhu et al., arXiv 2409.19606)."""

from __future__ import annotations

import torch
from torch import nn

from .base import Guarantees, Mixer, scale_parameter


class HCMixer(Mixer):
    """``H_res = B + α · tanh(d)`` with a learnable static ``B`` (initialised to ``I``). K = n².

    Nothing bounds the result: products over depth may amplify (the instability mHC was made for).
    As in HC, the connection's ``H_pre``/``H_post`` are tanh-based too (``gate = "tanh"``).
    Input ``(..., n²)`` read row-major; output ``(..., n, n)``.
    """

    name = "hc"
    guarantees = Guarantees()
    gate = "tanh"

    def __init__(self, n_streams: int, alpha: float = 0.01):
        super().__init__(n_streams)
        self.num_inputs = n_streams * n_streams
        self.alpha = scale_parameter(alpha)
        self.bias = nn.Parameter(torch.eye(n_streams))

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        n = self.n_streams
        alpha, bias = self.alpha.to(d_res.dtype), self.bias.to(d_res.dtype)
        return bias + alpha * torch.tanh(d_res).unflatten(-1, (n, n))
