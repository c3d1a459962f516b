"""Training-step and coefficient-path benchmarks of the residual families, as ratios to ``residual``.

Everything here is measured, not modelled: wall-clock time of whole training steps (forward,
cross-entropy, backward, AdamW, zero_grad) with the variants interleaved within every repetition, so
a slow phase of a shared machine hits all of them alike, and the ratio to ``residual`` is taken per
repetition before the median. Runs on the CPU or a CUDA device (``device``); on CUDA every timed
interval starts and ends with ``torch.cuda.synchronize``, so queued kernels are counted.

Peak memory is the largest amount of tensor memory live during one step on top of what was live before
it (parameters, optimizer state), so it does not depend on the C allocator's caching. On the CPU it is
read from the allocator's own allocation and free events (``torch.profiler`` with
``profile_memory=True``); on CUDA from the caching allocator's peak statistics
(``torch.cuda.max_memory_allocated``), which count the same thing (:func:`peak_step_bytes`).

Activation checkpointing of whole blocks is measured the same way: a variant with
``activation_checkpointing=true`` (or every variant's twin, ``BenchSettings(activation_checkpointing=True)``)
runs in the same repetitions as the variant without it, and its rows carry the ratios to it.

Precision (``dtype``, the names of ``TrainConfig.dtype``): ``"float32"`` (the default) or ``"bfloat16"``,
which runs each forward pass under ``torch.autocast`` with bfloat16 on the device and float32 weights, the
loss in float32 outside it, exactly as the training loop does (``"auto"``: bfloat16 where the device supports
it, :func:`s2hc.devices.autocast_dtype`).

Progress: ``log`` receives a line of text per model built and per repetition; ``on_event`` receives the
same as dictionaries as they happen (``event``: ``built``, ``repetition``, then one ``row`` per variant),
so a run cut short still leaves its finished repetitions (``s2hc bench --jsonl``).
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import parse_assignment
from ..connection import COMPUTE_OPTIONS, forms, set_connection_options
from ..connection.forms import CoefficientProbe, check_family
from ..devices import autocast_dtype, cpu_model
from ..extras import is_available, require
from ..flops import model_flops
from ..mixers import REFERENCE_FAMILY
from ..models import Transformer, get_preset
from ..reports import DASH, count, mib, ratio, table
from ..train.compiling import CompileWatch, compile_blocks
from .settings import BenchSettings

PEER = "hyper-connections:mhc"  # the hyper-connections package's mHC, in the same model
#: The bench's own option of a variant (``s2hc:activation_checkpointing=true``): whole blocks checkpointed
#: (:meth:`s2hc.models.Transformer.set_activation_checkpointing`), what ``s2hc train --activation-checkpointing``
#: does. Neither a compute option of the connections nor a family option.
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
_PEER_PACKAGE, _PEER_KIND = PEER.split(":")  # how "hyper-connections:mhc:KEY=VALUE" splits at its colons


@dataclass(frozen=True)
class Variant:
    """One model to time: a family (or :data:`PEER`), its stream count and options: how the connections compute
    (:data:`s2hc.connection.COMPUTE_OPTIONS`), whether whole blocks are checkpointed
    (:data:`ACTIVATION_CHECKPOINTING`) or the family's own (``family_options``, e.g. ``rank`` of
    ``gated-residual``)."""

    family: str
    n_streams: int
    options: dict = field(default_factory=dict)

    @property
    def compute_options(self) -> dict:
        """The options that say how the connections compute (``set_connection_options``)."""
        return {k: v for k, v in self.options.items() if k in COMPUTE_OPTIONS}

    @property
    def family_options(self) -> dict:
        """The options that say what they compute (the model's ``family_options``)."""
        return {k: v for k, v in self.options.items() if k not in (*COMPUTE_OPTIONS, ACTIVATION_CHECKPOINTING)}

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the model's blocks are checkpointed (recomputed in the backward pass)."""
        return bool(self.options.get(ACTIVATION_CHECKPOINTING, False))

    def with_activation_checkpointing(self, enabled: bool) -> Variant:
        """The same variant with whole-block activation checkpointing on (``enabled``) or off (the option
        dropped, so the label is the plain variant's)."""
        options = {k: v for k, v in self.options.items() if k != ACTIVATION_CHECKPOINTING}
        return Variant(self.family, self.n_streams, {**options, ACTIVATION_CHECKPOINTING: True} if enabled else options)

    @property
    def label(self) -> str:
        extra = "".join(f":{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.family}{extra}"


def parse_variant(text: str, n_streams: int) -> Variant:
    """``"s2hc"``, ``"s2hc:recompute=true"``, ``"mhc:iterations=10"``, ``"s2hc:activation_checkpointing=true"``
    or :data:`PEER` -> :class:`Variant`.

    Values are parsed as YAML (:func:`s2hc.config.parse_assignment`: ``true``, ``10``, bare words).
    ValueError naming ``--families`` for an unknown family, an option without ``=`` or an
    ``activation_checkpointing`` that is not a boolean.
    """
    name, *assignments = [part.strip() for part in text.split(":")]
    if name == _PEER_PACKAGE:
        name, assignments = PEER, [a for a in assignments if a != _PEER_KIND]
    if name != PEER:
        check_family(name, "argument --families")
    options = dict(parse_assignment(a, f"argument --families: option {a!r} of {name!r}") for a in assignments)
    if not isinstance(options.get(ACTIVATION_CHECKPOINTING, False), bool):
        raise ValueError(f"argument --families: option {ACTIVATION_CHECKPOINTING!r} of {name!r} must be true or "
                         f"false, got {options[ACTIVATION_CHECKPOINTING]!r}")
    one_stream = name != PEER and forms.get(name).max_streams == 1  # the residual, AttnRes
    variant = Variant(name, 1 if one_stream else n_streams, options)
    return variant.with_activation_checkpointing(variant.activation_checkpointing)  # `=false` is the plain variant


def peer_available() -> bool:
    """Whether the ``hyper-connections`` package (the peer) can be imported."""
    return is_available("hyper_connections")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); nothing to do on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall-clock seconds of one call of ``fn`` on ``device``, synchronised before the clock starts and
    before it stops on CUDA, so queued kernels count in the call that launched them."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- models


class _PeerConnection(nn.Module):
    """The ``hyper-connections`` package's mHC behind s2hc's ``hc(x, branch, *args)`` call."""

    def __init__(self, dim: int, n_streams: int, layer_index: int, **options: Any):
        super().__init__()
        peer = require("hyper_connections", "the bench's peer")
        self.inner = peer.ManifoldConstrainedHyperConnections(n_streams, dim=dim, layer_index=layer_index, **options)

    def forward(self, x, branch, *args, **kwargs):
        branch_in, add_residual = self.inner(x)
        return add_residual(branch(branch_in, *args, **kwargs))


class PeerTransformer(Transformer):
    """s2hc's :class:`~s2hc.models.Transformer` with every connection replaced by the package's mHC.

    The streams stay in the package's layout ``(batch · n, T, C)`` from the embedding to the reduction,
    so no transposition is added on either side; branches, norms and the head are s2hc's.
    """

    def __init__(self, config, n_streams: int, **options: Any):
        super().__init__(config)
        self.peer_streams = n_streams
        for block in self.blocks:
            block.attn_hc = _PeerConnection(config.dim, n_streams, block.layer, **options)
            block.mlp_hc = _PeerConnection(config.dim, n_streams, block.layer, **options)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab)``, as :meth:`Transformer.forward` without a cache."""
        from ..models.transformer import attention_inputs

        n = self.peer_streams
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self._embed(input_ids, positions)
        # The masks are None (no window, no padding: causal SDPA), so they broadcast over the package's layout.
        inputs = attention_inputs(self.config, positions)
        x = self.run_blocks(h.repeat_interleave(n, dim=0), inputs)  # (b s) t d, the package's expand
        x = x.view(-1, n, *x.shape[1:]).sum(1)
        return self.lm_head(self.norm(x))


def build_model(preset: str, variant: Variant, overrides: dict | None = None) -> nn.Module:
    """The preset's model for ``variant`` (seeded, float32, on the CPU; the caller moves it), its blocks
    checkpointed when the variant says so (the same weights either way)."""
    torch.manual_seed(0)
    overrides = dict(overrides or {})
    if variant.family == PEER:
        config = get_preset(preset, **overrides)
        if config.sliding_window is not None or config.embed_scale:
            raise ValueError(f"the {PEER} peer supports presets without sliding windows or embedding scaling")
        peer_options = {k: v for k, v in variant.options.items() if k != ACTIVATION_CHECKPOINTING}
        model = PeerTransformer(config, variant.n_streams, **peer_options)
    else:
        try:
            config = get_preset(preset, family=variant.family, n_streams=variant.n_streams,
                                **{"family_options": variant.family_options, **overrides})
            model = set_connection_options(Transformer(config), **variant.compute_options)
        except ValueError as error:
            raise ValueError(f"{variant.label!r}: {error}") from error
    model.set_activation_checkpointing(variant.activation_checkpointing)
    return model


# ------------------------------------------------------------------------------------------ measuring


def train_flops(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of ``model`` on sequences of ``seq_len`` tokens (:func:`s2hc.flops.model_flops`):
    what its step would cost if time followed arithmetic. None for the peer, whose model s2hc does not count."""
    config = getattr(model, "config", None)
    return None if isinstance(model, PeerTransformer) or config is None else model_flops(config, seq_len)[
        "train_per_token"]


def live_tensor_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``objects`` (modules, optimizers, tensors)."""
    seen, total = set(), 0

    def visit(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()

    for obj in objects:
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                visit(t)
                if getattr(t, "grad", None) is not None:
                    visit(t.grad)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        visit(value)
        elif isinstance(obj, torch.Tensor):
            visit(obj)
    return total


#: What the profiler's native library (kineto) writes to the process's stderr at every start and stop, whatever
#: its log level: ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` and ``STAGE:... Completed Stage``.
_PROFILER_LINE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S*ActivityProfiler\S*\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_profiler_lines():
    """Run the block with the process's stderr (file descriptor 2, where C++ writes) captured, then write back
    every line but the profiler's own: the bench's output stays the bench's."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def peak_step_bytes(step: Callable[[], Any], *baseline: Any, device: torch.device | str = "cpu") -> int:
    """Peak tensor memory in bytes of one call of ``step``: the bytes live before it (``baseline`` objects:
    modules, optimizers, tensors) plus the most that the step itself added at any moment.

    CPU: the highest running sum of the allocator's allocation (+) and free (−) events, recorded by
    ``torch.profiler``. CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less
    what was allocated on the device just before the step (other models of the same run included), so
    both count the same thing: ``baseline`` plus the step's own peak. CUDA figures are in the caching
    allocator's rounded block sizes (multiples of 512 bytes).
    """
    device = torch.device(device)
    before = live_tensor_bytes(*baseline)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return before + torch.cuda.max_memory_allocated(device) - allocated
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return before + peak


@dataclass
class StepRunner:
    """A model, its AdamW and one fixed batch ``inputs`` / ``targets`` ``(batch, seq_len)`` of token ids,
    all on ``device``; :meth:`step` is one training step, its forward pass under autocast to ``amp_dtype``
    (None: float32, no autocast) and the loss in float32, as in :mod:`s2hc.train.loop`. ``watch``: with its blocks
    compiled, which of them ran eagerly (:class:`s2hc.train.compiling.CompileWatch`)."""

    variant: Variant
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    forward: Callable[[torch.Tensor], torch.Tensor]
    device: torch.device = torch.device("cpu")
    amp_dtype: torch.dtype | None = None
    watch: CompileWatch | None = None

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            logits = self.forward(self.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_runner(
    preset: str,
    variant: Variant,
    *,
    batch_size: int,
    seq_len: int,
    compile: bool,
    overrides: dict | None = None,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
) -> StepRunner:
    """``variant``'s model of ``preset`` on ``device`` with AdamW and a fixed random batch of ``batch_size``
    sequences of ``seq_len`` tokens (the same weights and ids on every device: both are drawn on the CPU);
    float32 weights, the forward pass autocast as precision ``dtype`` says (:func:`s2hc.devices.autocast_dtype`).
    ``compile``: each block compiled as ``s2hc train --compile`` compiles it
    (:func:`s2hc.train.compiling.compile_blocks`), not the whole model."""
    device = torch.device(device)
    amp_dtype = autocast_dtype(dtype, device)
    model = build_model(preset, variant, overrides).to(device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    watch = CompileWatch(model.blocks) if compile else None
    if compile:
        compile_blocks(model.blocks)
    return StepRunner(variant, model, optimizer, ids[:, :-1], ids[:, 1:], model, device, amp_dtype, watch)


def _key(variant: Variant) -> tuple[str, int]:
    """What tells two variants apart (a Variant holds a dict, so it is not hashable)."""
    return variant.label, variant.n_streams


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def precision_name(dtype: str, device: torch.device | str) -> str:
    """What precision ``dtype`` (``TrainConfig.dtype``'s names) resolves to on ``device``: ``"bfloat16"``
    (autocast) or ``"float32"``. ValueError naming ``dtype`` for another name."""
    return "float32" if autocast_dtype(dtype, torch.device(device)) is None else "bfloat16"


def benchmark_steps(
    settings: BenchSettings,
    variants: list[Variant],
    *,
    log: Callable[[str], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time training steps of every variant as ``settings`` say (:class:`~s2hc.bench.settings.BenchSettings`: the
    preset and its overrides, ``batch_size``, ``seq_len``, ``compile``, ``repeats``, ``steps``, ``warmup``,
    ``memory``, ``activation_checkpointing``, ``device``, ``dtype``), interleaved, and return one row per variant.

    A plain ``residual`` (blocks not checkpointed) is added first if absent. With ``activation_checkpointing``
    every variant not checkpointed already gets a twin right after it whose blocks are
    (:meth:`Variant.with_activation_checkpointing`), timed in the same repetitions. Each of ``repeats``
    repetitions runs ``steps`` timed steps of every variant in turn; a variant's time in a repetition is the
    median of its steps, and its ratios to residual and to its twin are taken within the repetition. Rows:
    ``family``, ``label``, ``n_streams``, ``compiled``, ``activation_checkpointing``, ``step_s`` (median),
    ``step_ratio_vs_residual`` with ``step_ratio_min`` / ``step_ratio_max``, ``tokens_per_s``,
    ``peak_mem_bytes``, ``peak_mem_ratio_vs_residual`` (None when ``memory`` is False), for a checkpointed
    variant whose plain twin ran ``step_ratio_vs_without_ac`` with ``step_ratio_vs_without_ac_min`` /
    ``_max`` and ``peak_mem_ratio_vs_without_ac`` (None otherwise), ``params``, ``batch_size``,
    ``seq_len``, ``preset``, ``device`` (``"cpu"`` or ``"cuda"``), ``dtype`` (the precision it resolved to,
    :func:`precision_name`). Times are seconds (synchronised on CUDA), memory is bytes
    (:func:`peak_step_bytes`). A ValueError raised by a variant's first step (e.g. ``kernels=triton`` on a CPU
    without Triton's interpreter) is raised again with the variant's label and the device.

    ``on_event`` gets, as they happen: ``{"event": "built", "label", "family", "n_streams", "seconds"}`` per
    variant (building, moving and the warm-up steps, compilation included), ``{"event": "repetition",
    "repetition", "repeats", "step_s": {label: seconds}}`` per repetition, and ``{"event": "row", **row}`` per
    row at the end.
    """
    log = log or (lambda _: None)
    emit = on_event or (lambda _: None)
    device, compile, repeats = settings.device, settings.compile, settings.repeats
    precision = precision_name(settings.dtype, device)
    if settings.activation_checkpointing:
        variants = [twin for v in variants
                    for twin in ([v] if v.activation_checkpointing else [v, v.with_activation_checkpointing(True)])]
    if not any(v.family == forms.RESIDUAL.name and not v.activation_checkpointing for v in variants):
        plain = Variant(forms.RESIDUAL.name, 1)
        twin = [plain.with_activation_checkpointing(True)] * settings.activation_checkpointing
        variants = [plain, *twin, *variants]
    variants = list({_key(v): v for v in variants}.values())  # each variant once, where it first appears
    runners = []
    for variant in variants:
        built = time.perf_counter()
        log(f"building {variant.label} (n={variant.n_streams}, {device.type}, {precision}"
            f"{', compiling' if compile else ''})")  # fmt: skip
        if compile and variant.options.get("kernels") == "triton":
            log(
                f"note: {variant.label} compiled runs the PyTorch forms (inductor's kernels), not s2hc's Triton kernels"
            )
        runner = make_runner(settings.preset, variant, batch_size=settings.batch_size, seq_len=settings.seq_len,
                             compile=compile, overrides=settings.overrides, device=device, dtype=settings.dtype)
        try:
            for _ in range(max(settings.warmup, 2 if compile else 1)):  # compiles forward and backward at step 1
                runner.step()
        except ValueError as error:
            raise ValueError(f"{variant.label} failed its first training step on {device.type}: {error}") from error
        _sync(device)
        eager = runner.watch.line("its warm-up steps") if runner.watch is not None else None
        if eager:
            log(f"warning: {variant.label}: {eager}")
        runners.append(runner)
        seconds = time.perf_counter() - built
        log(f"built {variant.label} in {seconds:.1f}s (warm-up steps included)")
        emit({"event": "built", "label": variant.label, "family": variant.family, "n_streams": variant.n_streams,
              "seconds": seconds})  # fmt: skip
    times: dict[int, list[float]] = {i: [] for i in range(len(runners))}
    for rep in range(repeats):
        for i, runner in enumerate(runners):
            samples = []
            for _ in range(settings.steps):
                samples.append(timed(runner.step, device))
            times[i].append(statistics.median(samples))
        log(
            f"repetition {rep + 1}/{repeats}: "
            + ", ".join(f"{r.variant.label} {times[i][-1]:.3f}s" for i, r in enumerate(runners))
        )
        emit({"event": "repetition", "repetition": rep + 1, "repeats": repeats,
              "step_s": {r.variant.label: times[i][-1] for i, r in enumerate(runners)}})  # fmt: skip
    plain_residual = _key(Variant(forms.RESIDUAL.name, 1))
    base = next(i for i, r in enumerate(runners) if _key(r.variant) == plain_residual)
    index = {_key(r.variant): i for i, r in enumerate(runners)}
    peaks = {}
    memory = settings.memory
    if memory:
        for i, runner in enumerate(runners):
            peaks[i] = peak_step_bytes(runner.step, runner.model, runner.optimizer, device=device)
        log("peak memory: " + ", ".join(f"{r.variant.label} {peaks[i] / 2**20:,.1f} MiB"
                                        for i, r in enumerate(runners)))  # fmt: skip
    flops = [train_flops(runner.model, settings.seq_len) for runner in runners]
    rows = []
    for i, runner in enumerate(runners):
        ratio, low, high = _spread([t / b for t, b in zip(times[i], times[base])])
        step_s = statistics.median(times[i])
        variant = runner.variant
        plain = None
        if variant.activation_checkpointing:
            plain = index.get(_key(variant.with_activation_checkpointing(False)))
        vs_plain = (None,) * 3 if plain is None else _spread([t / b for t, b in zip(times[i], times[plain])])
        rows.append({
            "preset": settings.preset, "family": variant.family, "label": variant.label,
            "n_streams": variant.n_streams, "compiled": compile, "batch_size": settings.batch_size,
            "seq_len": settings.seq_len,
            "activation_checkpointing": variant.activation_checkpointing,
            "step_s": step_s, "step_ratio_vs_residual": ratio, "step_ratio_min": low, "step_ratio_max": high,
            "tokens_per_s": settings.batch_size * settings.seq_len / step_s,
            "peak_mem_bytes": peaks.get(i), "peak_mem_ratio_vs_residual": peaks[i] / peaks[base] if memory else None,
            "step_ratio_vs_without_ac": vs_plain[0], "step_ratio_vs_without_ac_min": vs_plain[1],
            "step_ratio_vs_without_ac_max": vs_plain[2],
            "peak_mem_ratio_vs_without_ac": peaks[i] / peaks[plain] if memory and plain is not None else None,
            "train_flops_per_token": flops[i],
            "flops_ratio_vs_residual": None if flops[i] is None else flops[i] / flops[base],
            "params": sum(p.numel() for p in runner.model.parameters()), "device": device.type,
            "dtype": precision,
        })  # fmt: skip
    for row in rows:
        emit({"event": "row", **row})
    return rows


# ------------------------------------------------------------------------------- the coefficient path


def benchmark_coefficients(
    mixers: list[str],
    *,
    n_streams: int,
    dim: int,
    tokens: int = 2048,
    repeats: int = 5,
    fused_options: tuple[bool, ...] = (True, False),
    device: torch.device | str = "cpu",
    dtype: str = "float32",
    log: Callable[[str], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Forward + backward time of the coefficient path alone (norm, projection, gates, constraint map) per
    token, for each family and implementation (``fused`` True: fast path, False: reference), on random
    streams ``(tokens, 1, n_streams, dim)`` on ``device`` (synchronised around every timing on CUDA), as each
    family's form probes it (:meth:`~s2hc.connection.forms.ConnectionForm.coefficient_probe`; the gated
    residual's is its norm and its two gates, its one implementation, timed once).

    Interleaved like :func:`benchmark_steps`; ``ratio_vs_mhc`` compares with ``mhc``'s time of the same
    implementation in the same repetition (None without ``mhc``). The float32 streams' forward runs under
    autocast as precision ``dtype`` says, as in a training step. Rows: ``family``, ``fused``, ``n_streams``,
    ``dim``, ``ns_per_token`` (nanoseconds), ``ns_min``, ``ns_max``, ``ratio_vs_mhc``, ``device``,
    ``dtype``; each also given to ``on_event`` as ``{"event": "coefficient", **row}``.
    """
    log = log or (lambda _: None)
    emit = on_event or (lambda _: None)
    device = torch.device(device)
    amp_dtype, precision = autocast_dtype(dtype, device), precision_name(dtype, device)
    names = [m for m in mixers if m != PEER and forms.get(m).coefficient_paths]
    generator = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on every device
    x = torch.randn(tokens, 1, n_streams, dim, generator=generator).to(device).requires_grad_()
    cases = []
    for name in names:
        torch.manual_seed(0)
        form = forms.get(name)
        probe = form.coefficient_probe(dim, n_streams, generator)
        probe.module.to(device)
        for fused in (f for f in fused_options if f in form.coefficient_paths):
            cases.append((name, fused, probe))

    def run(probe: CoefficientProbe, fused: bool) -> None:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            total = probe.run(x, fused)
        total.backward()

    for _, fused, hc in cases:  # warm-up
        run(hc, fused)
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    for _ in range(repeats):
        for i, (_, fused, hc) in enumerate(cases):
            times[i].append(timed(lambda hc=hc, fused=fused: run(hc, fused), device) / tokens * 1e9)
    rows = []
    for i, (name, fused, _) in enumerate(cases):
        reference = next((j for j, (m, f, _) in enumerate(cases) if m == REFERENCE_FAMILY and f == fused), None)
        ratio = None
        if reference is not None:
            ratio = statistics.median(t / r for t, r in zip(times[i], times[reference]))
        median, low, high = _spread(times[i])
        rows.append({"family": name, "fused": fused, "n_streams": n_streams, "dim": dim, "ns_per_token": median,
                     "ns_min": low, "ns_max": high, "ratio_vs_mhc": ratio, "device": device.type,
                     "dtype": precision})  # fmt: skip
        emit({"event": "coefficient", **rows[-1]})
    summary = ", ".join(f"{r['family']}{'' if r['fused'] else '(ref)'} {r['ns_per_token']:.0f} ns" for r in rows)
    log("coefficient path: " + summary)
    return rows


# ----------------------------------------------------------------------------------------- formatting


def machine_description(device: torch.device | str | None = None) -> str:
    """One line: CPU model, torch threads, the GPU when there is one, torch version, and with ``device``
    the device the benchmarks ran on (``"cpu"``, or ``"cuda"`` with the GPU's name)."""
    cpu = cpu_model()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    line = f"{cpu}, {torch.get_num_threads()} torch threads{gpu}; torch {torch.__version__}"
    if device is not None:
        device = torch.device(device)
        ran = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type
        line += f"; benchmarks ran on {ran}"
    return line


def format_step_table(rows: list[dict[str, Any]], peer_note: str | None = None) -> str:
    first = rows[0]
    mode = f"{'compiled' if first['compiled'] else 'eager'} on {first['device']}"
    if first.get("dtype") == "bfloat16":
        mode += ", bf16 autocast"
    lines = [
        f"Training step (forward, backward, AdamW), preset {first['preset']}, batch {first['batch_size']} x "
        f"sequence {first['seq_len']}, {mode}; ratios to residual within each repetition: median [min, max]; FLOPs: "
        "training FLOPs per token (s2hc.flops), the ratio the step would have if time followed arithmetic",
        "",
    ]
    cells = [[row["label"], count(row["n_streams"]), f"{count(row['step_s'] * 1e3)} ms",
              f"{ratio(row['step_ratio_vs_residual'])} [{row['step_ratio_min']:.2f}, {row['step_ratio_max']:.2f}]",
              ratio(row.get("flops_ratio_vs_residual")), count(row["tokens_per_s"]), mib(row["peak_mem_bytes"]),
              ratio(row["peak_mem_ratio_vs_residual"])]
             for row in rows]
    headers = ["family", "n", "step", "vs residual", "FLOPs vs residual", "tokens/s", "peak memory", "vs residual"]
    if any(row.get("step_ratio_vs_without_ac") is not None for row in rows):  # checkpointed twins ran
        headers += ["step vs without AC", "memory vs without AC"]
        for cell, row in zip(cells, rows):
            step = row.get("step_ratio_vs_without_ac")
            cell += [DASH, DASH] if step is None else [
                f"{ratio(step)} [{row['step_ratio_vs_without_ac_min']:.2f}, {row['step_ratio_vs_without_ac_max']:.2f}]",
                ratio(row["peak_mem_ratio_vs_without_ac"])]
        lines[0] += "; AC: activation checkpointing of whole blocks, against the same variant without it"
    lines += table(headers, cells)
    if peer_note:
        lines += ["", peer_note]
    return "\n".join(lines)


def format_coefficient_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "Coefficient path: no family to time."
    first = rows[0]
    lines = [
        f"Coefficient path alone (RMSNorm + projection + gates + constraint map, forward + backward), "
        f"n = {first['n_streams']}, C = {first['dim']}{', bf16 autocast' if first.get('dtype') == 'bfloat16' else ''}: "
        "time per token, median [min, max]",
        "",
    ]
    one_path = {row["family"] for row in rows if len(forms.get(row["family"]).coefficient_paths) == 1}
    cells = [[row["family"], "one path" if row["family"] in one_path else "fast" if row["fused"] else "reference",
              f"{count(row['ns_per_token'])} [{count(row['ns_min'])}, {count(row['ns_max'])}]",
              ratio(row["ratio_vs_mhc"])] for row in rows]
    return "\n".join(lines + table(["family", "implementation", "ns / token", "vs mhc (same implementation)"], cells,
                                    align="llrr"))


__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "PEER",
    "PeerTransformer",
    "StepRunner",
    "Variant",
    "benchmark_coefficients",
    "benchmark_steps",
    "build_model",
    "format_coefficient_table",
    "format_step_table",
    "live_tensor_bytes",
    "machine_description",
    "make_runner",
    "parse_variant",
    "peak_step_bytes",
    "peer_available",
    "precision_name",
    "timed",
]
