"""``s2hc diagnose --static`` of Attention Residuals checkpoints: Inkling-2 (transformers' ``inkling2``) and Kimi-K3
(nemo-automodel's ``kimi_k3``), read from safetensors and ``config.json`` alone (no model built, no data).

A depth read has no residual matrix and no bias: its weights over the sources are a softmax of the effective query
against the sources RMS-normalised, so what depends on the input is everything but a bound. What the weights alone
say is that bound (:meth:`s2hc.connection.forms.attn_res.DepthAttention.read_bounds`): how far the read can move
from the uniform one over its sources, whatever they hold. A zero query (the initialisation) reads them uniformly;
a query of norm ``‖u‖`` can put at most ``e^R / (e^R + S − 1)`` on one of ``S`` sources, ``R = 2‖u‖√C``. How a
trained model does read is what ``s2hc diagnose`` of a run measures (its depth reads, per token).

Each design's converter (:mod:`s2hc.hf.inkling2`, :mod:`s2hc.hf.kimi_k3`) says which tensors are its reads'
(``is_connection_tensor``), maps them to s2hc's names (``model_connections_from_hf``, which names a missing or
misshapen one) and gives each read's options (``connection_options``); a checkpoint is recognised by
``config.json``'s ``model_type`` (or its ``text_config``'s).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..checks import MAX_LAYERS, check_int
from ..connection.forms.attn_res import AttnResConnection, AttnResHead, sources_read
from . import inkling2, kimi_k3
from .one_stream import setting, text_config
from .weights import read_safetensors

#: config.json model_type -> the design's converter (Inkling-2's text model saves its own model_type).
DESIGNS: dict[str, ModuleType] = {inkling2.MODEL_TYPE: inkling2, inkling2.TEXT_MODEL_TYPE: inkling2,
                                  kimi_k3.MODEL_TYPE: kimi_k3}
_KINDS = (("attention", "attn_hc"), ("mlp", "mlp_hc"))
_QUERY_NAMES = ("q", "k", "v")  # a three-query read's queries: the inputs of the Q, K and V projections
#: What the numbers of a read are (the report's note and static.json's).
NOTE = ("A depth read's logits are u·k̂: u its effective query (the pseudo-query, times the key norm's weight where it "
        "has one, times C^-1/2 where the logits are scaled), k̂ a source RMS-normalised, ‖k̂‖₂ ≤ √C. So whatever the "
        "input, its logits span at most R = 2‖u‖₂√C, and the weight one of its S sources gets lies between "
        "1 / (1 + (S − 1)e^R) and e^R / (e^R + S − 1); a zero query (the initialisation) reads every source with "
        "1/S. These are bounds, reached only by sources aligned with ±u; how a trained model reads its sources is "
        "what `s2hc diagnose` of a run measures.")


def design_of(config: dict[str, Any]) -> ModuleType | None:
    """The converter of the design ``config`` (a ``config.json``) names, or None for another model."""
    for holder in (config, text_config(config)):
        if isinstance(holder, dict) and holder.get("model_type") in DESIGNS:
            return DESIGNS[holder["model_type"]]
    return None


def _reads(design: ModuleType, config: dict[str, Any], state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """One entry per query of every read, in depth order, the output read last."""
    layers = check_int("num_hidden_layers", setting(config, "num_hidden_layers", design.DESIGN), maximum=MAX_LAYERS)
    entries: list[dict[str, Any]] = []
    last = None
    for layer in range(layers):
        for kind, slot in _KINDS:
            options = design.connection_options(config, layer, kind)
            connection = last = AttnResConnection(layer_index=layer, **options).double()
            prefix = f"blocks.{layer}.{slot}."
            connection.load_state_dict({key[len(prefix):]: value for key, value in state.items()
                                        if key.startswith(prefix)})
            name = f"layers.{layer}.{kind}"
            if not connection.reads:
                entries.append({"name": name, "sublayer": connection.sublayer, "sources": 1, "reads": False})
                continue
            bounds = connection.read_bounds(connection.num_sources)
            for index, bound in enumerate(bounds):
                query = None if len(bounds) == 1 else _QUERY_NAMES[index]
                entries.append({"name": name if query is None else f"{name}.{query}", "sublayer": connection.sublayer,
                                "sources": connection.num_sources, "reads": True, **bound})
    conventions = {key: value for key, value in last.conventions().items() if key not in ("num_queries", "reads")}
    head = AttnResHead(last.dim, **conventions).double()
    head.load_state_dict({key[len("stream_head."):]: value for key, value in state.items()
                          if key.startswith("stream_head.")})
    sources = sources_read(2 * layers, last.block_size)
    entries.append({"name": "output", "sublayer": 2 * layers, "sources": sources, "reads": True,
                    **head.read_bounds(sources)[0]})
    return entries


def diagnose_attn_res(path: str | Path, config: dict[str, Any], design: ModuleType) -> dict[str, Any]:
    """What the checkpoint at ``path`` (safetensors and its ``config.json``, already read as ``config``) of
    ``design`` says its depth reads can do: ``{"kind": "static", "source", "layout", "family", "n_streams",
    "family_options", "files", "tensors_read", "depth_reads": {"note", "reads", "across_depth"}}``, each read
    ``name``, ``sublayer``, ``sources`` and, where it reads, ``query_norm``, ``logit_range``, ``weight_min`` and
    ``weight_max`` (:meth:`~s2hc.connection.forms.attn_res.DepthAttention.read_bounds`)."""
    tensors, files, _ = read_safetensors(path, design.is_connection_tensor)
    for name, value in tensors.items():
        if not bool(torch.isfinite(value.float()).all()):
            raise ValueError(f"{str(path)!r}: tensor {name!r} holds a NaN or an infinity")
    try:
        state = design.model_connections_from_hf(tensors, config)
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: {error}") from None
    reads = _reads(design, config, {key: value.double() for key, value in state.items()})
    reading = [entry for entry in reads if entry["reads"]]
    widest = max(reading, key=lambda entry: entry["logit_range"])
    return {
        "kind": "static", "source": str(path), "layout": design.MODEL_TYPE, "family": "attn-res", "n_streams": 1,
        "family_options": design.family_options(config), "files": [str(f) for f in files],
        "tensors_read": len(tensors),
        "depth_reads": {"note": NOTE, "reads": reads, "across_depth": {
            "reads": len(reading), "uniform": sum(entry["logit_range"] == 0 for entry in reading),
            "widest": {key: widest[key] for key in ("name", "sources", "logit_range", "weight_max")}}},
    }


def _across(result: dict[str, Any]) -> str:
    across = result["depth_reads"]["across_depth"]
    widest = across["widest"]
    return (f"{across['reads']} depth reads, {across['uniform']} of them uniform whatever the input (a zero query); "
            f"the widest, {widest['name']}, can put at most {widest['weight_max']:.3g} on one of its "
            f"{widest['sources']} sources (logit range {widest['logit_range']:.3g})")


def line(result: dict[str, Any]) -> str:
    """The line ``s2hc diagnose --static`` prints for :func:`diagnose_attn_res`'s result."""
    return f"{result['layout']} checkpoint as attn-res, {result['tensors_read']} tensors read: {_across(result)}"


def report(result: dict[str, Any]) -> str:
    """The ``report.md`` of :func:`diagnose_attn_res`'s result: the note, then one row per read."""
    reads = result["depth_reads"]
    lines = [f"# s2hc diagnose --static: `{result['source']}`", "",
             f"A {result['layout']} checkpoint, computed by s2hc's family `attn-res` "
             f"({_options(result['family_options'])}; {result['tensors_read']} tensors read): {_across(result)}.", "",
             reads["note"], "",
             "| read | sublayer | sources S | ‖u‖₂ | logit range R | least weight | most weight | uniform 1/S |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in reads["reads"]:
        if not entry["reads"]:
            lines.append(f"| {entry['name']} | {entry['sublayer']} | 1 | – (takes its one source) | – | 1 | 1 | 1 |")
            continue
        lines.append(f"| {entry['name']} | {entry['sublayer']} | {entry['sources']} | {entry['query_norm']:.4g} | "
                     f"{entry['logit_range']:.4g} | {entry['weight_min']:.4g} | {entry['weight_max']:.4g} | "
                     f"{1 / entry['sources']:.4g} |")
    return "\n".join(lines) + "\n"


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


__all__ = ["DESIGNS", "design_of", "diagnose_attn_res", "line", "report"]
