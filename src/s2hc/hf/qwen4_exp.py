"""Qwen's gated residual: transformers' ``Qwen4ExpTextGatedResidual`` (both of its forms) <-> s2hc.

A ``Qwen4ExpTextGatedResidual(config)`` (a decoder layer's ``attn_hyper_connection`` / ``mlp_hyper_connection``)
computes what :class:`s2hc.GatedResidual` computes, and a ``Qwen4ExpTextGatedResidual(config, use_combine=False)``
(the model's ``hyper_connection_mixer``, in place of a final norm) what :class:`s2hc.GatedHead` computes
(docs/mixers.md, "Qwen's gated residual"), once the parameters are renamed. With ``n = hc_count``,
``C = hidden_size`` and ``r = hc_lowrank``:

==============================================  ======================================================
transformers                                    s2hc
==============================================  ======================================================
``hc_norm.weight`` ``(nC,)``                    ``norm_weight`` ``(nC,)``, applied as ``1 + w`` by both
``input_mix_weight_down.weight`` ``(r, nC)``    ``read_down`` ``(r, nC)``
``input_mix_weight_up.weight`` ``(nC, r)``      ``read_up`` ``(nC, r)``
``block_inject_weight.weight`` ``(n, nC)``      ``write`` ``(n, nC)`` (:class:`s2hc.GatedResidual` only: the
                                                head has none)
==============================================  ======================================================

and from the config (:func:`connection_options`): ``hidden_size`` -> ``dim``, ``hc_count`` -> ``n_streams``,
``hc_lowrank`` -> ``rank``, ``rms_norm_eps`` -> ``eps``. The config is a ``Qwen4ExpTextConfig``, a
``Qwen4ExpConfig`` (whose ``text_config`` holds these settings) or a mapping of either (a ``config.json`` read
as a dict works too).

Where transformers returns ``(h, hyper_input, w)`` and its decoder layer writes
``hyper_input + (branch(h).unsqueeze(-2) * w.unsqueeze(-1)).flatten(-2)`` on the flat ``(B, T, nC)`` streams,
s2hc's ``GatedResidual(x, branch)`` does the same on ``x`` ``(B, T, n, C)`` (``flat.unflatten(-1, (n, C))``).

The state functions (``*_state_from_hf``, ``*_state_to_hf``) map dicts of tensors, both ways, as a pure renaming
(a round trip is exact; copies, dtypes kept); a missing, unexpected or misshapen tensor raises ValueError naming
the tensor, its shape and the shape expected, and a head's tensors given for a connection (or the reverse) say
so. :func:`connection_from_hf` and :func:`head_from_hf` build the s2hc module from a config and a module or state
dict; :func:`connection_to_hf` and :func:`head_to_hf` return the state dict to load into transformers' module,
after checking that the s2hc module is of the right kind and, with a config, of its sizes and epsilon. Gradients
map the same way (the parameters are only renamed). Nothing here imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import MAX_STREAMS, check_float, check_int
from ..connection import Connection, GatedHead, GatedResidual, StreamHead
from ..connection.forms.gated_residual import GATED_RESIDUAL, check_rank
from .deepseek_v4 import _as_state, _checked

# the converter's interface, the same names as s2hc.hf.deepseek_v4's, and the transformers names
__all__ = [
    "HF_NAMES", "connection_from_hf", "connection_options", "connection_state_from_hf", "connection_state_to_hf",
    "connection_to_hf", "head_from_hf", "head_options", "head_state_from_hf", "head_state_to_hf", "head_to_hf",
]  # fmt: skip

#: transformers' tensor name -> s2hc's parameter name (a head has all but ``block_inject_weight.weight``).
HF_NAMES = {
    "hc_norm.weight": "norm_weight",
    "input_mix_weight_down.weight": "read_down",
    "input_mix_weight_up.weight": "read_up",
    "block_inject_weight.weight": "write",
}
_HEAD_NAMES = {hf: ours for hf, ours in HF_NAMES.items() if ours != "write"}
#: s2hc's option -> the config setting it comes from.
_SETTINGS = {"dim": "hidden_size", "n_streams": "hc_count", "rank": "hc_lowrank", "eps": "rms_norm_eps"}


def _text_config(hf_config: Any) -> Any:
    """The settings' holder: ``hf_config``'s ``text_config`` (a ``Qwen4ExpConfig`` or its dict), else itself."""
    nested = hf_config.get("text_config") if isinstance(hf_config, Mapping) else getattr(hf_config, "text_config", None)
    return hf_config if nested is None else nested


def _get(hf_config: Any, name: str) -> Any:
    value = hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(hf_config, name, None)
    if value is None:
        raise ValueError(f"the Qwen4-Exp config has no {name!r}")
    return value


def connection_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.GatedResidual` arguments that compute what ``Qwen4ExpTextGatedResidual(hf_config)``
    computes: ``dim``, ``n_streams``, ``rank``, ``eps``. ``hf_config``: a ``Qwen4ExpTextConfig``, a
    ``Qwen4ExpConfig`` (its ``text_config`` is read) or a mapping with their keys, each checked under its own
    name before anything is built: ``hc_count`` in [2, :data:`s2hc.checks.MAX_STREAMS`] (transformers refuses
    ``hc_count <= 1`` too), ``hc_lowrank`` as :func:`s2hc.connection.forms.gated_residual.check_rank` bounds it."""
    text = _text_config(hf_config)
    dim = check_int("hidden_size", _get(text, "hidden_size"))
    n_streams = check_int("hc_count", _get(text, "hc_count"), minimum=2, maximum=MAX_STREAMS)
    return dict(
        dim=dim,
        n_streams=n_streams,
        rank=check_rank(_get(text, "hc_lowrank"), n_streams, dim, "hc_lowrank"),
        eps=check_float("rms_norm_eps", _get(text, "rms_norm_eps"), positive=True),
    )


def head_options(hf_config: Any) -> dict[str, Any]:
    """The :class:`s2hc.GatedHead` arguments for ``Qwen4ExpTextGatedResidual(hf_config, use_combine=False)``:
    those of :func:`connection_options` (the head has the same four)."""
    return connection_options(hf_config)


# ------------------------------------------------------------------------------------------ state dicts


def _shapes(names: dict[str, str], dim: int, n: int, rank: int, hf: bool) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors ``names`` (transformers' -> s2hc's), under transformers' names if ``hf``."""
    width = n * dim
    shapes = {"norm_weight": (width,), "read_down": (rank, width), "read_up": (width, rank), "write": (n, width)}
    return {(key if hf else ours): shapes[ours] for key, ours in names.items()}


def _refuse_other_kind(state: Mapping[str, torch.Tensor], expected: dict[str, str], other: dict[str, str],
                       what: str, other_kind: str, use: str) -> None:
    """ValueError when ``state`` holds exactly the tensors of the other kind (a head's for a connection, or the
    reverse): the generic "missing" or "unexpected" message would not say what was given."""
    if isinstance(state, Mapping) and set(state) == set(other) != set(expected):
        (name,) = set(expected) ^ set(other)
        verb = "is missing" if name in expected else "is unexpected"
        raise ValueError(f"{what}: tensor {name!r} {verb}: these are {other_kind}'s tensors; convert them with {use}")


def _rename(state: Mapping[str, torch.Tensor] | nn.Module, names: dict[str, str], other: dict[str, str], *,
            to_hf: bool, dim: int, n_streams: int, rank: int, what: str, other_kind: str, use: str
            ) -> dict[str, torch.Tensor]:
    """``state`` with the tensors ``names`` (transformers' -> s2hc's) renamed one way (``to_hf``: s2hc's to
    transformers'), checked and copied; ``other``: the other kind's names, refused as such
    (:func:`_refuse_other_kind`)."""
    sizes = (f"n_streams n={n_streams}, dim C={dim}, rank r={rank}" if to_hf
             else f"hc_count n={n_streams}, hidden_size C={dim}, hc_lowrank r={rank}")
    given = {ours: ours for ours in names.values()} if to_hf else names
    _refuse_other_kind(_as_state(state), given, {ours: ours for ours in other.values()} if to_hf else other, what,
                       other_kind, use)
    checked = _checked(state, _shapes(given, dim, n_streams, rank, hf=not to_hf), what, sizes)
    if to_hf:
        return {key: checked[ours].clone() for key, ours in names.items()}
    return {ours: checked[key].clone() for key, ours in names.items()}


def connection_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int, rank: int
) -> dict[str, torch.Tensor]:
    """``Qwen4ExpTextGatedResidual``'s ``hc_norm.weight``, ``input_mix_weight_down.weight``,
    ``input_mix_weight_up.weight``, ``block_inject_weight.weight`` -> the state dict of
    ``GatedResidual(dim, n_streams, rank=rank)`` (``norm_weight``, ``read_down``, ``read_up``, ``write``), dtypes
    kept, copies. ``state``: a mapping or the module itself. Also maps gradients. A head's state (no
    ``block_inject_weight``, transformers' ``use_combine=False``) is refused as such."""
    return _rename(state, HF_NAMES, _HEAD_NAMES, to_hf=False, dim=dim, n_streams=n_streams, rank=rank,
                   what="Qwen4-Exp connection state",
                   other_kind="a head (use_combine=False, the model's hyper_connection_mixer)", use="head_from_hf")


def connection_state_to_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int, rank: int
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`connection_state_from_hf`: an s2hc gated residual's state dict (or the module) ->
    ``hc_norm.weight``, ``input_mix_weight_down.weight``, ``input_mix_weight_up.weight``,
    ``block_inject_weight.weight``, copies."""
    return _rename(state, HF_NAMES, _HEAD_NAMES, to_hf=True, dim=dim, n_streams=n_streams, rank=rank,
                   what="s2hc gated residual state", other_kind="an s2hc.GatedHead", use="head_state_to_hf")


def head_state_from_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int, rank: int
) -> dict[str, torch.Tensor]:
    """``Qwen4ExpTextGatedResidual(use_combine=False)``'s ``hc_norm.weight``, ``input_mix_weight_down.weight``,
    ``input_mix_weight_up.weight`` -> the state dict of :class:`s2hc.GatedHead` (``norm_weight``, ``read_down``,
    ``read_up``), copies. A connection's state (with ``block_inject_weight``) is refused as such."""
    return _rename(state, _HEAD_NAMES, HF_NAMES, to_hf=False, dim=dim, n_streams=n_streams, rank=rank,
                   what="Qwen4-Exp head state",
                   other_kind="a connection (use_combine=True, a decoder layer's *_hyper_connection)",
                   use="connection_from_hf")


def head_state_to_hf(
    state: Mapping[str, torch.Tensor] | nn.Module, dim: int, n_streams: int, rank: int
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`head_state_from_hf`: :class:`s2hc.GatedHead`'s state -> ``hc_norm.weight``,
    ``input_mix_weight_down.weight``, ``input_mix_weight_up.weight``, copies."""
    return _rename(state, _HEAD_NAMES, HF_NAMES, to_hf=True, dim=dim, n_streams=n_streams, rank=rank,
                   what="s2hc gated head state", other_kind="an s2hc.GatedResidual", use="connection_state_to_hf")


# ------------------------------------------------------------------------------------------ modules


def connection_from_hf(
    hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module, layer_index: int = 0
) -> GatedResidual:
    """A :class:`s2hc.GatedResidual` computing what ``Qwen4ExpTextGatedResidual(hf_config)`` with parameters
    ``state`` (its state dict or the module) computes, its parameters copies (float32, as built).
    ``layer_index`` only names it."""
    settings = connection_options(hf_config)
    connection = GatedResidual(layer_index=layer_index, **settings)
    converted = connection_state_from_hf(state, settings["dim"], settings["n_streams"], settings["rank"])
    connection.load_state_dict(converted)
    return connection


def head_from_hf(hf_config: Any, state: Mapping[str, torch.Tensor] | nn.Module) -> GatedHead:
    """A :class:`s2hc.GatedHead` computing what ``Qwen4ExpTextGatedResidual(hf_config, use_combine=False)``
    with parameters ``state`` computes."""
    settings = head_options(hf_config)
    head = GatedHead(**settings)
    head.load_state_dict(head_state_from_hf(state, settings["dim"], settings["n_streams"], settings["rank"]))
    return head


def _check_matches(kind: str, module: GatedHead, hf_config: Any | None) -> None:
    """ValueError naming the first of ``module``'s dim, n_streams, rank, eps that differs from ``hf_config``'s."""
    if hf_config is None:
        return
    for key, value in connection_options(hf_config).items():
        actual = getattr(module, key)
        if actual != value:
            raise ValueError(f"the {kind} has {key}={actual!r}, but the Qwen4-Exp config's {_SETTINGS[key]} is "
                             f"{value!r}")


def connection_to_hf(connection: GatedResidual, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``hc_norm.weight``, ``input_mix_weight_down.weight``, ``input_mix_weight_up.weight``,
    ``block_inject_weight.weight`` for ``Qwen4ExpTextGatedResidual.load_state_dict`` from ``connection``, an
    :class:`s2hc.GatedResidual` (a :class:`s2hc.GatedHead` or any other module: ValueError), copies. With
    ``hf_config``, its ``dim``, ``n_streams``, ``rank`` and ``eps`` must match the config's ``hidden_size``,
    ``hc_count``, ``hc_lowrank`` and ``rms_norm_eps`` (ValueError naming the setting and both values)."""
    if not isinstance(connection, Connection) or connection.family != GATED_RESIDUAL.name:
        hint = " (a head: convert it with head_to_hf)" if _is_gated_head(connection) else ""
        raise ValueError(f"connection must be an s2hc.GatedResidual, got {type(connection).__name__}{hint}")
    _check_matches("connection", connection, hf_config)
    return connection_state_to_hf(connection.state_dict(), connection.dim, connection.n_streams, connection.rank)


def _is_gated_head(module: object) -> bool:
    """Whether ``module`` is Qwen's gated read alone (a head that reads and does not write)."""
    return (isinstance(module, StreamHead) and module.output_read == GatedHead.output_read
            and not isinstance(module, Connection))


def head_to_hf(head: GatedHead, hf_config: Any | None = None) -> dict[str, torch.Tensor]:
    """``hc_norm.weight``, ``input_mix_weight_down.weight``, ``input_mix_weight_up.weight`` for
    ``Qwen4ExpTextGatedResidual(config, use_combine=False).load_state_dict`` from ``head``, an
    :class:`s2hc.GatedHead` (not a :class:`s2hc.GatedResidual`, which writes too: ValueError), copies; with
    ``hf_config``, its sizes and epsilon must match the config's (ValueError naming the setting)."""
    if not _is_gated_head(head):
        hint = " (a connection: convert it with connection_to_hf)" if isinstance(head, Connection) else ""
        raise ValueError(f"head must be an s2hc.GatedHead, got {type(head).__name__}{hint}")
    _check_matches("head", head, hf_config)
    return head_state_to_hf(head.state_dict(), head.dim, head.n_streams, head.rank)
