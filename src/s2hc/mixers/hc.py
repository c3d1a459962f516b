"""``hc``: unconstrained Hyper-Connections (Zhu et al., arXiv 2409.19606)."""

from __future__ import annotations

import torch
from torch import nn

from ..counts import Count, count
from .base import Guarantees, Mixer, scale_parameter

PROJECTIONS = ("per-stream", "flat")
#: ``hold_sums``: which sums of ``H_res`` are held to 1 (an ablation; the HC paper holds none).
HELD_SUMS = ("none", "rows", "columns", "both")


class HCMixer(Mixer):
    """``H_res = B + α · tanh(d)`` with a learnable static ``B`` (initialised to ``I``). K = n².

    Nothing bounds the result: products over depth may amplify (the instability mHC was made for).
    As in HC, the connection's ``H_pre``/``H_post`` are tanh-based too (``gate = "tanh"``).
    Input ``(..., n²)`` read row-major; output ``(..., n, n)``.

    ``projection`` says how the connection computes ``d`` (the mixer itself is the same map):

    - ``"per-stream"`` (default; the HC paper's dynamic HC and lucidrains' ``hyper-connections``): each
      stream is normalised on its own (RMSNorm over C, one weight shared by the streams) and projected by
      one shared ``W ∈ R^{C × (2 + n)}`` to its read weight, its write weight and its row of ``A_r``; the
      connection applies ``H_res = A_rᵀ`` (stream s's row says where stream s goes).
    - ``"flat"``: mHC's form, one RMSNorm over all n·C features and ``W ∈ R^{nC × (2n + n²)}``, which lets
      each coefficient see every stream; the form every other family uses, so ``hc`` can be compared with
      them with only the constraint changed.

    ``hold_sums`` (an ablation, not the paper's HC: default ``"none"``) removes HC's common-mode gain
    ``1ᵀH1/n`` (what it does to a feature every stream shares, which the mean-preserving families hold at 1)
    and nothing else: the matrix is projected (Frobenius-nearest) onto the affine set whose ``"rows"`` sum to 1
    (``H + (1 − H1)1ᵀ/n``: copies of one feature stay copies of it), whose ``"columns"`` sum to 1
    (``H + 1(1ᵀ − 1ᵀH)/n``: the streams' mean is preserved) or ``"both"`` (``PHP + J``, ``P = I − J``: the
    sums of s²HC and mHC, with no bound on the norm). ``I`` is in every set, so the start is HC's own.
    """

    name = "hc"
    guarantees = Guarantees()
    gate = "tanh"

    @classmethod
    def upcycle_refusal(cls) -> str:
        """Refused: it would match the source at step 0 only because ``H_res`` starts at ``I``."""
        return ("its H_res is unconstrained, so nothing keeps its columns summing to 1 and the streams' sum stops "
                "following the source's residual stream")

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        return n_streams * n_streams, count(0, 3 * n_streams * n_streams)  # B + α tanh(d)

    def __init__(self, n_streams: int, alpha: float = 0.01, projection: str = "per-stream", hold_sums: str = "none"):
        super().__init__(n_streams)
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {projection!r}")
        if hold_sums not in HELD_SUMS:
            raise ValueError(f"hold_sums must be one of {list(HELD_SUMS)}, got {hold_sums!r}")
        self.projection = projection
        self.hold_sums = hold_sums
        self.num_inputs = n_streams * n_streams
        self.alpha = scale_parameter(alpha)
        self.bias = nn.Parameter(torch.eye(n_streams))

    @classmethod
    def projects_per_stream(cls, **family_options: object) -> bool:
        return family_options.get("projection", "per-stream") == "per-stream"

    @property
    def per_stream(self) -> bool:
        """Whether the connection projects each stream on its own (read by :class:`s2hc.HyperConnection`)."""
        return self.projects_per_stream(projection=self.projection)

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:
        n = self.n_streams
        alpha, bias = self.alpha.to(d_res.dtype), self.bias.to(d_res.dtype)
        H = bias + alpha * torch.tanh(d_res).unflatten(-1, (n, n))
        if self.hold_sums in ("rows", "both"):
            H = H - (H.sum(-1, keepdim=True) - 1) / n
        if self.hold_sums in ("columns", "both"):  # after the rows' step the row sums stay 1: 1ᵀH1 = n
            H = H - (H.sum(-2, keepdim=True) - 1) / n
        return H

    def extra_repr(self) -> str:
        held = f", hold_sums={self.hold_sums!r}" if self.hold_sums != "none" else ""
        return f"{super().extra_repr()}, projection={self.projection!r}{held}"
