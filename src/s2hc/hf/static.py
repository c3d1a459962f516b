"""``s2hc diagnose --static``: the input-independent part of every residual matrix, read from safetensors alone.

A connection's matrices are functions of its biases plus a term driven by the token (``α · d``, ``d`` the
projection of the normalised streams). With ``d = 0`` (the streams set to zero, whose RMS norm is zero) only the
biases remain: the matrices a checkpoint would apply to a token it has no opinion about. They tell, without
data, without a GPU and without loading the model, how far each layer's mixing sits from the identity, whether
it amplifies anything, and what the product over depth does.

Three layouts are recognised, by tensor name (any prefix before them, e.g. ``model.``; qwen4_exp's: below):

- s2hc (``s2hc export``): ``blocks.L.attn_hc.*`` and ``blocks.L.mlp_hc.*`` (and ``stream_head.*`` with
  ``stream_reduce="head"``); the family and its options come from ``config.json`` beside the weights (its
  ``s2hc`` entry).
- DeepSeek-V4: transformers' ``layers.L.attn_hc.{base,scale}`` / ``layers.L.ffn_hc.*`` and ``hc_head.hc_base``,
  or the released checkpoints' ``layers.L.hc_attn_base`` / ``hc_ffn_*`` / ``hc_head_base``; ``hc_mult`` follows
  from ``base``'s length (``2n + n²``), ``hc_sinkhorn_iters`` and ``hc_eps`` from ``config.json`` when present
  (else transformers' defaults, 20 and 1e-6). ``H_res`` is reported as applied, ``combᵀ``
  (:mod:`s2hc.hf.deepseek_v4`).

- Qwen's gated residual (``qwen4_exp``), in transformers' names: ``layers.L.attn_hyper_connection.*``,
  ``layers.L.mlp_hyper_connection.*`` and ``hyper_connection_mixer.*`` (prefix ``model.``, or
  ``model.language_model.`` for the multimodal model), with ``config.json``'s ``model_type`` ``"qwen4_exp"`` or
  ``"qwen4_exp_text"`` and its ``hc_count``, ``hc_lowrank``, ``hidden_size``, ``rms_norm_eps`` and
  ``num_hidden_layers`` (under ``text_config`` for ``"qwen4_exp"``, at the top for ``"qwen4_exp_text"``, and only
  there: ``rms_norm_eps`` in the other place is not read; the eps used is the one ``family_options`` records); and
  an s2hc export of ``family="gated-residual"``.

Only the tensors the static matrices need are read (biases and scales; not the projections, whose term is
zero here, nor anything else): a sharded checkpoint's index says which shards hold them, and only those are
opened, lazily (``safetensors.safe_open``).

The gated residual has no static part: its gates have no biases, and at zero input every read gate is 0.5 and
every write gate 1 (``H_res = I`` always), whatever the weights. For it the connections' tensors are read whole
(those alone) and :func:`stream_weights` reports what the weights say per stream: weight norms, not usage (the
gates themselves are token-driven).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checks import MAX_LAYERS, check_float, check_int
from ..connection import Connection, GatedHead, GatedResidual, HyperConnection, HyperHead, build_connection, forms
from ..connection.forms.gated_residual import NAME as GATED_RESIDUAL
from ..connection.forms.lagged_mhc import LaggedHyperConnection
from ..diagnostics import report as diagnostics_report
from ..diagnostics.collect import Capture
from ..diagnostics.summary import summarize
from ..io import json_kind, read_json_object
from ..mixers.mhc import DEEPSEEK_V4_EPS
from ..models import ModelConfig
from ..reports import number, table
from . import deepseek_v41, glm5_next, hy_v4, qwen4_exp, static_attn_res, static_one_stream
from .deepseek_v4 import connection_from_hf, connection_options
from .weights import read_safetensors

__all__ = ["StaticCheckpoint", "diagnose_static", "read_static", "static_matrices", "stream_weights", "write_static"]

JSON_NAME = "static.json"
#: ``basis`` of a result: what its matrices are.
BIAS_BASIS = "biases alone (d = 0)"
GATED_BASIS = "zero input (no static part: read gates 0.5, write gates 1, H_res = I)"
S2HC = "s2hc"
DEEPSEEK_V4 = "deepseek-v4"
QWEN4_EXP = "qwen4_exp"
GLM5_NEXT = "glm5_next"
HY_V4 = "hy_v4"
DEEPSEEK_V41 = "deepseek_v41"
#: What a layout's matrices mean beyond the family's, said in the report.
LAYOUT_NOTES = {
    DEEPSEEK_V41: "DeepSeek-V4.1 is single-pass: each site's read weights (pre) are read by the next site, the first "
                  "site reads stream 0 alone, and the final norm's input is the streams read with the last FFN "
                  "site's pre (it has no head of its own).",
}
#: config.json model_types of the qwen4_exp layout: the text model's settings at the top, or under text_config.
QWEN4_EXP_TYPES = ("qwen4_exp", "qwen4_exp_text")
#: The config.json settings the qwen4_exp layout needs.
QWEN4_EXP_SETTINGS = ("hc_count", "hc_lowrank", "hidden_size", "rms_norm_eps", "num_hidden_layers")
# s2hc: every tensor of a connection but the token-driven ones (the projection and the norm before it).
_S2HC_KEY = re.compile(r"^(?P<prefix>.*?)blocks\.(?P<layer>\d+)\.(?P<sublayer>attn|mlp)_hc\.(?P<param>.+)$")
_S2HC_DYNAMIC = ("projection", "norm_weight")
_S2HC_HEAD = re.compile(r"^(?P<prefix>.*?)stream_head\.(?P<param>bias|alpha)$")  # stream_reduce="head"
_S2HC_GATED_HEAD = re.compile(r"^(?P<prefix>.*?)stream_head\.(?P<param>norm_weight|read_down|read_up)$")
# qwen4_exp: the text model's prefixes only (an mtp.* module may hold connections of its own: not the model's).
_QWEN_PREFIX = r"(?P<prefix>(?:model\.)?(?:language_model\.)?)"
_QWEN_KEY = re.compile(
    rf"^{_QWEN_PREFIX}layers\.(?P<layer>\d+)\.(?P<sublayer>attn|mlp)_hyper_connection\.(?P<param>.+)$")
_QWEN_HEAD = re.compile(rf"^{_QWEN_PREFIX}hyper_connection_mixer\.(?P<param>.+)$")
_QWEN_STORED = {ours: hf for hf, ours in qwen4_exp.HF_NAMES.items()}  # s2hc's parameter -> transformers' tensor
_DSV4_KEYS = (
    re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<sublayer>attn|ffn)_hc\.(?P<param>base|scale)$"),
    re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.hc_(?P<sublayer>attn|ffn)_(?P<param>base|scale)$"),
)
_DSV4_HEAD = re.compile(r"^(?P<prefix>.*?)hc_head(?:\.hc_|_)(?P<param>base|scale)$")
# Hy4: transformers' module names (those of DeepSeek-V4, told apart by config.json's model_type "hy_v4") or the
# names its checkpoints store (hc_pre.*); the text model's only (model.mtp_layers.* is not the model's).
_HY_KEYS = (
    re.compile(r"^(?P<prefix>(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<sublayer>attn|ffn)_hc\.(?P<param>base|scale)$"),
    re.compile(r"^(?P<prefix>(?:model\.)?)layers\.(?P<layer>\d+)\.hc_pre\.hc_(?P<sublayer>attn|mlp)_layer\.hc_"
               r"(?P<param>base|scale)$"),
)
_HY_HEAD = re.compile(r"^(?P<prefix>(?:model\.)?)(?:hc_head\.hc_|hc_pre\.hc_head\.hc_head_)(?P<param>base|scale)$")
_LOOKED_FOR = ("s2hc's blocks.L.{attn,mlp}_hc.*, DeepSeek-V4's layers.L.{attn,ffn}_hc.{base,scale}, "
               "layers.L.hc_{attn,ffn}_{base,scale}, qwen4_exp's layers.L.{attn,mlp}_hyper_connection.*")


@dataclass
class StaticCheckpoint:
    """The hyper-connections of a checkpoint, rebuilt from their stored biases.

    ``connections``: ``(name, HyperConnection)`` in depth order (per layer the attention's, then the MLP's),
    float64, their token-driven parameters left at zero; ``head``: DeepSeek-V4's ``HyperHead`` or None. For the
    gated residual (``family="gated-residual"``): ``(name, GatedResidual)`` holding the checkpoint's tensors
    themselves (its dtype, not copied) and ``head`` a ``GatedHead`` or None.
    ``tensors_read``: the names of the tensors read, ``files``: the safetensors files opened.
    """

    source: str
    layout: str
    family: str
    n_streams: int
    family_options: dict[str, Any]
    connections: list[tuple[str, HyperConnection | GatedResidual]]
    head: HyperHead | GatedHead | None = None
    tensors_read: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def transposed(self) -> bool:
        return bool(self.family_options.get("transpose_res", False))

    @property
    def gated(self) -> bool:
        """Qwen's gated residual: no static part, :func:`stream_weights` instead."""
        return self.family == GATED_RESIDUAL


# ------------------------------------------------------------------------------------------------ files


def _config(directory: Path) -> dict[str, Any]:
    """``config.json`` beside the weights as a dict, ``{}`` when there is none; ValueError naming the file and its
    defect (a directory, unreadable, not UTF-8, not JSON, not a JSON object)."""
    path = directory / "config.json"
    if not path.exists():
        return {}
    remedy = "config.json beside the weights must be the model's config, a JSON object"
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; {remedy}")
    try:
        return read_json_object(path, remedy)
    except OSError as error:
        raise ValueError(f"cannot read {str(path)!r}: {error.strerror or error}") from None


def _check_finite(source: str, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor that is not floating point (a connection's weights and biases are; an
    integer or boolean one is a damaged or foreign checkpoint) or holds NaN or an infinity: its static matrices
    would be NaN, and a report of ``nan`` everywhere says nothing about where the checkpoint went wrong."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if not tensor.is_floating_point():
            raise ValueError(f"{source!r}: tensor {name} has dtype {str(tensor.dtype).removeprefix('torch.')}; a "
                             "checkpoint's hyper-connection tensors are floating point (float32, bfloat16, ...)")
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(f"{source!r}: tensor {name} holds {bad} non-finite value(s) (NaN or infinity) of "
                             f"{tensor.numel()}; a checkpoint's hyper-connection tensors must be finite")


def _wanted(name: str, gated: bool = False) -> bool:
    """Whether ``name`` is a tensor the static reading needs: every hyper-connection tensor but the token-driven
    ones, and for the gated residual (``gated``: an s2hc export of that family; qwen4_exp's names always) all of
    a connection's tensors (it has no others)."""
    s2hc = _S2HC_KEY.match(name)
    if s2hc:
        return gated or s2hc["param"] not in _S2HC_DYNAMIC
    patterns = (_S2HC_GATED_HEAD,) if gated else (_S2HC_HEAD,)
    return any(pattern.match(name) for pattern in (*patterns, *_DSV4_KEYS, _DSV4_HEAD, _QWEN_KEY, _QWEN_HEAD,
                                                   *_HY_KEYS, _HY_HEAD))


def _directory(path: str | Path) -> Path:
    """Where ``config.json`` would be for ``path`` (a file's folder, or the folder itself: the directory
    :func:`s2hc.hf.weights.read_safetensors` reads from)."""
    path = Path(path).expanduser()
    return path.parent if path.is_file() else path


def _s2hc_family(config: dict[str, Any]) -> str | None:
    settings = config.get("s2hc")
    return settings.get("family") if isinstance(settings, dict) else None


# ------------------------------------------------------------------------------------------------ layouts


def _s2hc_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    settings = config.get("s2hc")
    if settings is not None and not isinstance(settings, dict):
        raise ValueError(f"{source!r}: config.json's 's2hc' entry is {json_kind(settings)}, not the object of model "
                         "settings `s2hc export` writes")
    if not isinstance(settings, dict):
        raise ValueError(f"{source!r} has s2hc hyper-connection tensors but no config.json with an 's2hc' entry "
                         "beside them (an `s2hc export` directory has one); the family cannot be known without it")
    try:
        model = ModelConfig.from_dict(settings)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{source!r}: config.json's 's2hc' entry is not a model s2hc builds: {error}") from None
    gated = model.family == GATED_RESIDUAL
    if not gated and not forms.get(model.family).has_res:  # AttnRes, the wide and one-stream residuals
        raise ValueError(f"{source!r} is an s2hc export of family {model.family!r}, which has no residual matrix: "
                         "--static reads the input-independent part of each H_res (its biases alone), and there is "
                         "none; measure the run itself (s2hc diagnose RUN), which reports the family's own maps")
    grouped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = _S2HC_KEY.match(name)
        if key is None:
            head[(_S2HC_GATED_HEAD if gated else _S2HC_HEAD).match(name)["param"]] = tensor
            continue
        grouped.setdefault((int(key["layer"]), key["sublayer"]), {})[key["param"]] = tensor
    connections = []
    for layer in range(model.n_layers):
        for sublayer in ("attn", "mlp"):
            state = grouped.pop((layer, sublayer), None)
            name = f"blocks.{layer}.{sublayer}_hc"
            if state is None:
                raise ValueError(f"{source!r}: the hyper-connection tensors of {name} are missing "
                                 f"(config.json says {model.n_layers} layers of family {model.family!r})")
            if gated:  # built on the meta device, then given the checkpoint's tensors: no copy of a large model
                with torch.device("meta"):
                    connection = build_connection(model.dim, model.n_streams, family=model.family, layer_index=layer,
                                                  **model.family_options)
                _load_gated(connection, {f"{name}.{k}": v for k, v in state.items()}, name, source,
                            f"family {model.family!r}, dim={model.dim}, n_streams={model.n_streams}")
            else:
                connection = HyperConnection(1, model.n_streams, family=model.family, layer_index=layer,
                                             **model.family_options).double()
                _load(connection, state, name, source)
            connections.append((name, connection))
    if grouped:
        extra = sorted(f"blocks.{layer}.{sublayer}_hc" for layer, sublayer in grouped)
        raise ValueError(f"{source!r} has hyper-connection tensors of {extra}, beyond the {model.n_layers} layers "
                         "of its config.json")
    hyper_head = None
    if head and gated:
        with torch.device("meta"):
            hyper_head = GatedHead(model.dim, model.n_streams, **model.family_options)
        _load_gated(hyper_head, {f"stream_head.{k}": v for k, v in head.items()}, "stream_head", source,
                    f"family {model.family!r}, dim={model.dim}, n_streams={model.n_streams}")
    elif head:
        hyper_head = HyperHead(1, model.n_streams, eps=model.norm_eps,
                               hc_eps=model.family_options.get("hc_eps", DEEPSEEK_V4_EPS)).double()
        _load_head(hyper_head, head, {"bias": "bias", "alpha": "alpha"}, source)
    return model.family, model.n_streams, dict(model.family_options), connections, hyper_head


def _load_head(head: HyperHead, state: dict[str, torch.Tensor], names: dict[str, str], source: str) -> None:
    """Set ``head``'s bias and α from ``state`` (keys: ``names``' values); ValueError naming a bad tensor."""
    n = head.n_streams
    for param, shape in (("bias", (n,)), ("alpha", (1,))):
        value = state.get(names[param])
        if value is None or value.numel() != math.prod(shape):
            found = None if value is None else tuple(value.shape)
            raise ValueError(f"{source!r}: the hyper-head needs a {names[param]} of shape {shape}, found {found}")
        getattr(head, param).copy_(value.double().reshape(shape))


def _load(connection: HyperConnection, state: dict[str, torch.Tensor], name: str, source: str) -> None:
    """Load ``state`` (all but the token-driven tensors) into ``connection``; ValueError naming what differs."""
    expected = {k: tuple(v.shape) for k, v in connection.state_dict().items() if k not in _S2HC_DYNAMIC}
    for key, shape in expected.items():
        if key not in state:
            raise ValueError(f"{source!r}: tensor {name}.{key} is missing (expected shape {shape})")
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{source!r}: tensor {name}.{key} has shape {tuple(state[key].shape)}, expected {shape} "
                             f"(n_streams={connection.n_streams}, family {connection.family!r})")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source!r}: unexpected tensor(s) {[f'{name}.{k}' for k in unexpected]} for family "
                         f"{connection.family!r}")
    connection.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)


def _load_gated(module: GatedHead, state: dict[str, torch.Tensor], name: str, source: str, sizes: str,
                stored: dict[str, str] | None = None) -> None:
    """Give ``module`` (a :class:`GatedResidual` or :class:`GatedHead`, built on the meta device) the tensors of
    ``state`` (keyed by the checkpoint's full names: ``name.`` and ``stored[param]``, the param's own name
    without ``stored``) as they are, no copy; ValueError naming the first tensor that is missing, unexpected or of
    another shape than ``module``'s (``sizes`` says where its shape comes from)."""
    stored = stored or {}
    expected = {f"{name}.{stored.get(k, k)}": (k, tuple(v.shape)) for k, v in module.state_dict().items()}
    for key, (_, shape) in expected.items():
        if key not in state:
            raise ValueError(f"{source!r}: tensor {key} is missing (expected shape {shape}; {sizes})")
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{source!r}: tensor {key} has shape {tuple(state[key].shape)}, expected {shape} "
                             f"({sizes})")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source!r}: unexpected tensor(s) {unexpected} beside {name}'s {sorted(expected)}")
    module.load_state_dict({param: state[key] for key, (param, _) in expected.items()}, assign=True)


def _qwen_settings(source: str, config: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
    """``(GatedResidual options, number of layers, sizes text)`` from a qwen4_exp ``config.json``; ValueError
    (one line) for no config.json, another model_type, or a missing or invalid setting."""
    if not config:
        raise ValueError(f"{source!r} has qwen4_exp hyper-connection tensors but no config.json beside them; "
                         f"{', '.join(QWEN4_EXP_SETTINGS)} come from it")
    model_type = config.get("model_type")
    if model_type is not None and model_type not in QWEN4_EXP_TYPES:
        raise ValueError(f"{source!r} has qwen4_exp hyper-connection tensors, but config.json's model_type is "
                         f"{model_type!r}, not one of {list(QWEN4_EXP_TYPES)}")
    nested = model_type == "qwen4_exp" or (model_type is None and isinstance(config.get("text_config"), dict))
    text, where = (config.get("text_config"), "text_config.") if nested else (config, "")
    if not isinstance(text, dict):
        raise ValueError(f"{source!r}: config.json (model_type {model_type!r}) has no text_config object holding "
                         f"{', '.join(QWEN4_EXP_SETTINGS)}")
    for key in QWEN4_EXP_SETTINGS:
        if text.get(key) is None:
            raise ValueError(f"{source!r}: config.json has no {where}{key} (model_type {model_type!r}); the qwen4_exp "
                             f"layout needs {', '.join(QWEN4_EXP_SETTINGS)}")
    try:  # only the settings of the one place model_type names: a text_config beside top-level settings is not read
        options = qwen4_exp.connection_options({key: text[key] for key in QWEN4_EXP_SETTINGS})
        layers = check_int("num_hidden_layers", text["num_hidden_layers"], maximum=MAX_LAYERS)
    except ValueError as error:
        raise ValueError(f"{source!r}: config.json: {where}{error}") from None
    sizes = (f"config.json: hc_count={options['n_streams']}, hidden_size={options['dim']}, "
             f"hc_lowrank={options['rank']}")
    return options, layers, sizes


def _qwen_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    options, layers, sizes = _qwen_settings(source, config)
    prefixes = sorted({(_QWEN_KEY.match(name) or _QWEN_HEAD.match(name))["prefix"] for name in tensors})
    if len(prefixes) > 1:
        raise ValueError(f"{source!r} has qwen4_exp hyper-connection tensors under several prefixes {prefixes}; a "
                         "checkpoint holds one model")
    (prefix,) = prefixes
    grouped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _QWEN_KEY.match(name)
        if match:
            grouped.setdefault((int(match["layer"]), match["sublayer"]), {})[name] = tensor
        else:
            head[name] = tensor
    connections = []
    for layer in range(layers):
        for sublayer in ("attn", "mlp"):
            name = f"{prefix}layers.{layer}.{sublayer}_hyper_connection"
            state = grouped.pop((layer, sublayer), None)
            if state is None:
                raise ValueError(f"{source!r}: the hyper-connection tensors of {name} are missing (config.json says "
                                 f"num_hidden_layers={layers})")
            with torch.device("meta"):
                connection = GatedResidual(layer_index=layer, **options)
            _load_gated(connection, state, name, source, sizes, _QWEN_STORED)
            connections.append((name, connection))
    if grouped:
        extra = sorted(f"{prefix}layers.{layer}.{sublayer}_hyper_connection" for layer, sublayer in grouped)
        raise ValueError(f"{source!r} has hyper-connection tensors of {extra}, beyond config.json's "
                         f"num_hidden_layers={layers}")
    name = f"{prefix}hyper_connection_mixer"
    if not head:
        raise ValueError(f"{source!r}: the tensors of {name} are missing (every qwen4_exp model ends with this gated "
                         "read, Qwen4ExpTextGatedResidual(use_combine=False))")
    with torch.device("meta"):
        hyper_head = GatedHead(**options)
    _load_gated(hyper_head, head, name, source, sizes, _QWEN_STORED)
    return GATED_RESIDUAL, options["n_streams"], {"rank": options["rank"], "eps": options["eps"]}, connections, \
        hyper_head


def _streams_of(base: torch.Tensor, name: str, source: str) -> int:
    """``n`` from ``base`` ``(2n + n²,)``."""
    size = base.numel()
    n = round(-1 + (1 + size) ** 0.5)
    if base.dim() != 1 or n < 1 or n * n + 2 * n != size:
        raise ValueError(f"{source!r}: tensor {name} has shape {tuple(base.shape)}; DeepSeek-V4's base is (2n + n²,)")
    return n


def _deepseek_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    grouped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    names: dict[tuple[int, str], str] = {}
    for name, tensor in tensors.items():
        match = next((m for m in (p.match(name) for p in _DSV4_KEYS) if m), None)
        if match:
            sublayer = "attn" if match["sublayer"] == "attn" else "ffn"
            grouped.setdefault((int(match["layer"]), sublayer), {})[match["param"]] = tensor
            names[(int(match["layer"]), sublayer)] = name.rsplit(".", 1)[0] if "_hc." in name else name
        else:
            head[_DSV4_HEAD.match(name)["param"]] = tensor
    if not grouped:
        raise ValueError(f"{source!r} has a DeepSeek-V4 hyper-head but no connection tensors")
    first = min(grouped)
    if "base" not in grouped[first]:
        raise ValueError(f"{source!r}: layer {first[0]}'s {first[1]} connection has no base tensor")
    n = _streams_of(grouped[first]["base"], f"layers.{first[0]}.{first[1]}_hc.base", source)
    hf_config = {"hidden_size": 1, "hc_mult": n, "hc_sinkhorn_iters": config.get("hc_sinkhorn_iters", 20),
                 "hc_eps": config.get("hc_eps", 1e-6), "rms_norm_eps": config.get("rms_norm_eps", 1e-6)}
    if config.get("hc_mult", n) != n:
        raise ValueError(f"{source!r}: config.json says hc_mult={config['hc_mult']}, but base has {n} streams")
    try:  # the counts and epsilons of config.json, bounded before anything runs (10**11 Sinkhorn rounds would not end)
        checked = connection_options(hf_config)
    except ValueError as error:
        raise ValueError(f"{source!r}: config.json: {error}") from None
    hf_config.update(hc_sinkhorn_iters=checked["iterations"], hc_eps=checked["hc_eps"], rms_norm_eps=checked["eps"])
    connections = []
    layers = sorted({layer for layer, _ in grouped})
    for layer in layers:
        for sublayer in ("attn", "ffn"):
            state = grouped.get((layer, sublayer))
            name = f"layers.{layer}.{sublayer}_hc"
            if state is None or set(state) != {"base", "scale"}:
                have = sorted(state or {})
                raise ValueError(f"{source!r}: {name} needs base and scale, found {have}")
            state = {"fn": torch.zeros((2 + n) * n, n, dtype=torch.float64),  # the token-driven term: zero here
                     **{k: v.double() for k, v in state.items()}}
            try:
                connection = connection_from_hf(hf_config, state, layer_index=layer).double()
            except ValueError as error:
                raise ValueError(f"{source!r}: {name}: {error}") from None
            connections.append((name, connection))
    hyper_head = None
    if head:
        hyper_head = HyperHead(1, n, eps=hf_config["rms_norm_eps"], hc_eps=hf_config["hc_eps"]).double()
        _load_head(hyper_head, head, {"bias": "base", "alpha": "scale"}, source)
    options = {"variant": DEEPSEEK_V4, "iterations": hf_config["hc_sinkhorn_iters"], "hc_eps": hf_config["hc_eps"]}
    return "mhc", n, options, connections, hyper_head


def _headless_layers(source: str, tensors: dict[str, torch.Tensor], layers: int, why: str
                     ) -> dict[str, torch.Tensor]:
    """The DeepSeek-V4-named connection tensors of the model's ``layers`` layers (later ones, the released
    checkpoints' multi-token-prediction layer, left out) of a design without a hyper-head: a head tensor is refused,
    saying ``why``."""
    kept = {}
    for name, tensor in tensors.items():
        match = next((m for m in (p.match(name) for p in _DSV4_KEYS) if m), None)
        if match is None:
            raise ValueError(f"{source!r}: tensor {name} is a hyper-head's; {why}")
        if int(match["layer"]) < layers:
            kept[name] = tensor
    return kept


def _glm_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    """GLM-5.3 (config.json's model_type ``glm5_next`` or ``glm5_next_text``): DeepSeek-V4's connections (its
    tensors, its names), the settings from the text model's config; layers from ``num_hidden_layers`` on (the
    released checkpoints' multi-token-prediction layer) are not the model's and are left out. Its final read is the
    streams' mean: no head."""
    try:
        text = glm5_next.text_config(config)
        layers = check_int("num_hidden_layers", text.get("num_hidden_layers") if isinstance(text, dict) else None,
                           maximum=MAX_LAYERS)
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{source!r}: config.json (GLM-5.3): {error}") from None
    kept = _headless_layers(source, tensors, layers, "GLM-5.3 reads its streams by their mean")
    family, n, options, connections, head = _deepseek_connections(source, kept, text)
    options["eps"] = check_float("rms_norm_eps", text.get("rms_norm_eps", 1e-5), positive=True)
    return family, n, options, connections, head


def _deepseek_v41_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    """DeepSeek-V4.1 (config.json's model_type ``deepseek_v41`` or ``deepseek_v41_text``): DeepSeek-V4's tensors and
    names at each site, the settings from the text model's config (each required, as :mod:`s2hc.hf.deepseek_v41`
    reads them), ``family="mhc-lagged"``; layers from ``num_hidden_layers`` on are not the model's and are left
    out. It has no head: a hyper-head tensor is refused."""
    try:
        text = deepseek_v41.text_config(config)
        settings = deepseek_v41.connection_options({**text, "hidden_size": 1})
        layers = check_int("num_hidden_layers", text.get("num_hidden_layers"), maximum=MAX_LAYERS)
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{source!r}: config.json (DeepSeek-V4.1): {error}") from None
    kept = _headless_layers(source, tensors, layers, "DeepSeek-V4.1 has none (the final norm reads the streams "
                            "with the last FFN site's pre)")
    _, n, _, read, _ = _deepseek_connections(source, kept, text)
    if n != settings["n_streams"]:
        raise ValueError(f"{source!r}: config.json says hc_mult={settings['n_streams']}, but base has {n} streams")
    connections = []
    for name, connection in read:
        lagged = LaggedHyperConnection(**settings, layer_index=connection.layer_index).double()
        lagged.load_state_dict(connection.state_dict())
        connections.append((name, lagged))
    options = {key: settings[key] for key in ("iterations", "hc_eps", "eps")}
    return deepseek_v41.FAMILY, n, options, connections, None


def _hy_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    """Hy4 (``hy_v4``): ``family="ihc"``; ``n`` from ``base``'s length (2n), ``hc_eps``, ``hc_magnitude`` and
    ``rms_norm_eps`` from config.json when present (else ``HYV4Config``'s defaults, 1e-6, 2.0 and 1e-5)."""
    grouped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = next((m for m in (p.match(name) for p in _HY_KEYS) if m), None)
        if match:
            sublayer = "attn" if match["sublayer"] == "attn" else "ffn"
            grouped.setdefault((int(match["layer"]), sublayer), {})[match["param"]] = tensor
        elif _HY_HEAD.match(name):
            head[_HY_HEAD.match(name)["param"]] = tensor
        # anything else (model.mtp_layers.*: the multi-token-prediction module) is not the model's
    if not grouped:
        raise ValueError(f"{source!r} has a Hy4 hyper-head but no connection tensors")
    first = min(grouped)
    base = grouped[first].get("base")
    if base is None or base.dim() != 1 or base.numel() % 2 or base.numel() == 0:
        found = None if base is None else tuple(base.shape)
        raise ValueError(f"{source!r}: layer {first[0]}'s {first[1]} connection needs a base of shape (2n,), found "
                         f"{found}")
    n = base.numel() // 2
    settings = {"hidden_size": 1, "hc_mult": config.get("hc_mult", n), "hc_eps": config.get("hc_eps", 1e-6),
                "hc_magnitude": config.get("hc_magnitude", 2.0), "rms_norm_eps": config.get("rms_norm_eps", 1e-5)}
    try:
        options = hy_v4.connection_options(settings)
    except ValueError as error:
        raise ValueError(f"{source!r}: config.json: {error}") from None
    if options["n_streams"] != n:
        raise ValueError(f"{source!r}: config.json says hc_mult={options['n_streams']}, but base has {n} streams")
    connections = []
    for layer in sorted({layer for layer, _ in grouped}):
        for sublayer in ("attn", "ffn"):
            state = grouped.get((layer, sublayer))
            name = f"layers.{layer}.{sublayer}_hc"
            if state is None or set(state) != {"base", "scale"}:
                raise ValueError(f"{source!r}: {name} needs base and scale, found {sorted(state or {})}")
            state = {"fn": torch.zeros(2 * n, n, dtype=torch.float64), **{k: v.double() for k, v in state.items()}}
            try:
                connection = hy_v4.connection_from_hf(settings, state, layer_index=layer).double()
            except ValueError as error:
                raise ValueError(f"{source!r}: {name}: {error}") from None
            connections.append((name, connection))
    hyper_head = None
    if head:
        hyper_head = HyperHead(1, n, eps=options["eps"], hc_eps=options["hc_eps"]).double()
        _load_head(hyper_head, head, {"bias": "base", "alpha": "scale"}, source)
    family_options = {k: options[k] for k in ("hc_eps", "hc_magnitude", "eps")}
    return hy_v4.FAMILY, n, family_options, connections, hyper_head


@torch.no_grad()
def read_static(path: str | Path) -> StaticCheckpoint:
    """The hyper-connections stored in ``path`` (a ``.safetensors`` file, a directory of them, or a sharded
    checkpoint's directory or index), rebuilt from their biases; see the module docstring for the layouts.
    ValueError (one sentence) for a missing or unreadable path, no hyper-connection tensors, a missing
    ``config.json`` for the s2hc layout, or tensors of the wrong shape."""
    source = str(path)
    config = _config(_directory(path))  # read first: an s2hc export's says which tensors it needs
    gated = _s2hc_family(config) == GATED_RESIDUAL
    tensors, opened, _ = read_safetensors(path, lambda name: _wanted(name, gated))
    if not tensors:
        if config.get("model_type") in QWEN4_EXP_TYPES:
            raise ValueError(f"{source!r} is a qwen4_exp checkpoint (config.json's model_type "
                             f"{config['model_type']!r}) but holds no hyper-connection tensors (looked for "
                             "[model.[language_model.]]layers.L.{attn,mlp}_hyper_connection.* and "
                             "hyper_connection_mixer.*)")
        raise ValueError(f"{source!r} holds no hyper-connection tensors (looked for {_LOOKED_FOR}); a residual "
                         "model has none")
    _check_finite(source, tensors)
    kinds = {S2HC: [n for n in tensors if _S2HC_KEY.match(n) or _S2HC_HEAD.match(n) or _S2HC_GATED_HEAD.match(n)],
             QWEN4_EXP: [n for n in tensors if _QWEN_KEY.match(n) or _QWEN_HEAD.match(n)]}
    kinds[DEEPSEEK_V4] = [n for n in tensors if n not in kinds[S2HC] and n not in kinds[QWEN4_EXP]]
    found = {layout: names for layout, names in kinds.items() if names}
    if len(found) > 1:  # several layouts: which one the model uses is unknown
        (first, a), (second, b) = list(found.items())[:2]
        raise ValueError(f"{source!r} mixes {first} hyper-connection tensors ({a[0]!r}) with {second} ones "
                         f"({b[0]!r}); a checkpoint holds one layout")
    (layout,) = found
    model_type = config.get("model_type")
    if layout == DEEPSEEK_V4 and (model_type == hy_v4.MODEL_TYPE or any(".hc_pre." in n or n.startswith("hc_pre.")
                                                                        for n in tensors)):
        layout = HY_V4
    elif layout == DEEPSEEK_V4 and model_type in glm5_next.MODEL_TYPES:
        layout = GLM5_NEXT
    elif layout == DEEPSEEK_V4 and model_type in deepseek_v41.MODEL_TYPES:
        layout = DEEPSEEK_V41
    read = {S2HC: _s2hc_connections, QWEN4_EXP: _qwen_connections, DEEPSEEK_V4: _deepseek_connections,
            HY_V4: _hy_connections, GLM5_NEXT: _glm_connections, DEEPSEEK_V41: _deepseek_v41_connections}[layout]
    family, n, options, connections, head = read(source, tensors, config)
    return StaticCheckpoint(source=source, layout=layout, family=family, n_streams=n, family_options=options,
                            connections=connections, head=head, tensors_read=sorted(tensors), files=opened)


@torch.no_grad()
def static_matrices(checkpoint: StaticCheckpoint) -> dict[str, torch.Tensor]:
    """Every connection's matrices at ``d = 0``, float64: ``pre`` ``(L, n)``, ``post`` ``(L, n)``, ``res``
    ``(L, n, n)`` (as applied, ``X' = res X``), and ``head`` ``(n,)`` when there is a hyper-head. For the gated
    residual, the matrices of a zero input (:meth:`s2hc.GatedResidual.matrices`: ``pre`` 0.5/n, ``post`` 1,
    ``res`` I, whatever the weights) and no ``head`` (its read is token-driven alone)."""
    if checkpoint.gated:
        dim = checkpoint.connections[0][1].dim
        zero = torch.zeros(1, 1, checkpoint.n_streams, dim, dtype=torch.float64)
        found = [c.matrices(zero) for _, c in checkpoint.connections]
        return {key: torch.cat([m[key] for m in found]).flatten(0, 1) for key in ("pre", "post", "res")}
    zero = torch.zeros(1, 1, checkpoint.n_streams, 1, dtype=torch.float64)
    pre, post, res = zip(*(c.coefficients(zero) for _, c in checkpoint.connections))
    out = {"pre": torch.cat(pre).flatten(0, 1), "post": torch.cat(post).flatten(0, 1),
           "res": torch.cat(res).flatten(0, 1)}
    if checkpoint.head is not None:
        out["head"] = checkpoint.head.weights(zero)[0, 0]
    return out


#: What each per-stream measure of the gated residual is (:func:`stream_weights`), in report order.
STREAM_MEASURES = {
    "norm_scale": "mean norm scale 1 + w over the stream's C channels (hc_norm.weight / norm_weight)",
    "write_norm": "‖W_w[s]‖, the norm of the stream's write row (block_inject_weight row s / write row s)",
    "read_up_norm": "Frobenius norm of the stream's block of the read gates' up projection (input_mix_weight_up / "
                    "read_up rows s·C..(s+1)·C)",
    "read_down_norm": "Frobenius norm of the read gates' down projection's columns of the stream "
                      "(input_mix_weight_down / read_down columns s·C..(s+1)·C)",
}
STREAM_WEIGHTS_NOTE = (
    "The gated residual has no static part: its gates have no biases, and at zero input every read gate is 0.5 "
    "and every write gate 1 for every stream (H_res = I always), whatever the weights. The gates themselves are "
    "token-driven; what the weights say per stream is below. These are weight norms, not usage: how much a stream "
    "is read or written depends on the tokens."
)


def _per_stream(module: GatedHead) -> dict[str, torch.Tensor]:
    """``module``'s per-stream measures (:data:`STREAM_MEASURES`), each ``(n,)`` in float64 (no write for a
    head)."""
    n, dim, rank = module.n_streams, module.dim, module.rank
    out = {
        "norm_scale": (1.0 + module.norm_weight.double().view(n, dim)).mean(dim=-1),
        "read_up_norm": module.read_up.double().view(n, dim, rank).square().sum(dim=(1, 2)).sqrt(),
        "read_down_norm": module.read_down.double().view(rank, n, dim).square().sum(dim=(0, 2)).sqrt(),
    }
    if isinstance(module, Connection):  # a connection writes; the head only reads
        out["write_norm"] = module.write.double().norm(dim=-1)
    return {key: out[key] for key in STREAM_MEASURES if key in out}


def _shares(values: torch.Tensor) -> torch.Tensor:
    """Each stream's share of the sum over streams (last dim); NaN where that sum is zero."""
    total = values.sum(dim=-1, keepdim=True)
    return values / total.masked_fill(total == 0, float("nan"))


@torch.no_grad()
def stream_weights(checkpoint: StaticCheckpoint) -> dict[str, Any]:
    """What a gated-residual checkpoint's weights say per stream s (the gated residual has no static part: see
    :data:`STREAM_WEIGHTS_NOTE`): for every connection, the measures of :data:`STREAM_MEASURES` and each one's
    share of its sum over the streams (1/n each when no stream stands out), and the same across depth.

    Returns a JSON-ready dict: ``note``; ``measures`` (name -> description); ``connections`` (name ->
    ``{"values": L × n, "shares": L × n}``, rows in depth order, ``layers`` their names); ``head`` (the final read's
    ``{"values": n, "shares": n}`` per measure, no write) or None; ``across_depth`` (per measure: ``mean`` and
    ``mean_share`` per stream over the connections, and ``max_share``: the largest share of any stream at any
    connection, with the stream and the connection)."""
    if not checkpoint.gated:
        raise ValueError(f"stream_weights is for family {GATED_RESIDUAL!r}, got {checkpoint.family!r}")
    names = [name for name, _ in checkpoint.connections]
    found = [_per_stream(c) for _, c in checkpoint.connections]
    connections, across = {}, {}
    for key in STREAM_MEASURES:
        values = torch.stack([f[key] for f in found])
        shares = _shares(values)
        connections[key] = {"values": values.tolist(), "shares": shares.tolist()}
        flat = int(shares.nan_to_num(-math.inf).argmax())
        layer, stream = divmod(flat, checkpoint.n_streams)
        across[key] = {"mean": values.mean(dim=0).tolist(), "mean_share": shares.mean(dim=0).tolist(),
                       "max_share": {"share": shares[layer, stream].item(), "stream": stream,
                                     "connection": names[layer]}}
    head = None
    if checkpoint.head is not None:
        head = {key: {"values": v.tolist(), "shares": _shares(v).tolist()} for key, v in
                _per_stream(checkpoint.head).items()}
    return {"note": STREAM_WEIGHTS_NOTE, "measures": dict(STREAM_MEASURES), "layers": names,
            "connections": connections, "head": head, "across_depth": across}


# ------------------------------------------------------------------------------------------------ report


def diagnose_static(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Measure the static matrices of ``path`` (:func:`read_static`, :func:`static_matrices`) with every
    measurement of :func:`s2hc.diagnostics.summary.summarize` (one "token": the biases alone). With ``out``,
    writes ``out/static.json``, the figures and ``out/report.md`` (only after the checkpoint was read).
    Returns the JSON object: ``kind`` ("static"), ``source``, ``layout``, ``family``, ``n_streams``,
    ``family_options``, ``tensors_read``, ``files``, ``head_weights`` (DeepSeek-V4's hyper-head, or None),
    ``matrices`` (``pre``, ``post``, ``res`` as nested lists), ``basis`` (what the matrices are: the biases
    alone, or a zero input for the gated residual), ``stream_weights`` (:func:`stream_weights` for the gated
    residual, else None) and the summary's keys. A one-stream design (Muse Spark, Ergo, ZAYA, Beam: no residual
    matrix) gives its learned maps instead (:mod:`s2hc.hf.static_one_stream`), an Attention Residuals design
    (Inkling-2, Kimi-K3) the bounds of its depth reads (:mod:`s2hc.hf.static_attn_res`)."""
    config = static_one_stream.read_config(path)
    result = None
    if (design := static_one_stream.design_of(config)) is not None:
        result = static_one_stream.diagnose_one_stream(path, config, design)
    elif (design := static_attn_res.design_of(config)) is not None:
        result = static_attn_res.diagnose_attn_res(path, config, design)
    if result is not None:
        if out is not None:
            write_static(result, out)
        return result
    checkpoint = read_static(path)
    matrices = static_matrices(checkpoint)
    names = [name for name, _ in checkpoint.connections]
    summary = summarize(Capture(names, [checkpoint.family] * len(names), matrices["res"][:, None],
                                matrices["pre"][:, None], matrices["post"][:, None], similarity=None,
                                transposed=[checkpoint.transposed] * len(names)))
    result = {
        "kind": "static",
        "source": checkpoint.source,
        "layout": checkpoint.layout,
        "family": checkpoint.family,
        "n_streams": checkpoint.n_streams,
        "family_options": checkpoint.family_options,
        "tensors_read": len(checkpoint.tensors_read),
        "files": checkpoint.files,
        "head_weights": matrices["head"].tolist() if "head" in matrices else None,
        "matrices": {key: matrices[key].tolist() for key in ("pre", "post", "res")},
        "basis": GATED_BASIS if checkpoint.gated else BIAS_BASIS,
        "stream_weights": stream_weights(checkpoint) if checkpoint.gated else None,
        **summary,
    }
    if out is not None:
        write_static(result, out)
    return result


def write_static(result: dict[str, Any], out: str | Path) -> Path:
    """Write :func:`diagnose_static`'s ``result`` into ``out``: ``static.json``, the figures, ``report.md``."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    diagnostics_report.write_json(out / JSON_NAME, result)
    if "learned_maps" in result:  # a one-stream design: its maps, no matrices to draw
        diagnostics_report.write_text(out / diagnostics_report.REPORT_NAME, static_one_stream.report(result))
        return out
    if "depth_reads" in result:  # Attention Residuals: the bounds of its reads
        diagnostics_report.write_text(out / diagnostics_report.REPORT_NAME, static_attn_res.report(result))
        return out
    figures = diagnostics_report.write_figures(out, {result["family"]: result}, with_streams=False)
    diagnostics_report.write_text(out / diagnostics_report.REPORT_NAME, _report(result, figures, out))
    return out


def _stream_weight_lines(weights: dict[str, Any]) -> list[str]:
    """The gated residual's per-stream section: the note, then per measure a table (value and share per stream,
    one row per connection, the head, the mean over depth) and the largest share."""
    n = len(weights["across_depth"]["norm_scale"]["mean"])
    lines = ["## Per-stream weights (the gated residual)", "", weights["note"], "",
             "Each cell: the value, and in brackets the stream's share of the sum over the n streams (1/n = "
             f"{1 / n:.1%} each when no stream stands out; a share well above it is a stream the weights favour).", ""]

    def cell(value: float, share: float) -> str:
        return f"{number(value)} ({share:.1%})" if math.isfinite(share) else number(value)

    for key, description in weights["measures"].items():
        block = weights["connections"][key]
        rows = [[f"`{name}`", *(cell(v, s) for v, s in zip(values, shares))]
                for name, values, shares in zip(weights["layers"], block["values"], block["shares"])]
        head = (weights["head"] or {}).get(key)
        if head is not None:
            rows.append(["head (final read)", *(cell(v, s) for v, s in zip(head["values"], head["shares"]))])
        across = weights["across_depth"][key]
        rows.append(["**mean over depth**", *(cell(v, s) for v, s in zip(across["mean"], across["mean_share"]))])
        top = across["max_share"]
        lines += [f"### {key}: {description}", ""]
        lines += table(["connection", *(f"stream {s}" for s in range(n))], rows, align="l" + "r" * n)
        lines += ["", f"Largest share: stream {top['stream']} at `{top['connection']}`, "
                  f"{top['share']:.1%}." if math.isfinite(top["share"]) else "Largest share: none (all zero).", ""]
    return lines


def _report(result: dict[str, Any], figures: dict[str, Path], out: Path) -> str:
    gated = result.get("stream_weights") is not None
    what = ("The matrices of a zero input, the same for every checkpoint of this family (the gated residual has "
            "no static part; what its weights say per stream follows)" if gated else
            "The matrices at d = 0: the biases alone, what every connection applies before any token moves it")
    lines = [
        f"# s2hc diagnose --static: `{result['source']}`",
        "",
        f"Family `{result['family']}`{diagnostics_report.options_text(result['family_options'])} ({result['layout']} "
        f"layout), n = {result['n_streams']} streams, {result['depth']} connections. {what} "
        f"({result['tensors_read']} tensors read from {len(result['files'])} file(s), no model built). The "
        f"numbers: [`{JSON_NAME}`]({JSON_NAME}).",
        "",
    ]
    if result["layout"] in LAYOUT_NOTES:
        lines += [LAYOUT_NOTES[result["layout"]], ""]
    if gated:
        lines += _stream_weight_lines(result["stream_weights"])
    lines += ["## Summary", ""]
    lines += diagnostics_report.summary_lines(result, "worst over connections")
    if result["head_weights"] is not None:
        weights = ", ".join(f"{w:.4g}" for w in result["head_weights"])
        lines += [f"Hyper-head stream weights at d = 0: {weights}.", ""]
    lines += ["## Guarantees of the family, measured", ""] + diagnostics_report.guarantee_lines(result)
    lines += ["## Per connection", ""] + diagnostics_report.layer_lines(result)
    lines += ["## Across depth", "", "P = H_l ⋯ H_0: the static residual path through the first l + 1 connections.",
              ""] + diagnostics_report.depth_lines(result)
    lines += ["## Figures", ""] + diagnostics_report.figure_lines(figures, out)
    return "\n".join(lines)
