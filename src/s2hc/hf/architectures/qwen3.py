"""Qwen3 (``Qwen3ForCausalLM``): SwiGLU, QK-norm, optional attention biases (q, k, v and output alike)."""

from __future__ import annotations

from typing import Any

from ...models import ModelConfig
from .common import (
    LLAMA_WEIGHTS,
    Architecture,
    check_activation,
    check_full_attention,
    get,
    llama_shapes,
    llama_shapes_to_hf,
    rope,
)


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    shapes = llama_shapes(hf_config)  # first: a config.json without its shapes is named for them
    check_activation(hf_config, ("silu",), "SwiGLU", "hidden_act")
    check_full_attention(hf_config)
    bias = bool(get(hf_config, "attention_bias", False))
    theta, _ = rope(hf_config)
    return {**shapes, "mlp": "swiglu", "rope_theta": theta, "qk_norm": True, "qkv_bias": bias,
            "out_bias": bias}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {"model_type": "qwen3", **llama_shapes_to_hf(config), "attention_bias": config.qkv_bias}


QWEN3 = Architecture(model_types=("qwen3",), preset="qwen3-0.6b", config_from_hf=config_from_hf,
                     weights=LLAMA_WEIGHTS, config_to_hf=config_to_hf)
