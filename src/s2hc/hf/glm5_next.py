"""GLM-5.3's mHC: transformers' ``Glm5NextTextHyperConnection`` (``models/glm5_next``) <-> s2hc.

``Glm5NextTextHyperConnection`` subclasses DeepSeek-V4's ``DeepseekV4HyperConnection`` and changes only the storage
dtype of ``base`` and ``scale`` (float32, kept there by ``_keep_in_fp32_modules_strict``); its forward is
DeepSeek-V4's, line for line: an RMSNorm without a weight over the n·C features with ``rms_norm_eps`` (1e-5 in
GLM-5.3's config, against DeepSeek-V4's 1e-6), ``pre = σ(·) + hc_eps``, ``post = 2σ(·)``, ``comb`` by DeepSeek-V4's
Sinkhorn (``hc_sinkhorn_iters`` = 20, ``hc_eps`` = 1e-6) applied as ``combᵀ``. So it is
``s2hc.HyperConnection(family="mhc", variant="deepseek-v4", eps=rms_norm_eps)`` and its tensors convert with
:mod:`s2hc.hf.deepseek_v4`'s state functions (their messages name DeepSeek-V4's layout, which GLM's is).

Where GLM-5.3 differs from DeepSeek-V4 is the model around the connections: no learned head; the streams' final
read is their unweighted mean (``Glm5NextTextHyperHead``: ``hidden_streams.mean(dim=2)``), then the final norm, so
an s2hc model takes ``stream_reduce="mean"`` (:func:`model_options`). The decoder layer casts ``post`` and ``comb``
to the streams' dtype before the write (as s2hc does). The text model's settings are ``text_config``'s in a
``glm5_next`` config and at the top of a ``glm5_next_text`` one; :func:`text_config` finds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import MAX_LAYERS, check_float, check_int, check_streams
from ..connection import HyperConnection
from ..mixers.mhc import MAX_ITERATIONS
from . import deepseek_v4
from .deepseek_v4 import connection_state_from_hf, connection_state_to_hf
from .settings import required, text_settings

__all__ = [
    "MODEL_TYPE", "MODEL_TYPES", "connection_from_hf", "connection_options", "connection_state_from_hf",
    "connection_state_to_hf", "connection_to_hf", "model_options", "text_config",
]  # fmt: skip

#: ``config.json``'s ``model_type`` of GLM-5.3 (the multimodal model, whose ``text_config`` holds the text model's).
MODEL_TYPE = "glm5_next"
#: Both model types whose text settings :func:`text_config` reads: nested, or the text model's own config.
MODEL_TYPES = (MODEL_TYPE, "glm5_next_text")
NAME = "GLM-5.3"


def text_config(hf_config: Any) -> Any:
    """The text model's settings of ``hf_config`` (a ``Glm5NextConfig``, a ``Glm5NextTextConfig`` or either's
    ``config.json`` as a dict): ``text_config`` when the model type is ``glm5_next`` (or there is no model type and a
    ``text_config``), else the config itself. ValueError for another model type or a missing ``text_config``."""
    return text_settings(hf_config, NAME, MODEL_TYPE, MODEL_TYPES)


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.HyperConnection` arguments that compute what ``Glm5NextTextHyperConnection`` computes:
    ``dim``, ``n_streams``, ``family="mhc"``, ``variant="deepseek-v4"``, ``iterations``, ``hc_eps``, ``eps`` (the
    input norm's, ``rms_norm_eps``), each checked under its config name."""
    text = text_config(hf_config)
    return dict(
        dim=check_int("hidden_size", required(text, "hidden_size", NAME)),
        n_streams=check_streams("hc_mult", required(text, "hc_mult", NAME)),
        family="mhc",
        variant=deepseek_v4.VARIANT,
        iterations=check_int("hc_sinkhorn_iters", required(text, "hc_sinkhorn_iters", NAME), maximum=MAX_ITERATIONS),
        hc_eps=check_float("hc_eps", required(text, "hc_eps", NAME), minimum=0.0),
        eps=check_float("rms_norm_eps", required(text, "rms_norm_eps", NAME), positive=True),
    )


def model_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.models.ModelConfig` fields of GLM-5.3's residual design: ``dim``, ``family="mhc"``,
    ``n_streams``, ``family_options`` (``variant``, ``iterations``, ``hc_eps``, ``eps``), ``stream_reduce="mean"``
    (its final read, an unweighted mean), ``norm_eps`` and ``n_layers``. Its attention (Kimi delta attention and MLA
    with a DSA indexer) and MoE are not s2hc's, so no whole model converts."""
    options = connection_options(hf_config)
    layers = check_int("num_hidden_layers", required(text_config(hf_config), "num_hidden_layers", NAME),
                       maximum=MAX_LAYERS)
    return dict(dim=options["dim"], family="mhc", n_streams=options["n_streams"], n_layers=layers,
                family_options={k: options[k] for k in ("variant", "iterations", "hc_eps", "eps")},
                stream_reduce="mean", norm_eps=options["eps"])


def connection_from_hf(
    hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0, **options: Any
) -> HyperConnection:
    """A :class:`s2hc.HyperConnection` computing what ``Glm5NextTextHyperConnection(hf_config)`` with parameters
    ``state`` (its state dict or the module) computes, with ``H_res = combᵀ``. ``options``: how it computes."""
    settings = connection_options(hf_config)
    connection = HyperConnection(layer_index=layer_index, **settings, **options)
    connection.load_state_dict(connection_state_from_hf(state, settings["dim"], settings["n_streams"]))
    return connection


def connection_to_hf(connection: HyperConnection, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``fn``, ``base``, ``scale`` for ``Glm5NextTextHyperConnection.load_state_dict`` from ``connection``, which
    must be DeepSeek-V4's mHC (:func:`s2hc.hf.deepseek_v4.connection_to_hf` checks it); with ``hf_config``, its
    sizes, ``iterations``, ``hc_eps`` and ``eps`` must match GLM-5.3's config (ValueError naming the setting)."""
    state = deepseek_v4.connection_to_hf(connection)
    if hf_config is not None:
        actual = dict(dim=connection.dim, n_streams=connection.n_streams, iterations=connection.mixer.iterations,
                      hc_eps=connection.mixer.hc_eps, eps=connection.eps)
        for key, value in connection_options(hf_config).items():
            if key in actual and actual[key] != value:
                raise ValueError(f"the connection has {key}={actual[key]!r}, but the {NAME} config needs {value!r}")
    return state
