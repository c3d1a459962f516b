"""DeepSeek-V4's mHC: transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` <-> s2hc.

A ``DeepseekV4HyperConnection`` computes what ``s2hc.HyperConnection(family="mhc", variant="deepseek-v4")``
computes (docs/mixers.md, "DeepSeek-V4's mHC"), and a ``DeepseekV4HyperHead`` what :class:`s2hc.HyperHead`
computes, once the parameters are mapped. With ``n = hc_mult`` and ``C = hidden_size``:

=====================================  ====================================================================
transformers                           s2hc
=====================================  ====================================================================
``fn`` ``(2n + n², nC)``, rows         ``projection`` ``(nC, 2n + n²)`` = ``fnᵀ``, except that the n² comb
``[pre | post | comb]``                columns are transposed: comb entry ``[j, k]`` (input j, output k) is
                                       ``d_res[k, j]``, because s2hc mixes with ``H_res = combᵀ``
``base`` ``(2n + n²,)``                ``bias_pre``, ``bias_post``, ``mixer.bias`` ``(n, n)`` = comb biasᵀ
``scale`` ``(3,)``                     ``alpha_pre``, ``alpha_post``, ``mixer.alpha``
(no norm weight)                       (no ``norm_weight``: ``variant="deepseek-v4"`` has none)
``hc_fn`` ``(n, nC)``                  ``HyperHead.projection`` ``(nC, n)`` = ``hc_fnᵀ``
``hc_base`` ``(n,)``, ``hc_scale``     ``HyperHead.bias``, ``HyperHead.alpha``
=====================================  ====================================================================

and from the config (:func:`connection_options`): ``hc_mult`` -> ``n_streams``, ``hidden_size`` -> ``dim``,
``hc_sinkhorn_iters`` -> ``iterations``, ``hc_eps`` -> ``hc_eps``, ``rms_norm_eps`` -> ``eps`` (the norm's).

The state functions (``*_state_from_hf``, ``*_state_to_hf``) map dicts of tensors, both ways, as a pure
permutation (a round trip is exact); a missing, unexpected or misshapen tensor raises ValueError naming the
tensor, its shape and the shape expected. :func:`connection_from_hf` and :func:`head_from_hf` build the s2hc
module from a config and a module or state dict; :func:`connection_to_hf` and :func:`head_to_hf` return the
state dict to load into transformers' module, after checking that the s2hc module computes DeepSeek-V4's
function. Gradients map the same way (the parameters are only permuted). Nothing here imports
``transformers``: configs are read by attribute (or key), so a ``config.json`` read as a dict works too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_float, check_int, check_streams
from ..connection import Connection, HyperConnection, HyperHead, StreamHead
from ..mixers.mhc import MAX_ITERATIONS
from .settings import required

# the converter's interface, the same names as s2hc.hf.qwen4_exp's
__all__ = [
    "connection_from_hf", "connection_options", "connection_state_from_hf", "connection_state_to_hf",
    "connection_to_hf", "head_from_hf", "head_options", "head_state_from_hf", "head_state_to_hf", "head_to_hf",
]  # fmt: skip

VARIANT = "deepseek-v4"


def _get(hf_config: Any, name: str) -> Any:
    return required(hf_config, name, "DeepSeek-V4")


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.HyperConnection` arguments that compute what ``DeepseekV4HyperConnection(hf_config)``
    computes: ``dim``, ``n_streams``, ``family="mhc"``, ``variant="deepseek-v4"``, ``iterations``, ``hc_eps``,
    ``eps``. ``hf_config``: a ``DeepseekV4Config`` or a mapping with its keys (often a ``config.json`` read
    from disk), each checked under its own name before anything is built: ``hc_sinkhorn_iters`` at most
    :data:`s2hc.mixers.mhc.MAX_ITERATIONS`, ``hc_mult`` at most :data:`s2hc.checks.MAX_STREAMS`."""
    return dict(
        dim=check_int("hidden_size", _get(hf_config, "hidden_size")),
        n_streams=check_streams("hc_mult", _get(hf_config, "hc_mult")),
        family="mhc",
        variant=VARIANT,
        iterations=check_int("hc_sinkhorn_iters", _get(hf_config, "hc_sinkhorn_iters"), maximum=MAX_ITERATIONS),
        hc_eps=check_float("hc_eps", _get(hf_config, "hc_eps"), minimum=0.0),
        eps=check_float("rms_norm_eps", _get(hf_config, "rms_norm_eps"), positive=True),
    )


def head_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.HyperHead` arguments for ``DeepseekV4HyperHead(hf_config)``: ``dim``, ``n_streams``,
    ``eps``, ``hc_eps``."""
    options = connection_options(hf_config)
    return {key: options[key] for key in ("dim", "n_streams", "eps", "hc_eps")}


# ------------------------------------------------------------------------------------------ state dicts


def _as_state(source: Mapping[str, torch.Tensor] | nn.Module) -> Mapping[str, torch.Tensor]:
    return source.state_dict() if isinstance(source, nn.Module) else source


def _checked(
    state: Mapping[str, torch.Tensor] | nn.Module, shapes: dict[str, tuple[int, ...]], what: str, sizes: str
) -> dict[str, torch.Tensor]:
    """``state``'s tensors, which must be exactly those of ``shapes`` with those shapes; ValueError naming the
    first tensor that is missing, unexpected, not a tensor or misshapen, with its shape and the expected one."""
    state = _as_state(state)
    if not isinstance(state, Mapping):
        raise ValueError(f"{what} must be a mapping of names to tensors or a module, got {type(state).__name__}")
    for key, shape in shapes.items():
        if key not in state:
            raise ValueError(f"{what}: tensor {key!r} is missing; expected shape {shape} ({sizes}), "
                             f"got tensors {sorted(state)}")
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}: {key!r} must be a tensor of shape {shape}, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"{what}: tensor {key!r} has shape {tuple(value.shape)}, expected {shape} ({sizes})")
    unexpected = sorted(set(state) - set(shapes))
    if unexpected:
        found = {key: tuple(state[key].shape) if isinstance(state[key], torch.Tensor) else None for key in unexpected}
        raise ValueError(f"{what}: unexpected tensor(s) {found}; expected exactly {shapes} ({sizes})")
    return dict(state)


def _hf_connection_shapes(dim: int, n: int) -> dict[str, tuple[int, ...]]:
    return {"fn": ((2 + n) * n, n * dim), "base": ((2 + n) * n,), "scale": (3,)}


def _s2hc_connection_shapes(dim: int, n: int) -> dict[str, tuple[int, ...]]:
    return {
        "projection": (n * dim, (2 + n) * n), "alpha_pre": (1,), "alpha_post": (1,), "bias_pre": (n,),
        "bias_post": (n,), "mixer.alpha": (1,), "mixer.bias": (n, n),
    }


def _transpose_comb(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``rows`` ``(2n + n², ...)`` with the n² comb rows (row-major ``[j, k]``) reordered to ``[k, j]``: the
    layout change between DeepSeek-V4's ``comb`` and s2hc's ``H_res = combᵀ``. Its own inverse."""
    comb = rows[2 * n:].unflatten(0, (n, n)).transpose(0, 1).flatten(0, 1)
    return torch.cat((rows[: 2 * n], comb))


def connection_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """``DeepseekV4HyperConnection``'s ``fn``, ``base``, ``scale`` -> the state dict of
    ``HyperConnection(dim, n_streams, family="mhc", variant="deepseek-v4")`` (``projection``, ``alpha_pre``,
    ``alpha_post``, ``bias_pre``, ``bias_post``, ``mixer.alpha``, ``mixer.bias``), dtypes kept, copies.
    ``state``: a mapping or the module itself. Also maps gradients (``{"fn": fn.grad, ...}``)."""
    n, sizes = n_streams, f"hc_mult n={n_streams}, hidden_size C={dim}"
    hf = _checked(state, _hf_connection_shapes(dim, n), "DeepSeek-V4 connection state", sizes)
    base, scale = _transpose_comb(hf["base"], n), hf["scale"]
    return {
        "projection": _transpose_comb(hf["fn"], n).T.contiguous(),
        "alpha_pre": scale[0:1].clone(),
        "alpha_post": scale[1:2].clone(),
        "bias_pre": base[:n].clone(),
        "bias_post": base[n: 2 * n].clone(),
        "mixer.alpha": scale[2:3].clone(),
        "mixer.bias": base[2 * n:].reshape(n, n).clone(),
    }


def connection_state_to_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`: an s2hc connection's state dict (or the module) ->
    ``fn`` ``(2n + n², nC)``, ``base`` ``(2n + n²,)``, ``scale`` ``(3,)``. A ``norm_weight`` (a paper-variant
    connection) is refused as unexpected: DeepSeek-V4's norm has none."""
    n, sizes = n_streams, f"n_streams n={n_streams}, dim C={dim}"
    s = _checked(state, _s2hc_connection_shapes(dim, n), "s2hc connection state", sizes)
    base = torch.cat((s["bias_pre"], s["bias_post"], s["mixer.bias"].flatten()))
    return {
        "fn": _transpose_comb(s["projection"].T, n).contiguous(),
        "base": _transpose_comb(base, n),
        "scale": torch.cat((s["alpha_pre"], s["alpha_post"], s["mixer.alpha"])),
    }


def head_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """``DeepseekV4HyperHead``'s ``hc_fn`` ``(n, nC)``, ``hc_base`` ``(n,)``, ``hc_scale`` ``(1,)`` -> the state
    dict of :class:`s2hc.HyperHead` (``projection`` ``(nC, n)``, ``bias``, ``alpha``), copies."""
    sizes = f"hc_mult n={n_streams}, hidden_size C={dim}"
    shapes = {"hc_fn": (n_streams, n_streams * dim), "hc_base": (n_streams,), "hc_scale": (1,)}
    hf = _checked(state, shapes, "DeepSeek-V4 head state", sizes)
    return {"projection": hf["hc_fn"].T.contiguous(), "alpha": hf["hc_scale"].clone(), "bias": hf["hc_base"].clone()}


def head_state_to_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`head_state_from_hf`: :class:`s2hc.HyperHead`'s state -> ``hc_fn``, ``hc_base``,
    ``hc_scale``."""
    sizes = f"n_streams n={n_streams}, dim C={dim}"
    shapes = {"projection": (n_streams * dim, n_streams), "alpha": (1,), "bias": (n_streams,)}
    s = _checked(state, shapes, "s2hc head state", sizes)
    return {"hc_fn": s["projection"].T.contiguous(), "hc_base": s["bias"].clone(), "hc_scale": s["alpha"].clone()}


# ------------------------------------------------------------------------------------------ modules


def connection_from_hf(
    hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0, **options: Any
) -> HyperConnection:
    """A :class:`s2hc.HyperConnection` computing what ``DeepseekV4HyperConnection(hf_config)`` with parameters
    ``state`` (its state dict or the module) computes, with ``H_res = combᵀ``. ``options``: how it computes
    (``fused``, ``recompute``, ``kernels``); ``layer_index`` only names it, the biases come from ``base``."""
    settings = connection_options(hf_config)
    connection = HyperConnection(layer_index=layer_index, **settings, **options)
    dim, n = settings["dim"], settings["n_streams"]
    converted = connection_state_from_hf(state, dim, n)
    connection.load_state_dict(converted)
    return connection


def head_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module) -> HyperHead:
    """A :class:`s2hc.HyperHead` computing what ``DeepseekV4HyperHead(hf_config)`` with parameters ``state``
    computes."""
    settings = head_options(hf_config)
    head = HyperHead(**settings)
    head.load_state_dict(head_state_from_hf(state, settings["dim"], settings["n_streams"]))
    return head


def _check_matches(kind: str, actual: dict[str, Any], hf_config: Any | None, expected: dict[str, Any]) -> None:
    if hf_config is None:
        return
    for key, value in expected.items():
        if actual[key] != value:
            raise ValueError(f"the {kind} has {key}={actual[key]!r}, but the DeepSeek-V4 config needs {value!r}")


def connection_to_hf(connection: HyperConnection, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``fn``, ``base``, ``scale`` for ``DeepseekV4HyperConnection.load_state_dict`` from ``connection``, which
    must be ``family="mhc", variant="deepseek-v4"`` without ``transpose_res`` (else it computes another
    function: ValueError). With ``hf_config``, its sizes, ``iterations``, ``hc_eps`` and ``eps`` must match the
    config's too."""
    if not isinstance(connection, Connection):
        raise ValueError(f"connection must be an s2hc.HyperConnection, got {type(connection).__name__}")
    variant = getattr(getattr(connection, "mixer", None), "variant", None)
    transposed = getattr(connection, "transpose_res", None)
    if connection.family != "mhc" or variant != VARIANT or transposed:  # the one format: the mhc family's variant
        raise ValueError(
            f"connection must be family='mhc' with variant={VARIANT!r} and transpose_res=False to compute "
            f"DeepSeek-V4's mHC, got family={connection.family!r}, variant={variant!r}, transpose_res={transposed}"
        )
    actual = dict(dim=connection.dim, n_streams=connection.n_streams, iterations=connection.mixer.iterations,
                  hc_eps=connection.mixer.hc_eps, eps=connection.eps)
    expected = {} if hf_config is None else {k: v for k, v in connection_options(hf_config).items() if k in actual}
    _check_matches("connection", actual, hf_config, expected)
    return connection_state_to_hf(connection.state_dict(), connection.dim, connection.n_streams)


def head_to_hf(head: HyperHead, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``hc_fn``, ``hc_base``, ``hc_scale`` for ``DeepseekV4HyperHead.load_state_dict`` from ``head``; with
    ``hf_config``, its sizes and epsilons must match the config's (ValueError naming the setting)."""
    if not isinstance(head, StreamHead) or head.output_read != HyperHead.output_read:
        raise ValueError(f"head must be an s2hc.HyperHead, got {type(head).__name__}")
    actual = dict(dim=head.dim, n_streams=head.n_streams, eps=head.eps, hc_eps=head.hc_eps)
    _check_matches("head", actual, hf_config, {} if hf_config is None else head_options(hf_config))
    return head_state_to_hf(head.state_dict(), head.dim, head.n_streams)
