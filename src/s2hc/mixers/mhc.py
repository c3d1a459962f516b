"""``mhc``: Manifold-Constrained Hyper-Connections (DeepSeek): Sinkhorn–Knopp onto doubly stochastic.

Two variants (the ``variant`` option): ``"paper"`` (default), the mHC paper's log-domain Sinkhorn, and
``"deepseek-v4"``, the mHC DeepSeek-V4 ships (transformers' ``DeepseekV4HyperConnection``), which adds a
small ``hc_eps`` to ``H_pre``, to the softmax and to every Sinkhorn denominator, and normalises the streams
without a learnable weight (docs/mixers.md, "DeepSeek-V4's mHC").
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_float, check_int
from ..counts import Count, count
from .base import Guarantees, Mixer, scale_parameter

OFF_DIAGONAL_BIAS = -8.0
VARIANTS = ("paper", "deepseek-v4")
#: DeepSeek-V4's ``hc_eps`` (``DeepseekV4Config.hc_eps``), the default of ``hc_eps`` with ``variant="deepseek-v4"``.
DEEPSEEK_V4_EPS = 1e-6
#: The most Sinkhorn rounds (``iterations``, DeepSeek-V4's ``hc_sinkhorn_iters``): the papers use 20; each round is
#: two passes over every token's n x n logits, so 10**11 read from a config would make the first forward endless.
MAX_ITERATIONS = 10_000


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


def deepseek_v4_sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's Sinkhorn–Knopp on ``logits`` ``(..., n, n)`` in s2hc's orientation (rows = output streams).

    transformers computes ``comb`` with input streams in its rows and mixes with ``combᵀ``; this is the same
    computation on ``combᵀ``: a softmax over each column plus ``eps``, a row normalisation, then
    ``iterations − 1`` rounds of column and row normalisations, every denominator ``sum + eps``, in the
    plain domain as DeepSeek-V4 does. With ``eps = 0`` it is :func:`log_sinkhorn` (the softmax is the first
    column normalisation), so it also ends on the rows: they sum to ``S/(S + eps)`` for row sums ``S`` before
    the last step, 1 up to about ``eps`` unless a row was nearly empty. Returns ``(..., n, n)``, all entries > 0.
    """
    p = torch.softmax(logits, dim=-2) + eps
    p = p / (p.sum(dim=-1, keepdim=True) + eps)
    for _ in range(iterations - 1):
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
    return p


class MHCMixer(Mixer):
    """``H_res = SK_t(α · d + b)``: ``t`` Sinkhorn rounds (default 20). K = n².

    ``b`` is 0 on the diagonal and −8 off it, so ``H_res ≈ I`` at initialisation. The result is
    non-negative with rows summing to 1; column sums are only approximate after finitely many rounds
    and drift further from 1 as the logits spread. Always computed in at least float32.
    Input ``(..., n²)`` read row-major; output ``(..., n, n)``.

    ``variant="paper"`` (default): :func:`log_sinkhorn`, the mHC paper. ``variant="deepseek-v4"``:
    :func:`deepseek_v4_sinkhorn` with ``hc_eps`` (default 1e-6, DeepSeek-V4's), and the connection adds
    ``hc_eps`` to ``H_pre`` (``pre_offset``) and normalises without a weight (``weighted_norm``), so that
    :class:`s2hc.HyperConnection` computes what transformers' ``DeepseekV4HyperConnection`` computes with
    ``H_res = combᵀ`` (converters: :mod:`s2hc.hf.deepseek_v4`). Its rows sum to 1 only up to about ``hc_eps``
    (see :func:`deepseek_v4_sinkhorn`), so this variant's instance claims only non-negativity; ``hc_eps``
    is refused with ``variant="paper"``.
    """

    name = "mhc"
    guarantees = Guarantees(row_sums_one=True, nonnegative=True)

    @classmethod
    def upcycle_refusal(cls) -> None:
        """None: upcycling keeps the function although the columns are only guaranteed to Sinkhorn's tolerance
        (rows exact; at initialisation ``H_res`` is within about ``e⁻⁸`` of ``I``), for both variants."""
        return None

    @classmethod
    def flops(cls, n_streams: int, iterations: int = 20, variant: str = "paper", **family_options: object
              ) -> tuple[int, Count]:
        n = n_streams
        logits = 2 * n * n
        if variant == "deepseek-v4":  # a softmax + ε, then 2 (t − 1) + 1 normalisations (sum, + ε, divide)
            rounds = 5 * n * n + (2 * (iterations - 1) + 1) * (2 * n * n + n)
        else:  # 2t log-domain normalisations (max, subtract, exp, sum, log, add, subtract), then exp
            rounds = 2 * iterations * (5 * n * n + 2 * n) + n * n
        return n * n, count(0, logits + rounds)

    def __init__(
        self,
        n_streams: int,
        iterations: int = 20,
        alpha: float = 0.01,
        variant: str = "paper",
        hc_eps: float | None = None,
    ):
        super().__init__(n_streams)
        self.iterations = check_int("iterations", iterations, maximum=MAX_ITERATIONS)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
        self.variant = variant
        if variant == "paper":
            if hc_eps is not None:
                raise ValueError(f"hc_eps is DeepSeek-V4's constant and needs variant='deepseek-v4', got "
                                 f"hc_eps={hc_eps!r} with variant='paper'")
        else:
            self.hc_eps = check_float("hc_eps", DEEPSEEK_V4_EPS if hc_eps is None else hc_eps, minimum=0.0)
            self.pre_offset, self.weighted_norm = self.hc_eps, False
            self.guarantees = Guarantees(nonnegative=True)  # entries > 0; rows sum to 1 only up to ~hc_eps
        self.num_inputs = n_streams * n_streams
        self.alpha = scale_parameter(alpha)
        bias = torch.full((n_streams, n_streams), OFF_DIAGONAL_BIAS)
        bias.fill_diagonal_(0.0)
        self.bias = nn.Parameter(bias)

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        n = self.n_streams
        logits = self.alpha.to(d_res.dtype) * d_res.unflatten(-1, (n, n)) + self.bias.to(d_res.dtype)
        if self.variant == "deepseek-v4":
            return deepseek_v4_sinkhorn(logits, self.iterations, self.hc_eps)
        return log_sinkhorn(logits, self.iterations)

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, iterations={self.iterations}"
        if self.variant != "paper":
            text += f", variant={self.variant!r}, hc_eps={self.hc_eps}"
        return text
