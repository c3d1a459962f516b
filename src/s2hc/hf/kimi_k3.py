"""Kimi-K3's Block Attention Residuals: nemo-automodel's ``models/kimi_k3`` (0.7.0) <-> s2hc's ``attn-res`` form.

What the released code computes (``model.py``: ``KimiDecoderLayer._forward_attn_residual``,
``KimiK3TextModel._apply_output_attn_res``; ``situ.py``: ``_apply_attn_res``, ``_attn_res_core``). Each decoder
layer ``i`` takes the current block's partial sum ``P`` (the embedding at layer 0) and the block entries ``S``
(empty at layer 0), and a read over ``V = [*S, P]`` with a ``KimiRMSNorm`` weight ``g`` and a ``Linear(C, 1)``
projection ``p`` is, in float32 whatever the model's dtype and cast back::

    α = softmax_j( (V_j / rms(V_j)) · (g ⊙ p) ),   out = Σ_j α_j V_j       (rms with eps = rms_norm_eps)

* the attention's input is the read with ``self_attention_res_{norm,proj}`` when ``S`` is not empty (layer 0's
  attention takes the embedding: a one-source read, which is the identity, so s2hc reads it as the paper does);
* when ``i % attn_res_block_size == 0`` (12 layers) ``P`` joins ``S`` and the partial sum restarts at the
  attention's output, else the output is added to ``P``;
* the MLP's input is the read with ``mlp_res_{norm,proj}``, the layer returns ``P + mlp``;
* the model's output is the read with ``output_attn_res_{norm,proj}`` before the final norm.

That is the paper's Block AttnRes, s2hc's defaults (a learned key-norm weight, raw values, no logit scale), with
``block_size = 2 · attn_res_block_size`` sublayers (24: s2hc counts an attention and an MLP as a sublayer each)
and ``eps = rms_norm_eps``. With the released 93 layers that is 8 blocks: ``S`` holds at most 8 entries (the
embedding and 7 completed blocks; the docstring of ``attn_res_triton.py``: "k grows to 8 on the last pipeline
stage", a kernel that takes up to 16) and the output reads 9 sources; s2hc's ``block_size=None`` (eight blocks)
chooses the same 24 for 186 sublayers. ``attn_res_block_size=None`` (a plain residual) has no AttnRes to
convert: refused by name.

Conventions that differ only in where numbers are kept, not in what is computed: K3 keeps ``g`` and ``p`` in the
model's dtype (bf16) and computes in float32; s2hc keeps its parameters in float32 (a bf16 checkpoint converts
exactly) and computes in at least float32. K3 draws ``p`` from N(0, init_std²) where s2hc starts its queries at
zero (an initialisation, not a function: converted weights carry their trained values).

Tensors: ``layers.{i}.self_attention_res_proj.weight`` ``(1, C)`` <-> ``blocks.{i}.attn_hc.query`` ``(C,)``,
``layers.{i}.self_attention_res_norm.weight`` <-> ``blocks.{i}.attn_hc.key_norm_weight``, the same for ``mlp_res``
and ``mlp_hc``, ``output_attn_res_{proj,norm}`` <-> ``stream_head.{query,key_norm_weight}``. The state functions
copy (a round trip is exact, dtypes kept) and raise ValueError (one line) naming a missing, unexpected or misshapen
tensor. Nothing here imports nemo-automodel.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_float, check_int
from ..connection.forms.attn_res import CONVENTIONS, AttnResConnection, AttnResHead
from .deepseek_v4 import _as_state, _checked
from .inkling2 import check_attn_res
from .one_stream import setting, text_config

__all__ = [
    "ATTN_RES_BLOCK_SIZE", "DESIGN", "MODEL_TYPE", "TEXT_MODEL_TYPE", "connection_from_hf", "connection_options",
    "connection_state_from_hf", "connection_state_to_hf", "connection_to_hf", "family_options", "head_from_hf",
    "head_to_hf", "is_connection_tensor", "model_connections_from_hf", "model_connections_to_hf",
]  # fmt: skip

#: the ``model_type`` of the released model (``KimiK3Config``); its text config's is :data:`TEXT_MODEL_TYPE`.
MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
DESIGN = "Kimi-K3"
#: ``KimiK3TextConfig``'s default ``attn_res_block_size`` (layers), what a config without the key has.
ATTN_RES_BLOCK_SIZE = 12
_KINDS = ("attention", "mlp")
_MODULES = {"attention": "self_attention_res", "mlp": "mlp_res"}


def _dim(hf_config: Any) -> int:
    return check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN))


def family_options(hf_config: Any) -> dict[str, Any]:
    """The ``family_options`` of an s2hc :class:`~s2hc.models.Transformer` (``family="attn-res"``) computing
    Kimi-K3's connections: ``variant="block"``, ``block_size = 2 · attn_res_block_size``, ``eps = rms_norm_eps``
    and the paper's conventions."""
    text = text_config(hf_config)
    if isinstance(text, Mapping):
        size = text.get("attn_res_block_size", ATTN_RES_BLOCK_SIZE)
    else:
        size = getattr(text, "attn_res_block_size", ATTN_RES_BLOCK_SIZE)
    if size is None:
        raise ValueError(f"the {DESIGN} config has attn_res_block_size=None (a plain residual): no attention "
                         "residuals to convert")
    return {"variant": "block", "block_size": 2 * check_int("attn_res_block_size", size),
            "eps": check_float("rms_norm_eps", setting(hf_config, "rms_norm_eps", DESIGN), positive=True),
            **CONVENTIONS["kimi-k3"]}


def connection_options(hf_config: Any, layer: int = 0, kind: str = "attention") -> dict[str, Any]:
    """The :class:`AttnResConnection` arguments for layer ``layer``'s attention (``kind="attention"``) or MLP
    (``"mlp"``) read."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
    layers = check_int("num_hidden_layers", setting(hf_config, "num_hidden_layers", DESIGN))
    layer = check_int("layer", layer, minimum=0, maximum=layers - 1)
    options = {key: value for key, value in family_options(hf_config).items() if key != "variant"}
    return dict(dim=_dim(hf_config), sublayer=2 * layer + _KINDS.index(kind), **options)


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int,
                             module: str = "self_attention_res") -> dict[str, torch.Tensor]:
    """``{module}_proj.weight`` ``(1, C)`` and ``{module}_norm.weight`` ``(C,)`` -> ``query`` and
    ``key_norm_weight``, copies, dtypes kept. ``state``: a mapping (a decoder layer's, or just these two) or the
    decoder layer. Also maps gradients."""
    shapes = {f"{module}_proj.weight": (1, dim), f"{module}_norm.weight": (dim,)}
    given = {key: value for key, value in _as_state(state).items() if key.startswith(f"{module}_")}
    checked = _checked(given, shapes, f"{DESIGN} attention residual state", f"hidden_size C={dim}")
    return {"query": checked[f"{module}_proj.weight"][0].detach().clone(),
            "key_norm_weight": checked[f"{module}_norm.weight"].detach().clone()}


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int,
                           module: str = "self_attention_res") -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`."""
    checked = _checked(_as_state(state), {"query": (dim,), "key_norm_weight": (dim,)}, "s2hc attn-res state",
                       f"dim C={dim}")
    return {f"{module}_proj.weight": checked["query"].detach().clone()[None],
            f"{module}_norm.weight": checked["key_norm_weight"].detach().clone()}


def connection_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer: int = 0,
                       kind: str = "attention", dtype: torch.dtype = torch.float32) -> AttnResConnection:
    """An :class:`AttnResConnection` computing layer ``layer``'s ``kind`` read (its parameters in ``dtype``, float32 by
    default);
    ``state``: the decoder layer or its state dict."""
    options = connection_options(hf_config, layer, kind)
    connection = AttnResConnection(layer_index=layer, **options).to(dtype)
    connection.load_state_dict(connection_state_from_hf(state, options["dim"], _MODULES[kind]))
    return connection


def connection_to_hf(connection: AttnResConnection, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """The decoder layer's two tensors for ``connection`` (the attention's read at an even sublayer, the MLP's at
    an odd one), copies; with ``hf_config``, ValueError naming the first option that is not K3's."""
    check_attn_res(connection, {"num_queries": 1, "reads": True, **CONVENTIONS["kimi-k3"]}, DESIGN)
    if hf_config is not None:
        check_attn_res(connection, connection_options(hf_config, connection.sublayer // 2,
                                                      _KINDS[connection.sublayer % 2]), DESIGN)
    module = _MODULES[_KINDS[connection.sublayer % 2]]
    return connection_state_to_hf(connection.state_dict(), connection.dim, module)


def head_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module,
                 dtype: torch.dtype = torch.float32) -> AttnResHead:
    """An :class:`AttnResHead` computing the output read; ``state``: the text model or a mapping holding
    ``output_attn_res_{proj,norm}.weight``."""
    dim, eps = _dim(hf_config), family_options(hf_config)["eps"]
    head = AttnResHead(dim, eps=eps)
    head.to(dtype).load_state_dict(connection_state_from_hf(state, dim, "output_attn_res"))
    return head


def head_to_hf(head: AttnResHead, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``output_attn_res_{proj,norm}.weight`` from ``head`` (ValueError unless it computes K3's read)."""
    expected = {"num_queries": 1, **{k: v for k, v in CONVENTIONS["kimi-k3"].items() if k != "read_first"}}
    if hf_config is not None:
        expected.update(dim=_dim(hf_config), eps=family_options(hf_config)["eps"])
    check_attn_res(head, expected, DESIGN)
    return connection_state_to_hf(head.state_dict(), head.dim, "output_attn_res")


_HF_KEY = re.compile(r"^(?P<prefix>(?:.*?\.)?)(?:layers\.(?P<layer>\d+)\.)?(?P<module>self_attention_res|mlp_res"
                     r"|output_attn_res)_(?P<part>proj|norm)\.weight$")
_SLOTS = {"self_attention_res": "attn_hc", "mlp_res": "mlp_hc"}


def is_connection_tensor(name: str) -> bool:
    """Whether ``name`` is one of an attention residual's two tensors (its projection or its norm's weight)."""
    return _HF_KEY.match(name) is not None
_PARTS = {"proj": "query", "norm": "key_norm_weight"}


def model_connections_from_hf(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Every attention-residual tensor of a K3 state dict (any prefix before ``layers``) under s2hc's Transformer
    names (``blocks.{i}.attn_hc.query``, ``...key_norm_weight``, ``blocks.{i}.mlp_hc.*``, ``stream_head.*``),
    copies, every one checked; the other tensors are left out."""
    found = {}
    for key, value in state.items():
        match = _HF_KEY.match(key)
        if match is None or (match["layer"] is None) != (match["module"] == "output_attn_res"):
            continue
        slot = "stream_head" if match["layer"] is None else f"blocks.{match['layer']}.{_SLOTS[match['module']]}"
        name = f"{slot}.{_PARTS[match['part']]}"
        if name in found:
            raise ValueError(f"{DESIGN} state: two tensors map to {name} (one prefix per state dict)")
        found[name] = value[0] if match["part"] == "proj" and value.dim() == 2 and value.shape[0] == 1 else value
    checked = _checked(found, _model_shapes(hf_config), f"{DESIGN} state", "s2hc names, the projections' row")
    return {key: value.detach().clone() for key, value in checked.items()}


def model_connections_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any,
                            prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The inverse of :func:`model_connections_from_hf` (``prefix``: what comes before ``layers``); s2hc's other
    tensors are left out."""
    shapes = _model_shapes(hf_config)
    checked = _checked({key: value for key, value in state.items() if key in shapes}, shapes, "s2hc attn-res state",
                       "s2hc names")
    modules = {slot: module for module, slot in _SLOTS.items()}
    parts = {ours: part for part, ours in _PARTS.items()}
    out = {}
    for key, value in checked.items():
        *where, name = key.split(".")
        module = "output_attn_res" if where == ["stream_head"] else f"layers.{where[1]}.{modules[where[2]]}"
        value = value.detach().clone()
        out[f"{prefix}{module}_{parts[name]}.weight"] = value[None] if name == "query" else value
    return out


def _model_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    dim = _dim(hf_config)
    layers = check_int("num_hidden_layers", setting(hf_config, "num_hidden_layers", DESIGN))
    slots = [f"blocks.{i}.{slot}" for i in range(layers) for slot in ("attn_hc", "mlp_hc")] + ["stream_head"]
    return {f"{slot}.{name}": (dim,) for slot in slots for name in ("query", "key_norm_weight")}
