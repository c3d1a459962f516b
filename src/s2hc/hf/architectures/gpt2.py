"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, tanh-GELU MLP, learned positions, biases everywhere, tied head.

Its ``Conv1D`` layers store ``(in, out)``, the transpose of a Linear's weight, and ``c_attn`` holds the q, k and
v projections side by side: loading transposes and splits them, :meth:`GPT2Weights.to_hf` merges and transposes
back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...models import ModelConfig
from .common import Architecture, Triple, check_activation, get, required

_CHECKS = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
           ("reorder_and_upcast_attn", False), ("add_cross_attention", False))


def config_from_hf(hf_config: Any) -> dict[str, Any]:
    check_activation(hf_config, ("gelu_new", "gelu_pytorch_tanh"), "tanh-approximated GELU", "activation_function")
    for name, allowed in _CHECKS:
        if bool(get(hf_config, name, allowed)) != allowed:
            raise ValueError(f"{name} must be {allowed} to convert, got {get(hf_config, name)!r}")
    dim = required(hf_config, "n_embd")
    if not isinstance(dim, int):
        raise ValueError(f"n_embd must be an integer >= 1, got {dim!r}")
    return dict(
        vocab_size=required(hf_config, "vocab_size"), dim=dim, n_layers=required(hf_config, "n_layer"),
        n_heads=required(hf_config, "n_head"), ffn_dim=get(hf_config, "n_inner") or 4 * dim,
        max_seq_len=required(hf_config, "n_positions"), norm="layernorm",
        norm_eps=required(hf_config, "layer_norm_epsilon"),
        mlp="gelu", qkv_bias=True, out_bias=True, mlp_bias=True, pos="learned",
        tie_embeddings=bool(get(hf_config, "tie_word_embeddings", True)),
    )


_HF_LAYER = re.compile(r"h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)")
_OUR_LAYER = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias")  # causal masks of old checkpoints
_MODULES = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj",
            "mlp.c_proj": "mlp.down_proj"}
_SIMPLE = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight", "ln_f.weight": "norm.weight",
           "ln_f.bias": "norm.bias"}
_QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")


@dataclass(frozen=True)
class GPT2Weights:
    """``transformer.{wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f}``,
    ``lm_head``."""

    def fits(self, config: ModelConfig) -> bool:
        return config.pos == "learned" and config.norm == "layernorm" and config.mlp == "gelu"

    def to_ours(self, hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> Iterator[Triple]:
        for hf_name, value in hf_state_dict.items():
            if not _BUFFER.fullmatch(hf_name):
                for name, tensor in self._ours(hf_name, value, config.dim):
                    yield hf_name, name, tensor

    @staticmethod
    def _ours(hf_name: str, value: torch.Tensor, dim: int) -> list[tuple[str | None, torch.Tensor]]:
        if hf_name == "lm_head.weight":
            return [(hf_name, value)]
        name = hf_name.removeprefix("transformer.")
        if name in _SIMPLE:
            return [(_SIMPLE[name], value)]
        match = _HF_LAYER.fullmatch(name)
        if match is None:
            return [(None, value)]
        layer, module, leaf = match.groups()
        linear = value.t() if leaf == "weight" and not module.startswith("ln_") else value
        if module == "attn.c_attn":
            if linear.shape[0] != 3 * dim:
                return [(None, value)]  # reported as unexpected
            return [(f"blocks.{layer}.{p}.{leaf}", part) for p, part in zip(_QKV, linear.split(dim))]
        return [(f"blocks.{layer}.{_MODULES[module]}.{leaf}", linear)]

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        hf: dict[str, torch.Tensor] = {}
        simple = {ours: hf_name for hf_name, ours in _SIMPLE.items()}
        modules = {ours: hf_name for hf_name, ours in _MODULES.items()}
        for name, value in state_dict.items():
            match = _OUR_LAYER.fullmatch(name)
            if name == "lm_head.weight":
                hf[name] = value
            elif name in simple:
                hf[f"transformer.{simple[name]}"] = value
            elif match is not None and match[2] in _QKV:
                if match[2] == _QKV[0]:  # c_attn: q, k and v of this layer side by side
                    layer, leaf = match[1], match[3]
                    parts = torch.cat([state_dict[f"blocks.{layer}.{p}.{leaf}"] for p in _QKV])
                    hf[f"transformer.h.{layer}.attn.c_attn.{leaf}"] = _conv1d(parts, leaf)
            elif match is not None and match[2] in modules:
                module = modules[match[2]]
                linear = not module.startswith("ln_")
                hf[f"transformer.h.{match[1]}.{module}.{match[3]}"] = _conv1d(value, match[3]) if linear else value
            else:
                raise ValueError(f"{name!r} has no GPT-2 counterpart")
        return hf


def _conv1d(linear: torch.Tensor, leaf: str) -> torch.Tensor:
    """A Linear's ``(out, in)`` weight as Conv1D's ``(in, out)``; biases as they are."""
    return linear.t().contiguous() if leaf == "weight" else linear


GPT2 = Architecture(model_types=("gpt2",), preset="gpt2-small", config_from_hf=config_from_hf,
                    weights=GPT2Weights(), tokenizer="gpt2")  # the GPT-2 BPE, read offline (s2hc.data.tokenizer)
