"""What ``s2hc diagnose`` writes: ``diagnostics.json``, the figures and ``report.md``.

- :func:`diagnose_model`: your own model (an s2hc Transformer, or any module holding s2hc connections) on the
  token ids you give; the Python API's way to what ``s2hc diagnose`` writes.
- :func:`diagnose_checkpoint`: a trained model (run directory or checkpoint file) on real tokens (each run of a
  study, and so of ``s2hc compare``, is measured with it); it measures and writes as :func:`diagnose_model` does.
- :func:`diagnose_synthetic`: each family's matrices from random inputs of a chosen spread.

Tables and numbers are :mod:`s2hc.reports`'.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import mixers
from ..checks import check_int, check_str
from ..connection import Connection, forms
from ..data.loader import eval_batches
from ..data.shards import stored_cache_dir
from ..data.sources import spec_for
from ..data.stream import validation_tokens
from ..data.tokenizer import check_tokenizer_fits, get_tokenizer
from ..devices import autocast_dtype, resolve_device
from ..io import atomic_write_text, check_output_dir
from ..models import Transformer
from ..reports import DASH, number, table
from ..rundir import METRICS, load_model, read_metrics, resolve_checkpoint
from . import plots
from .collect import collect, mixing_connections
from .depth import depth_attention, depth_modules
from .depth import depth_lines as depth_attention_lines
from .maps import learned_maps, map_modules, maps_lines
from .measures import NEGATIVE_TOLERANCE
from .summary import OUTPUT_READS
from .synthetic import DEFAULT_SWEEP, logit_scale_sweep, synthetic_summaries

__all__ = ["default_out", "diagnose_checkpoint", "diagnose_model", "diagnose_synthetic", "stream_usage_lines",
           "write_json"]

JSON_NAME = "diagnostics.json"
REPORT_NAME = "report.md"
DEFAULT_TOKENS = 1024  # as the s²HC paper's Fig. 7 (1024 samples)
#: Keys of a summary that describe the sample rather than measure it.
SHARED_KEYS = ("layers", "depth", "tokens", "n_streams")


# --------------------------------------------------------------------------------------------- writing


def _json_ready(value: Any) -> Any:
    """Non-finite floats (an overflowed product) become null: strict JSON has no Infinity or NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def write_json(path: Path, obj: dict[str, Any]) -> Path:
    """``obj`` as indented strict JSON, written to a temporary file and renamed."""
    atomic_write_text(Path(path), json.dumps(_json_ready(obj), indent=1, allow_nan=False) + "\n")
    return Path(path)


def write_text(path: Path, text: str) -> Path:
    atomic_write_text(Path(path), text)
    return Path(path)


def write_figures(out: Path, summaries: dict[str, dict[str, Any]], with_streams: bool) -> dict[str, Path]:
    """The per-family figures into ``out``; {} without matplotlib."""
    if not plots.have_matplotlib():
        return {}
    path = {key: out / name for key, name in plots.FIGURES.items()}
    found = {}
    matrices = {name: summary for name, summary in summaries.items() if has_residual_matrix(summary)}
    if matrices:  # the H_res figures, of the families that have one
        found = {
            "deviation_singular_values": plots.plot_deviation_singular_values(matrices,
                                                                              path["deviation_singular_values"]),
            "amax_gain": plots.plot_amax_gain(matrices, path["amax_gain"]),
            "column_sums": plots.plot_column_sums(matrices, path["column_sums"]),
            "mixing": plots.plot_mixing(matrices, path["mixing"]),
        }
    if with_streams and any(s.get("stream_similarity", {}).get("offdiagonal") for s in summaries.values()):
        found["stream_similarity"] = plots.plot_stream_similarity(summaries, path["stream_similarity"])
    if any(plots.has_stream_usage(s) for s in summaries.values()):
        found["stream_usage"] = plots.plot_stream_usage(summaries, path["stream_usage"])
    return found


FIGURE_CAPTIONS = {
    "deviation_singular_values": "Singular values of the deviation block U_Zᵀ H_res U_Z per layer "
                                 "(as the s²HC paper's Fig. 5)",
    "amax_gain": "Forward / backward Amax gain of each H_res and of the composite, and the composite's spectral "
                 "norm, against depth (as mHC's Fig. 3)",
    "column_sums": "Column sums of each H_res and of the composite against depth (as the s²HC paper's Fig. 7)",
    "mixing": "What each H_res does to the streams against depth: ‖H − I‖_F, the rotation angle, the spectrum slope "
              "1 − σ² and the negative share (hollow: connections whose H_res cannot change the output)",
    "stream_similarity": "Cosine similarity between the streams at each connection's input",
    "stream_usage": "Each stream's share of what each connection reads and writes (token means of |H_pre| and "
                    "|H_post| over their sums; last read bar: the output's shares) and the effective number of "
                    "streams, exp of the entropy of the shares, against depth (hollow: a connection whose split "
                    "cannot change the output)",
    "logit_scale_sweep": "Headline numbers against the logit scale S",
    "training_history": "Diagnostics logged during training (diagnostics_every)",
}


def figure_lines(figures: dict[str, Path], relative_to: Path) -> list[str]:
    if not figures:
        return [plots.NO_FIGURES, ""]
    lines = []
    for key, path in figures.items():
        rel = Path(path).resolve().relative_to(relative_to.resolve()).as_posix()
        lines += [f"**{FIGURE_CAPTIONS[key]}**", "", f"![{key}]({rel})", ""]
    return lines


def inert_text(summary: dict[str, Any]) -> str:
    """``0 `blocks.0.attn_hc`, 7 `blocks.3.mlp_hc``` for the summary's inert connections; empty when none."""
    return ", ".join(f"{i} `{summary['layers'][i]}`" for i in summary.get("inert_layers", []))


def inert_lines(summary: dict[str, Any]) -> list[str]:
    """One paragraph naming the connections whose ``H_res`` cannot change the output and why, or saying there are
    none."""
    inert = summary.get("inert_layers", [])
    if not inert:
        return ["Every connection's H_res can change the output: all are interior.", ""]
    first = "the first sees identical copies of the embedding and its rows sum to 1"
    last = "the last one's streams are summed (or averaged) and its columns sum to 1"
    if summary["depth"] == 1:
        reasons = [f"it is the first and the last: {first}, or {last}"]
    else:
        reasons = [reason for layer, reason in ((0, first), (summary["depth"] - 1, last)) if layer in inert]
    every = len(inert) == summary["depth"]
    return [f"Connection{'s' if len(inert) > 1 else ''} {inert_text(summary)} cannot change the model's output "
            f"whatever {'their' if len(inert) > 1 else 'its'} H_res ({'; '.join(reasons)}; docs/diagnostics.md): "
            + ("every connection is such, so there are no interior values." if every else
               "the interior values leave them out, and their own are given apart."), ""]


def summary_lines(summary: dict[str, Any], over: str, mean_note: str = "") -> list[str]:
    """The headline table of a summary: each measurement's worst value ``over`` (the column's title), what the
    matrices do over the interior connections and, apart, over those that cannot change the output; the mean
    cosine between the output streams when the summary measured streams."""
    head = summary["headline"]
    tolerance = summary.get("negative_tolerance", NEGATIVE_TOLERANCE)
    rows = [
        ["row-sum error of H_res", head["row_sum_error"]],
        ["column-sum error of H_res", head["col_sum_error"]],
        ["spectral norm of H_res", head["spectral_norm"]],
        [f"smallest deviation singular value{mean_note}", head["smallest_deviation_singular_value_mean"]],
        ["‖H − I‖_F, largest token mean (interior connections)", head.get("identity_distance_mean")],
        ["rotation angle of the deviations, degrees, largest token mean (interior)", head.get("rotation_angle_mean")],
        ["spectrum slope 1 − σ², mean (interior)", head.get("spectrum_slope_mean")],
        [f"share of entries below −{tolerance:g}, largest token mean (interior)", head.get("negative_share_mean")],
    ]
    if summary.get("inert_layers"):
        where = f"(cannot change the output: {', '.join(map(str, summary['inert_layers']))})"
        rows += [
            [f"‖H − I‖_F {where}", head.get("identity_distance_inert")],
            [f"rotation angle, degrees {where}", head.get("rotation_angle_inert")],
            [f"spectrum slope 1 − σ² {where}", head.get("spectrum_slope_inert")],
            [f"share of entries below −{tolerance:g} {where}", head.get("negative_share_inert")],
        ]
    rows += [
        [f"spectral norm of the composite of all {summary['depth']}", head["composite_spectral_norm_at_depth"]],
        ["composite forward Amax gain (any depth)", head["composite_forward_amax"]],
        ["composite backward Amax gain (any depth)", head["composite_backward_amax"]],
        ["cumulative column sum (largest)", head["cumulative_column_sum_max"]],
    ]
    if "stream_similarity_output_mean" in head:
        rows.append(["mean cosine between the output streams", head["stream_similarity_output_mean"]])
    return table(["measurement", over], rows) + [""] + inert_lines(summary)


def guarantee_lines(summary: dict[str, Any]) -> list[str]:
    checks = summary.get("guarantees")
    if checks is None:
        return []
    if not checks:
        return ["The family claims no guarantee on H_res (nothing to check).", ""]
    rows = [[c["property"], c["measured"], c["tolerance"], c["holds"]] for c in checks]
    return table(["claimed property", "measured worst deviation", "tolerance", "holds"], rows) + [""]


def layer_lines(summary: dict[str, Any]) -> list[str]:
    """One row per connection; the last column says whether its H_res can change the model's output."""
    sim = summary.get("stream_similarity") or {}
    off = sim.get("offdiagonal")
    inert = set(summary.get("inert_layers", []))
    rows = []
    for i, name in enumerate(summary["layers"]):
        sv = summary["deviation_singular_values"]["mean"][i]
        slope = summary["spectrum_slope"]["mean"][i] if "spectrum_slope" in summary else []
        rows.append([
            f"{i} `{name}`",
            summary["row_sum_error"]["max"][i],
            summary["col_sum_error"]["max"][i],
            summary["col_sum_error"]["p99"][i],
            summary["spectral_norm"]["max"][i],
            ", ".join(number(v) for v in sv) if sv else DASH,
            sum(slope) / len(slope) if slope else None,
            summary["identity_distance"]["mean"][i],
            summary["rotation_angle"]["mean"][i] if "rotation_angle" in summary else None,
            summary["negative_share"]["mean"][i],
            summary["min_entry"]["min"][i],
            summary["h_pre"]["sum"]["mean"][i] if "h_pre" in summary else None,
            summary["h_post"]["sum"]["mean"][i] if "h_post" in summary else None,
            off["mean"][i] if off else None,
            "no" if i in inert else "yes",
        ])
    tolerance = summary.get("negative_tolerance", NEGATIVE_TOLERANCE)
    header = ["connection", "row-sum err max", "col-sum err max", "col-sum err p99", "‖H‖₂ max",
              "deviation σ (mean)", "1 − σ² (mean)", "‖H − I‖_F mean", "rotation angle ° (mean)",
              f"share below −{tolerance:g}", "min entry", "Σ H_pre mean", "Σ H_post mean", "stream cosine mean",
              "H_res can change the output"]
    return table(header, rows, align="l" + "r" * (len(header) - 2) + "l") + [""]


def depth_lines(summary: dict[str, Any]) -> list[str]:
    rows = []
    for i in range(summary["depth"]):
        rows.append([
            str(i + 1),
            summary["composite_spectral_norm"]["max"][i],
            summary["composite_forward_amax"]["max"][i],
            summary["composite_backward_amax"]["max"][i],
            summary["composite_col_sum_error"]["max"][i],
            summary["cumulative_column_sums"]["min"][i],
            summary["cumulative_column_sums"]["max"][i],
        ])
    header = ["connections composed", "‖P‖₂ max", "forward Amax max", "backward Amax max", "col-sum err max",
              "column sum min", "column sum max"]
    return table(header, rows) + [""]


# ------------------------------------------------------------------------------------------------ models


def _tensor_text(value: Any) -> str:
    """What ``value`` is, for an error: ``a 1-D torch.float32 tensor of shape (16,)``, or its type and value."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_model(model: Any) -> None:
    """ValueError unless ``model`` is a module holding at least one connection that mixes streams."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module holding s2hc.HyperConnection (or s2hc.GatedResidual) "
                         f"modules, got {_tensor_text(model)}")
    if not mixing_connections(model):
        found = sum(isinstance(m, Connection) for m in model.modules())
        raise ValueError(
            f"model ({type(model).__name__}) has no hyper-connection that mixes streams ({found} s2hc connection(s), "
            "none mixing): diagnose_model measures s2hc.HyperConnection modules with n_streams >= 2 and a family "
            "other than 'residual', or s2hc.GatedResidual modules"
        )


def _check_input_ids(input_ids: Any, model: nn.Module) -> None:
    """ValueError unless ``input_ids`` is a non-empty 2-D integer tensor (for an s2hc Transformer, of ids below its
    ``vocab_size``)."""
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0
            or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool):
        raise ValueError(f"input_ids must be a 2-D integer tensor of token ids (batch, time), at least one of each, "
                         f"got {_tensor_text(input_ids)}")
    if isinstance(model, Transformer):
        low, high, vocab = int(input_ids.min()), int(input_ids.max()), model.config.vocab_size
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}) (the model's vocab_size), got {low}..{high}")


def _model_about(model: nn.Module, input_ids: torch.Tensor, seed: int, name: str) -> dict[str, Any]:
    """What ``diagnostics.json`` says of a model given as a module, before its measurements."""
    connections = [m for _, m in mixing_connections(model)]
    families = list(dict.fromkeys(m.family for m in connections))
    about: dict[str, Any] = {"kind": "model", "model": name, "family": families[0] if len(families) == 1 else None}
    if len(families) > 1:
        about["families"] = families
    about["n_streams"] = connections[0].n_streams
    about["s2hc_transformer"] = isinstance(model, Transformer)
    if about["s2hc_transformer"]:
        about.update(family_options=dict(model.config.family_options), n_layers=model.config.n_layers)
    about.update(input_shape=list(input_ids.shape), seed=seed)
    return about


def _diagnose(model: nn.Module, input_ids: torch.Tensor, out: Path | None, about: dict[str, Any], *,
              tokens: int | None, batch_size: int | None, seed: int, autocast_dtype: torch.dtype | None,
              more_figures: Callable[[Path], dict[str, Path]] | None = None) -> tuple[dict[str, Any], Path | None]:
    """Measure ``model`` on ``input_ids`` and, with ``out``, write ``diagnostics.json`` (``about``, then the
    measurements), the figures (and ``more_figures(out)``'s) and ``report.md``: ``(result, report path or None)``.
    The one place that measures a model and writes its report (:func:`diagnose_model`, :func:`diagnose_checkpoint`).
    """
    capture = collect(model, input_ids, tokens=tokens, batch_size=batch_size, seed=seed,
                      autocast_dtype=autocast_dtype)
    summary = capture.summary()
    result = {**about, **summary}
    if out is None:
        return result, None
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / JSON_NAME, result)
    figures = write_figures(out, {result["family"] or "model": result}, with_streams=True)
    if more_figures is not None:
        figures.update(more_figures(out))
    return result, write_text(out / REPORT_NAME, _model_report(result, figures, out))


def diagnose_model(
    model: nn.Module,
    input_ids: torch.Tensor,
    out: str | Path,
    *,
    tokens: int | None = DEFAULT_TOKENS,
    batch_size: int | None = None,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> Path:
    """Measure your own model's hyper-connections on ``input_ids`` and write their report; returns its path.

    ``model``: an :class:`s2hc.models.Transformer`, or any module holding :class:`s2hc.HyperConnection` (or
    :class:`s2hc.GatedResidual`) modules whose ``forward`` takes ``input_ids`` alone and calls each connection
    once. ``input_ids``: token ids ``(B, T)``, an integer tensor (moved to the model's device). The model runs under
    ``no_grad`` on ``batch_size`` rows at a time (default all), in eval mode (its mode is restored), under autocast
    to ``autocast_dtype`` when given; every connection is measured on the same ``tokens`` positions, drawn from the
    ``B·T`` with ``seed`` (None: all of them) — :func:`s2hc.diagnostics.collect`.

    Writes into ``out`` (created): ``diagnostics.json`` (``kind: "model"``, ``model`` (``name``, default the
    module's class name), ``family`` (None when the connections' families differ, then ``families``),
    ``n_streams``, ``s2hc_transformer`` (whether ``model`` is an s2hc Transformer; then ``family_options`` and
    ``n_layers`` too), ``input_shape``, ``seed``, then every measurement of :func:`s2hc.diagnostics.summarize`),
    the figures (PNG, with the ``plot`` extra, matplotlib; without it the report says ``pip install
    's2hc[plot]'`` in their place, as ``s2hc diagnose`` does) and ``report.md``, laid out as ``s2hc diagnose``'s.
    Of a module that is not an s2hc Transformer s2hc does not know how the streams enter and leave, so no
    connection is set apart as unable to change the output.

    ValueError, one line naming the argument, for ``input_ids`` that is not a non-empty 2-D integer tensor (or,
    for a Transformer, holds ids outside its vocabulary), a ``model`` that is not a module or holds no connection
    that mixes streams, a bad ``tokens`` / ``batch_size`` / ``seed`` / ``autocast_dtype`` / ``name``, or an ``out``
    that cannot be written; what ``model``'s own forward raises passes through (``out`` is not left behind then,
    when this call created it empty).
    """
    _check_model(model)
    _check_input_ids(input_ids, model)
    if tokens is not None:
        check_int("tokens", tokens)
    if batch_size is not None:
        check_int("batch_size", batch_size)
    check_int("seed", seed, minimum=0)
    if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
        raise ValueError(f"autocast_dtype must be a torch.dtype (torch.bfloat16, torch.float16) or None, got "
                         f"{autocast_dtype!r}")
    name = type(model).__name__ if name is None else check_str("name", name)
    created = not Path(out).expanduser().exists()
    directory = check_output_dir(out, "out")
    about = _model_about(model, input_ids, seed, name)
    try:
        _, report = _diagnose(model, input_ids, directory, about, tokens=tokens, batch_size=batch_size, seed=seed,
                              autocast_dtype=autocast_dtype)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):  # not empty: keep what is there
                directory.rmdir()
        raise
    return report


# ------------------------------------------------------------------------------------------ checkpoints


def default_out(checkpoint: str | Path) -> Path:
    """Where ``s2hc diagnose CHECKPOINT`` writes without ``--out``: ``RUN/diagnostics``, RUN being the run
    directory given or the one holding the checkpoint given (a file or a sharded ``checkpoint.dcp/``).
    ValueError when there is no checkpoint there."""
    return resolve_checkpoint(checkpoint).parent / "diagnostics"


def _validation_ids(data: str, config, cache_dir, tokens: int, seq_len: int, batch_size: int) -> torch.Tensor:
    # the run's own data: the run's validation split exactly (s2hc.data.sources.spec_for)
    spec = spec_for(data, config.data, config.source_spec())
    windows = max(1, math.ceil(tokens / seq_len))
    # a source that streams is read only as far as these windows (the whole split otherwise)
    val = validation_tokens(data, config.tokenizer, cache_dir, spec=spec, seq_len=seq_len, batch_size=batch_size,
                            eval_batches=math.ceil(windows / batch_size))
    batches = eval_batches(val, seq_len, batch_size, max_batches=math.ceil(windows / batch_size))
    ids = torch.cat([x for x, _ in batches])[:windows]
    return ids


def _nothing_to_measure(path: Path, model, config) -> dict[str, Any]:
    connections = [m for m in model.modules() if isinstance(m, Connection)]
    c = model.config
    return {
        "kind": "checkpoint",
        "checkpoint": str(path),
        "nothing_to_measure": True,
        "reason": (f"family {c.family!r} with {c.n_streams} stream(s): none of its {len(connections)} connections "
                   "mixes streams, so there is no H_res, H_pre or H_post to measure"),
        "checked": {
            "checkpoint_format": "s2hc checkpoint, read and model rebuilt",
            "preset": config.preset,
            "family": c.family,
            "n_streams": c.n_streams,
            "n_layers": c.n_layers,
            "connections": len(connections),
            "mixing_connections": 0,
            "parameters": model.num_params(),
        },
    }


def diagnose_checkpoint(
    checkpoint: str | Path,
    data: str = "embedded",
    tokens: int = DEFAULT_TOKENS,
    out: str | Path | None = None,
    seed: int = 0,
    device: str = "auto",
    cache_dir: str | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Measure a trained model on ``tokens`` positions of the validation split of ``data``.

    ``checkpoint``: a run directory or a checkpoint file (:func:`s2hc.rundir.load_model`). The text is
    tokenised with the run's tokenizer (cached in ``cache_dir``, default the run's); the model runs on
    ``ceil(tokens / seq_len)`` windows of ``seq_len`` tokens (default the run's) spread over the split, and
    ``tokens`` positions are drawn from them (``seed``). With ``out``, writes ``out/diagnostics.json``, the figures
    and ``out/report.md``. Returns the JSON object: ``kind``, ``checkpoint``, ``family``, ``n_streams``, ``preset``,
    ``data``, ``seed``, ``layers``, ``depth``, ``tokens``, and one key per measurement (see
    :func:`s2hc.diagnostics.summary.summarize`); for a model without stream mixing (``residual``)
    ``nothing_to_measure: true`` with what was ``checked``. ValueError for a missing, corrupt or foreign file.
    ``loaded``: the ``(model, train_config)`` of ``checkpoint`` when the caller has read it already (it is not
    read again; the model is moved to ``device``).
    """
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    path = resolve_checkpoint(checkpoint)
    model, config = loaded if loaded is not None else load_model(path)
    out = Path(out).expanduser() if out is not None else None
    if not mixing_connections(model) and not depth_modules(model) and not map_modules(model):
        result = _nothing_to_measure(path, model, config)
        if out is not None:
            write_json(out / JSON_NAME, result)
            write_text(out / REPORT_NAME, _nothing_report(result))
        return result
    if not mixing_connections(model) and map_modules(model):  # the wide residual: its maps, read from the weights
        result = {"kind": "checkpoint", "checkpoint": str(path), "family": model.config.family,
                  "n_streams": model.config.n_streams, "family_options": dict(model.config.family_options),
                  "preset": config.preset, "n_layers": model.config.n_layers, "learned_maps": learned_maps(model)}
        if out is not None:
            write_json(out / JSON_NAME, result)
            write_text(out / REPORT_NAME, _maps_report(result))
        return result
    check_tokenizer_fits(get_tokenizer(config.tokenizer), model.config.vocab_size, path)  # as eval does
    target = resolve_device(device)
    model = model.to(target)
    seq_len = seq_len or config.seq_len
    batch_size = batch_size or config.batch_size
    cache = cache_dir if cache_dir is not None else stored_cache_dir(config.cache_dir)  # not another machine's
    ids = _validation_ids(data, config, cache, tokens, seq_len, batch_size)
    about = {
        "kind": "checkpoint",
        "checkpoint": str(path),
        "family": model.config.family,
        "n_streams": model.config.n_streams,
        "family_options": dict(model.config.family_options),
        "preset": config.preset,
        "n_layers": model.config.n_layers,
        "data": data,
        "split": "val",
        "seq_len": seq_len,
        "seed": seed,
    }
    if not mixing_connections(model):  # AttnRes: its depth softmax is what there is to measure
        result = {**about, "depth_attention": depth_attention(model, ids, tokens=tokens, seed=seed,
                                                                batch_size=batch_size,
                                                                autocast_dtype=autocast_dtype(config.dtype, target))}
        if out is not None:
            write_json(out / JSON_NAME, result)
            write_text(out / REPORT_NAME, _depth_report(result))
        return result
    result, _ = _diagnose(model, ids, out, about, tokens=tokens, batch_size=batch_size, seed=seed,
                          autocast_dtype=autocast_dtype(config.dtype, target),
                          more_figures=lambda directory: _history_figure(path.parent, directory))
    return result


def _depth_report(result: dict[str, Any]) -> str:
    """The report of an AttnRes checkpoint: what was measured, then the depth-attention table."""
    options = options_text(result.get("family_options"))
    lines = [f"# s2hc diagnose: `{result['checkpoint']}`", "",
             f"Family `{result['family']}`{options}, preset `{result['preset']}` ({result['n_layers']} layers). "
             f"Measured on the validation split of `{result['data']}` (windows of {result['seq_len']} tokens, seed "
             f"{result['seed']}). The numbers: [`{JSON_NAME}`]({JSON_NAME}).", ""]
    return "\n".join(lines + depth_attention_lines(result["depth_attention"])) + "\n"


def _maps_report(result: dict[str, Any]) -> str:
    """The report of a checkpoint whose form has learned maps of its own (the wide residual): its read and write
    maps, and no residual-matrix measure (it has no residual matrix)."""
    options = options_text(result.get("family_options"))
    lines = [f"# s2hc diagnose: `{result['checkpoint']}`", "",
             f"Family `{result['family']}`{options} with n = {result['n_streams']}, preset `{result['preset']}` "
             f"({result['n_layers']} layers). Read from the weights (the maps do not depend on the tokens). The "
             f"numbers: [`{JSON_NAME}`]({JSON_NAME}).", ""]
    return "\n".join(lines + maps_lines(result["learned_maps"])) + "\n"


def _history_figure(run_dir: Path, out: Path) -> dict[str, Path]:
    """``{"training_history": path}`` when the run logged diagnostics during training (and matplotlib is there)."""
    if not (run_dir / METRICS).is_file() or not plots.have_matplotlib():
        return {}
    try:
        records = [r for r in read_metrics(run_dir) if "diagnostics" in r]
    except (OSError, ValueError):
        return {}
    if not records:
        return {}
    return {"training_history": plots.plot_training_history(records, out / plots.FIGURES["training_history"])}


def _nothing_report(result: dict[str, Any]) -> str:
    lines = [f"# s2hc diagnose: `{result['checkpoint']}`", "", f"Nothing to measure: {result['reason']}.", "",
             "What was checked:", ""]
    lines += [f"- {k}: {v}" for k, v in result["checked"].items()]
    return "\n".join(lines) + "\n"


def nothing_message(result: dict[str, Any]) -> str:
    """The short text ``s2hc diagnose`` prints for a model without stream mixing."""
    checked = result["checked"]
    return (f"nothing to measure in {result['checkpoint']}: {result['reason']}.\n"
            f"checked: s2hc checkpoint read and model rebuilt (preset {checked['preset']!r}, {checked['n_layers']} "
            f"layers, {checked['parameters']:,} parameters); {checked['connections']} connections, "
            f"{checked['mixing_connections']} mixing streams")


def _heading_lines(result: dict[str, Any]) -> list[str]:
    """The report's title and the paragraph saying what was measured on what: of a checkpoint
    (:func:`diagnose_checkpoint`) or of a model given as a module (:func:`diagnose_model`)."""
    if result["kind"] == "checkpoint":
        return [
            f"# s2hc diagnose: `{result['checkpoint']}`",
            "",
            f"Family `{result['family']}`{options_text(result.get('family_options'))}, "
            f"n = {result['n_streams']} streams, preset "
            f"`{result['preset']}` ({result['n_layers']} layers, {result['depth']} connections). Measured on "
            f"{result['tokens']:,} token positions of the validation split of `{result['data']}` (windows of "
            f"{result['seq_len']} tokens, seed {result['seed']}). The numbers: [`{JSON_NAME}`]({JSON_NAME}).",
            "",
        ]
    families = result.get("families")
    family = (f"Families {', '.join(f'`{f}`' for f in families)}" if families else
              f"Family `{result['family']}`{options_text(result.get('family_options'))}")
    layers = f"{result['n_layers']} layers, " if "n_layers" in result else ""
    batch, time = result["input_shape"]
    wiring = ("" if result["s2hc_transformer"] else
              " s2hc does not know how this model's streams enter and leave, so every connection is counted as one "
              "that can change the output (in an s2hc Transformer the first and last cannot: docs/diagnostics.md).")
    return [
        f"# s2hc diagnostics: `{result['model']}`",
        "",
        f"{family}, n = {result['n_streams']} streams ({layers}{result['depth']} connections). Measured on "
        f"{result['tokens']:,} token positions of the given input_ids ({batch} × {time}, seed {result['seed']}). "
        f"The numbers: [`{JSON_NAME}`]({JSON_NAME}).{wiring}",
        "",
    ]


def has_residual_matrix(summary: dict[str, Any]) -> bool:
    """Whether the measured family mixes its streams by a residual matrix (False for the gated residual, whose
    ``H_res`` is the identity it never leaves: its H_res numbers would say nothing)."""
    family = summary.get("family")
    return family is None or family not in forms.REGISTRY or forms.get(family).has_res


def gate_layer_lines(summary: dict[str, Any]) -> list[str]:
    """One row per connection of a family without a residual matrix: its read and write weights and the streams'
    cosine, no H_res column."""
    sim = summary.get("stream_similarity") or {}
    off = sim.get("offdiagonal")
    rows = [[f"{i} `{name}`", summary["h_pre"]["sum"]["mean"][i] if "h_pre" in summary else None,
             summary["h_post"]["sum"]["mean"][i] if "h_post" in summary else None, off["mean"][i] if off else None]
            for i, name in enumerate(summary["layers"])]
    return table(["connection", "Σ H_pre mean (read)", "Σ H_post mean (write)", "stream cosine mean"], rows,
                 align="lrrr") + [""]


def _model_report(result: dict[str, Any], figures: dict[str, Path], out: Path) -> str:
    """``report.md`` of a measured model: what was measured, the headline, the family's guarantees, per connection,
    across depth, the stream usage and the figures; for a family without a residual matrix its reads and writes
    per connection and the stream usage, no H_res number."""
    if not has_residual_matrix(result):
        lines = _heading_lines(result) + [
            "## Per connection", "",
            f"Family `{result['family']}` has no residual matrix: its streams are never mixed (H_res = I), so there "
            "is no H_res to measure. What each connection reads and writes, mean over tokens:", ""]
        lines += gate_layer_lines(result)
        usage = stream_usage_lines(result)
        if usage:
            lines += ["## Stream usage", ""] + usage
        shown = {key: path for key, path in figures.items() if key.startswith("stream")}
        return "\n".join(lines + ["## Figures", ""] + figure_lines(shown, out))
    lines = _heading_lines(result) + ["## Summary", ""]
    lines += summary_lines(result, "worst over layers and tokens", " (mean over tokens)")
    guarantees = guarantee_lines(result)
    if not guarantees and result.get("families"):  # a model of several families: whose claims would be checked?
        guarantees = [f"The connections are of {len(result['families'])} families: there is no one family's "
                      "guarantees to check.", ""]
    lines += ["## Guarantees of the family, measured", ""] + guarantees
    lines += ["## Per connection", "", "Errors and norms are the worst over tokens unless marked mean.", ""]
    lines += layer_lines(result)
    lines += [
        "## Across depth",
        "",
        "P = H_l ⋯ H_0: the residual path through the first l + 1 connections, per token.",
        "",
    ]
    lines += depth_lines(result)
    usage = stream_usage_lines(result)
    if usage:
        lines += ["## Stream usage", ""] + usage
    lines += ["## Figures", ""] + figure_lines(figures, out)
    return "\n".join(lines)


#: The reading's rule for "one stream dominates": a stream has more than this share of what the interior
#: connections read (or write, or the output takes), their token-mean shares averaged over depth.
DOMINANT_SHARE = 0.5


def _shares_text(shares: list[float] | None) -> str:
    if not shares or any(v is None or math.isnan(v) for v in shares):
        return DASH
    return ", ".join(f"{v:.2f}" for v in shares)


def _dominant_text(stream: int | None, share: float | None) -> str:
    return DASH if stream is None or stream < 0 or share is None else f"{stream} ({share:.2f})"


def _effective_text(value: float | None, n: int) -> str:
    return DASH if value is None or math.isnan(value) else f"{value:.2f} of {n}"


def _usage_reading(summary: dict[str, Any]) -> str:
    """One line: what the streams' shares say over depth, each claim with its measure."""
    head, n = summary["headline"], summary["n_streams"]
    parts, dominant = [], []
    for prefix, verb in (("read", "read from"), ("write", "write to")):
        mean = head.get(f"{prefix}_effective_streams_mean")
        if mean is None:
            continue
        parts.append(f"{verb} {mean:.2f} of {n} effective streams (mean over the interior connections, the fewest "
                     f"{head[f'{prefix}_effective_streams_min']:.2f}; {head[f'{prefix}_depth_effective_streams']:.2f} "
                     f"of their {prefix} shares averaged over depth)")
        share, stream = head.get(f"{prefix}_depth_dominant_share"), summary.get(f"{prefix}_depth_dominant_stream")
        if share is not None:
            dominant.append((share, f"{prefix}s over depth", stream))
    output = summary.get("output_effective_streams")
    if output is not None and not math.isnan(output):
        parts.append(f"the output takes from {output:.2f} of {n}")
        dominant.append((summary["output_dominant_share"], "output", summary["output_dominant_stream"]))
    if not parts:
        return ""
    text = "Reading: the connections " + "; ".join(parts) + " (each: exp of the entropy of token-mean shares). "
    if dominant:
        share, what, stream = max(dominant, key=lambda d: d[0])
        if share > DOMINANT_SHARE:
            text += f"One stream dominates: stream {stream} has {share:.2f} of the {what} (> {DOMINANT_SHARE:g})."
        else:
            text += (f"No stream has more than {DOMINANT_SHARE:g} of the reads or writes over depth or of the output "
                     f"(the largest: stream {stream}, {share:.2f} of the {what}).")
    similarity = head.get("stream_similarity_output_mean")
    if similarity is not None:
        text += (f" The output streams' mean cosine is {similarity:.3g}" + (
            ": they are nearly one stream, whatever their shares." if similarity > 0.9 else
            " (near 1 the streams would be one, whatever their shares)."))
    return text


def stream_usage_lines(summary: dict[str, Any]) -> list[str]:
    """The "Stream usage" section's body: each stream's share of every connection's read and write, the effective
    number of streams and the dominant stream, a line for the output and for depth, and the one-line reading.
    Empty when the summary has no read or write weights."""
    if "read_share" not in summary and "write_share" not in summary:
        return []
    n = summary["n_streams"]
    read_inert, write_inert = set(summary.get("read_inert_layers", [])), set(summary.get("write_inert_layers", []))
    spread = (summary.get("read_spread") or {}).get("relative")
    rows = []
    for i, name in enumerate(summary["layers"]):
        row = [f"{i} `{name}`"]
        for prefix, inert in (("read", read_inert), ("write", write_inert)):
            if f"{prefix}_share" not in summary:
                row += [DASH] * 4
                continue
            row += [_shares_text(summary[f"{prefix}_share"][i]),
                    _effective_text(summary[f"{prefix}_effective_streams"][i], n),
                    _dominant_text(summary[f"{prefix}_dominant_stream"][i], summary[f"{prefix}_dominant_share"][i]),
                    "no" if i in inert else "yes"]
        if spread is not None:
            row.append(sum(spread[i]) / len(spread[i]))
        rows.append(row)
    header = ["connection", "read shares", "effective read streams", "dominant read stream (share)",
              "read split can change the output", "write shares", "effective write streams",
              "dominant write stream (share)", "write split can change the output"]
    if spread is not None:
        header.append("read gates' spread over channels / mean")
    lines = [
        "Per connection and token, stream s's read share is |H_pre[s]| / Σ_t |H_pre[t]| (its write share the same of "
        "H_post; for the gated residual H_pre[s] is its read gates' mean over channels / n), averaged over tokens; "
        "the effective number of streams is exp(−Σ p log p) of those shares (1: one stream, n: all alike), the "
        "dominant stream the one with the largest share. The split of the first connection's read (identical "
        "copies in) and of the last one's write (streams summed or averaged) cannot change the output: the "
        "interior values leave them out.",
        "",
    ]
    lines += table(header, rows, align="l" + "rrrl" * 2 + "r" * (spread is not None)) + [""]
    if "output_share" in summary:
        how = OUTPUT_READS.get(summary.get("output_read") or "unknown", summary.get("output_read"))
        lines += [f"Output, what the model's final read takes from each final stream ({how}), per token over its sum, "
                  f"averaged over tokens: shares {_shares_text(summary['output_share'])}, effective streams "
                  f"{_effective_text(summary['output_effective_streams'], n)}, dominant stream "
                  f"{_dominant_text(summary['output_dominant_stream'], summary['output_dominant_share'])}.", ""]
    else:
        lines += ["Output: not measured (the final streams are not known here).", ""]
    depth = [f"{prefix} shares {_shares_text(summary[f'{prefix}_depth_share'])} (effective "
             f"{_effective_text(summary[f'{prefix}_depth_effective_streams'], n)})"
             for prefix in ("read", "write") if summary.get(f"{prefix}_depth_share") is not None]
    if depth:
        lines += ["Over depth, the interior connections' shares averaged: " + "; ".join(depth) + ".", ""]
    reading = _usage_reading(summary)
    return lines + ([reading, ""] if reading else [])


def options_text(options: dict | None) -> str:
    return f" ({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else ""


# ------------------------------------------------------------------------------------------- synthetic


def _pivot(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{family: {measurement: v}}`` -> ``{measurement: {family: v}}`` (shared keys once)."""
    first = next(iter(summaries.values()))
    out: dict[str, Any] = {key: first[key] for key in SHARED_KEYS}
    for family, summary in summaries.items():
        for key, value in summary.items():
            if key not in SHARED_KEYS:
                out.setdefault(key, {})[family] = value
    return out


def diagnose_synthetic(
    families: Sequence[str],
    n_streams: int = 4,
    layers: int = 28,
    tokens: int = DEFAULT_TOKENS,
    logit_scale: float = 1.0,
    seed: int = 0,
    sweep: Sequence[float] = DEFAULT_SWEEP,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Every measurement on each family's matrices from random inputs (:mod:`s2hc.diagnostics.synthetic`).

    ``layers`` matrices are composed per token, ``tokens`` tokens, inputs of logit scale ``logit_scale``
    (standard deviation of ``α·d_res``); ``sweep`` repeats the headline numbers at other scales (empty: none).
    Returns (and with ``out`` writes as ``out/diagnostics.json``, beside the figures and ``out/report.md``) one
    object: ``kind: "synthetic"``, ``settings``, ``families``, the shared ``layers``/``depth``/``tokens``/
    ``n_streams``, one key per measurement mapping each family to its statistics, and ``logit_scale_sweep``.
    """
    families = [f for f in families if f in mixers.REGISTRY]
    if not families:
        raise ValueError("no family with a residual matrix to generate (only the mixing families "
                         f"{list(mixers.REGISTRY)} have one)")
    summaries = synthetic_summaries(families, n_streams, layers, tokens, logit_scale, seed)
    scales = sorted(set(float(s) for s in sweep) | ({float(logit_scale)} if sweep else set()))
    sweep_rows = logit_scale_sweep(families, scales, n_streams, layers, tokens, seed) if scales else {}
    result = {
        "kind": "synthetic",
        "settings": {
            "families": families, "n_streams": n_streams, "layers": layers, "tokens": tokens,
            "logit_scale": float(logit_scale), "seed": seed, "sweep": scales,
            "logit_scale_definition": "standard deviation of alpha * d_res: every scale alpha of the family is set "
                                      "to S and d_res ~ N(0, 1); all other parameters at their initial values",
        },
        "families": families,
        **_pivot(summaries),
        "logit_scale_sweep": sweep_rows,
    }
    if out is not None:
        out = Path(out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / JSON_NAME, result)
        figures = write_figures(out, summaries, with_streams=False)
        if sweep_rows and plots.have_matplotlib():
            figures["logit_scale_sweep"] = plots.plot_logit_scale_sweep(
                sweep_rows, out / plots.FIGURES["logit_scale_sweep"]
            )
        write_text(out / REPORT_NAME, _synthetic_report(result, summaries, figures, out))
    return result


def synthetic_table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The headline table of the synthetic mode, one row per family (Markdown lines)."""
    rows = []
    for family, s in summaries.items():
        h = s["headline"]
        rows.append([f"`{family}`", h["col_sum_error"], h["column_sum_max"], h["spectral_norm"],
                     h["composite_spectral_norm_at_depth"], h["composite_forward_amax"], h["composite_backward_amax"],
                     h["cumulative_column_sum_max"], h["composite_col_sum_error"], h["rotation_angle_mean"],
                     h["spectrum_slope_mean"], h["negative_share_mean"]])
    header = ["family", "col-sum err (1 layer)", "column sum max (1 layer)", "‖H‖₂ max", "‖P_L‖₂ max",
              "composite fwd Amax", "composite bwd Amax", "cumulative column sum max", "composite col-sum err",
              "rotation angle °", "1 − σ² (mean)", f"share below −{NEGATIVE_TOLERANCE:g}"]
    return table(header, rows)


def _synthetic_report(result: dict[str, Any], summaries: dict[str, dict[str, Any]], figures: dict[str, Path],
                      out: Path) -> str:
    st = result["settings"]
    lines = [
        "# s2hc diagnose --synthetic",
        "",
        f"{st['layers']} matrices per token composed over depth, {st['tokens']:,} tokens, n = {st['n_streams']} "
        f"streams, logit scale S = {st['logit_scale']:g} (the standard deviation of α·d_res: each family's scales α "
        f"set to S, d_res ~ N(0, 1), everything else at initialisation), seed {st['seed']}. "
        f"Worst values over layers, depths and tokens; P_L is the product of all {st['layers']}.",
        "",
    ]
    lines += synthetic_table(summaries) + [""]
    lines += ["## Guarantees claimed, measured", ""]
    for family, s in summaries.items():
        lines += [f"`{family}`:", ""] + guarantee_lines(s)
    if result["logit_scale_sweep"]:
        lines += [
            "## Against the logit scale",
            "",
            "Worst single-layer column-sum error / composite column-sum error / composite backward Amax gain:",
            "",
        ]
        scales = st["sweep"]
        rows = []
        for family, entries in result["logit_scale_sweep"].items():
            rows.append(
                [f"`{family}`"]
                + [
                    f"{number(e['col_sum_error'])} / {number(e['composite_col_sum_error'])} / "
                    f"{number(e['composite_backward_amax'])}"
                    for e in entries
                ]
            )
        lines += table(["family"] + [f"S = {s:g}" for s in scales], rows) + [""]
    lines += ["## Figures", ""] + figure_lines(figures, out)
    return "\n".join(lines)
