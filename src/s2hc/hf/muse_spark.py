"""Muse Spark's residual gate: transformers' ``MuseSparkResidualGate`` (``models/muse_spark``) <-> s2hc.

A ``MuseSparkResidualGate(config)`` (a text decoder layer's ``post_attention_residual_gate`` and
``post_feedforward_residual_gate``) computes, with ``w`` its ``gate`` ``(C,)`` and ``τ`` the config's
``residual_gate_temperature``::

    β = σ(w/τ),  α = √max(σ(−w/τ)(1 + β), 10⁻³),  out = (α ⊙ residual + β ⊙ F).to(residual.dtype)

which is ``s2hc.connection.VPResidual(dim, gate="learned", temperature=τ, alpha="clamped", alpha_floor=1e-3)``: the
defaults of the ``vp-residual`` family (docs/mixers.md, "Production designs"). The gate is kept in float32
(``_keep_in_fp32_modules_strict``) and drawn N(0, initializer_range²); the branch ``F`` is the post-normed
sublayer (``post_attention_layernorm``, ``post_feedforward_layernorm``), which s2hc's ``post_norms`` holds.

==============================  ==============================
transformers                    s2hc
==============================  ==============================
``gate`` ``(C,)``               ``gate`` ``(C,)``
``residual_gate_temperature``   ``temperature``
``residual_gate_eps`` (1e-3,    ``alpha_floor``
the module's default)
``initializer_range``           ``init_std``
==============================  ==============================

The state functions map dicts both ways as a pure renaming (a round trip is exact; copies, dtypes kept); a
missing, unexpected or misshapen tensor raises ValueError (one line) naming it. Nothing here imports
``transformers``: configs are read by attribute or key (a ``config.json`` read as a dict works; a
``MuseSparkConfig``'s ``text_config`` is read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_float, check_int
from ..connection import Connection
from ..connection.forms.vp_residual import VP_RESIDUAL, VPResidual
from .one_stream import model_connections_from_hf, rename, setting

__all__ = [
    "DESIGN", "HF_NAMES", "LAYER_MODULES", "MODEL_TYPE", "RESIDUAL_GATE_EPS", "connection_from_hf",
    "check_vp", "connection_options", "connection_state_from_hf", "connection_state_to_hf", "connection_to_hf",
    "model_gates_from_hf",
]  # fmt: skip

#: transformers' ``model_type`` of the design.
MODEL_TYPE = "muse_spark"
DESIGN = "Muse Spark"
#: transformers' tensor name -> s2hc's parameter name.
HF_NAMES = {"gate": "gate"}
#: a ``MuseSparkTextDecoderLayer``'s gates around its attention and its MLP.
LAYER_MODULES = ("post_attention_residual_gate", "post_feedforward_residual_gate")
#: ``MuseSparkResidualGate``'s ``residual_gate_eps`` (an argument no config sets): the floor of α².
RESIDUAL_GATE_EPS = 1e-3


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`VPResidual` arguments that compute what ``MuseSparkResidualGate(hf_config)`` computes:
    ``dim``, ``gate``, ``temperature``, ``alpha``, ``alpha_floor``, ``gate_init``, ``init_std``, each checked under
    its transformers name."""
    return dict(
        dim=check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN)),
        gate="learned",
        temperature=check_float("residual_gate_temperature",
                                setting(hf_config, "residual_gate_temperature", DESIGN), positive=True),
        alpha="clamped",
        alpha_floor=RESIDUAL_GATE_EPS,
        gate_init="normal",
        init_std=check_float("initializer_range", setting(hf_config, "initializer_range", DESIGN, 0.02),
                             minimum=0.0),
    )


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """``MuseSparkResidualGate``'s ``gate`` ``(C,)`` -> :class:`VPResidual`'s ``gate``, a copy, dtype kept.
    ``state``: a mapping or the module. Also maps gradients."""
    return rename(state, HF_NAMES, dim, to_hf=False, what=f"{DESIGN} residual gate state")


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`."""
    return rename(state, HF_NAMES, dim, to_hf=True, what="s2hc vp-residual state")


def connection_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0,
                       sublayer: int = 0) -> VPResidual:
    """A :class:`VPResidual` computing what ``MuseSparkResidualGate(hf_config)`` with parameters ``state``
    computes (its gate a float32 copy, as transformers keeps it)."""
    options = connection_options(hf_config)
    connection = VPResidual(layer_index=layer_index, sublayer=sublayer, **options)
    connection.load_state_dict(connection_state_from_hf(state, options["dim"]))
    return connection


def connection_to_hf(connection: VPResidual, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``gate`` for ``MuseSparkResidualGate.load_state_dict`` from ``connection``, a learned-gate
    :class:`VPResidual` (anything else: ValueError), a copy. With ``hf_config``, every option must match
    what :func:`connection_options` reads (ValueError naming the first that differs)."""
    check_vp(connection, connection_options(hf_config) if hf_config is not None else {"gate": "learned"}, DESIGN)
    return connection_state_to_hf(connection.state_dict(), connection.dim)


def check_vp(connection: object, expected: Mapping[str, Any], design: str) -> None:
    """ValueError unless ``connection`` is an :class:`VPResidual` whose options are ``expected``'s (those that
    change what it computes: ``gate_init``, ``init_std`` only start it)."""
    if not isinstance(connection, Connection) or connection.family != VP_RESIDUAL.name:
        raise ValueError(f"connection must be an s2hc.connection.VPResidual, got {type(connection).__name__}")
    actual = {"dim": connection.dim, "gate": connection.gate_kind, "temperature": connection.temperature,
              "alpha": connection.alpha_kind, "alpha_floor": connection.alpha_floor}
    for key, value in expected.items():
        if key in actual and actual[key] != value:
            raise ValueError(f"the connection has {key}={actual[key]!r}, but {design} computes {key}={value!r}")


def model_gates_from_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every residual gate of a Muse Spark state dict under s2hc's Transformer names
    (``...layers.{i}.post_attention_residual_gate.gate`` -> ``blocks.{i}.attn_hc.gate``), copies."""
    return model_connections_from_hf(state, LAYER_MODULES, HF_NAMES, f"{DESIGN} state")
