"""The wide residual: one residual stream of width n·C with a learned dense read (n·C -> C) and write
(C -> n·C) per sublayer: the control every hyper-connection paper leaves out.

Per token, with the stream ``x ∈ R^{nC}`` (held as ``(n, C)`` like the streams of a hyper-connection)::

    x' = x + W F(R x)          R ∈ R^{C × nC},  W ∈ R^{nC × C}

Hyper-connections restrict ``R`` to ``H_pre ⊗ I_C`` and ``W`` to ``H_postᵀ ⊗ I_C`` (a scalar per stream) and add
``H_res``; here both are general linear maps and the stream is never mixed. It starts as the residual model, the
way the papers' gates start: ``R`` reads block ``layer_index mod n`` (``[0 … I … 0]``) and ``W`` writes the
output to every block (``[I; …; I]``), so the n blocks stay copies of the residual stream until training moves
them, and the reads of different layers, which differ, break that symmetry from the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...checks import check_int, check_streams
from ...counts import Count, count
from ..base import Connection, _stream_precision, call_branch, check_stream_tensor
from .base import ConnectionForm


class WideResidual(Connection):
    """The wide residual around one branch (module docstring). ``forward(x, branch, *args, **kwargs)``: ``x``
    ``(B, T, n, C)`` -> ``(B, T, n, C)``. Parameters ``read`` ``(C, nC)`` and ``write`` ``(nC, C)``, both
    token-independent matrices (``projections``: weight decay's "matrices" decays them)."""

    projections: tuple[str, ...] = ("read", "write")

    def __init__(self, dim: int, n_streams: int, layer_index: int = 0):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_streams("n_streams", n_streams)
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        eye = torch.eye(dim)
        read = torch.zeros(n_streams, dim, dim)
        read[layer_index % n_streams] = eye
        self.read = nn.Parameter(read.permute(1, 0, 2).reshape(dim, n_streams * dim))  # [0 … I … 0]
        self.write = nn.Parameter(eye.repeat(n_streams, 1))  # [I; …; I]

    @property
    def family(self) -> str:
        return WIDE_RESIDUAL.name

    def matrices(self, x: torch.Tensor, fused: bool | None = None) -> dict[str, torch.Tensor]:
        """What the stream diagnostics read, per token (the same for every token): ``pre`` ``(B, T, n)``, the norm
        ratio of each block of the read ``‖R_s‖_F / ‖[I]‖_F``; ``post`` ``(B, T, n)``, the same of the write;
        ``res`` the identity."""
        check_stream_tensor(x, self.n_streams, self.dim, self)
        n, c = self.n_streams, self.dim
        unit = c**0.5
        pre = self.read.detach().float().view(c, n, c).norm(dim=(0, 2)) / unit
        post = self.write.detach().float().view(n, c, c).norm(dim=(1, 2)) / unit
        shape = (*x.shape[:2], n)
        eye = torch.eye(n, device=x.device)
        return {"pre": pre.to(x.device).expand(shape), "post": post.to(x.device).expand(shape),
                "res": eye.expand(*x.shape[:2], n, n)}

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        check_stream_tensor(x, self.n_streams, self.dim, self)
        with _stream_precision(x):
            h = x.flatten(-2) @ self.read.to(x.dtype).T
        out = call_branch(branch, h, args, kwargs)  # the one part that runs under autocast
        with _stream_precision(x):
            return x + (out.to(x.dtype) @ self.write.to(x.dtype).T).unflatten(-1, (self.n_streams, self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}, layer_index={self.layer_index}"


class WideResidualForm(ConnectionForm):
    name = "wide-residual"
    summary = "one residual stream of width n·C, dense learned read and write per sublayer"
    min_streams = 2

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return WideResidual(dim, n_streams, layer_index)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """The read ``nC -> C`` and the write ``C -> nC`` (products) and the add (``nC``)."""
        return count(2 * n_streams * dim * dim * 2, n_streams * dim)


WIDE_RESIDUAL = WideResidualForm()
