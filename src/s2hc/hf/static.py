"""``s2hc diagnose --static``: the input-independent part of every residual matrix, read from safetensors alone.

A connection's matrices are functions of its biases plus a term driven by the token (``α · d``, ``d`` the
projection of the normalised streams). With ``d = 0`` (the streams set to zero, whose RMS norm is zero) only the
biases remain: the matrices a checkpoint would apply to a token it has no opinion about. They tell, without
data, without a GPU and without loading the model, how far each layer's mixing sits from the identity, whether
it amplifies anything, and what the product over depth does.

Two layouts are recognised, by tensor name (any prefix before them, e.g. ``model.``):

- s2hc (``s2hc export``): ``blocks.L.attn_hc.*`` and ``blocks.L.mlp_hc.*`` (and ``stream_head.*`` with
  ``stream_reduce="head"``); the family and its options come from ``config.json`` beside the weights (its
  ``s2hc`` entry).
- DeepSeek-V4: transformers' ``layers.L.attn_hc.{base,scale}`` / ``layers.L.ffn_hc.*`` and ``hc_head.hc_base``,
  or the released checkpoints' ``layers.L.hc_attn_base`` / ``hc_ffn_*`` / ``hc_head_base``; ``hc_mult`` follows
  from ``base``'s length (``2n + n²``), ``hc_sinkhorn_iters`` and ``hc_eps`` from ``config.json`` when present
  (else transformers' defaults, 20 and 1e-6). ``H_res`` is reported as applied, ``combᵀ``
  (:mod:`s2hc.hf.deepseek_v4`).

Only the tensors the static matrices need are read (biases and scales; not the projections, whose term is
zero here, nor anything else): a sharded checkpoint's index says which shards hold them, and only those are
opened, lazily (``safetensors.safe_open``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..connection import HyperConnection, HyperHead
from ..diagnostics import report as diagnostics_report
from ..diagnostics.summary import summarize
from ..mixers.mhc import DEEPSEEK_V4_EPS
from ..models import ModelConfig
from .deepseek_v4 import connection_from_hf, connection_options
from .weights import read_safetensors

__all__ = ["StaticCheckpoint", "diagnose_static", "read_static", "static_matrices", "write_static"]

JSON_NAME = "static.json"
S2HC = "s2hc"
DEEPSEEK_V4 = "deepseek-v4"
# s2hc: every tensor of a connection but the token-driven ones (the projection and the norm before it).
_S2HC_KEY = re.compile(r"^(?P<prefix>.*?)blocks\.(?P<layer>\d+)\.(?P<sublayer>attn|mlp)_hc\.(?P<param>.+)$")
_S2HC_DYNAMIC = ("projection", "norm_weight")
_S2HC_HEAD = re.compile(r"^(?P<prefix>.*?)stream_head\.(?P<param>bias|alpha)$")  # stream_reduce="head"
_DSV4_KEYS = (
    re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<sublayer>attn|ffn)_hc\.(?P<param>base|scale)$"),
    re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.hc_(?P<sublayer>attn|ffn)_(?P<param>base|scale)$"),
)
_DSV4_HEAD = re.compile(r"^(?P<prefix>.*?)hc_head(?:\.hc_|_)(?P<param>base|scale)$")
_LOOKED_FOR = ("s2hc's blocks.L.{attn,mlp}_hc.*, DeepSeek-V4's layers.L.{attn,ffn}_hc.{base,scale}, "
               "layers.L.hc_{attn,ffn}_{base,scale}")


@dataclass
class StaticCheckpoint:
    """The hyper-connections of a checkpoint, rebuilt from their stored biases.

    ``connections``: ``(name, HyperConnection)`` in depth order (per layer the attention's, then the MLP's),
    float64, their token-driven parameters left at zero; ``head``: DeepSeek-V4's ``HyperHead`` or None.
    ``tensors_read``: the names of the tensors read, ``files``: the safetensors files opened.
    """

    source: str
    layout: str
    family: str
    n_streams: int
    family_options: dict[str, Any]
    connections: list[tuple[str, HyperConnection]]
    head: HyperHead | None = None
    tensors_read: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def transposed(self) -> bool:
        return bool(self.family_options.get("transpose_res", False))


# ------------------------------------------------------------------------------------------------ files


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {str(path)!r}: {error}") from None
    return config if isinstance(config, dict) else {}


def _check_finite(source: str, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor that holds NaN or an infinity: its static matrices would be NaN, and a
    report of ``nan`` everywhere says nothing about where the checkpoint went wrong."""
    for name in sorted(tensors):
        tensor = tensors[name]
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        if bad:
            raise ValueError(f"{source!r}: tensor {name} holds {bad} non-finite value(s) (NaN or infinity) of "
                             f"{tensor.numel()}; a checkpoint's hyper-connection tensors must be finite")


def _wanted(name: str) -> bool:
    s2hc = _S2HC_KEY.match(name)
    if s2hc:
        return s2hc["param"] not in _S2HC_DYNAMIC
    return any(pattern.match(name) for pattern in (_S2HC_HEAD, *_DSV4_KEYS, _DSV4_HEAD))


# ------------------------------------------------------------------------------------------------ layouts


def _s2hc_connections(source: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]):
    settings = config.get("s2hc")
    if not isinstance(settings, dict):
        raise ValueError(f"{source!r} has s2hc hyper-connection tensors but no config.json with an 's2hc' entry "
                         "beside them (an `s2hc export` directory has one); the family cannot be known without it")
    model = ModelConfig.from_dict(settings)
    grouped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = _S2HC_KEY.match(name)
        if key is None:
            head[_S2HC_HEAD.match(name)["param"]] = tensor
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
            connection = HyperConnection(1, model.n_streams, family=model.family, layer_index=layer,
                                         **model.family_options).double()
            _load(connection, state, name, source)
            connections.append((name, connection))
    if grouped:
        extra = sorted(f"blocks.{layer}.{sublayer}_hc" for layer, sublayer in grouped)
        raise ValueError(f"{source!r} has hyper-connection tensors of {extra}, beyond the {model.n_layers} layers "
                         "of its config.json")
    hyper_head = None
    if head:
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


@torch.no_grad()
def read_static(path: str | Path) -> StaticCheckpoint:
    """The hyper-connections stored in ``path`` (a ``.safetensors`` file, a directory of them, or a sharded
    checkpoint's directory or index), rebuilt from their biases; see the module docstring for the layouts.
    ValueError (one sentence) for a missing or unreadable path, no hyper-connection tensors, a missing
    ``config.json`` for the s2hc layout, or tensors of the wrong shape."""
    source = str(path)
    tensors, opened, directory = read_safetensors(path, _wanted)
    if not tensors:
        raise ValueError(f"{source!r} holds no hyper-connection tensors (looked for {_LOOKED_FOR}); a residual "
                         "model has none")
    _check_finite(source, tensors)
    config = _config(directory)
    s2hc_names = [name for name in tensors if _S2HC_KEY.match(name) or _S2HC_HEAD.match(name)]
    if s2hc_names and len(s2hc_names) < len(tensors):  # both layouts: which one the model uses is unknown
        other = next(name for name in tensors if name not in s2hc_names)
        raise ValueError(f"{source!r} mixes s2hc hyper-connection tensors ({s2hc_names[0]!r}) with DeepSeek-V4 "
                         f"ones ({other!r}); a checkpoint holds one layout")
    if s2hc_names:
        family, n, options, connections, head = _s2hc_connections(source, tensors, config)
        layout = S2HC
    else:
        family, n, options, connections, head = _deepseek_connections(source, tensors, config)
        layout = DEEPSEEK_V4
    return StaticCheckpoint(source=source, layout=layout, family=family, n_streams=n, family_options=options,
                            connections=connections, head=head, tensors_read=sorted(tensors), files=opened)


@torch.no_grad()
def static_matrices(checkpoint: StaticCheckpoint) -> dict[str, torch.Tensor]:
    """Every connection's matrices at ``d = 0``, float64: ``pre`` ``(L, n)``, ``post`` ``(L, n)``, ``res``
    ``(L, n, n)`` (as applied, ``X' = res X``), and ``head`` ``(n,)`` when there is a hyper-head."""
    zero = torch.zeros(1, 1, checkpoint.n_streams, 1, dtype=torch.float64)
    pre, post, res = zip(*(c.coefficients(zero) for _, c in checkpoint.connections))
    out = {"pre": torch.cat(pre).flatten(0, 1), "post": torch.cat(post).flatten(0, 1),
           "res": torch.cat(res).flatten(0, 1)}
    if checkpoint.head is not None:
        out["head"] = checkpoint.head.weights(zero)[0, 0]
    return out


# ------------------------------------------------------------------------------------------------ report


def diagnose_static(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Measure the static matrices of ``path`` (:func:`read_static`, :func:`static_matrices`) with every
    measurement of :func:`s2hc.diagnostics.summary.summarize` (one "token": the biases alone). With ``out``,
    writes ``out/static.json``, the figures and ``out/report.md`` (only after the checkpoint was read).
    Returns the JSON object: ``kind`` ("static"), ``source``, ``layout``, ``family``, ``n_streams``,
    ``family_options``, ``tensors_read``, ``files``, ``head_weights`` (DeepSeek-V4's hyper-head, or None),
    ``matrices`` (``pre``, ``post``, ``res`` as nested lists) and the summary's keys."""
    checkpoint = read_static(path)
    matrices = static_matrices(checkpoint)
    names = [name for name, _ in checkpoint.connections]
    summary = summarize(matrices["res"][:, None], matrices["pre"][:, None], matrices["post"][:, None], names=names,
                        family=checkpoint.family, transposed=checkpoint.transposed)
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
    figures = diagnostics_report.write_figures(out, {result["family"]: result}, with_streams=False)
    diagnostics_report.write_text(out / diagnostics_report.REPORT_NAME, _report(result, figures, out))
    return out


def _report(result: dict[str, Any], figures: dict[str, Path], out: Path) -> str:
    lines = [
        f"# s2hc diagnose --static: `{result['source']}`",
        "",
        f"Family `{result['family']}`{diagnostics_report.options_text(result['family_options'])} ({result['layout']} "
        f"layout), n = {result['n_streams']} streams, {result['depth']} connections. The matrices at d = 0: the "
        f"biases alone, what every connection applies before any token moves it ({result['tensors_read']} "
        f"tensors read from {len(result['files'])} file(s), no model built). The numbers: [`{JSON_NAME}`]"
        f"({JSON_NAME}).",
        "",
        "## Summary",
        "",
    ]
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
