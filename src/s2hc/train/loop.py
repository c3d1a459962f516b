"""The training loop: one process or one rank of several, any device; resumable exactly from its last checkpoint.

:func:`train` reads like nanoGPT's loop: set up (the run directory, resume check, data, model, optimizer,
restore), then per step the learning rate, the micro-steps, clipping, the update, logging, evaluation and
checkpoints. What a checkpoint holds is :class:`~s2hc.train.checkpointer.Checkpointer`'s job, the files are
:mod:`s2hc.rundir`'s; the run directory is opened through :func:`s2hc.rundir.open_run_directory` (created or
resumed, never overwritten, locked for the whole run).

Nothing non-finite is kept: every step's loss, gradient norm and updated weights are checked, and the
validation loss when measured; the run then stops with :class:`TrainingError` naming the first non-finite step
and the checkpoint it keeps, which (like every checkpoint) was only written because all its tensors were finite.
A step makes no host sync (on CUDA) unless it logs, evaluates, runs diagnostics or saves: its values stay on the
device until the next of those reads them (:mod:`s2hc.train.step_values`), so a non-finite step stops the run
at that read, up to ``log_every`` steps later, still named exactly and never checkpointed (a read comes first).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import TrainConfig, completed_settings, resumable_fields, schedule_of
from ..connection import set_connection_options
from ..data.loader import StreamBatches, TokenBatches, eval_batches
from ..data.shards import prepare_tokens
from ..data.stream import ChunkStream, should_stream, validation_tokens
from ..data.tokenizer import get_tokenizer
from ..devices import autocast_dtype, platform_record
from ..diagnostics.collect import gradient_norms, training_diagnostics
from ..flops import MEASURED_PEAK, measure_matmul_peak
from ..io import WriteError
from ..loggers import RunLog, open_sinks, parse_loggers
from ..models import ModelConfig, Transformer
from ..rundir import (
    METRICS,
    Checkpoint,
    History,
    MetricsLog,
    NonFiniteError,
    checkpoint_paths,
    load_checkpoint,
    open_run_directory,
    read_config,
    read_metrics,
    write_config,
)
from ..rundir.checkpoint import check_kept_of_run
from ..rundir.guard import clear_run, notice
from ..rundir.schema import new_run_id
from ..schedule import learning_rate
from . import compiling, distributed
from .banner import start_lines
from .checkpointer import Checkpointer
from .init_from import load_initial_weights
from .optim import make_optimizer, optimizer_record, other_optimizer_refused, weight_decay_record
from .step_values import PendingSteps, StepValues


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, gradient, weights or validation loss; a checkpoint that cannot be
    written); the message, one line, says what happened at which step and which checkpoint is kept."""


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


def _say(line: str) -> None:
    """``line`` on stderr from a signal handler: straight to the descriptor, since the handler may interrupt a
    write to ``sys.stderr`` (a progress bar's), which a second, nested write would break."""
    with contextlib.suppress(OSError):
        os.write(2, f"s2hc: {line}\n".encode())


class _StopNow(BaseException):
    """A signal before the loop started, raised by the handler wherever the run then is (opening its directory,
    reading or tokenising its data, building or restoring its model); :func:`train` turns it into
    :class:`Interrupted`. A BaseException, so that no ``except Exception`` on the way takes it for its own error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT/SIGTERM during :func:`train` (:func:`stop_on_signals`): ``received`` the signals so far, ``looping``
    whether the loop has started (set by it)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.looping = False

    def handle(self, signum, frame) -> None:
        if self.received:
            _say("stopping now; resume with --resume from the last checkpoint")
            raise KeyboardInterrupt(f"signal {signum} again")
        self.received.append(signum)
        if not self.looping:
            raise _StopNow(signum)
        again = "press Ctrl-C" if signum == signal.SIGINT else f"send signal {signum}"
        _say(f"signal {signum}: stopping after this step (a checkpoint is saved); {again} again to stop now")


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM from the start of a run to its end. Before the loop starts the first one stops the run at once
    (:class:`_StopNow`, then :class:`Interrupted`), wherever it is: a new run has trained nothing (its directory is
    left without a run, :func:`train`), a resumed one keeps its checkpoint untouched. In the loop the first asks for
    a stop after the current step (a flag the loop checks between steps, which then saves a checkpoint), and says
    so; a second one stops at once (KeyboardInterrupt): a step may take hours (a large ``grad_accum``), and the run
    resumes from its last checkpoint, which nothing leaves half-written (saves are atomic)."""
    signals = _Signals()
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            previous[signum] = signal.signal(signum, signals.handle)
    try:
        yield signals
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _stopped_before_training(config: TrainConfig, resume: bool, signum: int) -> str:
    if resume:
        return (f"stopped by signal {signum} before training went on; the run is as it was: resume with "
                f"`s2hc train --out {config.out} --resume`")
    return f"stopped by signal {signum} before the first step; nothing was saved: run the same command again"


def _check_resumable(before: dict, before_world_size: int, config: TrainConfig, world_size: int) -> None:
    """ValueError unless ``config`` computes what the run configured as ``before`` (a TrainConfig's dict) computed
    on ``before_world_size`` processes: the same settings but those that may change on ``--resume``
    (:func:`s2hc.config.resumable_fields`), and the same global batch (``batch_size × grad_accum ×
    processes``) even when the process count changed."""
    # A field added since the run was configured reads as what s2hc did before it existed (config.completed_settings;
    # weight_decay_on="matrices" did so for every family but mhc's and hc's (n, n) matrices: docs/training.md).
    before, after = completed_settings(before), config.to_dict()
    for settings in (before, after):  # the warmup as computed: unset, it is a tenth of the schedule
        settings["warmup_steps"] = schedule_of(settings)[1]
    changed = {k for k, v in after.items() if before.get(k) != v} - set(resumable_fields())
    if "streaming" in changed and should_stream(before["streaming"], config.data) == should_stream(
            config.streaming, config.data):
        changed.discard("streaming")  # 'auto' where it reads the data as the run did ('never' for local data)
    changed -= {"batch_size", "grad_accum"}  # checked below, as the global batch
    if changed == {"optimizer"}:  # AdamW's moments are no Muon momentum, nor the other way round
        raise ValueError(other_optimizer_refused(config.out, before["optimizer"], config.optimizer))
    if changed:
        details = ", ".join(f"{k}: {before.get(k)!r} -> {after[k]!r}" for k in sorted(changed))
        raise ValueError(
            f"the run in {config.out!r} was trained with a different configuration ({details}); "
            f"resume with the same settings, or choose another --out"
        )
    old = before["batch_size"] * before["grad_accum"] * before_world_size
    new = config.batch_size * config.grad_accum * world_size
    sequences = before["batch_size"] * before_world_size
    if old != new or sequences != config.batch_size * world_size:
        fits = before["grad_accum"] == config.grad_accum and sequences % config.batch_size == 0
        hint = f" (with batch_size={config.batch_size}: resume with --nproc {sequences // config.batch_size})"
        raise ValueError(
            f"the checkpoint in {config.out!r} was trained with {before['batch_size']} sequences x "
            f"{before['grad_accum']} micro-steps x {before_world_size} processes per step; keep "
            f"batch_size x processes = {sequences} and the same grad_accum" + (hint if fits else "")
        )


def _kept_schedule(before: dict, config: TrainConfig, step: int | None) -> TrainConfig:
    """``config`` as it resumes the run configured as ``before`` (its stored settings), from its checkpoint of
    ``step`` (None: it has none yet, and starts again from step 0): ``warmup_steps`` left unset is the run's
    warmup, and, from a checkpoint, ``schedule_steps`` left unset is the run's schedule span. So a resume to more
    steps (or fewer) keeps the schedule the run was following, and its learning rate never jumps: past the
    schedule's end the run holds its floor (:func:`_schedule_notice` says so). A ``schedule_steps`` given (or
    recorded by an earlier resume) is kept as it is."""
    span, warmup = schedule_of(completed_settings(before))
    if step is not None and config.schedule_steps is None and config.schedule_span != span:
        config = config.replace(schedule_steps=span)
    if config.warmup_steps is None and config.warmup != warmup:
        config = config.replace(warmup_steps=warmup)
    return config


def _schedule_notice(before: dict, config: TrainConfig, step: int) -> str | None:
    """The line that says what a resume from ``step`` does to the learning rate where it changes ``max_steps`` or
    the schedule of the run configured as ``before``; None when it changes neither, or trains no step, or the
    schedule is ``constant`` (no span: its rate is the same whatever the length)."""
    before = completed_settings(before)
    old_span, old_warmup = schedule_of(before)
    old_max, new_max, span = before["max_steps"], config.max_steps, config.schedule_span
    if step >= new_max or config.lr_schedule == "constant":
        return None

    def rate(at: int, span: int, warmup: int) -> float:  # the 0-based step ``at``'s
        return learning_rate(at, peak=config.lr, warmup_steps=warmup, max_steps=span, min_ratio=config.min_lr_ratio,
                             kind=config.lr_schedule, decay_fraction=config.decay_fraction)

    floor, kind = config.min_lr_ratio * config.lr, config.lr_schedule
    if span != old_span:  # schedule_steps given: the rate follows the new schedule from the next step
        return (f"{config.out}: the {kind} schedule spans {span} steps, no longer {old_span}: step {step + 1} runs at "
                f"lr {rate(step, span, config.warmup):.1e} (the old schedule's {rate(step, old_span, old_warmup):.1e})")
    if new_max > old_max and new_max > span:
        return (f"extending {config.out} from {old_max} to {new_max} steps: the {kind} schedule "
                f"{'ended' if step >= span else 'ends'} at step {span}; steps {max(old_max, span) + 1}-{new_max} "
                f"continue at its floor lr {floor:.1e} (set --schedule-steps {new_max} to restart the schedule over "
                "the new length)")
    if new_max < old_max and span > new_max:
        return (f"shortening {config.out} from {old_max} to {new_max} steps: the {kind} schedule still spans {span} "
                f"steps, so the run ends at lr {rate(new_max - 1, span, config.warmup):.1e}, above its floor "
                f"{floor:.1e} (set --schedule-steps {new_max} to decay over the new length)")
    return None


@torch.no_grad()
def evaluate(model, batches, device, amp_dtype, ctx: distributed.Context | None = None) -> float:
    """Mean cross-entropy per token over fixed validation batches ``[(x, y), ...]``: this rank's share of the
    validation set (:func:`s2hc.data.loader.eval_batches`), summed over all ranks of ``ctx``, so the result is the
    same on every rank and equals one process's over the whole set. A rank whose share of a batch is empty still
    runs the model (on a placeholder window, counted nowhere), since a sharded model's forward pass needs every
    rank."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # the summed loss and the tokens it sums over
    for x, y in batches:
        empty = not len(x)
        if empty:
            x = y = torch.zeros((1, x.shape[1]), dtype=torch.int64)
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x)
        if not empty:
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            total[0] += losses.double().sum()
            total[1] += y.numel()
    model.train()
    if ctx is not None:
        distributed.sum_across_ranks_(total, ctx)
    loss, count = total.tolist()
    return loss / max(count, 1)


def train(config: TrainConfig, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Train ``config`` into the run directory ``config.out``: a new run, or with ``resume`` the run there.

    Without ``resume``, ``config.out`` must not hold a run (``config.yaml``, ``metrics.jsonl`` or a checkpoint)
    unless ``overwrite`` asks to remove it first; with ``resume`` it must hold one, which continues exactly from
    its newest checkpoint (or starts again from step 0 when it has none yet, with the same configuration). The
    directory is locked for the whole run (:func:`s2hc.rundir.open_run_directory`; under torchrun by rank 0).

    One process, or one of several started by torchrun (DDP or FSDP2, see :mod:`s2hc.train.distributed`).
    Writes ``out/metrics.jsonl`` (and its scalars to the loggers ``config.logger`` names, :mod:`s2hc.loggers`), a
    line per log and evaluation on stderr where there is no progress bar, and a checkpoint (``out/checkpoint.pt``,
    or ``out/checkpoint.dcp/`` when sharded) every ``checkpoint_every`` steps and at the end. Raises ValueError
    for bad input (and a run directory refused as above, or in use by another process), :class:`TrainingError`
    for a non-finite loss, gradient, weights or validation loss or a checkpoint that cannot be written (the last
    good checkpoint is kept), :class:`Interrupted` after saving on SIGINT/SIGTERM (at once before the loop starts:
    a new run then leaves no run behind, a resumed one its checkpoint as it was), KeyboardInterrupt (at once,
    nothing saved) on a second one; :class:`s2hc.extras.MissingExtra` first, before anything is written, when the
    run needs an optional package that is not installed.

    A resume keeps the run's schedule when it changes ``max_steps`` (:func:`_kept_schedule`): past the
    schedule's end the run holds its floor, and says so, unless ``schedule_steps`` asks for another schedule.
    """
    with stop_on_signals() as signals:  # from here: a signal before the loop stops the run at once
        try:
            return _train_run(config, resume, overwrite, signals)
        except _StopNow as stop:
            raise Interrupted(_stopped_before_training(config, resume, stop.signum), stop.signum) from None


def _train_run(config: TrainConfig, resume: bool, overwrite: bool, signals: _Signals) -> RunResult:
    """:func:`train` with its signals handled."""
    config.check_extras()  # before anything is written: a missing package must not leave a run to refuse
    ctx = distributed.setup(config.device, config.parallel)
    if ctx.is_main:
        for line in config.schedule_warnings():
            notice(f"warning: {line}")
    try:
        with contextlib.ExitStack() as run_directory:
            saved, config = _open_run(config, resume, overwrite, ctx, run_directory)
            try:
                return _train(config, saved, ctx, signals)
            # settings that fail only once the model meets data (a corpus too small), or a signal before the loop:
            # a new run without a checkpoint is removed again
            except (ValueError, _StopNow):
                if ctx.is_main and not resume:
                    _forget_unsaved_run(Path(config.out).expanduser())
                raise
    except WriteError as error:  # config.yaml or metrics.jsonl at the start: a full disk, say
        raise TrainingError(str(error)) from error
    finally:
        distributed.teardown()


def _forget_unsaved_run(out: Path) -> None:
    """Remove a new run that was refused before its first checkpoint (its config.yaml, metrics.jsonl): it holds
    nothing to resume, and left in place it would make the corrected command be refused as "already holds a
    run"."""
    if not checkpoint_paths(out):
        clear_run(out, log=None)


def _on_main(ctx: distributed.Context, work):
    """``work()`` on rank 0 alone; an exception there is raised on every rank (a ValueError as a ValueError)."""
    result, failure = None, None
    if ctx.is_main:
        try:
            result = work()
        except BaseException as error:  # noqa: BLE001 - re-raised below, after the other ranks are told
            failure = error
    if ctx.distributed:
        box = [None if failure is None else (isinstance(failure, ValueError), str(failure))]
        dist.broadcast_object_list(box, src=0)
        if failure is None and box[0] is not None:
            is_value_error, message = box[0]
            raise ValueError(message) if is_value_error else RuntimeError(f"rank 0 failed: {message}")
    if failure is not None:
        raise failure
    return result


def _open_run(config: TrainConfig, resume: bool, overwrite: bool, ctx: distributed.Context,
              stack: contextlib.ExitStack) -> tuple[Checkpoint | None, TrainConfig]:
    """Open (rank 0: check, lock, clean) the run directory; the header of the checkpoint to resume (or None) and the
    config to train: ``config``, on a resume keeping the run's schedule (:func:`_kept_schedule`)."""
    out = Path(config.out).expanduser()

    def open_on_main() -> tuple[Checkpoint | None, TrainConfig]:
        stack.enter_context(open_run_directory(config.out, resume=resume, overwrite=overwrite, log=notice))
        if not resume:
            return None, config
        if checkpoint_paths(out):
            saved = load_checkpoint(out, with_model=False)  # verified: a damaged checkpoint stops here
            check_kept_of_run(out, saved)  # a kept one copied in from another run: refused, never pruned or beaten
            kept = _kept_schedule(saved.config, config, saved.step)
            _check_resumable(saved.config, saved.world_size, kept, ctx.world_size)
            line = _schedule_notice(saved.config, kept, saved.step)
            if line is not None:
                notice(line)
            return saved, kept
        previous, kept = read_config(out), config
        if previous is not None:
            kept = _kept_schedule(previous, config, None)
            _check_resumable(previous, ctx.world_size, kept, ctx.world_size)
        notice(f"{config.out!r} holds no checkpoint yet: its run starts again from step 0")
        return None, kept

    saved, kept = _on_main(ctx, open_on_main) or (None, None)
    if ctx.distributed:  # rank 0's config (the schedule it kept) for every rank
        box = [kept.to_dict() if ctx.is_main else None]
        dist.broadcast_object_list(box, src=0)
        kept = TrainConfig.from_dict(box[0])
    if not ctx.is_main and resume and checkpoint_paths(out):
        saved = load_checkpoint(out, with_model=False, verify=False)  # rank 0 verified it
    return saved, kept


def _local_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, as this rank holds it (its local shard under FSDP2), detached."""
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach() for name, p in model.named_parameters()}


def _largest_weight(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The largest magnitude among the parameters (this rank's local shards), a 0-dim tensor on the device: one
    fused reduction and no sync. It is finite exactly when every parameter is (a NaN propagates through the
    maximum, and there are no squares to overflow)."""
    tensors = [p for p in _local_parameters(model).values() if p.numel()]
    if not tensors:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)


def _non_finite_weights(model: torch.nn.Module, values: StepValues) -> str:
    """The names of this rank's parameters that are not finite now (read one by one: only after a divergence),
    for the message about step ``values``, whose weights some rank found non-finite."""
    bad = [name for name, p in _local_parameters(model).items() if not bool(torch.isfinite(p).all())]
    if not bad:
        return "on another rank" if values.weights_finite else "not finite any more when read"
    return ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def _train(config: TrainConfig, saved: Checkpoint | None, ctx: distributed.Context, signals: _Signals) -> RunResult:
    """The run after its directory is open: set up, measure an ``init_from`` source, then step until
    ``max_steps`` (or a signal), checkpointing as configured."""
    run = _Run(config, saved, ctx)
    resume = f"s2hc train --out {config.out} --resume"
    try:
        with contextlib.closing(_Console(run, ctx.is_main)) as console:
            run.measure_source()
            run.model.train()
            received = signals.received
            signals.looping = True  # from here a signal stops the run after its step, which is saved
            while run.step < config.max_steps:
                run.optimizer_step()
                console.stepped()
                console.warn(run.compile_line("training"))
                if run.log_due():
                    run.log()
                    console.logged()
                run.diagnose_if_due()
                if run.evaluate_if_due():
                    console.evaluated()
                    console.warn(run.compile_line("evaluation"))
                if run.checkpoint_due() or received:
                    run.save()
                if received:
                    raise Interrupted(f"stopped by signal {received[0]} after step {run.step}; resume with "
                                      f"`{resume}`", received[0])
    except WriteError as error:  # a full disk while saving or logging: the last checkpoint written stays good
        raise run.stop(f"at step {run.step}, {error}, then resume with `{resume}`") from error
    finally:
        run.close()
    return run.result()


class _Console:
    """What a run shows on stderr (rank 0 only): first the banner (:func:`.banner.start_lines`: the parameters,
    device, precision, tokens per step, optimizer, run directory, and "compiling…" with ``compile``), then a
    progress bar (its postfix the last loss, tokens/s and validation loss) when ``progress`` is on and stderr is a
    terminal; otherwise, for batch jobs and log files, plain lines (no carriage return, no escape code): one per
    ``log_every`` steps and one per evaluation. With ``compile``, a warning line when blocks ran eagerly or a
    compiled graph broke (:meth:`_Run.compile_line`), after the step or evaluation where it is first seen."""

    def __init__(self, run: _Run, is_main: bool):
        config = run.config
        self.run, self.is_main = run, is_main
        if is_main:  # before the bar, which draws itself when made
            for line in start_lines(config, step=run.step, params=run.params, connection_params=run.hc_params,
                                    device=run.device, amp_dtype=run.amp_dtype, tokens_per_step=run.tokens_per_step,
                                    world_size=run.ctx.world_size, out=run.out):
                print(line, file=sys.stderr, flush=True)
        terminal = sys.stderr.isatty()
        self.lines = is_main and not (config.progress and terminal)
        self.bar = tqdm(total=config.max_steps, initial=run.step, disable=not is_main or self.lines,
                        desc=f"{config.family}", unit="step")
        self.postfix: dict[str, str] = {}

    def stepped(self) -> None:
        self.bar.update(1)

    def logged(self) -> None:
        run = self.run
        loss, tokens_per_s = run.history.train_loss, run.tokens_per_step / run.history.step_times[-1]
        if self.lines:
            self._line(f"loss {loss:.4f}, lr {run.lr:.2e}, grad norm {run.grad_norm:.3g}, {tokens_per_s:,.0f} tokens/s")
        self.postfix.update(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
        self.bar.set_postfix(self.postfix)

    def evaluated(self) -> None:
        val_loss = self.run.history.val_loss
        if self.lines:
            perplexity = math.exp(val_loss) if val_loss < 700 else math.inf
            self._line(f"validation loss {val_loss:.4f} (perplexity {perplexity:,.2f})")
        self.postfix.update(val=f"{val_loss:.3f}")
        self.bar.set_postfix(self.postfix)

    def warn(self, line: str | None) -> None:
        """``line`` (if any) as a warning of its own, above the progress bar when there is one."""
        if line is not None and self.is_main:
            tqdm.write(f"s2hc: warning: {line}", file=sys.stderr)

    def _line(self, text: str) -> None:
        print(f"step {self.run.step}/{self.run.config.max_steps}: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


class _Run:
    """One run's state between steps, and the named steps of the loop (:func:`_train` calls them in order).

    Built from the config: the tokenizer, the model (restored, or started from ``init_from``), its wrapping,
    the optimizer, the data and the metrics log. ``step`` counts optimizer steps; ``history`` is what the
    checkpoint keeps of the losses and step times (a resumed run continues it)."""

    def __init__(self, config: TrainConfig, saved: Checkpoint | None, ctx: distributed.Context):
        self.config, self.ctx = config, ctx
        self.out = Path(config.out).expanduser()
        self.device, self.amp_dtype = ctx.device, autocast_dtype(config.dtype, ctx.device)
        tokenizer = get_tokenizer(config.tokenizer)
        self.model_config = _model_config(config, tokenizer.vocab_size)
        if saved is not None and ModelConfig.from_dict(saved.model_config) != self.model_config:
            raise ValueError(f"the checkpoint in {str(self.out)!r} holds a model of another shape; choose another "
                             "--out")
        self.loader, self.validation = _data(config, tokenizer, ctx)
        self.model = self._build_model(saved)
        self.params, self.hc_params = self.model.num_params(), self.model.num_connection_params()
        # which blocks ran eagerly under --compile, said once per new finding (:meth:`compile_line`)
        self.compile_watch = compiling.CompileWatch(self.model.blocks) if config.compile else None
        self.compile_said: set[str] = set()
        self.forward = distributed.wrap(self.model, ctx, config.compile, self.amp_dtype)
        self.optimizer = make_optimizer(self.model, config.lr, config.weight_decay, (config.beta1, config.beta2),
                                        on=config.weight_decay_on, optimizer=config.optimizer)
        torch.manual_seed(config.seed + ctx.rank)  # per-rank streams from here on
        self.checkpointer = Checkpointer(self.out, self.model, self.optimizer, self.loader, ctx,
                                         keep=config.keep_checkpoints, keep_best=config.keep_best)
        self.best_due = False  # this step's validation loss is a new best: its checkpoint is saved as the best
        self.step = self.checkpointer.restore(saved) if saved is not None else 0
        # the run's identity, in each of its checkpoints: a kept one from another run is told from its own
        self.run_id = (saved.run_id if saved is not None else None) or new_run_id()
        # a finished run resumed (`train --resume` with the same max_steps) still reports its numbers
        self.history = saved.history if saved is not None else History(train_loss=math.nan)
        self.metrics = None
        if ctx.is_main:
            resumed_step = self.step if saved is not None else None
            # the loggers first: one that cannot start stops the run before config.yaml and metrics.jsonl are written
            sinks = open_sinks(parse_loggers(config.logger), self.out, config=config.to_dict(),
                               logger_dir=config.logger_dir, group=config.logger_group, resumed_step=resumed_step,
                               records=lambda: _kept_records(self.out, resumed_step), log=notice)
            try:
                write_config(self.out, config.to_dict())
                self.metrics = RunLog(MetricsLog(self.out, keep_until_step=resumed_step, log=notice), sinks,
                                      log=notice)
            except BaseException:
                RunLog(None, sinks, log=notice).close()
                raise
            if "weight_decay" not in self.metrics.kept_keys:  # once per run (from its first step, or this resume's)
                self.metrics.write(step=self.step, weight_decay=weight_decay_record(
                    self.model, config.weight_decay, config.weight_decay_on))
            if "optimizer" not in self.metrics.kept_keys:  # which optimizer updates what, once per run likewise
                self.metrics.write(step=self.step, optimizer=optimizer_record(self.model, config.optimizer))
            # at every start: a resumed run may continue on another machine, and its rounding with it
            self.metrics.write(step=self.step, platform=_platform(self.device))
        self.tokens_per_step = config.batch_size * config.seq_len * config.grad_accum * ctx.world_size
        self.pending = PendingSteps(ctx)  # the steps' values not read yet: read_steps reads them
        self.lr = math.nan
        self.grad_norm = math.nan
        self.layer_grads = None

    def _build_model(self, saved: Checkpoint | None) -> Transformer:
        torch.manual_seed(self.config.seed)  # the same initial weights on every rank
        model = Transformer(self.model_config, init_rng=self.config.init_rng, init_seed=self.config.seed)
        if self.config.init_from and saved is None:  # a resumed run restores its own weights
            load_initial_weights(model, self.config.init_from)
        # Whole blocks recomputed in backward; set before distributed.wrap compiles and shards the blocks.
        model.set_activation_checkpointing(self.config.activation_checkpointing)
        return set_connection_options(model.to(self.device), **self.config.connection)

    # ------------------------------------------------------------------------------------- the steps

    def measure_source(self) -> None:
        """A run from another run's weights first measures them: its curve starts at the source's loss (an
        upcycled model's equals the residual source's, which is the point of upcycling)."""
        if self.config.init_from and self.step == 0 and self.config.eval_every:
            self.history.val_loss = evaluate(self.forward, self.validation, self.device, self.amp_dtype, self.ctx)
            if self.metrics:
                self.metrics.write(step=0, val_loss=self.history.val_loss, train_seconds=0.0)

    def optimizer_step(self) -> None:
        """One optimizer step: the scheduled learning rate, ``grad_accum`` micro-steps, clipping, the update. No
        host sync (but for diagnostics when due): its loss, gradient norm and updated weights stay on the device
        until :meth:`read_steps` checks them (the update runs whatever they are)."""
        config = self.config
        self.pending.start()
        self.lr = learning_rate(self.step, peak=config.lr, warmup_steps=config.warmup,
                                max_steps=config.schedule_span, min_ratio=config.min_lr_ratio,
                                kind=config.lr_schedule, decay_fraction=config.decay_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        train_loss = self._accumulate_gradients()
        self.layer_grads = gradient_norms(self.model) if self._due(config.diagnostics_every) else None  # unclipped
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip or float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.pending.add(self.step, self.lr, train_loss, grad_norm, _largest_weight(self.model, self.device))

    def _accumulate_gradients(self) -> torch.Tensor:
        """Forward and backward over ``grad_accum`` micro-batches (gradients synchronised on the last); this
        rank's mean loss over micro-steps, a float64 0-dim tensor on the device (summed in the order and precision
        the host summed ``loss.item()`` in, without reading it)."""
        config = self.config
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in range(config.grad_accum):
            x, y = (t.to(self.device, non_blocking=True) for t in next(self.loader))
            with distributed.gradient_sync(self.forward, self.ctx, enabled=micro == config.grad_accum - 1):
                with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    logits = self.forward(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss / config.grad_accum).backward()
            loss_sum += loss.detach().to(torch.float64)
        return loss_sum / config.grad_accum

    def read_steps(self) -> None:
        """Read the steps taken since the last read (:class:`~s2hc.train.step_values.PendingSteps`: one transfer,
        their only host sync on CUDA) into the run's record, stopping at the first non-finite one with
        :class:`TrainingError` (after recording the divergence) that names it: a non-finite loss, else gradient,
        else updated weights (any rank's). Every rank calls it, before the loop logs, runs diagnostics, evaluates
        or saves, so a non-finite step is never checkpointed, though it may be found ``log_every`` steps late."""
        for values in self.pending.read():
            at, train_loss, grad_norm = values.step, values.loss, values.grad_norm
            if not math.isfinite(train_loss):  # its gradient is not finite either
                raise self.diverged(f"non-finite loss ({train_loss}) or gradient at step {at}", at)
            if not math.isfinite(grad_norm):  # the loss is not the suspect: the backward pass overflowed
                raise self.diverged(f"non-finite gradient (norm {grad_norm}) at step {at}, with a finite loss "
                                    f"({train_loss:.4f}): the backward pass overflowed", at)
            if not values.ranks_finite:
                raise self.diverged(f"non-finite weights after the update of step {at} "
                                    f"({_non_finite_weights(self.model, values)}; learning rate {values.lr})", at)
            self.grad_norm, self.history.train_loss = grad_norm, train_loss
            self.history.step_times.append(values.seconds)

    def _due(self, every: int) -> bool:
        """Whether a task done every ``every`` steps (0: never) is due after the step now being taken."""
        return bool(every) and (self.step + 1) % every == 0

    def compile_line(self, during: str) -> str | None:
        """With ``compile``, after a step (``during`` "training") or an evaluation ("evaluation"): the line saying
        how many blocks ran eagerly and why, and any graph break (:class:`.compiling.CompileWatch`), when it says
        something not said before; else None."""
        line = self.compile_watch.line(during) if self.compile_watch is not None else None
        if line is None or line in self.compile_said:
            return None
        self.compile_said.add(line)
        return line

    def log_due(self) -> bool:
        return self.step % self.config.log_every == 0 or self.step == self.config.max_steps

    def log(self) -> None:
        """The step's metrics (read first: :meth:`read_steps`); ``step_time`` and ``tokens_per_s`` are those of the
        interval since the previous read (:mod:`s2hc.train.step_values`)."""
        self.read_steps()
        if self.metrics:
            step_time = self.history.step_times[-1]
            self.metrics.write(step=self.step, loss=self.history.train_loss, lr=self.lr, grad_norm=self.grad_norm,
                               tokens=self.step * self.tokens_per_step, step_time=step_time,
                               tokens_per_s=self.tokens_per_step / step_time)

    def diagnose_if_due(self) -> None:
        """The hyper-connection diagnostics on a fixed batch (no RNG), with the gradient norms taken before
        clipping; every rank runs it (FSDP), the main one writes."""
        if self.layer_grads is None:
            return
        self.read_steps()  # a non-finite step stops the run before diagnostics run on its weights
        record = training_diagnostics(self.model, self.validation[0][0], self.layer_grads,
                                      autocast_dtype=self.amp_dtype)
        if self.metrics:
            self.metrics.write(step=self.step, diagnostics=record)

    def evaluate_if_due(self) -> bool:
        """The validation loss when due (every ``eval_every`` steps and at the end); whether it was measured."""
        every = self.config.eval_every
        if not ((every and self.step % every == 0) or self.step == self.config.max_steps):
            return False
        self.read_steps()  # a non-finite step stops the run before it is evaluated
        val_loss = evaluate(self.forward, self.validation, self.device, self.amp_dtype, self.ctx)
        if distributed.mean_across_ranks(float(not math.isfinite(val_loss)), self.ctx) > 0:  # all ranks stop
            raise self.diverged(f"non-finite validation loss ({val_loss}) at step {self.step}", self.step)
        self.history.val_loss = val_loss
        if self.metrics:
            self.metrics.write(step=self.step, val_loss=val_loss, **self._train_seconds())
        self.best_due = self.checkpointer.improves(val_loss)  # keep_best: saved next, as the best one
        return True

    def _train_seconds(self) -> dict[str, float]:
        """``{"train_seconds": ...}``, the measured training time of every step so far (their step times: evaluation,
        diagnostics and checkpoints left out), for a validation record; empty when the history lacks some steps'
        times (a run resumed from a checkpoint written before they were kept), so no partial sum is recorded."""
        times = self.history.step_times
        return {"train_seconds": round(math.fsum(times), 6)} if len(times) == self.step else {}

    def checkpoint_due(self, *, best: bool = True) -> bool:
        """Whether a checkpoint is due after this step: every ``checkpoint_every`` steps, at the end, and (with
        ``best``) when the step's validation loss is a new best (``keep_best``)."""
        every = self.config.checkpoint_every
        regular = bool(every and self.step % every == 0) or self.step == self.config.max_steps
        return regular or (best and self.best_due)

    def save(self) -> None:
        """The latest checkpoint; also the best one when due, and a step checkpoint (``keep_checkpoints``) unless
        it was saved for the best alone. The steps since the last read are read first (:meth:`read_steps`): a
        non-finite one stops the run instead, and is never saved."""
        self.read_steps()
        checkpoint = Checkpoint(config=self.config.to_dict(), model_config=self.model_config.to_dict(),
                                step=self.step, history=self.history, run_id=self.run_id)
        keep_step = self.checkpoint_due(best=False) or not self.best_due  # a regular save, or a signal's
        try:
            self.checkpointer.save(checkpoint, best=self.best_due, keep_step=keep_step)
            self.best_due = False
        except NonFiniteError as error:
            raise TrainingError(f"the training state of step {self.step} is not finite, so it was not saved "
                                f"({str(error).removeprefix('not saved: ')}); stopped; "
                                f"{self.checkpointer.kept()}") from None

    # ---------------------------------------------------------------------------------- ends of a run

    def close(self) -> None:
        """Close the loggers and stop a streaming loader's tokenising thread (the run ended, or stopped)."""
        if self.metrics:
            self.metrics.close()
        stream = getattr(self.loader, "stream", None)
        if stream is not None:
            stream.close()

    def stop(self, problem: str) -> TrainingError:
        return TrainingError(f"{problem}; stopped; {self.checkpointer.kept()}")

    def diverged(self, problem: str, at_step: int) -> TrainingError:
        """A non-finite value: recorded in metrics.jsonl as ``{"step", "diverged"}`` (studies count it), then
        the run stops."""
        if self.metrics:
            with contextlib.suppress(WriteError):
                self.metrics.write(step=at_step, diverged=problem)
        return self.stop(problem)

    def result(self) -> RunResult:
        # The median step ignores the first steps' warm-up (and compilation) and any evaluation pauses.
        times = self.history.step_times
        median_step = statistics.median(times) if times else math.nan
        return RunResult(out=self.out, step=self.step, train_loss=self.history.train_loss,
                         val_loss=self.history.val_loss, tokens_per_s=self.tokens_per_step / median_step,
                         params=self.params, hc_params=self.hc_params)


def _kept_records(out: Path, resumed_step: int | None) -> list[dict] | None:
    """The records of ``out/metrics.jsonl`` a run resumed at ``resumed_step`` keeps (None for a new run), read
    before the run trims the file: what the loggers rebuild from (a damaged file is a ValueError naming it and the
    line, as the run's own reading would be)."""
    if resumed_step is None:
        return None
    if not (out / METRICS).is_file():
        return []
    return [record for record in read_metrics(out) if record["step"] <= resumed_step]


def _platform(device: torch.device) -> dict[str, object]:
    """The platform record (:func:`s2hc.devices.platform_record`) and, on a CPU, the float32 matmul peak measured
    now with the run's threads (:func:`s2hc.flops.measure_matmul_peak`, a few milliseconds): what a study's MFU
    divides by there (a GPU's peak comes from the table in :mod:`s2hc.flops`)."""
    record = platform_record(device)
    if device.type == "cpu":
        record[MEASURED_PEAK] = measure_matmul_peak(device)
    return record


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
    """``(training batches, fixed validation batches)``. A split tokenised whole (``streaming``, see
    :func:`s2hc.data.stream.should_stream`): rank 0 tokenises it once, the others map its shards. A streamed
    training split: every process reads it chunk by chunk as it trains (:class:`~s2hc.data.loader.StreamBatches`;
    the others wait for rank 0's chunks in a shared cache); a streamed validation split: its first
    ``eval_batches`` global batches of windows (rank 0 first). The validation set is the same whatever the
    process count (:func:`~s2hc.data.loader.eval_batches`: ``eval_batches`` global batches of ``batch_size ×
    processes`` windows, each rank taking its share of each)."""
    spec, progress = config.source_spec(), config.progress and ctx.is_main
    stream_train = should_stream(spec.streaming, config.data)

    def tokens(split: str):
        if split == "val":
            return validation_tokens(config.data, tokenizer, config.cache_dir, spec=spec,
                                     seq_len=config.seq_len, batch_size=config.batch_size * ctx.world_size,
                                     eval_batches=config.eval_batches, progress=progress)
        return prepare_tokens(config.data, tokenizer, config.cache_dir, split, progress=progress, spec=spec)

    if not ctx.is_main:
        distributed.barrier(ctx)
    train_tokens = None if stream_train else tokens("train")
    val_tokens = tokens("val")
    if ctx.is_main:
        distributed.barrier(ctx)
    data_seed = config.seed if config.data_seed is None else config.data_seed
    if stream_train:
        stream = ChunkStream(config.data, tokenizer, config.cache_dir, "train", prefetch=2,
                             wait_s=0.0 if ctx.is_main else 30.0, spec=spec)
        if ctx.is_main:
            notice(f"streaming data={config.data!r}: tokenised chunk by chunk as training reads it, into "
                   f"{str(stream.directory)!r}")
        loader = StreamBatches(stream, config.seq_len, config.batch_size, seed=data_seed, rank=ctx.rank,
                               world_size=ctx.world_size)
    else:
        loader = TokenBatches(train_tokens, config.seq_len, config.batch_size, seed=data_seed,
                              rank=ctx.rank, world_size=ctx.world_size)
    validation = eval_batches(val_tokens, config.seq_len, config.batch_size, config.eval_batches, rank=ctx.rank,
                              world_size=ctx.world_size)
    return loader, list(validation)
