"""The plain residual, ``x + F(x)``: one stream, no mixing (:class:`~s2hc.HyperConnection`, ``family="residual"``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..module import RESIDUAL as NAME
from ..module import HyperConnection
from .base import ConnectionForm


class ResidualForm(ConnectionForm):
    name = NAME
    summary = "the plain residual x + F(x): one stream"
    min_streams = max_streams = default_streams = 1
    stream_reductions = ("sum", "mean")
    stream_scaling = False
    mixes_streams = False
    compute_options = True  # HyperConnection's fused / recompute / kernels are accepted: one stream, nothing changes

    def check_streams(self, n_streams: int, argument: str = "n_streams") -> int:
        if isinstance(n_streams, int) and not isinstance(n_streams, bool) and n_streams > 1:
            raise ValueError(f"{argument} must be 1 for family='residual', got {n_streams}: several streams need "
                             "a multi-stream family (family='s2hc', 'mhc', ...; --family on the command line)")
        return super().check_streams(n_streams, argument)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        return HyperConnection(dim, n_streams, family=self.name, layer_index=layer_index, **options)

    def upcycle_refusal(self) -> str | None:
        return "it is the source's own family (one stream): there is nothing to upcycle"


RESIDUAL = ResidualForm()
