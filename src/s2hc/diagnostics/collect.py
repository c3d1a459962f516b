"""Model-level collectors: what each hyper-connection of a model computes on real tokens, and gradient norms.

:class:`Recorder` is a context manager that hooks every :class:`s2hc.HyperConnection` that mixes streams (and
:class:`s2hc.GatedResidual`): on each call it takes the connection's input streams ``x`` ``(B, T, n, C)``, keeps
a subsample of token positions, and computes ``matrices(x)`` on them (under ``no_grad``, in the autocast state
the model runs in) and the cosine similarity of the streams; and what the model's final read takes from each
final stream (its ``stream_head`` hooked too, when it has one), for the output's stream usage. The model's
output is unchanged: the hooks only read. :func:`collect` runs
a model on token ids with a recorder and returns a :class:`Capture` (tensors stacked over depth);
:meth:`Capture.summary` gives every measurement (:func:`s2hc.diagnostics.summary.summarize`).

>>> import torch
>>> from s2hc.models import Transformer, get_preset
>>> model = Transformer(get_preset("tiny", n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64,
...                                 vocab_size=64, family="s2hc", n_streams=4))
>>> capture = collect(model, torch.randint(0, 64, (2, 16)), tokens=20)
>>> capture.names, tuple(capture.res.shape)
(['blocks.0.attn_hc', 'blocks.0.mlp_hc', 'blocks.1.attn_hc', 'blocks.1.mlp_hc'], (4, 20, 4, 4))
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..connection import Connection, StreamHead, is_mixing_connection
from ..models import Transformer
from . import measures
from .depth import depth_modules
from .depth import training_record as depth_record
from .inert import SUM_KEEPING_REDUCTIONS, model_inert_connections
from .maps import map_modules
from .maps import training_record as maps_record
from .positions import model_device, sample_positions
from .summary import summarize

__all__ = [
    "Capture",
    "Recorder",
    "collect",
    "gradient_norms",
    "mixing_connections",
    "sample_positions",
    "split_inert_connections",
    "training_diagnostics",
]

#: Token positions a training-time diagnostics record measures (from the first validation batch).
TRAINING_TOKENS = 256


def mixing_connections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every connection in ``model`` with several streams (a :class:`~s2hc.HyperConnection`
    that is not ``residual``, or a :class:`~s2hc.GatedResidual`), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_mixing_connection(m)]


def split_inert_connections(model: nn.Module, depth: int) -> tuple[list[int], list[int]]:
    """``(read, write)``: the connections (depth order, of ``depth``) whose split of the read, or of the write,
    over the streams cannot change ``model``'s output, whatever the shares.

    - **Read, the first connection**, when its input streams are identical copies ``X_s = x`` (an
      :class:`s2hc.models.Transformer` without a learned stream scaling): it reads ``Σ_s H_pre[s] X_s =
      (Σ_s H_pre[s]) x``, only the sum of the weights matters (for the gated residual the channel-wise sum of
      ``G_s ⊙ (1 + w_s)``, the same way).
    - **Write, the last connection**, when the model sums or averages its final streams (``stream_reduce`` "sum"
      or "mean"): ``Σ_s X'_s = 1ᵀ H_res X + (Σ_s H_post[s]) F(h)``, only the sum of the write weights matters.

    Whatever the family; unlike :func:`~s2hc.diagnostics.inert.inert_connections`, which is about ``H_res``. Of a
    module that is not a Transformer the wiring is unknown: none.
    """
    if not isinstance(model, Transformer) or depth < 1:
        return [], []
    read = [0] if model.stream_scale is None else []
    write = [depth - 1] if model.config.stream_reduce in SUM_KEEPING_REDUCTIONS else []
    return read, write


def _output_read(model: nn.Module) -> str:
    """How ``model``'s final read takes from its streams, a key of :data:`~s2hc.diagnostics.summary.OUTPUT_READS`."""
    if not isinstance(model, Transformer):
        return "unknown"
    if isinstance(model.stream_head, StreamHead):
        return model.stream_head.output_read
    if model.stream_head is None and model.config.stream_reduce in SUM_KEEPING_REDUCTIONS:
        return model.config.stream_reduce
    return "unknown"


def head_contributions(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a learned head takes from each stream of ``x`` ``(N, n, C)``, in size: ``(N, n)`` float64, as the head
    says (:meth:`s2hc.connection.StreamHead.stream_contributions`: ``|w_s| ‖X_s‖`` for :class:`s2hc.HyperHead`,
    ``‖G_s ⊙ X̃_s‖`` for :class:`s2hc.GatedHead`)."""
    if not isinstance(head, StreamHead):
        raise ValueError(f"head must be a learned stream head (s2hc.connection.StreamHead), got {type(head).__name__}")
    with torch.autocast(x.device.type, enabled=False):  # the gates in their own precision, as the heads compute them
        return head.stream_contributions(x)


@dataclass
class Capture:
    """What :class:`Recorder` saw, stacked over depth (connections in call order) and tokens.

    ``res`` ``(L, N, n, n)``, ``pre`` / ``post`` ``(L, N, n)``: float32 (or the coefficient dtype) on the CPU.
    ``similarity`` ``(L + 1, N, n, n)`` float64: the stream cosine similarity at each connection's input and at
    the last one's output. ``streams`` ``(L + 1, N, n, C)`` only with ``keep_streams``. ``inert``: the indices of
    the connections whose ``H_res`` cannot change the model's output (:mod:`s2hc.diagnostics.inert`), which the
    summary reports apart.

    For the stream usage: ``output`` ``(N, n)`` float64, what the model's final read takes from each final stream
    per token, in size, and ``output_read`` how (:data:`~s2hc.diagnostics.summary.OUTPUT_READS`: ``‖X_s‖`` of the
    last connection's output for ``stream_reduce`` "sum" / "mean" and for a module that is not an s2hc
    Transformer, ``"unknown"`` then; ``|w_s| ‖X_s‖`` for a HyperHead; ``‖G_s ⊙ X̃_s‖`` for a GatedHead);
    ``read_spread`` ``(L, N, n)`` for the gated residual (its read gates' spread over channels, else None);
    ``read_inert`` / ``write_inert``: the connections whose split of the read / write over the streams cannot
    change the output (:func:`split_inert_connections`).
    """

    names: list[str]
    families: list[str]
    res: torch.Tensor
    pre: torch.Tensor
    post: torch.Tensor
    similarity: torch.Tensor
    streams: torch.Tensor | None = None
    transposed: list[bool] = field(default_factory=list)  # per connection: transpose_res
    inert: list[int] = field(default_factory=list)
    output: torch.Tensor | None = None
    output_read: str | None = None
    read_spread: torch.Tensor | None = None
    read_inert: list[int] = field(default_factory=list)
    write_inert: list[int] = field(default_factory=list)

    @property
    def family(self) -> str | None:
        """The family of every connection, or None when they differ."""
        return self.families[0] if len(set(self.families)) == 1 else None

    def summary(self, **options: Any) -> dict[str, Any]:
        """Every measurement per layer and across depth: :func:`~s2hc.diagnostics.summary.summarize`."""
        return summarize(self, **options)


@dataclass
class _Record:
    family: str
    transposed: bool = False
    pre: list = field(default_factory=list)
    post: list = field(default_factory=list)
    res: list = field(default_factory=list)
    sim_in: list = field(default_factory=list)
    sim_out: list = field(default_factory=list)
    norm_out: list = field(default_factory=list)  # (N, n) per pass: each output stream's norm
    spread: list = field(default_factory=list)  # the gated residual's read_spread
    x_in: list = field(default_factory=list)
    x_out: list = field(default_factory=list)


class Recorder(contextlib.AbstractContextManager):
    """Hooks on every stream-mixing :class:`~s2hc.HyperConnection` (and :class:`~s2hc.GatedResidual`) of ``model``,
    and on its ``stream_head`` when it is an s2hc Transformer with one, while the ``with`` block runs.

    ``positions``: flat indices into the ``B·T`` token positions of the next forward passes (set it before each
    pass with different shapes), or None for every position. ``keep_streams`` keeps the sampled input and
    output streams too (``(N, n, C)`` per connection per pass: memory grows with C).
    Each connection is expected to run once per forward pass; several passes concatenate along tokens.

    >>> import torch, s2hc
    >>> hc = s2hc.HyperConnection(8, n_streams=2, family="mhc")
    >>> x = torch.randn(1, 3, 2, 8)
    >>> with Recorder(hc) as recorder:
    ...     y = hc(x, torch.tanh)
    >>> recorder.capture().res.shape
    torch.Size([1, 3, 2, 2])
    """

    def __init__(self, model: nn.Module, positions: torch.Tensor | None = None, keep_streams: bool = False):
        self.model = model
        self.positions = positions
        self.keep_streams = keep_streams
        self.records: dict[str, _Record] = {}
        self.order: list[str] = []
        self.head: list[torch.Tensor] = []  # (N, n) per pass: what the stream head takes from each stream
        self._handles: list = []

    def _sample(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().flatten(0, 1)
        if self.positions is not None:
            flat = flat[self.positions.to(flat.device)]
        return flat

    def _hooks(self, name: str, module: Connection):
        def before(mod, args, kwargs):
            x = mod.state_streams(args[0] if args else kwargs["x"])  # a state may carry more than the streams
            with torch.no_grad():
                sample = self._sample(x)
                h = mod.matrices(sample.unsqueeze(0))
                record = self.records.setdefault(name, _Record(mod.family, getattr(mod, "transpose_res", False)))
                if name not in self.order:
                    self.order.append(name)
                record.pre.append(h["pre"][0].cpu())
                record.post.append(h["post"][0].cpu())
                record.res.append(h["res"][0].cpu())
                if "read_spread" in h:
                    record.spread.append(h["read_spread"][0].cpu())
                record.sim_in.append(measures.stream_similarity(sample).cpu())
                if self.keep_streams:
                    record.x_in.append(sample.cpu())

        def after(mod, args, kwargs, output):
            with torch.no_grad():
                sample = self._sample(mod.state_streams(output))
                record = self.records[name]
                record.sim_out.append(measures.stream_similarity(sample).cpu())
                record.norm_out.append(measures.stream_norms(sample).cpu())
                if self.keep_streams:
                    record.x_out.append(sample.cpu())

        return before, after

    def _head_hook(self, mod, args, kwargs):
        x = args[0] if args else kwargs["x"]
        with torch.no_grad():
            self.head.append(head_contributions(mod, self._sample(x)).cpu())

    def __enter__(self) -> Recorder:
        connections = mixing_connections(self.model)
        for name, module in connections:
            before, after = self._hooks(name, module)
            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(after, with_kwargs=True))
        if _output_read(self.model) not in SUM_KEEPING_REDUCTIONS + ("unknown",):  # a learned head's read
            self._handles.append(self.model.stream_head.register_forward_pre_hook(self._head_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def capture(self) -> Capture:
        """The recorded tensors stacked over depth; ValueError when no mixing connection ran."""
        if not self.order:
            raise ValueError("no hyper-connection that mixes streams ran (a residual model has nothing to measure)")
        recs = [self.records[name] for name in self.order]
        sizes = {r.res[0].shape[-1] for r in recs}
        if len(sizes) != 1:
            raise ValueError(f"the connections have different numbers of streams {sorted(sizes)}; measure them apart")
        cat = lambda parts: torch.cat(parts, dim=0)  # noqa: E731 - concatenate the passes along tokens
        sim = [cat(r.sim_in) for r in recs] + [cat(recs[-1].sim_out)]
        streams = None
        if self.keep_streams:
            streams = torch.stack([cat(r.x_in) for r in recs] + [cat(recs[-1].x_out)])
        families, transposed = [r.family for r in recs], [r.transposed for r in recs]
        output_read = _output_read(self.model)
        if output_read not in SUM_KEEPING_REDUCTIONS + ("unknown",):
            output = cat(self.head) if self.head else None  # a pass that stopped before the head: unknown
        else:
            output = cat(recs[-1].norm_out) if recs[-1].norm_out else None
        spread = torch.stack([cat(r.spread) for r in recs]) if all(r.spread for r in recs) else None
        read_inert, write_inert = split_inert_connections(self.model, len(recs))
        return Capture(
            names=list(self.order),
            families=families,
            res=torch.stack([cat(r.res) for r in recs]),
            pre=torch.stack([cat(r.pre) for r in recs]),
            post=torch.stack([cat(r.post) for r in recs]),
            similarity=torch.stack(sim),
            streams=streams,
            transposed=transposed,
            inert=model_inert_connections(self.model, families, transposed),
            output=output,
            output_read=output_read if output is not None else None,
            read_spread=spread,
            read_inert=read_inert,
            write_inert=write_inert,
        )


def collect(
    model: nn.Module,
    input_ids: torch.Tensor,
    tokens: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    keep_streams: bool = False,
) -> Capture:
    """Run ``model`` on ``input_ids`` ``(B, T)`` and capture every mixing connection on ``tokens`` positions.

    The positions are drawn uniformly without replacement from all ``B·T`` (all of them when ``tokens`` is None
    or at least ``B·T``) with a private generator seeded by ``seed``; the same positions are measured at every
    layer, so products over depth are per token. ``batch_size`` rows run per forward pass (default all),
    under ``no_grad`` and, with ``autocast_dtype``, autocast on the model's device. The model's mode
    (train/eval) is restored afterwards. ValueError when the model has no connection that mixes streams.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a tensor (batch, time), got {getattr(input_ids, 'shape', input_ids)!r}")
    if not mixing_connections(model):
        raise ValueError("the model has no hyper-connection that mixes streams (residual): nothing to measure")
    B, T = input_ids.shape
    positions = sample_positions(B * T, tokens, seed)
    rows = batch_size or B
    device = model_device(model)
    was_training = model.training
    model.eval()
    recorder = Recorder(model, keep_streams=keep_streams)
    try:
        with recorder, torch.no_grad():
            for start in range(0, B, rows):
                stop = min(start + rows, B)
                if positions is None:
                    recorder.positions = None
                else:
                    inside = positions[(positions >= start * T) & (positions < stop * T)]
                    if inside.numel() == 0:
                        continue
                    recorder.positions = inside - start * T
                batch = input_ids[start:stop].to(device)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    model(batch)
    finally:
        model.train(was_training)
    return recorder.capture()


def _group(name: str) -> str:
    """``blocks.3.attn.q_proj.weight -> blocks.3``; ``embed.weight -> embed``: the layer a parameter belongs to."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    """``Σ g²`` as a plain tensor; for a sharded (FSDP2 DTensor) gradient the sum over all shards (a collective)."""
    total = grad.detach().float().square().sum()
    return total.full_tensor() if hasattr(total, "full_tensor") else total


def gradient_norms(model: nn.Module) -> dict[str, dict[str, float]]:
    """L2 norms of the current gradients: ``{"layers": {group: norm}, "hyper_connections": {name: norm}}``.

    A layer group is a parameter name up to its first integer component (``blocks.3``), else its first
    component (``embed``, ``norm``, ``lm_head``); each stream-mixing connection is also reported on its own
    (its parameters are in its layer's norm too). Parameters without a gradient are left out. Read before
    the optimizer clears the gradients (and, for raw norms, before clipping). Under FSDP2 every rank must call
    it (the shards' sums are reduced).
    """
    squares: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            squares.setdefault(_group(name), []).append(_square_sum(p.grad))
    connections: dict[str, list[torch.Tensor]] = {}
    for name, module in mixing_connections(model):
        grads = [_square_sum(p.grad) for p in module.parameters() if p.grad is not None]
        if grads:
            connections[name] = grads
    keys = list(squares) + list(connections)
    if not keys:
        return {"layers": {}, "hyper_connections": {}}
    values = torch.stack([torch.stack(v).sum() for v in (*squares.values(), *connections.values())]).sqrt().tolist()
    found = dict(zip(keys, values))
    return {"layers": {k: found[k] for k in squares}, "hyper_connections": {k: found[k] for k in connections}}


def training_diagnostics(
    model: nn.Module,
    input_ids: torch.Tensor,
    grad_norms: dict | None = None,
    tokens: int = TRAINING_TOKENS,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """A compact diagnostics record for ``metrics.jsonl``: cheap statistics on ``tokens`` positions of
    ``input_ids`` ``(B, T)`` (a fixed batch, so records are comparable over steps) and ``grad_norms``
    (:func:`gradient_norms`).

    Keys (lists are per connection, in depth order): ``tokens``, ``layers``, ``row_sum_error_max``,
    ``col_sum_error_max``, ``spectral_norm_max``, ``deviation_singular_values_mean``,
    ``identity_distance_mean``, ``rotation_angle_mean`` (degrees), ``spectrum_slope_mean`` (``1 − σ²`` per
    component), ``negative_share_mean`` (entries below −1e-3), ``inert_layers`` (the connections whose ``H_res``
    cannot change the output), ``stream_similarity_mean`` (mean off-diagonal cosine at
    each connection's input, then the output), ``composite_spectral_norm_max``, ``composite_forward_amax_max``,
    ``composite_backward_amax_max``, ``cumulative_column_sum_max``, ``cumulative_column_sum_min``,
    ``common_mode_gain_mean`` (``1ᵀH1/n``, what ``H_res`` does to what the streams share), ``row_sum_min``,
    ``row_sum_max``, ``column_sum_min``, ``column_sum_max``, ``composite_common_mode_gain_mean``; and
    ``grad_norm``. An AttnRes model gets its depth softmax instead (:func:`s2hc.diagnostics.depth.training_record`:
    ``depth_effective_sources``, ``depth_embedding_weight``, ``depth_uniform_sources``), a wide residual its read
    and write maps (:func:`s2hc.diagnostics.maps.training_record`: ``map_read_effective_blocks`` and the like); a
    model without any of these gets only ``grad_norm``. Deterministic and free of the
    global RNG, so a resumed run writes the same records. Compiled blocks run eagerly for this forward pass
    (``torch.compiler.set_stance("force_eager")``); under FSDP2 every rank must call it (the forward gathers).
    """
    record: dict[str, Any] = {}
    if mixing_connections(model):
        # Compiled blocks run eagerly here: hooks inside a compiled region would force recompilations.
        stance = getattr(torch.compiler, "set_stance", None)
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            capture = collect(model, input_ids, tokens=tokens, seed=seed, autocast_dtype=autocast_dtype)
        s = capture.summary()
        sim = s.get("stream_similarity") or {}
        record.update(
            tokens=s["tokens"],
            layers=s["layers"],
            row_sum_error_max=s["row_sum_error"]["max"],
            col_sum_error_max=s["col_sum_error"]["max"],
            spectral_norm_max=s["spectral_norm"]["max"],
            deviation_singular_values_mean=s["deviation_singular_values"]["mean"],
            identity_distance_mean=s["identity_distance"]["mean"],
            rotation_angle_mean=s["rotation_angle"]["mean"],
            spectrum_slope_mean=s["spectrum_slope"]["mean"],
            negative_share_mean=s["negative_share"]["mean"],
            inert_layers=s["inert_layers"],
            stream_similarity_mean=sim["offdiagonal"]["mean"] if sim.get("offdiagonal") else None,
            composite_spectral_norm_max=s["composite_spectral_norm"]["max"],
            composite_forward_amax_max=s["composite_forward_amax"]["max"],
            composite_backward_amax_max=s["composite_backward_amax"]["max"],
            cumulative_column_sum_max=s["cumulative_column_sums"]["max"],
            cumulative_column_sum_min=s["cumulative_column_sums"]["min"],
            common_mode_gain_mean=s["common_mode_gain"]["mean"],
            row_sum_min=s["row_sums"]["min"],
            row_sum_max=s["row_sums"]["max"],
            column_sum_min=s["column_sums"]["min"],
            column_sum_max=s["column_sums"]["max"],
            composite_common_mode_gain_mean=s["composite_common_mode_gain"]["mean"],
        )
    elif map_modules(model):  # the wide residual: its read and write maps, from the weights
        record.update(maps_record(model))
    elif depth_modules(model):  # AttnRes: the depth softmax's spread and its weight on the embedding
        stance = getattr(torch.compiler, "set_stance", None)
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            record.update(depth_record(model, input_ids, tokens=tokens, seed=seed, autocast_dtype=autocast_dtype))
    if grad_norms is not None:
        record["grad_norm"] = grad_norms
    return record
