"""Ergo's residual gate: transformers' ``ErgoResidualGate`` (``models/ergo``) <-> s2hc.

An ``ErgoResidualGate(config)`` (a decoder layer's ``attention_residual_gate`` and ``feedforward_residual_gate``)
computes, with ``w`` its ``weight`` ``(C,)`` (float32, stored zero)::

    β = σ(w),  α = √(1 + β) · exp(−softplus(w)/2),  out = β ⊙ F + α ⊙ residual

``α = √(1 − β²)`` written another way: Muse Spark's gate (``s2hc.hf.muse_spark``) without its temperature
(``τ = 1``) and without its floor on α. It is ``s2hc.connection.VPResidual(dim, gate="learned", temperature=1.0,
alpha="softplus", alpha_floor=0.0, gate_init="zeros")`` (docs/mixers.md, "Production designs"). The stream is
float32 throughout an Ergo model (its embedding, norms and gates are kept in float32), and nothing casts the
output back; s2hc writes the streams' dtype, the same for a float32 stream.

=====================  ====================
transformers           s2hc
=====================  ====================
``weight`` ``(C,)``    ``gate`` ``(C,)``
=====================  ====================

The state functions map dicts both ways as a pure renaming (a round trip is exact; copies, dtypes kept); a
missing, unexpected or misshapen tensor raises ValueError (one line) naming it. Nothing here imports
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
from .one_stream import model_connections_from_hf, rename, setting

__all__ = [
    "DESIGN", "HF_NAMES", "LAYER_MODULES", "MODEL_TYPE", "connection_from_hf", "connection_options",
    "connection_state_from_hf", "connection_state_to_hf", "connection_to_hf", "model_gates_from_hf",
]  # fmt: skip

#: transformers' ``model_type`` of the design.
MODEL_TYPE = "ergo"
DESIGN = "Ergo"
#: transformers' tensor name -> s2hc's parameter name.
HF_NAMES = {"weight": "gate"}
#: an ``ErgoDecoderLayer``'s gates around its attention and its MLP.
LAYER_MODULES = ("attention_residual_gate", "feedforward_residual_gate")
#: What ``save_pretrained`` and the released checkpoints hold instead (transformers' conversion mapping for "ergo"
#: renames them on load): the layer's modules and their tensor -> transformers' tensor name.
CHECKPOINT_MODULES = ("post_attention_residual", "post_ffn_residual")
CHECKPOINT_NAMES = {"scale": "weight"}


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`VPResidual` arguments that compute what ``ErgoResidualGate(hf_config)`` computes: ``dim``
    (``hidden_size``) and Ergo's fixed conventions (no temperature, no floor, the softplus form, zero start)."""
    return dict(dim=check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN)), gate="learned",
                temperature=1.0, alpha="softplus", alpha_floor=0.0, gate_init="zeros")


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """``ErgoResidualGate``'s ``weight`` ``(C,)`` -> :class:`VPResidual`'s ``gate``, a copy, dtype kept.
    ``state``: a mapping or the module. Also maps gradients."""
    return rename(state, HF_NAMES, dim, to_hf=False, what=f"{DESIGN} residual gate state")


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`: ``gate`` -> ``weight``."""
    return rename(state, HF_NAMES, dim, to_hf=True, what="s2hc vp-residual state")


def connection_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0,
                       sublayer: int = 0) -> VPResidual:
    """A :class:`VPResidual` computing what ``ErgoResidualGate(hf_config)`` with parameters ``state``
    computes (its gate a float32 copy)."""
    options = connection_options(hf_config)
    connection = VPResidual(layer_index=layer_index, sublayer=sublayer, **options)
    connection.load_state_dict(connection_state_from_hf(state, options["dim"]))
    return connection


def connection_to_hf(connection: VPResidual, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``weight`` for ``ErgoResidualGate.load_state_dict`` from ``connection``, an :class:`VPResidual` with
    Ergo's conventions (ValueError naming the first option that differs, or for any other module), a copy; with
    ``hf_config``, its ``hidden_size`` must be the connection's ``dim``."""
    expected = connection_options(hf_config if hf_config is not None else {"hidden_size": getattr(connection, "dim",
                                                                                                  1)})
    check_vp(connection, expected, DESIGN)
    return connection_state_to_hf(connection.state_dict(), connection.dim)


def model_gates_from_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every residual gate of an Ergo state dict under s2hc's Transformer names
    (``...layers.{i}.attention_residual_gate.weight`` -> ``blocks.{i}.attn_hc.gate``), copies."""
    return model_connections_from_hf(state, LAYER_MODULES, HF_NAMES, f"{DESIGN} state")
