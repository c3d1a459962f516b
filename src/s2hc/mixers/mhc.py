"""``mhc``: Manifold-Constrained Hyper-Connections (DeepSeek): Sinkhorn–Knopp onto doubly stochastic."""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_int
from .base import Guarantees, Mixer, scale_parameter

OFF_DIAGONAL_BIAS = -8.0


def log_sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` rounds of log-domain Sinkhorn–Knopp on ``logits`` ``(..., n, n)``.

    Each round normalises columns, then rows (mHC's ``T_r(T_c(·))``), so the rows of the result sum to 1
    exactly and the columns only approximately. Autograd runs through every round, so the gradient is
    the true gradient of this finite-iteration map, not the implicit gradient at convergence.
    """
    log_p = logits
    for _ in range(iterations):
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return log_p.exp()


class MHCMixer(Mixer):
    """``H_res = SK_t(α · d + b)``: ``t`` log-domain Sinkhorn rounds (default 20). K = n².

    ``b`` is 0 on the diagonal and −8 off it, so ``H_res ≈ I`` at initialisation. The result is
    non-negative with rows summing to 1; column sums are only approximate after finitely many rounds
    and drift further from 1 as the logits spread. Always computed in at least float32.
    Input ``(..., n²)`` read row-major; output ``(..., n, n)``.
    """

    name = "mhc"
    guarantees = Guarantees(row_sums_one=True, nonnegative=True)

    def __init__(self, n_streams: int, iterations: int = 20, alpha: float = 0.01):
        super().__init__(n_streams)
        self.iterations = check_int("iterations", iterations)
        self.num_inputs = n_streams * n_streams
        self.alpha = scale_parameter(alpha)
        bias = torch.full((n_streams, n_streams), OFF_DIAGONAL_BIAS)
        bias.fill_diagonal_(0.0)
        self.bias = nn.Parameter(bias)

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        n = self.n_streams
        logits = self.alpha.to(d_res.dtype) * d_res.unflatten(-1, (n, n)) + self.bias.to(d_res.dtype)
        return log_sinkhorn(logits, self.iterations)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, iterations={self.iterations}"
