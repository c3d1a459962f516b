"""One finished (or diverged) study run, measured into one row of ``results.json``.

A row holds everything the report needs, so that ``--report-only`` rebuilds the report from ``results.json``
alone: the losses, the curves, gradient-norm statistics, the largest loss spike, the trained model's residual
matrices (compact per-layer summaries, :func:`compact_diagnostics`), the rotation parameters' drift and their
gradients at float32 against float64 (:func:`rotation_probe`), and, apart, what depends on the machine
(``timing``: tokens/s and the median step time).
"""

from __future__ import annotations

import copy
import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import TrainConfig, completed_settings
from ..connection import HyperConnection
from ..data.loader import eval_batches
from ..data.stream import validation_tokens
from ..data.tokenizer import get_tokenizer
from ..diagnostics import diagnose_checkpoint, mixing_connections
from ..flops import model_flops
from ..mixers.orthomaps import Rotation
from ..models import Transformer
from ..rundir import Checkpoint, checkpoint_paths, load_checkpoint, model_from_checkpoint, read_config, read_metrics
from ..rundir.metrics import final_train_loss
from ..train.init_from import load_initial_weights
from .spec import Configuration

#: The version of a row's ``cost`` (what the verdicts at equal cost read, :mod:`.cost`): rows measured before it
#: lack it, and the report leaves the verdicts out for them, so it needs no new row version.
COST_VERSION = 1
#: Rows of another version are measured again from their run directories (where there are none, as for the
#: committed studies' results, the report still builds from them and says what they lack). 3: the rotation angle,
#: the spectrum slope, negative entries counted below −1e-3 and the connections that cannot change the output.
ROW_VERSION = 3
#: The first row version whose headline holds :func:`s2hc.diagnostics.summary.mixing_headline`'s measures (the
#: study report shows a dash for older rows rather than read a key that meant something else then:
#: ``negative_share_mean`` counted every entry below 0 and took the largest over all connections, inert ones too).
MIXING_VERSION = 3
# Kept per layer from the trained model's diagnostics: what the report's tables and figures read (None: the
# value as it is).
DIAGNOSTIC_KEYS = {
    "deviation_singular_values": ("mean", "p10", "p90"),
    "spectrum_slope": ("mean",),
    "column_sums": ("min", "max"),
    "cumulative_column_sums": ("min", "max"),
    "forward_amax": ("max",),
    "backward_amax": ("max",),
    "composite_forward_amax": ("max",),
    "composite_backward_amax": ("max",),
    "composite_spectral_norm": ("max",),
    "spectral_norm": ("max",),
    "identity_distance": ("mean",),
    "rotation_angle": ("mean",),
    "negative_share": ("mean",),  # entries below −negative_tolerance
    "min_entry": ("min",),
    "inert_layers": None,
    "negative_tolerance": None,
}
#: Kept as they are when the trained model's diagnostics have them (the stream usage,
#: :func:`s2hc.diagnostics.summary.stream_usage`): rows measured before it lack them and the report skips them, so
#: they need no new row version.
STREAM_USAGE_KEYS = tuple(f"{prefix}_{key}" for prefix in ("read", "write") for key in (
    "share", "effective_streams", "dominant_share", "dominant_stream", "inert_layers", "depth_share",
    "depth_effective_streams", "depth_dominant_stream")) + (
    "output_share", "output_effective_streams", "output_dominant_share", "output_dominant_stream", "output_read")


def _round(value: Any, digits: int = 6) -> Any:
    """Floats to ``digits`` significant digits (lists and dicts recursively): a row records measurements, not
    their last bits."""
    if isinstance(value, float):
        return value if not math.isfinite(value) or value == 0 else float(f"{value:.{digits}g}")
    if isinstance(value, list):
        return [_round(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    return value


def loss_spike(losses: list[float]) -> float:
    """The largest rise of a loss curve above its running minimum (0 for a curve that never rises)."""
    best, spike = math.inf, 0.0
    for loss in losses:
        spike = max(spike, loss - best) if math.isfinite(best) else spike
        best = min(best, loss)
    return spike


def compact_diagnostics(summary: dict[str, Any]) -> dict[str, Any]:
    """The per-layer statistics of :data:`DIAGNOSTIC_KEYS`, the stream usage (:data:`STREAM_USAGE_KEYS`, those the
    summary has) and the stream similarities of a :func:`~s2hc.diagnostics.summarize` dict, in the same structure
    (the diagnostics' figures draw them)."""
    out: dict[str, Any] = {"layers": summary["layers"], "n_streams": summary["n_streams"],
                           "tokens": summary["tokens"], "headline": summary["headline"]}
    for key, stats in DIAGNOSTIC_KEYS.items():
        out[key] = summary[key] if stats is None else {stat: summary[key][stat] for stat in stats}
    out.update({key: summary[key] for key in STREAM_USAGE_KEYS if key in summary})
    similarity = summary.get("stream_similarity")
    if similarity and similarity.get("offdiagonal"):
        out["stream_similarity"] = {
            "labels": similarity["labels"],
            "offdiagonal": {k: similarity["offdiagonal"][k] for k in ("mean", "min", "max")},
            "pairwise_mean": similarity["pairwise_mean"],
        }
    return _round(out)


def _rotation_parameters(connection: HyperConnection, grads: bool = False) -> list[torch.Tensor]:
    """The parameters that make a connection's rotations (or, with ``grads``, their gradients): its Rotation
    modules' own (α, b, γ) and the projection columns that feed them (the first rotation inputs of ``d_res``,
    after the ``2n`` gate columns). Empty for a family without rotations."""
    mixer = getattr(connection, "mixer", None)  # the gated residual has none
    rotations = [] if mixer is None else [m for m in mixer.modules() if isinstance(m, Rotation)]
    if not rotations:
        return []

    def pick(p: torch.Tensor) -> torch.Tensor:
        return (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p

    start, count = 2 * connection.n_streams, sum(r.num_inputs for r in rotations)
    columns = pick(connection.projection)[:, start : start + count]
    return [columns, *(pick(p) for r in rotations for p in r.parameters())]


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


def _rotation_gradients(model: Transformer, batch: tuple[torch.Tensor, torch.Tensor],
                        dtype: torch.dtype) -> list[float]:
    """The gradient norm of each connection's rotation parameters for one batch, the model in ``dtype``."""
    model = copy.deepcopy(model).to(dtype).train()
    x, y = batch
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return [_norm(_rotation_parameters(hc, grads=True)) for _, hc in mixing_connections(model)]


def rotation_probe(trained: Transformer, config: TrainConfig, batch) -> dict[str, Any] | None:
    """How the rotation parameters of each connection moved, and whether their gradients are real.

    The streams enter the first connection as identical copies, and an ``H_res`` whose rows sum to 1 maps
    identical streams to themselves; the last connection's streams are summed, and an ``H_res`` whose columns sum
    to 1 keeps the sum (:func:`s2hc.diagnostics.inert.inert_connections` finds such connections, and the
    diagnostics report them apart). Neither connection's rotations can change the model's output: their
    gradient is zero in exact arithmetic and what float32 computes is rounding noise. Measured per connection
    (depth order): ``drift`` (norm of trained − initial rotation parameters; the initial model is rebuilt from
    the seed exactly as training built it, and loaded from ``init_from`` when the run started from another
    run's weights), ``grad_init_fp32`` / ``grad_init_fp64`` and ``grad_final_fp32`` /
    ``grad_final_fp64`` (gradient norms on one validation batch at initialisation and after training, the model
    in float32 and float64: a gradient that is rounding noise is orders of magnitude smaller in float64).
    None for families without rotations.
    """
    connections = mixing_connections(trained)
    if not connections or not any(_rotation_parameters(hc) for _, hc in connections):
        return None
    torch.manual_seed(config.seed)  # as training seeded the initial weights
    initial = Transformer(trained.config, init_rng=config.init_rng, init_seed=config.seed)
    if config.init_from:  # a run that started from another one's weights (upcycled or continued)
        load_initial_weights(initial, config.init_from)
    drift = []
    for (_, hc), (_, hc0) in zip(connections, mixing_connections(initial)):
        trained_params, initial_params = _rotation_parameters(hc), _rotation_parameters(hc0)
        drift.append(_norm([a - b for a, b in zip(trained_params, initial_params)]))
    return _round({
        "connections": [name for name, _ in connections],
        "drift": drift,
        "grad_init_fp32": _rotation_gradients(initial, batch, torch.float32),
        "grad_init_fp64": _rotation_gradients(initial, batch, torch.float64),
        "grad_final_fp32": _rotation_gradients(trained, batch, torch.float32),
        "grad_final_fp64": _rotation_gradients(trained, batch, torch.float64),
    }, digits=4)


def trajectory(records: list[dict[str, Any]]) -> dict[str, list] | None:
    """What the matrices did over training, from the run's ``diagnostics`` records (``diagnostics_every``): per
    recorded step the smallest deviation singular value (token mean, smallest over the interior connections, those
    whose ``H_res`` can change the output), the largest rotation angle over them (degrees), the composite forward
    Amax gain, the mean cosine between the output streams, and (records that have it) the common-mode gain
    ``1ᵀH1/n`` averaged over the interior connections and that of the composite over the whole depth. None for a
    run without such records."""
    out: dict[str, list] = {"steps": [], "smallest_deviation_singular_value": [], "rotation_angle": [],
                            "composite_forward_amax": [], "stream_similarity_output": [], "common_mode_gain": [],
                            "composite_common_mode_gain": []}
    for record in records:
        d = record.get("diagnostics") or {}
        if "deviation_singular_values_mean" not in d:
            continue
        inert = set(d.get("inert_layers") or ())
        values = d["deviation_singular_values_mean"]  # per connection, its components largest first
        interior = [i for i in range(len(values)) if i not in inert]
        smallest = [values[i][-1] for i in interior if values[i]]
        angles = [d["rotation_angle_mean"][i] for i in interior] if d.get("rotation_angle_mean") else []
        similarity = d.get("stream_similarity_mean") or [None]
        out["steps"].append(record["step"])
        out["smallest_deviation_singular_value"].append(min(smallest) if smallest else None)
        out["rotation_angle"].append(max(angles) if angles else None)
        out["composite_forward_amax"].append(max(d["composite_forward_amax_max"]))
        out["stream_similarity_output"].append(similarity[-1])
        gains = d.get("common_mode_gain_mean")  # recorded since the common mode was measured
        out["common_mode_gain"].append(statistics.fmean(gains[i] for i in interior) if gains and interior else None)
        composite = d.get("composite_common_mode_gain_mean")
        out["composite_common_mode_gain"].append(composite[-1] if composite else None)
    if not any(v is not None for v in out["common_mode_gain"] + out["composite_common_mode_gain"]):
        del out["common_mode_gain"], out["composite_common_mode_gain"]  # a run from before: its rows stay as they were
    return out if out["steps"] else None


def _timing(payload: Checkpoint | None, records: list[dict], tokens_per_step: int) -> dict[str, float | None]:
    """Tokens/s from the median step time (every step's time is in the checkpoint ``payload``; the logged ones
    otherwise)."""
    times = list(payload.history.step_times) if payload is not None else []
    if not times:
        times = [r["step_time"] for r in records if "step_time" in r]
    if not times:
        return {"tokens_per_s": None, "median_step_s": None}
    median = statistics.median(times)
    return {"tokens_per_s": round(tokens_per_step / median, 1), "median_step_s": round(median, 5)}


def measure_run(configuration: Configuration, seed: int, run_dir: Path, diagnostics_tokens: int,
                device: str = "cpu") -> dict[str, Any]:
    """The row of one run whose directory holds a finished or diverged run."""
    records = read_metrics(run_dir)
    config = TrainConfig.from_dict({**completed_settings(read_config(run_dir)), "out": str(run_dir)})
    diverged = next((r for r in records if "diverged" in r), None)
    train_points = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val_points = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    grad_norms = [r["grad_norm"] for r in records if isinstance(r.get("grad_norm"), float)]
    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum
    row: dict[str, Any] = {
        "name": run_dir.name, "label": configuration.label, "family": configuration.family,
        "options": dict(configuration.options), "n_streams": configuration.n_streams, "seed": seed,
        "settings": dict(configuration.settings),
        "steps": config.max_steps, "tokens": config.max_steps * tokens_per_step,
        "status": "diverged" if diverged else "finished",
        "diverged_at": diverged["step"] if diverged else None,
        "diverged_reason": diverged["diverged"] if diverged else None,
        "train_loss": final_train_loss(run_dir) if train_points and not diverged else None,
        "val_loss": val_points[-1][1] if val_points and not diverged else None,
        "grad_norm": {
            "mean": statistics.fmean(grad_norms), "median": statistics.median(grad_norms),
            "p95": sorted(grad_norms)[min(len(grad_norms) - 1, int(0.95 * len(grad_norms)))],
            "max": max(grad_norms),
        } if grad_norms else None,
        "loss_spike": loss_spike([loss for _, loss in train_points]),
        "curves": {"train": [list(p) for p in train_points], "val": [list(p) for p in val_points]},
        "trajectory": trajectory(records),
        # where it trained (CPU model, torch build, threads, device), per start: what decides its rounding
        "platform": [{"step": r["step"], **r["platform"]} for r in records if "platform" in r] or None,
        "params": None, "hc_params": None, "diagnostics": None, "rotations": None,
    }
    row["val_ppl"] = math.exp(row["val_loss"]) if row["val_loss"] is not None else None
    payload = load_checkpoint(run_dir) if checkpoint_paths(run_dir) else None  # read (and verified) once
    if payload is not None:
        model, saved_config = model_from_checkpoint(payload)
        row["params"], row["hc_params"] = model.num_params(), model.num_connection_params()
        if not diverged:
            result = diagnose_checkpoint(run_dir, data=config.data, tokens=diagnostics_tokens,
                                         out=run_dir / "diagnostics", device=device, loaded=(model, saved_config))
            if "depth_attention" in result:  # AttnRes: its depth softmax, not stream matrices
                row["depth_attention"] = result["depth_attention"]
            elif "learned_maps" in result:  # the wide residual: its read and write maps
                row["learned_maps"] = result["learned_maps"]
            elif not result.get("nothing_to_measure"):
                row["diagnostics"] = compact_diagnostics(result)
            row["rotations"] = rotation_probe(model.cpu().float(), config, _probe_batch(config))
    row["timing"] = _timing(payload, records, tokens_per_step)
    # cumulative training seconds at each validation record (None where a record lacks them: an older run)
    seconds = [r.get("train_seconds") for r in records if "val_loss" in r]
    row["timing"]["val_seconds"] = seconds if seconds and None not in seconds else None
    row["cost"] = _cost(config, None if payload is None else model.config, tokens_per_step, row["platform"])
    row["version"] = ROW_VERSION
    return _round(row)


def _cost(config: TrainConfig, model_config, tokens_per_step: int, platform: list[dict] | None) -> dict[str, Any]:
    """What the verdicts at equal cost need beside the curves and timing: the tokens per step (a validation record
    at step s is s × that many tokens), the precision the run trained in (``dtype``; ``auto`` is bfloat16 on a GPU,
    float32 on a CPU) and the model's FLOPs per token (:func:`s2hc.flops.model_flops`; None, with the reason, where
    there is no checkpoint to read the model from or no count for its connection form)."""
    device = (platform or [{}])[0].get("device", "cpu")
    precision = config.dtype if config.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    cost: dict[str, Any] = {"version": COST_VERSION, "tokens_per_step": tokens_per_step, "precision": precision,
                            "flops": None}
    if model_config is None:
        cost["flops_reason"] = "no checkpoint to read the model from"
        return cost
    try:
        cost["flops"] = model_flops(model_config, config.seq_len)
    except ValueError as error:  # a connection form without a count
        cost["flops_reason"] = str(error)
    return cost


def _probe_batch(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's first validation batch (inputs, targets)."""
    tokenizer = get_tokenizer(config.tokenizer)
    tokens = validation_tokens(config.data, tokenizer, config.cache_dir, spec=config.source_spec(),
                               seq_len=config.seq_len, batch_size=config.batch_size, eval_batches=config.eval_batches)
    return next(iter(eval_batches(tokens, config.seq_len, config.batch_size, config.eval_batches)))
