"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): SwiGLU; its q, k, v projections always carry a bias, its output
projection never."""

from __future__ import annotations

from typing import Any

from .common import LLAMA_WEIGHTS, Architecture, check_activation, check_full_attention, llama_shapes, rope


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    shapes = llama_shapes(hf_config)  # first: a config.json without its shapes is named for them
    check_activation(hf_config, ("silu",), "SwiGLU", "hidden_act")
    check_full_attention(hf_config)
    theta, _ = rope(hf_config)
    return {**shapes, "mlp": "swiglu", "rope_theta": theta, "qk_norm": False, "qkv_bias": True,
            "out_bias": False}


QWEN2 = Architecture(model_types=("qwen2",), preset="qwen2.5-1.5b", config_from_hf=config_from_hf,
                     weights=LLAMA_WEIGHTS)
