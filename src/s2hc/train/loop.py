"""The training loop: one process or one rank of several, any device; resumable exactly from its last checkpoint.

:func:`train` reads like nanoGPT's loop: set up (resume check, data, model, optimizer, restore), then per step
the learning rate, the micro-steps, clipping, the update, logging, evaluation and checkpoints. What a
checkpoint holds is :class:`~s2hc.train.state.Checkpointer`'s job, the files are :mod:`s2hc.rundir`'s.
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import TrainConfig
from ..connection import set_connection_options
from ..data.loader import TokenBatches, eval_batches
from ..data.shards import prepare_tokens
from ..data.tokenizer import get_tokenizer
from ..devices import autocast_dtype
from ..diagnostics.collect import gradient_norms, training_diagnostics
from ..models import ModelConfig, Transformer
from ..rundir import MetricsLog, checkpoint_paths, load_checkpoint, saved_step, write_config
from . import distributed
from .optim import learning_rate, make_optimizer
from .state import Checkpointer

# Fields of a run's config that may change on --resume without changing what is computed.
RESUMABLE_CHANGES = {
    "max_steps", "eval_every", "checkpoint_every", "log_every", "progress", "out", "compile", "device", "parallel",
    "diagnostics_every", "connection",
}  # fmt: skip


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss); the message says what happened and what is kept."""


class Interrupted(RuntimeError):
    """SIGINT / SIGTERM arrived: the run saved a checkpoint and stopped. ``signum`` is the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@dataclass
class RunResult:
    out: Path
    step: int
    train_loss: float
    val_loss: float | None
    tokens_per_s: float
    params: int
    hc_params: int


@contextlib.contextmanager
def stop_on_signals():
    """Turn SIGINT/SIGTERM into a flag the loop checks between steps (a step is never cut in half)."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            previous[signum] = signal.signal(signum, handler)
    try:
        yield received
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _check_resumable(saved: dict, config: TrainConfig, world_size: int) -> None:
    """ValueError unless ``config`` computes what the checkpoint's run computed: the same settings, and the
    same global batch (``batch_size × grad_accum × processes``) even when the process count changed."""
    before = saved["config"]
    changed = {k for k, v in config.to_dict().items() if before.get(k) != v} - RESUMABLE_CHANGES
    changed -= {"batch_size", "grad_accum"}  # checked below, as the global batch
    if changed:
        details = ", ".join(f"{k}: {before.get(k)!r} -> {getattr(config, k)!r}" for k in sorted(changed))
        raise ValueError(
            f"the checkpoint in {config.out!r} was trained with a different configuration ({details}); "
            f"resume with the same settings or choose another --out"
        )
    old = before["batch_size"] * before["grad_accum"] * saved.get("world_size", 1)
    new = config.batch_size * config.grad_accum * world_size
    if old != new or before["batch_size"] * saved.get("world_size", 1) != config.batch_size * world_size:
        raise ValueError(
            f"the checkpoint in {config.out!r} was trained with {before['batch_size']} sequences x "
            f"{before['grad_accum']} micro-steps x {saved.get('world_size', 1)} processes per step; keep "
            f"batch_size x processes = {before['batch_size'] * saved.get('world_size', 1)} and the same grad_accum"
        )


@torch.no_grad()
def evaluate(model, batches, device, amp_dtype) -> float:
    """Mean cross-entropy over fixed validation batches ``[(x, y), ...]``."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()
        count += 1
    model.train()
    return total / max(count, 1)


def train(config: TrainConfig, resume: bool = False) -> RunResult:
    """Train ``config``; with ``resume`` continue exactly from ``config.out``'s newest checkpoint if there is one.

    One process, or one of several started by torchrun (DDP or FSDP2, see :mod:`s2hc.train.distributed`).
    Writes ``out/metrics.jsonl`` and a checkpoint (``out/checkpoint.pt``, or ``out/checkpoint.dcp/`` when
    sharded) every ``checkpoint_every`` steps and at the end. Raises ValueError for bad input,
    :class:`TrainingError` for a non-finite loss (the last good checkpoint is kept), :class:`Interrupted` after
    saving on SIGINT/SIGTERM.
    """
    ctx = distributed.setup(config.device, config.parallel)
    try:
        return _train(config, resume, ctx)
    finally:
        distributed.teardown()


def _train(config: TrainConfig, resume: bool, ctx: distributed.Context) -> RunResult:
    out = Path(config.out).expanduser()
    saved = load_checkpoint(out, with_model=False) if resume and out.is_dir() and checkpoint_paths(out) else None
    if saved is not None:
        _check_resumable(saved, config, ctx.world_size)
    device, amp_dtype = ctx.device, autocast_dtype(config.dtype, ctx.device)
    tokenizer = get_tokenizer(config.tokenizer)
    model_config = _model_config(config, tokenizer.vocab_size)
    if saved is not None and saved["model_config"] != model_config.to_dict():
        raise ValueError(f"the checkpoint in {str(out)!r} holds a model of another shape; choose another --out")
    loader, validation = _data(config, tokenizer, ctx)

    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = set_connection_options(Transformer(model_config).to(device), **config.connection)
    params, hc_params = model.num_params(), model.num_hc_params()
    forward = distributed.wrap(model, ctx, config.compile, amp_dtype)
    optimizer = make_optimizer(model, config.lr, config.weight_decay, (config.beta1, config.beta2))
    torch.manual_seed(config.seed + ctx.rank)  # per-rank streams from here on
    checkpointer = Checkpointer(out, model, optimizer, loader, ctx)
    step = checkpointer.restore(saved) if saved is not None else 0
    metrics = None
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_config(out, config.to_dict())
        metrics = MetricsLog(out, keep_until_step=step if saved is not None else None)

    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum * ctx.world_size
    step_times: list[float] = []
    train_loss, val_loss = math.nan, None
    if saved is not None:  # a finished run resumed by `compare --resume` still reports its numbers
        step_times = list(saved["history"]["step_times"])
        train_loss, val_loss = saved["history"]["train_loss"], saved["history"]["val_loss"]

    def save() -> None:
        history = {"step_times": list(step_times), "train_loss": train_loss, "val_loss": val_loss}
        checkpointer.save(step, {"config": config.to_dict(), "model_config": model_config.to_dict(),
                                 "history": history})

    bar = tqdm(total=config.max_steps, initial=step, disable=not (config.progress and ctx.is_main),
               desc=f"{config.family}", unit="step")
    model.train()
    with stop_on_signals() as received:
        while step < config.max_steps:
            started = time.perf_counter()
            lr = learning_rate(step, peak=config.lr, warmup_steps=config.warmup_steps, max_steps=config.max_steps,
                               min_ratio=config.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for micro in range(config.grad_accum):
                x, y = (t.to(device, non_blocking=True) for t in next(loader))
                with distributed.gradient_sync(forward, ctx, enabled=micro == config.grad_accum - 1):
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        logits = forward(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / config.grad_accum).backward()
                loss_sum += loss.item()
            train_loss = distributed.mean_across_ranks(loss_sum / config.grad_accum, ctx)
            diagnose = bool(config.diagnostics_every) and (step + 1) % config.diagnostics_every == 0
            layer_grads = gradient_norms(model) if diagnose else None  # before clipping; every rank (FSDP)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
            grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                bar.close()
                kept = f"the last good checkpoint (step {saved_step(out)}) is kept in {str(out)!r}"
                raise TrainingError(f"non-finite loss ({train_loss}) or gradient at step {step + 1}; stopped; {kept}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_time = time.perf_counter() - started
            step_times.append(step_time)
            bar.update(1)
            if metrics and (step % config.log_every == 0 or step == config.max_steps):
                metrics.write(step=step, loss=train_loss, lr=lr, grad_norm=grad_norm, tokens=step * tokens_per_step,
                              step_time=step_time)
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_step / step_time:.0f}")
            if layer_grads is not None:  # a fixed batch, no RNG; every rank runs it (FSDP), the main one writes
                record = training_diagnostics(model, validation[0][0], layer_grads, autocast_dtype=amp_dtype)
                if metrics:
                    metrics.write(step=step, diagnostics=record)
            if (config.eval_every and step % config.eval_every == 0) or step == config.max_steps:
                val_loss = evaluate(forward, validation, device, amp_dtype)
                if metrics:
                    metrics.write(step=step, val_loss=val_loss)
            if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == config.max_steps:
                save()
            if received:
                save()
                bar.close()
                raise Interrupted(
                    f"stopped by signal {received[0]} after step {step}; resume with --resume", received[0]
                )
    bar.close()
    # The median step ignores the first steps' warm-up (and compilation) and any evaluation pauses.
    median_step = statistics.median(step_times) if step_times else math.nan
    return RunResult(out=out, step=step, train_loss=train_loss, val_loss=val_loss,
                     tokens_per_s=tokens_per_step / median_step, params=params, hc_params=hc_params)


def _model_config(config: TrainConfig, vocab_size: int) -> ModelConfig:
    """The run's ModelConfig, its vocabulary sized to the tokenizer's unless ``model_overrides`` sets one
    (which must then hold every token)."""
    model_config = config.model_config()
    if "vocab_size" not in config.model_overrides:
        return ModelConfig.from_dict({**model_config.to_dict(), "vocab_size": vocab_size})
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"model_overrides.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size} tokens ({config.tokenizer!r})"
        )
    return model_config


def _data(config: TrainConfig, tokenizer, ctx: distributed.Context):
    """``(training batches, fixed validation batches)``; rank 0 tokenises once, the others map its shards."""

    def tokens(split: str):
        return prepare_tokens(config.data, tokenizer, config.cache_dir, split, progress=config.progress and ctx.is_main)

    if not ctx.is_main:
        distributed.barrier(ctx)
    train_tokens, val_tokens = tokens("train"), tokens("val")
    if ctx.is_main:
        distributed.barrier(ctx)
    loader = TokenBatches(train_tokens, config.seq_len, config.batch_size, seed=config.seed,
                          rank=ctx.rank, world_size=ctx.world_size)
    return loader, list(eval_batches(val_tokens, config.seq_len, config.batch_size, config.eval_batches))
