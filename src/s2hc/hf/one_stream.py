"""What the converters of the one-stream residuals of production models share (``s2hc.hf.muse_spark``, ``ergo``,
``zaya``, ``beam``): reading a config by attribute or key, renaming a connection's tensors both ways with every
tensor checked, and a whole model's connection tensors by layer.

Each of those modules declares its ``MODEL_TYPE`` (transformers' ``model_type``), ``DESIGN`` (how its messages
name it), ``HF_NAMES`` (transformers' tensor name -> s2hc's parameter name), ``LAYER_MODULES`` (a decoder layer's
attribute holding the attention's and the MLP's connection) and the options of the s2hc form that computes it.
Nothing here imports ``transformers``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .deepseek_v4 import _as_state, _checked


def text_config(hf_config: Any) -> Any:
    """The settings' holder: ``hf_config``'s ``text_config`` (a multimodal config or its dict), else itself."""
    nested = hf_config.get("text_config") if isinstance(hf_config, Mapping) else getattr(hf_config, "text_config", None)
    return hf_config if nested is None else nested


def setting(hf_config: Any, name: str, design: str, default: Any = None) -> Any:
    """Setting ``name`` of ``hf_config`` (its ``text_config`` if it has one), ``default`` where it has none;
    ValueError naming the design and the setting when there is neither."""
    text = text_config(hf_config)
    value = text.get(name) if isinstance(text, Mapping) else getattr(text, name, None)
    if value is None and default is None:
        raise ValueError(f"the {design} config has no {name!r}")
    return default if value is None else value


def rename(state: Mapping[str, torch.Tensor] | nn.Module, names: Mapping[str, str], dim: int, *, to_hf: bool,
           what: str) -> dict[str, torch.Tensor]:
    """``state`` with every tensor ``(dim,)`` of ``names`` (transformers' -> s2hc's) renamed one way (``to_hf``:
    s2hc's to transformers'), checked and copied, dtypes kept; ValueError (one line) naming the first tensor
    missing, unexpected or misshapen."""
    given = {ours: ours for ours in names.values()} if to_hf else dict(names)
    sizes = f"dim C={dim}" if to_hf else f"hidden_size C={dim}"
    checked = _checked(_as_state(state), {key: (dim,) for key in given}, what, sizes)
    if to_hf:
        return {hf: checked[ours].clone() for hf, ours in names.items()}
    return {ours: checked[hf].clone() for hf, ours in names.items()}


#: A decoder layer's tensor in a causal LM's (or its text model's) state dict: its prefix, layer and the rest.
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<rest>.+)$")


def model_connections_from_hf(state: Mapping[str, torch.Tensor], layer_modules: tuple[str, str],
                              names: Mapping[str, str], what: str) -> dict[str, torch.Tensor]:
    """Every connection tensor of a model's state dict (``model.layers.{i}.{module}.{name}``, any prefix before
    ``layers``) under s2hc's :class:`~s2hc.models.Transformer` names (``blocks.{i}.attn_hc.{ours}``,
    ``blocks.{i}.mlp_hc.{ours}``), copies; the other tensors are left out. ``layer_modules``: the decoder layer's
    attributes of the attention's and the MLP's connection. ValueError when a layer has one of a connection's
    tensors without the others."""
    slots = dict(zip(layer_modules, ("attn_hc", "mlp_hc")))
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LAYER.match(key)
        if match is None:
            continue
        module, _, name = match["rest"].rpartition(".")
        if module in slots and name in names:
            found[f"blocks.{match['layer']}.{slots[module]}.{names[name]}"] = value.detach().clone()
    per_connection: dict[str, set[str]] = {}
    for key in found:
        connection, _, name = key.rpartition(".")
        per_connection.setdefault(connection, set()).add(name)
    for connection, present in sorted(per_connection.items()):
        missing = sorted(set(names.values()) - present)
        if missing:
            raise ValueError(f"{what}: {connection} has {sorted(present)} but not {missing}")
    return found
