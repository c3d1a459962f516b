"""Gemma3 (``Gemma3ForCausalLM``, or the text part of the multimodal ``gemma3``): GeGLU, QK-norm, ``1 + w``
RMSNorms, sandwich norms, ``sqrt(dim)``-scaled embeddings, and local (sliding-window) layers with their own
RoPE base between the global ones."""

from __future__ import annotations

from typing import Any

from .common import LLAMA_WEIGHTS, Architecture, check_activation, get, llama_shapes, required, rope


def _text_config(hf_config: Any) -> Any:
    if get(hf_config, "model_type") != "gemma3":
        return hf_config
    text = get(hf_config, "text_config")  # the multimodal config: use its text part
    if text is None or isinstance(text, (list, str, int, float)):
        raise ValueError(f"a 'gemma3' config needs a text_config object (the text model's settings), got {text!r}")
    return text


def _layer_types(hf_config: Any, declared: Any) -> list[str]:
    """Gemma3's ``layer_types``; from ``sliding_window_pattern`` when a config.json has only that (as
    ``Gemma3TextConfig`` derives them: layer ``i`` is global iff ``(i + 1) % p == 0``). ValueError when it has
    neither, or they are not a list."""
    layer_types = get(hf_config, "layer_types")
    if layer_types is None and isinstance(declared, int) and not isinstance(declared, bool) and declared >= 1:
        n_layers = required(hf_config, "num_hidden_layers")
        return ["full_attention" if (i + 1) % declared == 0 else "sliding_attention" for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"a Gemma3 config needs layer_types (a list of 'sliding_attention' / 'full_attention') "
                         f"or sliding_window_pattern, got layer_types={layer_types!r}")
    return list(layer_types)


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


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    hf_config = _text_config(hf_config)
    shapes = llama_shapes(hf_config)  # first: a config.json without its shapes is named for them
    check_activation(hf_config, ("gelu_pytorch_tanh", "gelu_new"), "GeGLU", "hidden_activation", "hidden_act")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(hf_config, name) is not None:
            raise ValueError(f"{name} must be None (no soft-capping) to convert, got {get(hf_config, name)!r}")
    if get(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported (the model is causal)")
    declared = get(hf_config, "_sliding_window_pattern") or get(hf_config, "sliding_window_pattern")
    layer_types = _layer_types(hf_config, declared)
    bias = bool(get(hf_config, "attention_bias", False))
    return {
        **shapes,
        "mlp": "geglu", "qk_norm": True, "qkv_bias": bias, "out_bias": bias, "norm_unit_offset": True,
        "embed_scale": True, "post_norms": True, "query_pre_attn_scalar": get(hf_config, "query_pre_attn_scalar"),
        "sliding_window": get(hf_config, "sliding_window"),
        "sliding_window_pattern": _sliding_pattern(layer_types, declared),
        "rope_theta": rope(hf_config, "full_attention")[0],
        "local_rope_theta": rope(hf_config, "sliding_attention", legacy="rope_local_base_freq")[0],
    }  # fmt: skip


GEMMA3 = Architecture(model_types=("gemma3_text", "gemma3"), preset="gemma3-1b", config_from_hf=config_from_hf,
                      weights=LLAMA_WEIGHTS)
