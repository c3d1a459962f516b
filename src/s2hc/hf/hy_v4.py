"""Hy4's independent HC: transformers' ``HYV4HyperConnection`` and ``HYV4HyperHead`` (``models/hy_v4``) <-> s2hc.

A ``HYV4HyperConnection`` computes what ``s2hc.HyperConnection(family="ihc")`` computes (docs/mixers.md, "Hy4's
independent HC"), and a ``HYV4HyperHead`` what :class:`s2hc.HyperHead` computes, once the parameters are mapped.
With ``n = hc_mult`` and ``C = hidden_size``, per token, ``x`` the n·C features of the streams::

    r = rsqrt(mean(x²) + rms_norm_eps)                      (the input norm: no weight)
    pre  = σ(scale[0] · r fn[:n] x + base[:n]) + hc_eps
    post = hc_magnitude · σ(scale[1] · r fn[n:] x + base[n:]) + hc_eps
    out  = Σ_s pre_s X_s    (the branch's input);    X'_s = X_s + post_s F(out)    (no comb: H_res = I)

=====================================  ====================================================================
transformers                           s2hc
=====================================  ====================================================================
``fn`` ``(2n, nC)``, rows ``[pre|post]``  ``projection`` ``(nC, 2n)`` = ``fnᵀ``
``base`` ``(2n,)``                     ``bias_pre``, ``bias_post``
``scale`` ``(2,)``                     ``alpha_pre``, ``alpha_post``
(no norm weight, no comb)              (no ``norm_weight``; ``ihc`` has no mixer parameters)
``hc_fn`` ``(n, nC)``                  ``HyperHead.projection`` ``(nC, n)`` = ``hc_fnᵀ``
``hc_base`` ``(n,)``, ``hc_scale``     ``HyperHead.bias``, ``HyperHead.alpha``
=====================================  ====================================================================

and from the config (:func:`connection_options`): ``hc_mult`` -> ``n_streams``, ``hidden_size`` -> ``dim``,
``hc_eps`` -> ``hc_eps``, ``hc_magnitude`` -> ``hc_magnitude``, ``rms_norm_eps`` -> ``eps`` (the norm's).

Hy4 runs the connection, the head and the decoder layer's write in float32 (``.float()``, autocast off) whatever
the model's dtype, casting the branch input and the new streams back; s2hc computes the coefficients in at least
float32 and the read and the write in the streams' dtype. Both are the same in float32; in bfloat16 s2hc rounds the
products where Hy4 rounds once (a convention, not an option: docs/mixers.md). In float64 Hy4's ``.float()`` runs
its coefficients in float32, s2hc in float64.

The state functions map dicts of tensors both ways as a pure permutation (a round trip is exact); a missing,
unexpected or misshapen tensor raises one-line ValueError naming it, its shape and the shape expected. Nothing
here imports ``transformers``: configs are read by attribute (or key), so a ``config.json`` read as a dict works.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_float, check_int, check_streams
from ..connection import Connection, HyperConnection, HyperHead, StreamHead
from .deepseek_v4 import (
    _checked,
    head_state_to_hf,  # the same head's layout: s2hc's HyperHead -> hc_fn, hc_base, hc_scale
)
from .settings import required

__all__ = [
    "MODEL_TYPE", "connection_from_hf", "connection_options", "connection_state_from_hf", "connection_state_to_hf",
    "connection_to_hf", "head_from_hf", "head_options", "head_state_from_hf", "head_state_to_hf", "head_to_hf",
    "model_options",
]  # fmt: skip

#: ``config.json``'s ``model_type`` of the models this module converts.
MODEL_TYPE = "hy_v4"
FAMILY = "ihc"
NAME = "Hy4"


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.HyperConnection` arguments that compute what ``HYV4HyperConnection(hf_config)`` computes:
    ``dim``, ``n_streams``, ``family="ihc"``, ``hc_eps``, ``hc_magnitude``, ``eps``. ``hf_config``: an
    ``HYV4Config`` or a mapping with its keys (a ``config.json`` read from disk), each checked under its own name."""
    return dict(
        dim=check_int("hidden_size", required(hf_config, "hidden_size", NAME)),
        n_streams=check_streams("hc_mult", required(hf_config, "hc_mult", NAME)),
        family=FAMILY,
        hc_eps=check_float("hc_eps", required(hf_config, "hc_eps", NAME), minimum=0.0),
        hc_magnitude=check_float("hc_magnitude", required(hf_config, "hc_magnitude", NAME), positive=True),
        eps=check_float("rms_norm_eps", required(hf_config, "rms_norm_eps", NAME), positive=True),
    )


def head_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.HyperHead` arguments for ``HYV4HyperHead(hf_config)``: ``dim``, ``n_streams``, ``eps``,
    ``hc_eps``."""
    options = connection_options(hf_config)
    return {key: options[key] for key in ("dim", "n_streams", "eps", "hc_eps")}


def model_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.models.ModelConfig` fields of Hy4's residual design: ``dim``, ``family="ihc"``,
    ``n_streams``, ``family_options`` (``hc_eps``, ``hc_magnitude``, ``eps``), ``stream_reduce="head"`` (Hy4's
    learned final read) and ``norm_eps`` (its final norm's and the head's). Its attention (MLA with a DSA indexer,
    sinks and gates) and MoE are not s2hc's, so no whole model converts."""
    options = connection_options(hf_config)
    return dict(dim=options["dim"], family=FAMILY, n_streams=options["n_streams"],
                family_options={k: options[k] for k in ("hc_eps", "hc_magnitude", "eps")},
                stream_reduce="head", norm_eps=options["eps"])


# ------------------------------------------------------------------------------------------ state dicts


def _hf_connection_shapes(dim: int, n: int) -> dict[str, tuple[int, ...]]:
    return {"fn": (2 * n, n * dim), "base": (2 * n,), "scale": (2,)}


def _s2hc_connection_shapes(dim: int, n: int) -> dict[str, tuple[int, ...]]:
    return {"projection": (n * dim, 2 * n), "alpha_pre": (1,), "alpha_post": (1,), "bias_pre": (n,), "bias_post": (n,)}


def connection_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """``HYV4HyperConnection``'s ``fn``, ``base``, ``scale`` -> the state dict of
    ``HyperConnection(dim, n_streams, family="ihc")`` (``projection``, ``alpha_pre``, ``alpha_post``, ``bias_pre``,
    ``bias_post``), dtypes kept, copies. ``state``: a mapping or the module itself. Also maps gradients."""
    n, sizes = n_streams, f"hc_mult n={n_streams}, hidden_size C={dim}"
    hf = _checked(state, _hf_connection_shapes(dim, n), f"{NAME} connection state", sizes)
    base, scale = hf["base"], hf["scale"]
    return {
        "projection": hf["fn"].T.contiguous(),
        "alpha_pre": scale[0:1].clone(),
        "alpha_post": scale[1:2].clone(),
        "bias_pre": base[:n].clone(),
        "bias_post": base[n:].clone(),
    }


def connection_state_to_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`: an ``ihc`` connection's state dict (or the module) ->
    ``fn`` ``(2n, nC)``, ``base`` ``(2n,)``, ``scale`` ``(2,)``. A ``norm_weight`` or a mixer's parameters (another
    family) are refused as unexpected."""
    n, sizes = n_streams, f"n_streams n={n_streams}, dim C={dim}"
    s = _checked(state, _s2hc_connection_shapes(dim, n), "s2hc connection state", sizes)
    return {
        "fn": s["projection"].T.contiguous(),
        "base": torch.cat((s["bias_pre"], s["bias_post"])),
        "scale": torch.cat((s["alpha_pre"], s["alpha_post"])),
    }


def head_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """``HYV4HyperHead``'s ``hc_fn`` ``(n, nC)``, ``hc_base`` ``(n,)``, ``hc_scale`` ``(1,)`` -> the state dict of
    :class:`s2hc.HyperHead` (``projection`` ``(nC, n)``, ``bias``, ``alpha``), copies."""
    sizes = f"hc_mult n={n_streams}, hidden_size C={dim}"
    shapes = {"hc_fn": (n_streams, n_streams * dim), "hc_base": (n_streams,), "hc_scale": (1,)}
    hf = _checked(state, shapes, f"{NAME} head state", sizes)
    return {"projection": hf["hc_fn"].T.contiguous(), "alpha": hf["hc_scale"].clone(), "bias": hf["hc_base"].clone()}


# ------------------------------------------------------------------------------------------ modules


def connection_from_hf(
    hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0, **options: Any
) -> HyperConnection:
    """A :class:`s2hc.HyperConnection` computing what ``HYV4HyperConnection(hf_config)`` with parameters ``state``
    (its state dict or the module) computes. ``options``: how it computes (``fused``, ``recompute``, ``kernels``)."""
    settings = connection_options(hf_config)
    connection = HyperConnection(layer_index=layer_index, **settings, **options)
    connection.load_state_dict(connection_state_from_hf(state, settings["dim"], settings["n_streams"]))
    return connection


def head_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module) -> HyperHead:
    """A :class:`s2hc.HyperHead` computing what ``HYV4HyperHead(hf_config)`` with parameters ``state`` computes."""
    settings = head_options(hf_config)
    head = HyperHead(**settings)
    head.load_state_dict(head_state_from_hf(state, settings["dim"], settings["n_streams"]))
    return head


def _check_matches(kind: str, actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if key in actual and actual[key] != value:
            raise ValueError(f"the {kind} has {key}={actual[key]!r}, but the {NAME} config needs {value!r}")


def connection_to_hf(connection: HyperConnection, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``fn``, ``base``, ``scale`` for ``HYV4HyperConnection.load_state_dict`` from ``connection``, which must be
    ``family="ihc"`` (else it computes another function: ValueError). With ``hf_config``, its sizes, ``hc_eps``,
    ``hc_magnitude`` and ``eps`` must match the config's too."""
    if not isinstance(connection, Connection):
        raise ValueError(f"connection must be an s2hc.HyperConnection, got {type(connection).__name__}")
    if getattr(connection, "family", None) != FAMILY:
        raise ValueError(f"connection must be family={FAMILY!r} to compute {NAME}'s independent HC, got "
                         f"family={getattr(connection, 'family', None)!r}")
    actual = dict(dim=connection.dim, n_streams=connection.n_streams, hc_eps=connection.mixer.hc_eps,
                  hc_magnitude=connection.mixer.hc_magnitude, eps=connection.eps)
    if hf_config is not None:
        _check_matches("connection", actual, connection_options(hf_config))
    return connection_state_to_hf(connection.state_dict(), connection.dim, connection.n_streams)


def head_to_hf(head: HyperHead, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``hc_fn``, ``hc_base``, ``hc_scale`` for ``HYV4HyperHead.load_state_dict`` from ``head``; with ``hf_config``,
    its sizes and epsilons must match the config's (ValueError naming the setting)."""
    if not isinstance(head, StreamHead) or head.output_read != HyperHead.output_read:
        raise ValueError(f"head must be an s2hc.HyperHead, got {type(head).__name__}")
    actual = dict(dim=head.dim, n_streams=head.n_streams, eps=head.eps, hc_eps=head.hc_eps)
    if hf_config is not None:
        _check_matches("head", actual, head_options(hf_config))
    return head_state_to_hf(head.state_dict(), head.dim, head.n_streams)
