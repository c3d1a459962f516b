"""Qwen's gated residual (:class:`~s2hc.GatedResidual`, its final read :class:`~s2hc.GatedHead`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..gated import GATED_RESIDUAL as NAME
from ..gated import GATED_RESIDUAL_OPTIONS, GatedHead, GatedResidual, check_rank
from .base import ConnectionForm


class GatedResidualForm(ConnectionForm):
    name = NAME
    summary = "Qwen's gated residual: per-channel read gates, H_res = I"
    min_streams = 2
    pre_norms = False  # its read is normalised already
    default_stream_reduce = "head"
    compute_options = False
    coefficient_path = "one path"
    connection_options = ("eps",)
    option_kinds = {"rank": {"int"}, "eps": {"float"}}

    def options(self) -> dict[str, Any]:
        return dict(GATED_RESIDUAL_OPTIONS)

    def check_sizes(self, options: Mapping[str, Any], *, dim: int, n_streams: int, n_sublayers: int) -> None:
        if "rank" in options:
            check_rank(options["rank"], n_streams, dim, f"family option 'rank' of {self.name!r}")

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return GatedResidual(dim, n_streams, layer_index=layer_index, **options)

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        return GatedHead(dim, n_streams, **options)

    def replaces_final_norm(self, stream_reduce: str) -> bool:
        return stream_reduce == "head"  # Qwen's gated read is normalised (its own RMSNorm with 1 + w)

    def upcycle_refusal(self) -> str | None:
        return ("its gates start random, so its start is not the source's function; the start that is (zero gate "
                "projections) keeps the streams identical copies under every gradient step")


GATED_RESIDUAL = GatedResidualForm()
