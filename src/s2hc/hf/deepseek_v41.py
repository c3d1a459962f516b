"""DeepSeek-V4.1's single-pass mHC: ``nemo-automodel``'s ``DeepseekV41HyperConnection`` (0.7.0,
``nemo_automodel/components/models/deepseek_v41``; not in transformers) <-> s2hc's ``family="mhc-lagged"``.

Each site's ``(fn, base, scale)`` is DeepSeek-V4's and converts as :mod:`s2hc.hf.deepseek_v4` converts it (``fn`` ->
``projection = fnᵀ`` with the comb columns transposed, ``base`` -> the biases, ``scale`` -> the three scales;
``H_res = combᵀ``); what differs is the model around them, which s2hc's form computes
(:mod:`s2hc.connection.forms.lagged_mhc`): each site's ``pre`` is read by the next site, the first read is one-hot
on stream 0, the final norm's input is the last FFN site's collapse, and there is no head of its own (no
``hc_head_*`` tensors). From the config (:func:`connection_options`): ``hc_mult`` -> ``n_streams``,
``hidden_size`` -> ``dim``, ``hc_sinkhorn_iters`` -> ``iterations``, ``hc_eps`` -> ``hc_eps``, ``rms_norm_eps``
-> ``eps`` (1e-20 in the released config).

The checkpoint holds them as ``layers.{i}.hc_attn_{fn,base,scale}`` and ``layers.{i}.hc_ffn_{fn,base,scale}``
(nemo-automodel's module tree: ``model.layers.{i}.{attn,ffn}_hc.{fn,base,scale}``; both are read);
:func:`state_from_hf` maps them to an s2hc :class:`~s2hc.models.Transformer`'s ``blocks.{i}.attn_hc.*`` and
``blocks.{i}.mlp_hc.*`` and :func:`state_to_hf` back, as pure permutations (a round trip is exact). A missing,
misshapen or surplus tensor raises one ValueError naming it. Nothing here imports ``nemo_automodel`` or
``transformers``: configs are read by attribute or key, so a ``config.json`` read as a dict works too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import MAX_LAYERS, check_float, check_int, check_streams
from ..connection import Connection
from ..connection.forms.lagged_mhc import LaggedHyperConnection
from ..mixers.mhc import MAX_ITERATIONS
from .deepseek_v4 import connection_state_from_hf, connection_state_to_hf
from .settings import required, text_settings

__all__ = [
    "FAMILY", "MODEL_TYPE", "MODEL_TYPES", "connection_from_hf", "connection_options", "connection_state_from_hf",
    "connection_state_to_hf", "connection_to_hf", "model_options", "state_from_hf", "state_to_hf", "text_config",
]  # fmt: skip

#: ``config.json``'s ``model_type`` of DeepSeek-V4.1 (text and vision; ``text_config`` holds the text model's).
MODEL_TYPE = "deepseek_v41"
#: Both model types whose text settings :func:`text_config` reads: nested, or the text model's own config.
MODEL_TYPES = (MODEL_TYPE, "deepseek_v41_text")
#: The s2hc family that computes it.
FAMILY = "mhc-lagged"
NAME = "DeepSeek-V4.1"
#: Its two sites per layer: the checkpoint's name of each -> the s2hc Transformer block's connection.
SITES = {"attn": "attn_hc", "ffn": "mlp_hc"}
_RELEASED = re.compile(r"layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)")
_NEMO = re.compile(r"model\.layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)")
_S2HC = re.compile(r"blocks\.(\d+)\.(attn_hc|mlp_hc)\.(.+)")


def text_config(hf_config: Any) -> Any:
    """The text model's settings of ``hf_config`` (a ``DeepseekV41Config``, a ``DeepseekV41TextConfig`` or either's
    ``config.json`` as a dict): ``text_config`` for model type ``deepseek_v41`` (or no model type and a
    ``text_config``), else the config itself. ValueError for another model type or a missing ``text_config``."""
    return text_settings(hf_config, NAME, MODEL_TYPE, MODEL_TYPES)


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`~s2hc.connection.forms.LaggedHyperConnection` arguments that compute what
    ``DeepseekV41HyperConnection(config)`` computes with the handoff of ``DeepseekV41Block``: ``dim``, ``n_streams``,
    ``iterations``, ``hc_eps``, ``eps`` (the coefficient norm's, ``rms_norm_eps``), each checked under its config
    name."""
    text = text_config(hf_config)
    return dict(
        dim=check_int("hidden_size", required(text, "hidden_size", NAME)),
        n_streams=check_streams("hc_mult", required(text, "hc_mult", NAME)),
        iterations=check_int("hc_sinkhorn_iters", required(text, "hc_sinkhorn_iters", NAME), maximum=MAX_ITERATIONS),
        hc_eps=check_float("hc_eps", required(text, "hc_eps", NAME), minimum=0.0),
        eps=check_float("rms_norm_eps", required(text, "rms_norm_eps", NAME), positive=True),
    )


def model_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.models.ModelConfig` fields of DeepSeek-V4.1's residual design: ``dim``,
    ``family="mhc-lagged"``, ``n_streams``, ``n_layers``, ``family_options`` (``iterations``, ``hc_eps``, ``eps``),
    ``stream_reduce="head"`` (the final collapse with the last FFN site's ``pre``) and ``norm_eps``. Its attention
    (CSA2), MoE and Engram are not s2hc's, so no whole model converts."""
    options = connection_options(hf_config)
    layers = check_int("num_hidden_layers", required(text_config(hf_config), "num_hidden_layers", NAME),
                       maximum=MAX_LAYERS)
    return dict(dim=options["dim"], family=FAMILY, n_streams=options["n_streams"], n_layers=layers,
                family_options={k: options[k] for k in ("iterations", "hc_eps", "eps")}, stream_reduce="head",
                norm_eps=options["eps"])


# ------------------------------------------------------------------------------------------ modules


def connection_from_hf(
    hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0, **options: Any
) -> LaggedHyperConnection:
    """The connection computing what ``DeepseekV41HyperConnection(config)`` with parameters ``state`` (its state
    dict or the module: ``fn``, ``base``, ``scale``) computes at its site, ``H_res = combᵀ``. ``options``: how it
    computes (``fused``, ``recompute``, ``kernels``); ``layer_index`` only names it."""
    settings = connection_options(hf_config)
    connection = LaggedHyperConnection(layer_index=layer_index, **settings, **options)
    connection.load_state_dict(connection_state_from_hf(state, settings["dim"], settings["n_streams"]))
    return connection


def connection_to_hf(connection: LaggedHyperConnection, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``fn``, ``base``, ``scale`` for ``DeepseekV41HyperConnection.load_state_dict`` from ``connection``, which must
    be ``family="mhc-lagged"`` (another family computes another function: ValueError); with ``hf_config``, its
    sizes, ``iterations``, ``hc_eps`` and ``eps`` must match the config's (ValueError naming the setting)."""
    family = getattr(connection, "family", None)
    if not isinstance(connection, Connection) or family != FAMILY:  # the one format: the single-pass form's
        raise ValueError(f"connection must be an s2hc connection of family {FAMILY!r} to compute {NAME}'s "
                         f"single-pass mHC, got {type(connection).__name__} of family {family!r}")
    if hf_config is not None:
        actual = dict(dim=connection.dim, n_streams=connection.n_streams, iterations=connection.mixer.iterations,
                      hc_eps=connection.mixer.hc_eps, eps=connection.eps)
        for key, value in connection_options(hf_config).items():
            if actual[key] != value:
                raise ValueError(f"the connection has {key}={actual[key]!r}, but the {NAME} config needs {value!r}")
    return connection_state_to_hf(connection.state_dict(), connection.dim, connection.n_streams)


# ------------------------------------------------------------------------------------------ whole state dicts


def _as_state(source: Mapping[str, torch.Tensor] | nn.Module, what: str) -> Mapping[str, torch.Tensor]:
    state = source.state_dict() if isinstance(source, nn.Module) else source
    if not isinstance(state, Mapping):
        raise ValueError(f"{what} must be a mapping of names to tensors or a module, got {type(state).__name__}")
    return state


def _layers(hf_config: Any, n_layers: int | None) -> int:
    if n_layers is not None:
        return check_int("n_layers", n_layers, maximum=MAX_LAYERS)
    return check_int("num_hidden_layers", required(text_config(hf_config), "num_hidden_layers", NAME),
                     maximum=MAX_LAYERS)


def state_from_hf(state: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                  n_layers: int | None = None) -> dict[str, torch.Tensor]:
    """The hyper-connection tensors of a DeepSeek-V4.1 checkpoint (``layers.{i}.hc_{attn,ffn}_{fn,base,scale}``, or
    nemo-automodel's ``model.layers.{i}.{attn,ffn}_hc.*``; every other tensor is left alone) -> the state of an s2hc
    :class:`~s2hc.models.Transformer` of :func:`model_options`: ``blocks.{i}.attn_hc.*`` and ``blocks.{i}.mlp_hc.*``
    for the ``num_hidden_layers`` layers (or ``n_layers``). ValueError naming a missing or misshapen tensor, or one
    of a layer the model does not have."""
    settings = connection_options(hf_config)
    dim, n, layers = settings["dim"], settings["n_streams"], _layers(hf_config, n_layers)
    source = _as_state(state, f"the {NAME} state")
    sites: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in source.items():
        match = _RELEASED.fullmatch(key) or _NEMO.fullmatch(key)
        if match is None:
            continue
        layer, site, name = int(match[1]), match[2], match[3]
        if layer >= layers:
            raise ValueError(f"the {NAME} state has {key!r}, a tensor of layer {layer}, but the model has {layers} "
                             "layers (num_hidden_layers)")
        if name in sites.setdefault((layer, site), {}):
            raise ValueError(f"the {NAME} state holds layer {layer}'s {site} {name!r} twice (as {key!r} too)")
        sites[layer, site][name] = value
    converted = {}
    for layer in range(layers):
        for site, ours in SITES.items():
            found = sites.get((layer, site), {})
            missing = [name for name in ("fn", "base", "scale") if name not in found]
            if missing:
                raise ValueError(f"the {NAME} state has no {f'layers.{layer}.hc_{site}_{missing[0]}'!r} (nor "
                                 f"{f'model.layers.{layer}.{site}_hc.{missing[0]}'!r})")
            for name, value in connection_state_from_hf(found, dim, n).items():
                converted[f"blocks.{layer}.{ours}.{name}"] = value
    return converted


def state_to_hf(state: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                n_layers: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`state_from_hf`: an s2hc Transformer's state (or the model; only its
    ``blocks.{i}.attn_hc.*`` and ``blocks.{i}.mlp_hc.*`` tensors are read) -> the checkpoint's
    ``layers.{i}.hc_{attn,ffn}_{fn,base,scale}``. ValueError naming a missing, misshapen or unexpected tensor."""
    settings = connection_options(hf_config)
    dim, n, layers = settings["dim"], settings["n_streams"], _layers(hf_config, n_layers)
    source = _as_state(state, "the s2hc state")
    sites: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in source.items():
        match = _S2HC.fullmatch(key)
        if match is None:
            continue
        layer = int(match[1])
        if layer >= layers:
            raise ValueError(f"the s2hc state has {key!r}, a tensor of block {layer}, but the {NAME} config has "
                             f"{layers} layers (num_hidden_layers)")
        sites.setdefault((layer, match[2]), {})[match[3]] = value
    released = {}
    for layer in range(layers):
        for site, ours in SITES.items():
            found = sites.get((layer, ours))
            if found is None:
                raise ValueError(f"the s2hc state has no tensors of {f'blocks.{layer}.{ours}'!r}")
            for name, value in connection_state_to_hf(found, dim, n).items():
                released[f"layers.{layer}.hc_{site}_{name}"] = value
    return released
