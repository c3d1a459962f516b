"""A hyper-connection over a mixing family (:class:`~s2hc.HyperConnection`): one form per family of
:data:`s2hc.mixers.REGISTRY`, whose mathematics its :class:`~s2hc.mixers.Mixer` class declares."""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import mixers
from ..module import HyperConnection, _mixer_projection_width
from .base import ConnectionForm

# HyperConnection's own keywords (its RMSNorm epsilon; mixing with H_resᵀ; how its projection and its gates start),
# accepted beside the family's options.
HYPER_CONNECTION_OPTIONS = ("eps", "transpose_res", "projection_init", "gate_init")


class HyperConnectionForm(ConnectionForm):
    """The papers' connection, ``X' = H_res X + H_postᵀ F(H_pre X)``, with the constraint map of mixer ``name``."""

    compute_options = True
    coefficient_path = "paths"
    connection_options = HYPER_CONNECTION_OPTIONS

    def __init__(self, name: str):
        self.mixer = mixers.get(name)
        self.name = name
        self.summary = f"hyper-connection, H_res from the {name} family"

    def options(self) -> dict[str, Any]:
        return mixers.options(self.name)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        return HyperConnection(dim, n_streams, family=self.name, layer_index=layer_index, **options)

    def projection_width(self, n_streams: int, **options: Any) -> int | None:
        return _mixer_projection_width(mixers.build(self.name, n_streams, **options))

    def res_guarantees(self) -> mixers.Guarantees:
        return self.mixer.guarantees

    def upcycle_refusal(self) -> str | None:
        return self.mixer.upcycle_refusal()
