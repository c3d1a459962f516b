"""``s2hc diagnose --static`` of the one-stream residuals of production models: Muse Spark's and Ergo's
variance-preserving gates, ZAYA's affine residual, Beam's depth-scaled add. They have no residual matrix: what a
checkpoint says is what their learned maps do, read from safetensors and ``config.json`` alone (no model built,
no data) and measured by the s2hc connection that computes each (:meth:`s2hc.connection.Connection.measures`, the
same numbers ``s2hc diagnose`` gives a trained s2hc run of the family).

Each design's converter (:mod:`s2hc.hf.muse_spark`, ``ergo``, ``zaya``, ``beam``) says where its tensors are
(``LAYER_MODULES``, ``HF_NAMES``; Beam's add has none) and builds its connection (``connection_from_hf``); a
checkpoint is recognised by ``config.json``'s ``model_type`` (or its ``text_config``'s).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..checks import MAX_LAYERS, check_int
from ..connection import Connection
from ..diagnostics.maps import maps_lines
from . import beam, ergo, muse_spark, zaya
from .one_stream import setting, text_config
from .weights import read_safetensors

#: config.json model_type -> the design's converter (Muse Spark's text model saves its own model_type).
DESIGNS: dict[str, ModuleType] = {
    **{design.MODEL_TYPE: design for design in (muse_spark, ergo, zaya, beam)},
    f"{muse_spark.MODEL_TYPE}_text": muse_spark,
}
#: The slots of a decoder layer, attention then MLP, as s2hc's sublayers count them.
SLOTS = ("attention", "mlp")


def design_of(config: dict[str, Any]) -> ModuleType | None:
    """The converter of the design ``config`` (a ``config.json``) names, or None for another model."""
    for holder in (config, text_config(config)):
        if isinstance(holder, dict) and holder.get("model_type") in DESIGNS:
            return DESIGNS[holder["model_type"]]
    return None


def _layout(design: ModuleType, tensors: dict[str, torch.Tensor]) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(the layer's modules, their tensor names -> transformers' names)`` the checkpoint holds: transformers'
    module names, or the released checkpoints' where the design saves those (Ergo's ``post_attention_residual``)."""
    modules, names = getattr(design, "LAYER_MODULES", SLOTS), getattr(design, "HF_NAMES", {})
    saved = getattr(design, "CHECKPOINT_MODULES", None)
    if saved is not None and any(f".{saved[0]}." in f".{key}" for key in tensors):
        return saved, design.CHECKPOINT_NAMES
    return modules, {name: name for name in names}


def _connections(design: ModuleType, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 source: str) -> list[tuple[str, Connection]]:
    """``(name, connection)`` for every sublayer of the checkpoint, in depth order; ValueError (one line) for a
    layer whose tensors are missing."""
    layers = check_int("num_hidden_layers", setting(config, "num_hidden_layers", design.DESIGN), maximum=MAX_LAYERS)
    modules, names = _layout(design, tensors)
    found: list[tuple[str, Connection]] = []
    for layer in range(layers):
        for slot, module in enumerate(modules):
            sublayer = 2 * layer + slot
            if not names:  # Beam: a fixed add, nothing stored
                found.append((f"layers.{layer}.{SLOTS[slot]}", design.connection_from_hf(
                    config, design.residual_add_idx(sublayer))))
                continue
            pattern = re.compile(rf"(?:^|\.)layers\.{layer}\.{re.escape(module)}\.(?P<name>[^.]+)$")
            own = {match["name"]: value for key, value in tensors.items() if (match := pattern.search(key))}
            missing = sorted(set(names) - set(own))
            if missing:
                raise ValueError(f"{source!r}: layer {layer}'s {module} has no {missing}, which a {design.DESIGN} "
                                 f"checkpoint (config.json's model_type {design.MODEL_TYPE!r}) holds")
            state = {hf: own[saved].float() for saved, hf in names.items()}
            found.append((f"layers.{layer}.{module}", design.connection_from_hf(config, state, layer)))
    return found


def diagnose_one_stream(path: str | Path, config: dict[str, Any], design: ModuleType) -> dict[str, Any]:
    """What the checkpoint at ``path`` (safetensors and its ``config.json``, already read as ``config``) of
    ``design`` says its residuals do: ``{"kind": "static", "source", "layout", "family", "n_streams",
    "family_options", "files", "tensors_read", "learned_maps": {"note", "connections"}}``."""
    modules = (*getattr(design, "LAYER_MODULES", ()), *getattr(design, "CHECKPOINT_MODULES", ()))
    wanted = (lambda name: any(f".{module}." in f".{name}" for module in modules)) if modules else (lambda _: False)
    tensors, files, _ = read_safetensors(path, wanted)
    for name, value in tensors.items():
        if not bool(torch.isfinite(value.float()).all()):
            raise ValueError(f"{str(path)!r}: tensor {name!r} holds a NaN or an infinity")
    connections = _connections(design, config, tensors, str(path))
    first = connections[0][1]
    note = " ".join((type(first).measures.__doc__ or "").split())
    return {
        "kind": "static", "source": str(path), "layout": design.MODEL_TYPE, "family": first.family, "n_streams": 1,
        "family_options": {}, "files": [str(f) for f in files], "tensors_read": len(tensors),
        "learned_maps": {"note": note, "connections": [{"name": name, **c.measures()} for name, c in connections]},
    }


def report(result: dict[str, Any]) -> str:
    """The ``report.md`` of :func:`diagnose_one_stream`'s result."""
    lines = [f"# s2hc diagnose --static: `{result['source']}`", "",
             f"A {result['layout']} checkpoint, computed by s2hc's family `{result['family']}` "
             f"({len(result['learned_maps']['connections'])} connections, {result['tensors_read']} tensors read). "
             "One stream: no residual matrix to measure.", ""]
    return "\n".join(lines + maps_lines(result["learned_maps"])) + "\n"


__all__ = ["DESIGNS", "design_of", "diagnose_one_stream", "read_config", "report"]


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` beside the checkpoint at ``path`` (a directory, or a file in it) as a dict, ``{}`` when there
    is none or it is no JSON object (the general reader names those defects)."""
    from ..io import read_json_object

    path = Path(path).expanduser()
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return {}
    try:
        return read_json_object(config, "config.json beside the weights must be the model's config, a JSON object")
    except (OSError, ValueError):
        return {}
