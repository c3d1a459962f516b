"""What the architectures share: the :class:`Architecture` record, config reading helpers, the Llama-style weights.

A Hugging Face config is read by attribute or by key (:func:`get`), so a ``transformers`` config object and a
``config.json`` loaded as a dict convert alike. Weight maps turn a Hugging Face state dict into ``(HF name,
our name or None, tensor)`` triples (None: a tensor this model has no place for, reported as unexpected) and
an s2hc state dict back into Hugging Face names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...models import ModelConfig
from ...models.model_config import ROPE_SCALINGS

Triple = tuple[str, str | None, torch.Tensor]  # (HF name, our name or None, tensor)


class WeightMap(Protocol):
    """Parameter names both ways between a Hugging Face ``*ForCausalLM`` and an s2hc ``Transformer``."""

    def fits(self, config: ModelConfig) -> bool:
        """Whether a model of ``config`` has this map's layout (chooses the map from a model alone)."""

    def to_ours(self, hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> Iterator[Triple]:
        """``(HF name, our name or None, tensor)`` for every tensor worth loading (buffers skipped)."""

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """The Hugging Face state dict of an s2hc residual model's ``state_dict`` (tied heads listed twice)."""


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture s2hc converts.

    ``model_types``: the ``config.json`` model types it reads (the first is its name). ``preset``: the s2hc
    preset an upcycled run records (every setting is in its ``model_overrides``; the preset only names it).
    ``config_from_hf(hf_config)``: the :class:`ModelConfig` fields of a Hugging Face config; ValueError for a
    feature this model does not have. ``weights``: the parameter names both ways. ``tokenizer``: what
    ``s2hc upcycle`` uses when the model directory has no ``tokenizer.json`` (None: the user must name one).
    ``config_to_hf(config)``: the other way, the Hugging Face config's keys for a residual model of this
    architecture (``s2hc export --native``); None where s2hc writes none.
    """

    model_types: tuple[str, ...]
    preset: str
    config_from_hf: Callable[[Any], dict[str, Any]]
    weights: WeightMap
    tokenizer: str | None = None
    config_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        return self.model_types[0]


# ---- reading a config --------------------------------------------------------------------------------------


def get(hf_config: Any, name: str, default: Any = None) -> Any:
    """``hf_config.name`` of a ``transformers`` config, or ``hf_config[name]`` of a ``config.json`` dict."""
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def required(hf_config: Any, name: str) -> Any:
    """``hf_config[name]``; ValueError naming the key when it is missing or null (a config.json written by hand
    or cut short), rather than a TypeError from the arithmetic on it."""
    value = get(hf_config, name)
    if value is None:
        raise ValueError(f"the Hugging Face config has no {name!r} (a {get(hf_config, 'model_type')} config "
                         "needs it to convert)")
    return value


def check_activation(hf_config: Any, allowed: tuple[str, ...], what: str, *names: str) -> None:
    """ValueError unless the first of ``names`` the config sets (default: ``allowed[0]``) is in ``allowed``."""
    value = next((get(hf_config, n) for n in names if get(hf_config, n) is not None), allowed[0])
    if value not in allowed:
        raise ValueError(f"{names[0]} must be {allowed[0]!r} ({what}) to convert, got {value!r}")


def check_full_attention(hf_config: Any) -> None:
    """ValueError when a config (Qwen's) asks for sliding-window layers, which its converter does not build."""
    if get(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True (Qwen's bottom-layer window layout) is not supported")
    layer_types = get(hf_config, "layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types must all be 'full_attention', got {layer_types}")


def rope(hf_config: Any, layer_type: str | None = None, legacy: str = "rope_theta",
         scalings: tuple[str, ...] = ()) -> tuple[float, dict[str, Any] | None]:
    """``(RoPE base, ModelConfig.rope_scaling)`` of ``layer_type`` layers, from ``rope_parameters``
    (transformers 5) or the legacy ``rope_theta`` (``legacy``) and ``rope_scaling`` attributes.

    ``scalings``: the rope types besides ``"default"`` the architecture accepts (Llama's ``"llama3"``); any
    other type, or a partial rotation, is a ValueError naming it.
    """
    params = get(hf_config, "rope_parameters")
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if params and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = get(hf_config, legacy), get(hf_config, "rope_scaling") or {}
        if theta is None:
            raise ValueError(f"the Hugging Face config has no RoPE base ({legacy} / rope_parameters)")
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be an object (the RoPE scaling's settings), got {scaling!r}")
    partial = scaling.get("partial_rotary_factor", get(hf_config, "partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0 (RoPE on every feature) to convert, got {partial!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # "type": configs before 4.45
    if rope_type == "default":
        return float(theta), None
    if rope_type not in scalings:
        allowed = f"one of {['default', *scalings]}" if scalings else "'default' (no RoPE scaling)"
        raise ValueError(f"rope_type must be {allowed} to convert, got {rope_type!r}")
    keys = ROPE_SCALINGS[rope_type]
    missing = [k for k in keys if scaling.get(k) is None]
    if missing:
        raise ValueError(f"the Hugging Face config's {rope_type!r} RoPE scaling has no {missing}")
    return float(theta), {"rope_type": rope_type, **{k: scaling[k] for k in keys}}


def llama_shapes(hf_config: Any) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every Llama-style config (Llama, Mistral, Qwen, Gemma3) states alike:
    shapes, RMSNorm, RoPE positions, tied embeddings."""
    n_heads = required(hf_config, "num_attention_heads")
    dim = required(hf_config, "hidden_size")
    if not isinstance(n_heads, int) or not isinstance(dim, int) or n_heads < 1:
        raise ValueError(f"hidden_size and num_attention_heads must be integers >= 1, got {dim!r} and {n_heads!r}")
    return dict(
        vocab_size=required(hf_config, "vocab_size"),
        dim=dim,
        n_layers=required(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=get(hf_config, "num_key_value_heads") or n_heads,
        head_dim=get(hf_config, "head_dim") or dim // n_heads,
        ffn_dim=required(hf_config, "intermediate_size"),
        max_seq_len=required(hf_config, "max_position_embeddings"),
        norm="rmsnorm",
        norm_eps=required(hf_config, "rms_norm_eps"),
        pos="rope",
        tie_embeddings=bool(get(hf_config, "tie_word_embeddings", False)),
    )


def llama_shapes_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The inverse of :func:`llama_shapes` (and the RoPE base): the keys every Llama-style config states alike."""
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
        "rope_theta": config.rope_theta,
    }


# ---- the Llama-style weights (Llama, Mistral, Qwen2, Qwen3, Gemma3) ---------------------------------------

_IGNORED = re.compile(r".*(rotary_emb\.(original_)?inv_freq|embed_scale)$")  # buffers, recomputed here
_HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_OUR_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")
_SIMPLE = {"embed_tokens.weight": "embed.weight", "norm.weight": "norm.weight"}
_PREFIXES = ("model.language_model.", "model.")  # Gemma3's multimodal model, then every *ForCausalLM


def _norms(post_norms: bool) -> dict[str, str]:
    """HF norm module -> ours. Llama's ``post_attention_layernorm`` is the MLP's pre-norm; with Gemma3's
    sandwich norms (``post_norms``) it is the attention's post-norm and the MLP has a ``pre_feedforward`` one."""
    if post_norms:
        return {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}
    return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def _strip_prefix(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


@dataclass(frozen=True)
class LlamaWeights:
    """``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}``,
    ``model.norm``, ``lm_head``: the same names as ours inside the attention and the MLP."""

    def fits(self, config: ModelConfig) -> bool:
        return config.pos == "rope" and config.norm == "rmsnorm" and config.mlp in ("swiglu", "geglu")

    def our_name(self, hf_name: str, post_norms: bool) -> str | None:
        """Our parameter name for the Hugging Face parameter ``hf_name``, or None when there is none."""
        if hf_name == "lm_head.weight":
            return hf_name
        name = _strip_prefix(hf_name)
        if name in _SIMPLE:
            return _SIMPLE[name]
        match = _HF_LAYER.fullmatch(name)
        if match is None:
            return None
        layer, rest = match.groups()
        module, _, leaf = rest.rpartition(".")
        norms = _norms(post_norms)
        if module in norms:
            return f"blocks.{layer}.{norms[module]}.{leaf}"
        if module.startswith("self_attn."):
            return f"blocks.{layer}.attn.{module.removeprefix('self_attn.')}.{leaf}"
        if module.startswith("mlp."):
            return f"blocks.{layer}.{module}.{leaf}"
        return None

    def hf_name(self, name: str, post_norms: bool) -> str:
        """The Hugging Face name of our parameter ``name`` (a text ``*ForCausalLM``'s)."""
        if name == "lm_head.weight":
            return name
        simple = {ours: hf for hf, ours in _SIMPLE.items()}
        if name in simple:
            return f"model.{simple[name]}"
        match = _OUR_LAYER.fullmatch(name)
        if match is None:
            raise ValueError(f"{name!r} has no Hugging Face counterpart")
        layer, rest = match.groups()
        module, _, leaf = rest.partition(".")
        norms = {ours: hf for hf, ours in _norms(post_norms).items()}
        if module in norms:
            return f"model.layers.{layer}.{norms[module]}.{leaf}"
        if module == "attn":
            return f"model.layers.{layer}.self_attn.{leaf}"
        if module == "mlp":
            return f"model.layers.{layer}.mlp.{leaf}"
        raise ValueError(f"{name!r} has no Hugging Face counterpart")

    def to_ours(self, hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> Iterator[Triple]:
        for hf_name, value in hf_state_dict.items():
            if not _IGNORED.fullmatch(hf_name):
                yield hf_name, self.our_name(hf_name, config.post_norms), value

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return {self.hf_name(name, config.post_norms): value for name, value in state_dict.items()}


LLAMA_WEIGHTS = LlamaWeights()
