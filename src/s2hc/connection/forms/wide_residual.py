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

    def start(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R₀, W₀)``, the residual start (module docstring), float64 on the CPU."""
        n, c = self.n_streams, self.dim
        read = torch.zeros(c, n, c, dtype=torch.float64)
        read[:, self.layer_index % n] = torch.eye(c, dtype=torch.float64)
        return read.reshape(c, n * c), torch.eye(c, dtype=torch.float64).repeat(n, 1)

    @torch.no_grad()
    def measures(self) -> dict[str, Any]:
        """What the read map R (C × nC) and the write map W (nC × C) do: each block's share of each map's Frobenius
        norm (``read_share``, ``write_share``), the effective number of blocks exp of those shares' entropy (1: one
        block, n: all alike; it starts reading one block and writing all n), the largest and smallest singular
        values (``_sv_max``, ``_sv_min``; 1 for R and √n for W at the start) and ‖M − M₀‖_F / ‖M₀‖_F from the
        residual start (``_start_distance``)."""
        n, c = self.n_streams, self.dim
        read, write = self.read.detach().double().cpu(), self.write.detach().double().cpu()
        start_read, start_write = self.start()
        out: dict[str, Any] = {}
        for name, matrix, blocks, begin in (("read", read, read.view(c, n, c).norm(dim=(0, 2)), start_read),
                                             ("write", write, write.view(n, c, c).norm(dim=(1, 2)), start_write)):
            share = blocks / blocks.sum()
            singular = torch.linalg.svdvals(matrix)
            out[f"{name}_share"] = [float(v) for v in share]
            out[f"{name}_effective_blocks"] = float((-(share * share.clamp_min(1e-30).log()).sum()).exp())
            out[f"{name}_sv_max"], out[f"{name}_sv_min"] = float(singular.max()), float(singular.min())
            out[f"{name}_start_distance"] = float((matrix - begin).norm() / begin.norm())
        return out

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
    mixes_streams = False  # no residual matrix: its diagnostics are its maps (WideResidual.measures)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return WideResidual(dim, n_streams, layer_index)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """The read ``nC -> C`` and the write ``C -> nC`` (products) and the add (``nC``)."""
        return count(2 * n_streams * dim * dim * 2, n_streams * dim)


WIDE_RESIDUAL = WideResidualForm()
