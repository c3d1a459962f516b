"""Beam's depth-scaled residual add: transformers' ``depth_scaled_residual_add`` (``models/beam``) <-> s2hc.

A ``BeamDecoderLayer(config, layer_idx)`` adds its attention's output with ``residual_add_idx = 2·(layer_idx + 1)``
and its MLP's with the next index, ``i``::

    out = F · (1/√i) + residual · √((i − 1)/i)

the variance-preserving residual with its weights fixed by depth: ``s2hc.connection.VPResidual(dim, gate="depth",
sublayer=i − 2)`` (the ``vp-residual`` family with ``gate="depth"``; s2hc's sublayers count from 0 with attention
``2·layer`` and the MLP ``2·layer + 1``, so the embedding is Beam's first add). It has no parameters: the state
functions map the empty state both ways and refuse any tensor (ValueError, one line). Nothing here imports
``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_int
from ..connection.forms.vp_residual import VPResidual
from .muse_spark import check_vp
from .one_stream import rename, setting

__all__ = [
    "DESIGN", "MODEL_TYPE", "connection_from_hf", "connection_options", "connection_state_from_hf",
    "connection_state_to_hf", "connection_to_hf", "residual_add_idx", "sublayer_of",
]  # fmt: skip

#: transformers' ``model_type`` of the design.
MODEL_TYPE = "beam"
DESIGN = "Beam"


def residual_add_idx(sublayer: int) -> int:
    """Beam's ``residual_add_idx`` of s2hc's sublayer ``sublayer`` (attention ``2·layer``, MLP ``2·layer + 1``)."""
    return check_int("sublayer", sublayer, minimum=0) + 2


def sublayer_of(add_idx: int) -> int:
    """s2hc's sublayer of Beam's ``residual_add_idx`` (at least 2: the embedding is the first add)."""
    return check_int("residual_add_idx", add_idx, minimum=2) - 2


def connection_options(hf_config: Any, add_idx: int) -> dict[str, Any]:
    """The :class:`VPResidual` arguments that compute Beam's ``depth_scaled_residual_add`` at
    ``residual_add_idx = add_idx``: ``dim`` (``hidden_size``), ``gate="depth"``, ``sublayer``."""
    return dict(dim=check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN)), gate="depth",
                sublayer=sublayer_of(add_idx))


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """The empty state (Beam's add has no parameters): ValueError naming any tensor given."""
    return rename(state, {}, dim, to_hf=False, what=f"{DESIGN} residual add state")


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """The empty state: ValueError naming any tensor given (a learned gate has none in Beam)."""
    return rename(state, {}, dim, to_hf=True, what="s2hc vp-residual state (gate='depth')")


def connection_from_hf(hf_config: Any, add_idx: int, state: Mapping[str, torch.Tensor] | nn.Module | None = None,
                       layer_index: int | None = None) -> VPResidual:
    """A :class:`VPResidual` computing Beam's add at ``residual_add_idx = add_idx`` (``layer_index`` defaults
    to the decoder layer's, ``(add_idx − 2) // 2``)."""
    options = connection_options(hf_config, add_idx)
    connection_state_from_hf({} if state is None else state, options["dim"])
    layer = options["sublayer"] // 2 if layer_index is None else layer_index
    return VPResidual(layer_index=layer, **options)


def connection_to_hf(connection: VPResidual, hf_config: Any | None = None) -> dict[str, Any]:
    """What Beam needs of ``connection``, a depth-gated :class:`VPResidual` (anything else: ValueError):
    ``{"residual_add_idx": i}``, the add it computes (its state is empty); with ``hf_config``, its
    ``hidden_size`` must be the connection's ``dim``."""
    dim = getattr(connection, "dim", None)
    hidden = {"hidden_size": dim if hf_config is None else setting(hf_config, "hidden_size", DESIGN)}
    check_vp(connection, {"dim": hidden["hidden_size"], "gate": "depth"}, DESIGN)
    connection_state_to_hf(connection.state_dict(), connection.dim)
    return {"residual_add_idx": residual_add_idx(connection.sublayer)}
