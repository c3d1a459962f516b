"""Hugging Face ``transformers`` parity: configs and weights of Qwen3, Qwen2 / Qwen2.5, Gemma3 (text), GPT-2, Llama
and Mistral, both ways.

``config_from_hf`` maps a ``Qwen3Config``, ``Qwen2Config``, ``Gemma3TextConfig`` (or a ``Gemma3Config``, whose
text part is used), ``GPT2Config``, ``LlamaConfig`` or ``MistralConfig`` to a :class:`ModelConfig`;
``load_hf_state_dict`` copies the weights of the matching ``*ForCausalLM`` (``GPT2LMHeadModel``) into a
:class:`Transformer`, and ``to_hf_state_dict`` gives a residual model's weights under the Hugging Face names.
With ``family="residual"`` the two models then give the same logits (``tests/test_hf_parity.py``). With another
mixer the transformer weights are loaded the same way and the hyper-connections keep their initialisation
(``s2hc upcycle`` sets them so that the model keeps the source's function). None of these functions imports
``transformers``; they read the config's attributes, so a config loaded from a ``config.json`` works the same
way.

What each architecture reads and how its weights are named lives in its module of
:mod:`s2hc.hf.architectures`; this module only dispatches through that registry. Features outside this model
raise ValueError rather than convert approximately: RoPE scaling other than Llama 3's (Llama, Mistral), logit
soft-capping, bidirectional attention, Qwen's ``use_sliding_window`` and activations other than SiLU
(Qwen, Llama, Mistral) or tanh-GELU (Gemma, GPT-2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..connection import forms
from ..models import ModelConfig, Transformer
from . import architectures
from .architectures.common import WeightMap, get

__all__ = ["config_from_hf", "load_hf_state_dict", "to_hf_state_dict"]


def config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face config (object or ``config.json`` dict) of an architecture in
    :data:`s2hc.hf.architectures.REGISTRY`.

    ``overrides`` are applied last (e.g. ``family="s2hc", n_streams=4``). ValueError naming the allowed model
    types for another one, or naming a feature this model does not have.
    """
    architecture = architectures.get(get(hf_config, "model_type"))
    return ModelConfig.from_dict({**architecture.config_from_hf(hf_config), **overrides})


def _weights_of(config: ModelConfig) -> WeightMap:
    """The weight layout of a model of ``config``: the first architecture's whose map fits it."""
    for architecture in architectures.ARCHITECTURES:
        if architecture.weights.fits(config):
            return architecture.weights
    raise ValueError(f"no Hugging Face architecture has a model with pos={config.pos!r}, norm={config.norm!r}, "
                     f"mlp={config.mlp!r}; converted are {architectures.model_types()}")


@torch.no_grad()
def load_hf_state_dict(model: Transformer, hf_state_dict: Mapping[str, torch.Tensor]) -> Transformer:
    """Copy a Hugging Face ``*ForCausalLM`` (``GPT2LMHeadModel``) state dict of a registered architecture into
    ``model``; returns ``model``.

    ``model`` must have been built from :func:`config_from_hf` of the same config (or one of the same
    shapes). Every non-hyper-connection parameter must be supplied exactly once; ValueError listing the
    missing and unexpected keys otherwise, or naming a key whose shape differs. With tied embeddings an
    ``lm_head.weight`` entry is accepted if it equals the embedding (Hugging Face lists tied weights twice).
    Values are cast to the parameter's dtype and device.
    """
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be an s2hc.models.Transformer, got {type(model).__name__}")
    ours = model.state_dict(keep_vars=True)
    tied = model.config.tie_embeddings
    expected = {k for k in ours if "_hc." not in k} - ({"lm_head.weight"} if tied else set())
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    lm_head: tuple[str, torch.Tensor] | None = None
    for hf_name, target, value in _weights_of(model.config).to_ours(hf_state_dict, model.config):
        if tied and target == "lm_head.weight":
            lm_head = (hf_name, value)
        elif target is None or target not in expected or target in mapped:
            unexpected.append(hf_name)
        else:
            mapped[target] = value
    if lm_head is not None:
        embed = mapped.get("embed.weight")
        if embed is None or embed.shape != lm_head[1].shape or not torch.equal(embed, lm_head[1]):
            unexpected.append(f"{lm_head[0]} (an untied LM head for a model with tie_embeddings=True)")
    missing = sorted(expected - set(mapped))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {sorted(unexpected)}")
    for name, value in mapped.items():
        param = ours[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} in the state dict, {tuple(param.shape)} in the model")
        param.copy_(value.to(dtype=param.dtype, device=param.device))
    return model


def native_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config (its keys, ``model_type`` first) of a residual model ``config`` as a native
    transformers class: the first architecture that writes one (:attr:`Architecture.config_to_hf`) and reads it
    back as exactly ``config``'s model, so that the class computes what s2hc computes. ValueError naming the
    architectures tried for a model no native class holds (a family with streams, or a feature none writes)."""
    if forms.get(config.family) is not forms.RESIDUAL:
        raise ValueError(f"a native transformers class holds the residual model only, got family {config.family!r}; "
                         "export it without --native (as S2HCForCausalLM)")
    tried = []
    for architecture in architectures.ARCHITECTURES:
        if architecture.config_to_hf is None:
            continue
        tried.append(architecture.name)
        hf_config = architecture.config_to_hf(config)
        try:
            back = ModelConfig(**{**config.to_dict(), **architecture.config_from_hf(hf_config)})
        except ValueError:
            continue
        if back == config and architecture.weights.fits(config):
            return hf_config
    raise ValueError(f"no native transformers class computes this model (tried {tried}: each reads its config back "
                     "as another model); export it without --native (as S2HCForCausalLM)")


@torch.no_grad()
def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights of a residual ``model`` under the names of its Hugging Face text ``*ForCausalLM`` (the inverse of
    :func:`load_hf_state_dict`: GPT-2's ``Conv1D`` weights transposed back, its q, k, v merged into ``c_attn``;
    with tied embeddings ``lm_head.weight`` is listed too, as transformers lists it). Tensors are detached,
    on the model's device and dtype. ValueError for a model with hyper-connections (Hugging Face has no place
    for them; ``s2hc export`` writes such a model as ``S2HCForCausalLM``).
    """
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be an s2hc.models.Transformer, got {type(model).__name__}")
    if model.form is not forms.RESIDUAL:
        raise ValueError(f"to_hf_state_dict needs a residual model (no hyper-connections), got family "
                         f"{model.config.family!r}; export it with s2hc export instead")
    state = {name: value.detach() for name, value in model.state_dict().items()}
    return _weights_of(model.config).to_hf(state, model.config)
