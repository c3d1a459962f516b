"""The plain residual, ``x + F(x)``: one stream, no mixing (:class:`ResidualConnection`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...checks import check_int, check_streams
from ..base import Connection, call_branch, check_stream_tensor
from .base import OneStreamForm, count

NAME = "residual"


class ResidualConnection(Connection):
    """``x + F(x)`` around one branch, on one stream held as the streams of every other form: ``forward(x, branch,
    *args, **kwargs)``, ``x`` ``(B, T, 1, C)`` -> ``(B, T, 1, C)``, the branch given ``(B, T, C)``. No parameters.

    It takes the compute options every hyper-connection takes (:meth:`set_options`) and ignores them: with one
    stream there is one way to add, so a run's ``fused`` or ``kernels`` setting applies to every family alike."""

    family = NAME

    def __init__(self, dim: int, n_streams: int = 1, layer_index: int = 0):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_streams("n_streams", n_streams)
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        RESIDUAL.check_streams(n_streams)

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        return self  # one stream: every compute option computes x + F(x) the same way

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        check_stream_tensor(x, 1, self.dim, self)
        return x + call_branch(branch, x.squeeze(-2), args, kwargs).unsqueeze(-2)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, layer_index={self.layer_index}"


class ResidualForm(OneStreamForm):
    name = NAME
    summary = "the plain residual x + F(x): one stream"

    def check_streams(self, n_streams: int, argument: str = "n_streams") -> int:
        if isinstance(n_streams, int) and not isinstance(n_streams, bool) and n_streams > 1:
            raise ValueError(f"{argument} must be 1 for family='residual', got {n_streams}: several streams need "
                             "a multi-stream family (family='s2hc', 'mhc', ...; --family on the command line)")
        return super().check_streams(n_streams, argument)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return ResidualConnection(dim, n_streams, layer_index)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any):
        return count(0, dim)  # one add per channel

    def upcycle_refusal(self) -> str | None:
        return "it is the source's own family (one stream): there is nothing to upcycle"


RESIDUAL = ResidualForm()
