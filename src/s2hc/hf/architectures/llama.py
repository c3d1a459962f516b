"""Llama 2 / 3 (``LlamaForCausalLM``; SmolLM2, TinyLlama): SwiGLU, grouped-query attention, optional attention and
MLP biases, tied or untied embeddings, and Llama 3's RoPE scaling (rope type ``llama3``)."""

from __future__ import annotations

from typing import Any

from ...models import ModelConfig
from .common import LLAMA_WEIGHTS, Architecture, check_activation, get, llama_shapes, llama_shapes_to_hf, rope


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    shapes = llama_shapes(hf_config)  # first: a config.json without its shapes is named for them
    check_activation(hf_config, ("silu",), "SwiGLU", "hidden_act")
    attention_bias = bool(get(hf_config, "attention_bias", False))  # q, k, v and o alike
    theta, scaling = rope(hf_config, scalings=("llama3",))
    return {**shapes, "mlp": "swiglu", "rope_theta": theta, "rope_scaling": scaling,
            "qkv_bias": attention_bias, "out_bias": attention_bias,
            "mlp_bias": bool(get(hf_config, "mlp_bias", False))}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {"model_type": "llama", **llama_shapes_to_hf(config), "attention_bias": config.qkv_bias,
            "mlp_bias": config.mlp_bias, "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None}


LLAMA = Architecture(model_types=("llama",), preset="llama3.2-1b", config_from_hf=config_from_hf,
                     weights=LLAMA_WEIGHTS, config_to_hf=config_to_hf)
