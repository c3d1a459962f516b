"""Mistral (``MistralForCausalLM``): Llama's layout without biases, and a sliding window on every layer.

transformers' Mistral lets query ``t`` see keys ``t - W < s <= t`` (``kv_idx > q_idx - sliding_window``), as
s2hc's local layers do; ``sliding_window_pattern = 0`` makes every layer local. ``sliding_window: null`` is
plain causal attention. ``layer_types`` in a Mistral config is ignored, as ``MistralForCausalLM`` ignores it.
"""

from __future__ import annotations

from typing import Any

from ...checks import check_int
from .common import LLAMA_WEIGHTS, Architecture, check_activation, get, llama_shapes, rope


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    shapes = llama_shapes(hf_config)  # first: a config.json without its shapes is named for them
    check_activation(hf_config, ("silu",), "SwiGLU", "hidden_act")
    window = get(hf_config, "sliding_window")
    if window is not None:
        window = check_int("sliding_window", window)
    theta, scaling = rope(hf_config, scalings=("llama3",))
    return {**shapes, "mlp": "swiglu", "rope_theta": theta, "rope_scaling": scaling,
            "sliding_window": window, "sliding_window_pattern": 0, "local_rope_theta": theta}


MISTRAL = Architecture(model_types=("mistral",), preset="mistral-7b", config_from_hf=config_from_hf,
                       weights=LLAMA_WEIGHTS)
