"""Inkling-2's Block Attention Residuals: transformers' ``models/inkling2`` (``Inkling2BlockAttentionResidual``)
<-> s2hc's ``attn-res`` form (:mod:`s2hc.connection.forms.attn_res`).

What the released code computes (transformers 5.25, ``modeling_inkling2.py``). Each decoder layer ``i`` takes the
current block's partial sum ``H_i`` (the embedding at layer 0) and the list of block states ``S`` (empty at layer
0); ``Inkling2BlockAttentionResidual(S, H)`` reads, with ``q`` its float32 ``query``, zero at init::

    x_j = RMSNorm(float32([*S, H])_j)        (Inkling2UnweightedRMSNorm: no weight, eps 1e-6)
    α = softmax_j(q · x_j / √C),  out = Σ_j α_j x_j        (the normalised states are the keys *and* the values)

* the attention's input is ``attention_input(S, H_i)`` (layer 0 has none: its attention takes the embedding);
  a full-attention layer's (``layer_types[i] != "hybrid_sliding"``) reads with three queries, ``query`` ``(3, C)``,
  whose reads are the inputs of its Q, K and V projections (each through its own RMSNorm);
* when ``i % n_layers_per_attn_res_block == 0`` (6) the layer appends ``H_i`` to ``S`` and the partial sum
  restarts at the attention's output, else the output is added to ``H_i`` (in float32);
* the MLP's input is ``mlp_input(S, partial)`` with one query, and the layer returns ``partial + mlp``;
* the model's output is ``final_input(S, H_L)`` before the final norm.

That is s2hc's Block AttnRes with ``block_size = 2 · n_layers_per_attn_res_block`` sublayers (12: s2hc counts the
attention and the MLP as a sublayer each, as the paper does; a block of 6 layers is a block of 12 sublayers, the
same sources at every read) and these conventions, each a named option of the form (:data:`FAMILY_OPTIONS`):

=========================  ==================================  ==============================================
option                     Inkling-2                           the paper's default
=========================  ==================================  ==============================================
``key_norm="unweighted"``  ``Inkling2UnweightedRMSNorm``       a learned weight on the key norm
``values="normed"``        the normalised states are values    the raw sources are the values
``scaled_logits=True``     ``scaling=hidden_size**-0.5``       no scale
``read_first=False``       layer 0 has no ``attention_input``  the first sublayer reads its one source
``eps=1e-6``               the unweighted norm's default       (the same)
``qkv_reads=True``         a full-attention layer's attention  one query (``num_queries=3``, below)
=========================  ==================================  ==============================================

The read runs in float32 in transformers whatever the model's dtype (``.float()``, and the queries are kept in
float32: ``_keep_in_fp32_modules_strict``); s2hc's runs in at least float32 (in float64 for a float64 model) and
hands its read on in the sources' dtype (float32 under s2hc's float32 residual).

**The three-query read.** ``AttnResConnection(num_queries=3)`` calls ``branch(h_q, h_k, h_v, *args)``. In s2hc's
:class:`~s2hc.models.Transformer` the form's ``qkv_reads`` builds it for every global layer's attention, whose
query, key and value projections then read one each through their own pre-norms (``attn_norm``, ``attn_k_norm``,
``attn_v_norm``: Inkling-2's ``q/k/v_input_layernorm``); local (sliding-window) layers read one query, as
Inkling-2's ``hybrid_sliding`` layers do. So an s2hc model holds Inkling-2's connections when its global layers are
Inkling-2's full-attention layers (:func:`full_attention_layers`; the default layer types, every sixth layer full,
are ``sliding_window_pattern=6``); a query of the wrong shape is refused by name when the state loads.

Tensors: ``layers.{i}.attention_input.query`` ``(C,)`` or ``(3, C)`` <-> ``blocks.{i}.attn_hc.query``,
``layers.{i}.mlp_input.query`` <-> ``blocks.{i}.mlp_hc.query``, ``final_input.query`` <-> ``stream_head.query``;
no norm weights. The state functions copy (a round trip is exact, dtypes kept) and raise ValueError (one line)
naming a missing, unexpected or misshapen tensor. Nothing here imports ``transformers``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_int
from ..connection import Connection, ConnectionModule
from ..connection.forms.attn_res import CONVENTIONS, AttnResConnection, AttnResHead
from .deepseek_v4 import _as_state, _checked
from .one_stream import setting, text_config

__all__ = [
    "DESIGN", "FAMILY_OPTIONS", "KEY_NORM_EPS", "MODEL_TYPE", "TEXT_MODEL_TYPE", "check_attn_res",
    "connection_from_hf", "connection_options", "connection_state_from_hf", "connection_state_to_hf",
    "connection_to_hf", "family_options", "full_attention_layers", "head_from_hf", "head_to_hf", "is_connection_tensor",
    "model_connections_from_hf", "model_connections_to_hf",
]  # fmt: skip

#: transformers' ``model_type`` of the design (its text model's: :data:`TEXT_MODEL_TYPE`).
MODEL_TYPE = "inkling2"
TEXT_MODEL_TYPE = "inkling2_text"
DESIGN = "Inkling-2"
#: ``Inkling2UnweightedRMSNorm()``'s epsilon (the module's default; no config sets it).
KEY_NORM_EPS = 1e-6
#: The attn-res options every Inkling-2 connection has (``block_size`` comes from the config).
FAMILY_OPTIONS = {"variant": "block", **CONVENTIONS["inkling2"], "eps": KEY_NORM_EPS}
_SLIDING = "hybrid_sliding"
_KINDS = ("attention", "mlp")


def block_size(hf_config: Any) -> int:
    """Sublayers per block: two per layer of ``n_layers_per_attn_res_block``."""
    return 2 * check_int("n_layers_per_attn_res_block", setting(hf_config, "n_layers_per_attn_res_block", DESIGN, 6))


def full_attention_layers(hf_config: Any) -> list[int]:
    """The layers whose attention reads three queries (``layer_types[i] != "hybrid_sliding"``; transformers'
    default: every sixth)."""
    layers = check_int("num_hidden_layers", setting(hf_config, "num_hidden_layers", DESIGN))
    text = text_config(hf_config)
    types = text.get("layer_types") if isinstance(text, Mapping) else getattr(text, "layer_types", None)
    if types is None:
        types = ["hybrid" if (i + 1) % 6 == 0 else _SLIDING for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"the {DESIGN} config has {len(types)} layer_types for num_hidden_layers={layers}")
    return [i for i, kind in enumerate(types) if kind != _SLIDING]


def family_options(hf_config: Any) -> dict[str, Any]:
    """The ``family_options`` of an s2hc :class:`~s2hc.models.Transformer` (``family="attn-res"``) computing
    Inkling-2's connections: its conventions, its block size and ``qkv_reads`` (three queries at each global
    layer's attention) when it has full-attention layers; the model's global layers must be those
    (:func:`full_attention_layers`, module docstring)."""
    return {**FAMILY_OPTIONS, "block_size": block_size(hf_config),
            "qkv_reads": bool(full_attention_layers(hf_config))}


def _num_queries(hf_config: Any, layer: int, kind: str) -> int:
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
    return 3 if kind == "attention" and layer in full_attention_layers(hf_config) else 1


def connection_options(hf_config: Any, layer: int = 0, kind: str = "attention") -> dict[str, Any]:
    """The :class:`AttnResConnection` arguments for layer ``layer``'s ``attention_input`` (``kind="attention"``)
    or ``mlp_input`` (``"mlp"``): ``dim``, ``sublayer``, ``block_size``, ``num_queries`` and :data:`FAMILY_OPTIONS`'
    conventions."""
    layers = check_int("num_hidden_layers", setting(hf_config, "num_hidden_layers", DESIGN))
    layer = check_int("layer", layer, minimum=0, maximum=layers - 1)
    options = {key: value for key, value in FAMILY_OPTIONS.items() if key != "variant"}
    return dict(dim=check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN)),
                sublayer=2 * layer + _KINDS.index(kind), block_size=block_size(hf_config),
                num_queries=_num_queries(hf_config, layer, kind), **options)


def _shape(dim: int, num_queries: int) -> tuple[int, ...]:
    return (dim,) if num_queries == 1 else (num_queries, dim)


def connection_state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int, num_queries: int = 1,
                             reads: bool = True) -> dict[str, torch.Tensor]:
    """``Inkling2BlockAttentionResidual``'s ``query`` ``(C,)`` (``(Q, C)`` with ``num_queries=Q > 1``) -> the
    connection's ``query``, a copy, dtype kept; ``reads=False`` (layer 0's attention, which has no module): an
    empty state. Also maps gradients."""
    shapes = {"query": _shape(dim, num_queries)} if reads else {}
    checked = _checked(_as_state(state), shapes, f"{DESIGN} attention residual state", f"hidden_size C={dim}")
    return {key: value.detach().clone() for key, value in checked.items()}


def connection_state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, dim: int, num_queries: int = 1,
                           reads: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`."""
    shapes = {"query": _shape(dim, num_queries)} if reads else {}
    checked = _checked(_as_state(state), shapes, "s2hc attn-res state", f"dim C={dim}")
    return {key: value.detach().clone() for key, value in checked.items()}


def connection_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module | None, layer: int = 0,
                       kind: str = "attention", dtype: torch.dtype = torch.float32) -> AttnResConnection:
    """An :class:`AttnResConnection` computing layer ``layer``'s ``attention_input`` or ``mlp_input`` (its
    parameters in ``dtype``, float32 by default, as transformers keeps them); ``state``: its module or state dict
    (None for layer 0's attention)."""
    options = connection_options(hf_config, layer, kind)
    connection = AttnResConnection(layer_index=layer, **options).to(dtype)
    connection.load_state_dict(connection_state_from_hf({} if state is None else state, options["dim"],
                                                        options["num_queries"], connection.reads))
    return connection


def _is_attn_res_connection(module: object) -> bool:
    return isinstance(module, Connection) and module.depth_read  # AttnRes's connections read depth sources


def check_attn_res(module: object, expected: Mapping[str, Any], design: str) -> None:
    """ValueError unless ``module`` is an AttnRes connection or head whose options are ``expected``'s."""
    if not (isinstance(module, ConnectionModule) and module.depth_read and hasattr(module, "conventions")):
        raise ValueError(f"module must be an s2hc AttnResConnection or AttnResHead, got {type(module).__name__}")
    actual = {"dim": module.dim, **module.conventions()}
    if _is_attn_res_connection(module):
        actual.update(sublayer=module.sublayer, block_size=module.block_size, read_first=module.read_first)
    for key, value in expected.items():
        if key in actual and actual[key] != value:
            raise ValueError(f"the {type(module).__name__} has {key}={actual[key]!r}, but {design} computes "
                             f"{key}={value!r}")


def connection_to_hf(connection: AttnResConnection, hf_config: Any | None = None, layer: int | None = None,
                     kind: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict for the ``Inkling2BlockAttentionResidual`` ``connection`` computes (``{}`` for layer 0's
    attention, which has none), a copy. With ``hf_config`` (and the layer and kind, the connection's own by
    default), every option must be Inkling-2's (ValueError naming the first that differs)."""
    if not _is_attn_res_connection(connection):
        raise ValueError(f"connection must be an s2hc AttnResConnection, got {type(connection).__name__}")
    expected = {key: value for key, value in FAMILY_OPTIONS.items() if key != "variant"}
    if hf_config is not None:
        layer = connection.sublayer // 2 if layer is None else layer
        kind = _KINDS[connection.sublayer % 2] if kind is None else kind
        expected = connection_options(hf_config, layer, kind)
    check_attn_res(connection, expected, DESIGN)
    return connection_state_to_hf(connection.state_dict(), connection.dim, connection.num_queries, connection.reads)


def head_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module,
                 dtype: torch.dtype = torch.float32) -> AttnResHead:
    """An :class:`AttnResHead` computing ``final_input`` (one query)."""
    dim = check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN))
    head = AttnResHead(dim, eps=KEY_NORM_EPS, key_norm="unweighted", values="normed", scaled_logits=True)
    head.to(dtype).load_state_dict(connection_state_from_hf(state, dim))
    return head


def head_to_hf(head: AttnResHead, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``final_input``'s state dict from ``head`` (ValueError unless it computes Inkling-2's read)."""
    expected = {"key_norm": "unweighted", "values": "normed", "scaled_logits": True, "num_queries": 1,
                "eps": KEY_NORM_EPS}
    if hf_config is not None:
        expected["dim"] = check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN))
    check_attn_res(head, expected, DESIGN)
    return connection_state_to_hf(head.state_dict(), head.dim)


_HF_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)(?:layers\.(?P<layer>\d+)\.(?P<module>attention_input|mlp_input)"
                     r"|final_input)\.query$")
#: The released checkpoints' names (transformers renames them on loading, ``conversion_mapping.py``): the queries of
#: the attentions of layers 1, 2, ... as ``attn_queries.0``, 1, ... (layer 0's has none), the MLPs' by their layer.
_RELEASED_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)attn_res\.(?:(?P<module>attn_queries|mlp_queries)\.(?P<index>\d+)"
                           r"|output_query)$")
_SLOTS = {"attention_input": "attn_hc", "mlp_input": "mlp_hc", "attn_queries": "attn_hc", "mlp_queries": "mlp_hc"}


def is_connection_tensor(name: str) -> bool:
    """Whether ``name`` is an attention residual's query, in transformers' names or the released checkpoints'."""
    return bool(_HF_KEY.match(name) or _RELEASED_KEY.match(name))


def _s2hc_name(key: str) -> str | None:
    """The s2hc name of the query ``key`` (either naming), None for another tensor."""
    if match := _HF_KEY.match(key):
        return ("stream_head.query" if match["layer"] is None
                else f"blocks.{match['layer']}.{_SLOTS[match['module']]}.query")
    if match := _RELEASED_KEY.match(key):
        if match["module"] is None:
            return "stream_head.query"
        layer = int(match["index"]) + (match["module"] == "attn_queries")
        return f"blocks.{layer}.{_SLOTS[match['module']]}.query"
    return None


def model_connections_from_hf(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Every attention-residual query of an Inkling-2 state dict (any prefix before ``layers`` and
    ``final_input``; or the released checkpoints' ``attn_res.{attn,mlp}_queries.{i}`` and ``attn_res.output_query``)
    under s2hc's Transformer names (``blocks.{i}.attn_hc.query``, ``blocks.{i}.mlp_hc.query``,
    ``stream_head.query``), copies, each checked against the config's shape (``(3, C)`` for a full-attention
    layer's attention); the other tensors are left out. ValueError naming a missing, unexpected or misshapen one."""
    found = {}
    for key, value in state.items():
        name = _s2hc_name(key)
        if name is None:
            continue
        if name in found:
            raise ValueError(f"{DESIGN} state: two tensors map to {name} (one prefix per state dict)")
        found[name] = value
    checked = _checked(found, _model_shapes(hf_config), f"{DESIGN} state", "s2hc names")
    return {key: value.detach().clone() for key, value in checked.items()}


def model_connections_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any,
                            prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The inverse of :func:`model_connections_from_hf` (``prefix``: what comes before ``layers``, ``model.`` in
    ``Inkling2ForCausalLM``); s2hc's other tensors are left out."""
    shapes = _model_shapes(hf_config)
    checked = _checked({key: value for key, value in state.items() if key in shapes}, shapes, "s2hc attn-res state",
                       "s2hc names")
    out = {}
    for key, value in checked.items():
        if key == "stream_head.query":
            out[f"{prefix}final_input.query"] = value.detach().clone()
        else:
            _, layer, slot, _ = key.split(".")
            module = "attention_input" if slot == "attn_hc" else "mlp_input"
            out[f"{prefix}layers.{layer}.{module}.query"] = value.detach().clone()
    return out


def _model_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    dim = check_int("hidden_size", setting(hf_config, "hidden_size", DESIGN))
    layers = check_int("num_hidden_layers", setting(hf_config, "num_hidden_layers", DESIGN))
    full = set(full_attention_layers(hf_config))
    shapes = {f"blocks.{i}.attn_hc.query": _shape(dim, 3 if i in full else 1) for i in range(1, layers)}
    shapes.update({f"blocks.{i}.mlp_hc.query": (dim,) for i in range(layers)})
    shapes["stream_head.query"] = (dim,)
    return shapes
