"""Hugging Face ``transformers`` parity: configs and weights of Qwen3, Qwen2 / Qwen2.5, Gemma3 (text), GPT-2.

``config_from_hf`` maps a ``Qwen3Config``, ``Qwen2Config``, ``Gemma3TextConfig`` (or a ``Gemma3Config``,
whose text part is used) or ``GPT2Config`` to a :class:`ModelConfig`; ``load_hf_state_dict`` copies the weights
of the matching ``*ForCausalLM`` (``GPT2LMHeadModel``) into a :class:`Transformer`. With ``family="residual"``
the two models then give the same logits (``tests/test_hf_parity.py``). With another mixer the transformer weights
are loaded the same way and the hyper-connections keep their initialisation (``s2hc upcycle`` sets them so that
the model keeps the source's function). Neither function imports ``transformers``; they read the
config's attributes, so a config loaded from a ``config.json`` works the same way.

Features outside this model raise ValueError rather than convert approximately: scaled RoPE
(``rope_type != "default"``), logit soft-capping, bidirectional attention, Qwen's ``use_sliding_window``
and activations other than SiLU (Qwen) or tanh-GELU (Gemma).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..models import ModelConfig, Transformer

__all__ = ["config_from_hf", "load_hf_state_dict"]

ARCHITECTURES = ("qwen3", "qwen2", "gemma3_text", "gpt2")


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _required(hf_config: Any, name: str) -> Any:
    """``hf_config[name]``; ValueError naming the key when it is missing or null (a config.json written by hand
    or cut short), rather than a TypeError from the arithmetic on it."""
    value = _get(hf_config, name)
    if value is None:
        raise ValueError(f"the Hugging Face config has no {name!r} (a {_get(hf_config, 'model_type')} config "
                         "needs it to convert)")
    return value


def _text_config(hf_config: Any) -> Any:
    if _get(hf_config, "model_type") == "gemma3":  # the multimodal config: use its text part
        text = _get(hf_config, "text_config")
        if text is None or isinstance(text, (list, str, int, float)):
            raise ValueError(f"a 'gemma3' config needs a text_config object (the text model's settings), "
                             f"got {text!r}")
        return text
    return hf_config


def _rope_theta(hf_config: Any, layer_type: str | None = None, legacy: str = "rope_theta") -> float:
    """The RoPE base of ``layer_type`` layers from ``rope_parameters`` (transformers 5) or the legacy attribute."""
    params = _get(hf_config, "rope_parameters")
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if params and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_type must be 'default' (no RoPE scaling) to convert, got {rope_type!r}")
        return float(params["rope_theta"])
    if _get(hf_config, "rope_scaling"):
        raise ValueError(f"RoPE scaling is not supported, got rope_scaling={_get(hf_config, 'rope_scaling')!r}")
    theta = _get(hf_config, legacy)
    if theta is None:
        raise ValueError(f"the Hugging Face config has no RoPE base ({legacy} / rope_parameters)")
    return float(theta)


def _sliding_pattern(layer_types: list[str], declared: int | None) -> int:
    """The period ``p`` with layer ``i`` global iff ``(i + 1) % p == 0`` that reproduces ``layer_types``."""
    n = len(layer_types)
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    candidates = [declared] if declared else []
    candidates += [full[0] + 1] if full else [n + 1]
    for p in candidates:
        if p >= 1 and all((t == "full_attention") == ((i + 1) % p == 0) for i, t in enumerate(layer_types)):
            return p
    raise ValueError(
        f"layer_types must repeat (sliding_attention × (p-1), full_attention) for some p, got {layer_types}"
    )


def config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face Qwen3, Qwen2 (Qwen2.5) or Gemma3 text config.

    ``overrides`` are applied last (e.g. ``family="s2hc", n_streams=4``). ValueError for another model type
    or a feature this model does not have.
    """
    hf_config = _text_config(hf_config)
    model_type = _get(hf_config, "model_type")
    if model_type == "gpt2":
        return _gpt2_config(hf_config, overrides)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {list(ARCHITECTURES)} (or 'gemma3'), got {model_type!r}")
    n_heads = _required(hf_config, "num_attention_heads")
    dim = _required(hf_config, "hidden_size")
    if not isinstance(n_heads, int) or not isinstance(dim, int) or n_heads < 1:
        raise ValueError(f"hidden_size and num_attention_heads must be integers >= 1, got {dim!r} and {n_heads!r}")
    fields: dict[str, Any] = dict(
        vocab_size=_required(hf_config, "vocab_size"),
        dim=dim,
        n_layers=_required(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=_get(hf_config, "num_key_value_heads") or n_heads,
        head_dim=_get(hf_config, "head_dim") or dim // n_heads,
        ffn_dim=_required(hf_config, "intermediate_size"),
        max_seq_len=_required(hf_config, "max_position_embeddings"),
        norm="rmsnorm",
        norm_eps=_required(hf_config, "rms_norm_eps"),
        pos="rope",
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )
    if model_type in ("qwen3", "qwen2"):
        activation = _get(hf_config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU) to convert, got {activation!r}")
        if _get(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True (Qwen's bottom-layer window layout) is not supported")
        layer_types = _get(hf_config, "layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types must all be 'full_attention', got {layer_types}")
        fields.update(mlp="swiglu", rope_theta=_rope_theta(hf_config))
        if model_type == "qwen3":
            bias = bool(_get(hf_config, "attention_bias", False))
            fields.update(qk_norm=True, qkv_bias=bias, out_bias=bias)
        else:  # Qwen2's q, k, v projections always carry a bias, its output projection never
            fields.update(qk_norm=False, qkv_bias=True, out_bias=False)
    else:
        activation = _get(hf_config, "hidden_activation") or _get(hf_config, "hidden_act")
        if activation not in ("gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh' (GeGLU) to convert, got {activation!r}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if _get(hf_config, name) is not None:
                raise ValueError(f"{name} must be None (no soft-capping) to convert, got {_get(hf_config, name)!r}")
        if _get(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (the model is causal)")
        declared = _get(hf_config, "_sliding_window_pattern") or _get(hf_config, "sliding_window_pattern")
        layer_types = _gemma_layer_types(hf_config, declared)
        bias = bool(_get(hf_config, "attention_bias", False))
        fields.update(
            mlp="geglu",
            qk_norm=True,
            qkv_bias=bias,
            out_bias=bias,
            norm_unit_offset=True,
            embed_scale=True,
            post_norms=True,
            query_pre_attn_scalar=_get(hf_config, "query_pre_attn_scalar"),
            sliding_window=_get(hf_config, "sliding_window"),
            sliding_window_pattern=_sliding_pattern(list(layer_types), declared),
            rope_theta=_rope_theta(hf_config, "full_attention"),
            local_rope_theta=_rope_theta(hf_config, "sliding_attention", legacy="rope_local_base_freq"),
        )
    fields.update(overrides)
    return ModelConfig.from_dict(fields)


def _gemma_layer_types(hf_config: Any, declared: Any) -> list[str]:
    """Gemma3's ``layer_types``; from ``sliding_window_pattern`` when a config.json has only that (as
    ``Gemma3TextConfig`` derives them: layer ``i`` is global iff ``(i + 1) % p == 0``). ValueError when it has
    neither, or they are not a list."""
    layer_types = _get(hf_config, "layer_types")
    if layer_types is None and isinstance(declared, int) and not isinstance(declared, bool) and declared >= 1:
        n_layers = _required(hf_config, "num_hidden_layers")
        return ["full_attention" if (i + 1) % declared == 0 else "sliding_attention" for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"a Gemma3 config needs layer_types (a list of 'sliding_attention' / 'full_attention') "
                         f"or sliding_window_pattern, got layer_types={layer_types!r}")
    return list(layer_types)


def _gpt2_config(hf_config: Any, overrides: dict[str, Any]) -> ModelConfig:
    """GPT-2 (``GPT2Config``): LayerNorm, tanh-GELU MLP, learned positions, biases everywhere, tied head."""
    activation = _get(hf_config, "activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function must be 'gelu_new' (tanh-approximated GELU) to convert, "
                         f"got {activation!r}")
    for name, allowed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(_get(hf_config, name, allowed)) != allowed:
            raise ValueError(f"{name} must be {allowed} to convert, got {_get(hf_config, name)!r}")
    dim = _required(hf_config, "n_embd")
    if not isinstance(dim, int):
        raise ValueError(f"n_embd must be an integer >= 1, got {dim!r}")
    fields = dict(
        vocab_size=_required(hf_config, "vocab_size"), dim=dim, n_layers=_required(hf_config, "n_layer"),
        n_heads=_required(hf_config, "n_head"), ffn_dim=_get(hf_config, "n_inner") or 4 * dim,
        max_seq_len=_required(hf_config, "n_positions"), norm="layernorm",
        norm_eps=_required(hf_config, "layer_norm_epsilon"),
        mlp="gelu", qkv_bias=True, out_bias=True, mlp_bias=True, pos="learned",
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", True)),
    )
    return ModelConfig.from_dict({**fields, **overrides})


_IGNORED = re.compile(r".*(rotary_emb\.(original_)?inv_freq|embed_scale)$")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _target_name(name: str, post_norms: bool) -> str | None:
    """Our parameter name for the Hugging Face parameter ``name`` (without its ``model.`` prefix), or None."""
    simple = {"embed_tokens.weight": "embed.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    if name in simple:
        return simple[name]
    match = _LAYER.fullmatch(name)
    if match is None:
        return None
    layer, rest = match.groups()
    # Qwen's "post_attention_layernorm" is the MLP's pre-norm; Gemma3's is the attention's post-norm.
    norms = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "attn_post_norm" if post_norms else "mlp_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "mlp_post_norm",
    }
    module, _, leaf = rest.rpartition(".")
    if module in norms:
        return f"blocks.{layer}.{norms[module]}.{leaf}"
    if module.startswith("self_attn."):
        return f"blocks.{layer}.attn.{module.removeprefix('self_attn.')}.{leaf}"
    if module.startswith("mlp."):
        return f"blocks.{layer}.{module}.{leaf}"
    return None


_GPT2_LAYER = re.compile(r"h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)")
_GPT2_MODULES = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj",
                 "mlp.c_proj": "mlp.down_proj"}
_GPT2_SIMPLE = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight", "ln_f.weight": "norm.weight",
                "ln_f.bias": "norm.bias", "lm_head.weight": "lm_head.weight"}


def _gpt2_tensors(name: str, value: torch.Tensor, dim: int):
    """``(our name or None, tensor)`` pairs for one GPT-2 tensor. GPT-2's ``Conv1D`` stores ``(in, out)``, the
    transpose of a Linear's weight, and ``c_attn`` holds q, k and v side by side."""
    name = name.removeprefix("transformer.")
    if name in _GPT2_SIMPLE:
        return [(_GPT2_SIMPLE[name], value)]
    match = _GPT2_LAYER.fullmatch(name)
    if match is None:
        return [(None, value)]
    layer, module, leaf = match.groups()
    linear = value.t() if leaf == "weight" and not module.startswith("ln_") else value
    if module == "attn.c_attn":
        if linear.shape[0] != 3 * dim:
            return [(None, value)]  # reported as unexpected
        return [(f"blocks.{layer}.attn.{p}_proj.{leaf}", part) for p, part in zip("qkv", linear.split(dim))]
    return [(f"blocks.{layer}.{_GPT2_MODULES[module]}.{leaf}", linear)]


def _named_tensors(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig):
    """``(Hugging Face name, our name or None, tensor)`` for every tensor of a Hugging Face state dict."""
    gpt2 = any(_GPT2_LAYER.fullmatch(k.removeprefix("transformer.")) for k in hf_state_dict)
    for hf_name, value in hf_state_dict.items():
        if gpt2:
            if _GPT2_BUFFER.fullmatch(hf_name):
                continue
            for target, tensor in _gpt2_tensors(hf_name, value, config.dim):
                yield hf_name, target, tensor
        elif not _IGNORED.fullmatch(hf_name):
            yield hf_name, _target_name(_strip_prefix(hf_name), config.post_norms), value


_GPT2_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias")  # causal masks of old checkpoints


def _strip_prefix(name: str) -> str:
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


@torch.no_grad()
def load_hf_state_dict(model: Transformer, hf_state_dict: Mapping[str, torch.Tensor]) -> Transformer:
    """Copy a Hugging Face Qwen3 / Qwen2 / Gemma3 ``*ForCausalLM`` or ``GPT2LMHeadModel`` state dict into
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
    for hf_name, target, value in _named_tensors(hf_state_dict, model.config):
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
