"""ZAYA's residual scaling: transformers' ``ZayaResidualScaling`` (``models/zaya``) <-> s2hc.

A ``ZayaResidualScaling(hidden_size)`` (a decoder layer's ``post_attention_residual_scale`` and
``post_mlp_residual_scale``) computes ``(F + b_F) ⊙ s_F + (residual + b_x) ⊙ s_x``, which is
``s2hc.connection.AffineResidual(dim)`` (the ``affine-residual`` family; docs/mixers.md, "Production designs") once the
parameters are renamed:

===================================  ==================================
transformers                         s2hc
===================================  ==================================
``hidden_states_scale`` ``(C,)``     ``branch_scale`` ``(C,)``
``hidden_states_bias`` ``(C,)``      ``branch_bias`` ``(C,)``
``residual_scale`` ``(C,)``          ``residual_scale`` ``(C,)``
``residual_bias`` ``(C,)``           ``residual_bias`` ``(C,)``
===================================  ==================================

ZAYA's model also scales and shifts its embeddings once (``model.input_hidden_states_scale`` and ``_bias``): that is
no connection and is not converted here. The state functions map dicts both ways as a pure renaming (a round trip
is exact; copies, dtypes kept); a missing, unexpected or misshapen tensor raises ValueError (one line) naming it.
Nothing here imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_int
from ..connection import Connection
from ..connection.forms.affine_residual import AFFINE_RESIDUAL, AffineResidual
from .one_stream import model_connections_from_hf, rename, setting

__all__ = [
    "DESIGN", "HF_NAMES", "LAYER_MODULES", "MODEL_TYPE", "connection_from_hf", "connection_options",
    "connection_state_from_hf", "connection_state_to_hf", "connection_to_hf", "model_scalings_from_hf",
]  # fmt: skip

#: transformers' ``model_type`` of the design.
MODEL_TYPE = "zaya"
DESIGN = "ZAYA"
#: transformers' tensor name -> s2hc's parameter name.
HF_NAMES = {"hidden_states_scale": "branch_scale", "hidden_states_bias": "branch_bias",
            "residual_scale": "residual_scale", "residual_bias": "residual_bias"}
#: a ``ZayaDecoderLayer``'s residual scalings after its attention and its MLP.
LAYER_MODULES = ("post_attention_residual_scale", "post_mlp_residual_scale")


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`AffineResidual` arguments for ``ZayaResidualScaling(hf_config.hidden_size)``: ``dim``."""
    return dict(dim=check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN)))


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """``ZayaResidualScaling``'s four vectors ``(C,)`` -> :class:`AffineResidual`'s, copies, dtypes kept.
    ``state``: a mapping or the module. Also maps gradients."""
    return rename(state, HF_NAMES, dim, to_hf=False, what=f"{DESIGN} residual scaling state")


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`."""
    return rename(state, HF_NAMES, dim, to_hf=True, what="s2hc affine-residual state")


def connection_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module,
                       layer_index: int = 0) -> AffineResidual:
    """A :class:`AffineResidual` computing what ``ZayaResidualScaling`` with parameters ``state`` computes;
    its parameters float32 copies (as built; ``.to(dtype)`` for another)."""
    dim = connection_options(hf_config)["dim"]
    connection = AffineResidual(dim, layer_index=layer_index)
    connection.load_state_dict(connection_state_from_hf(state, dim))
    return connection


def connection_to_hf(connection: AffineResidual, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """The four vectors for ``ZayaResidualScaling.load_state_dict`` from ``connection``, an
    :class:`AffineResidual` (anything else: ValueError), copies; with ``hf_config``, its ``hidden_size``
    must be the connection's ``dim`` (ValueError naming both)."""
    if not isinstance(connection, Connection) or connection.family != AFFINE_RESIDUAL.name:
        raise ValueError(f"connection must be an s2hc.connection.AffineResidual, got {type(connection).__name__}")
    if hf_config is not None and connection_options(hf_config)["dim"] != connection.dim:
        raise ValueError(f"the connection has dim={connection.dim}, but the {DESIGN} config's hidden_size is "
                         f"{connection_options(hf_config)['dim']}")
    return connection_state_to_hf(connection.state_dict(), connection.dim)


def model_scalings_from_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every residual scaling of a ZAYA state dict under s2hc's Transformer names
    (``...layers.{i}.post_attention_residual_scale.residual_bias`` -> ``blocks.{i}.attn_hc.residual_bias``)."""
    return model_connections_from_hf(state, LAYER_MODULES, HF_NAMES, f"{DESIGN} state")
