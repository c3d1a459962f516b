"""What a training checkpoint holds and how it is put back: model, optimizer, data position, RNG and step.

:class:`Checkpointer` is the training side of :mod:`s2hc.rundir.checkpoint` (which owns the file formats):
it collects the state of a run through ``torch.distributed.checkpoint.state_dict`` (so a DDP-, FSDP2- or
un-wrapped model saves the same names), writes one file with one process and shards with several or
under FSDP, and restores either into the current wrapping, resharding when the process count changed.
Nothing is written unless every tensor of the state is finite (:class:`~s2hc.rundir.checkpoint.NonFiniteError`
otherwise, on every rank).

Kept checkpoints (``keep_checkpoints``, ``keep_best``): the state is written once, into ``RUN/checkpoints/best``
first when the step's validation loss is a new best (so a kill before the latest follows does not lose it), else
into the latest; the latest and ``RUN/checkpoints/step-N`` are then copies of it, verified byte for byte and never
hard links (:func:`~s2hc.rundir.checkpoint.keep_copy`: a user's ``cp`` over one changes no other), and the step
checkpoints beyond the newest ``keep_checkpoints`` are removed only after the new one is in place.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..config import completed_settings
from ..io import WriteError
from ..rundir.checkpoint import (
    NonFiniteError,
    best_val_loss,
    keep_copy,
    kept_path,
    load_checkpoint,
    load_sharded_into,
    prune_kept,
    remove_other_kind,
    save_checkpoint,
    save_sharded_checkpoint,
)
from ..rundir.layout import BEST, CHECKPOINT, KEPT, SHARDED
from ..rundir.schema import Checkpoint
from . import distributed
from .optim import optimizer_name, optimizer_parts, other_optimizer_refused


def rng_state() -> dict[str, Any]:
    """Every RNG a run touches, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves and restores one run's training state in ``run_dir``.

    ``optimizer``: one of :func:`s2hc.train.optim.make_optimizer`'s, AdamW or Muon with AdamW; the state of each
    torch optimizer it is made of (:func:`~s2hc.train.optim.optimizer_parts`) is saved and put back by parameter
    name, into one ``state`` and the groups of all.

    ``save(checkpoint)`` writes a :class:`~s2hc.rundir.schema.Checkpoint` (configs, step, history) with the
    model, the optimizer, the data loader's position and every RNG filled in; ``restore(saved)`` puts one read
    by :func:`~s2hc.rundir.checkpoint.load_checkpoint` back and returns its step. Collective under
    ``torch.distributed``: every rank calls both. ``last_step`` and ``last_path``: the latest checkpoint of this
    run written or restored last (None before the first), the one a failed run keeps.

    ``keep``: also keep the newest ``keep`` checkpoints by step in ``RUN/checkpoints/`` (0: none);
    ``keep_best``: also keep the one of the lowest validation loss (:meth:`improves` tells whether a step's is),
    ``best_loss`` being the loss to beat (the kept best's, read back when a run resumes; infinity before one).
    """

    def __init__(self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader,
                 ctx: distributed.Context, *, keep: int = 0, keep_best: bool = False):
        self.run_dir, self.model, self.optimizer, self.loader, self.ctx = Path(run_dir), model, optimizer, loader, ctx
        self.sharded = ctx.distributed or ctx.parallel == "fsdp"
        self.last_step: int | None = None
        self.last_path: Path | None = None
        self.keep, self.keep_best = keep, keep_best
        self.best_loss = best_val_loss(self.run_dir) if keep_best else math.inf

    def improves(self, val_loss: float) -> bool:
        """Whether ``val_loss`` (a step's validation loss) is below the kept best's, with ``keep_best``: that
        step's checkpoint is then saved as the best. The same answer on every rank (any rank's says so)."""
        if not self.keep_best:
            return False
        better = val_loss < self.best_loss
        if self.ctx.distributed:
            better = distributed.mean_across_ranks(float(better), self.ctx) > 0
        return better

    def kept(self) -> str:
        """What a run that stops now keeps, for its error message."""
        if self.last_step is None:
            return f"no checkpoint of this run was written to {str(self.run_dir)!r} yet"
        return f"the last good checkpoint (step {self.last_step}) is kept in {str(self.last_path)!r}"

    def _check_finite(self, state: dict[str, Any]) -> None:
        """NonFiniteError on every rank when a tensor of any rank's (local shard of the) state is not finite."""
        bad = []
        for name, tensor in _tensors(state, ""):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
                bad.append(name)
        if distributed.mean_across_ranks(float(len(bad)), self.ctx) > 0:
            names = bad or ["a tensor of another rank"]
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise NonFiniteError(f"not saved: {names[0]}{more} hold NaN or infinite values", names)

    def save(self, checkpoint: Checkpoint, *, best: bool = False, keep_step: bool = True) -> None:
        """Write ``checkpoint`` with this run's training state as the latest checkpoint: NonFiniteError (nothing
        written) when the state is not finite, :class:`~s2hc.io.WriteError` (the previous checkpoint kept) when
        the disk refuses it.

        ``best`` (with ``keep_best``): it is also the best one, ``RUN/checkpoints/best``; ``keep_step`` (with
        ``keep``): it is also ``RUN/checkpoints/step-N``, and the step checkpoints beyond the newest ``keep``
        are removed. The state is written once, the other places are copies of it (see the module)."""
        model_state, optimizer_state = get_state_dict(self.model, optimizer_parts(self.optimizer))
        checkpoint = dataclasses.replace(checkpoint, loader=self.loader.state_dict(), rng=rng_state(),
                                         world_size=self.ctx.world_size)
        latest = self.run_dir / (SHARDED if self.sharded else CHECKPOINT)
        best_path = kept_path(self.run_dir, BEST, self.sharded) if best and self.keep_best else None
        step_path = kept_path(self.run_dir, checkpoint.step, self.sharded) if keep_step and self.keep else None
        first = best_path or latest
        if self.sharded:
            self._check_finite({"model": model_state, "optimizer": optimizer_state})
            save_sharded_checkpoint(first, {"model": model_state, "optimizer": optimizer_state},
                                    checkpoint, is_main=self.ctx.is_main, barrier=lambda: distributed.barrier(self.ctx))
        else:  # save_checkpoint checks finiteness itself, in the pass that computes the checksum
            save_checkpoint(first, dataclasses.replace(checkpoint, model=model_state, optimizer=optimizer_state))
        if best_path is not None and checkpoint.history.val_loss is not None:
            self.best_loss = checkpoint.history.val_loss
        self._keep(first, [latest, step_path], [latest, best_path, step_path])
        self.last_step, self.last_path = checkpoint.step, latest

    def _keep(self, written: Path, copies: list[Path | None], names: list[Path | None]) -> None:
        """Rank 0: make each of ``copies`` the checkpoint ``written`` too, remove the other kind of each of
        ``names`` (older: the run changed its process count), then the step checkpoints beyond the newest
        ``keep``. A failure is raised on every rank (a WriteError)."""
        failure = None
        if self.ctx.is_main:
            try:
                for target in copies:
                    if target is not None:
                        keep_copy(written, target)
                for target in names:
                    if target is not None:
                        remove_other_kind(target)
                if copies[-1] is not None:
                    prune_kept(self.run_dir, self.keep)
            except OSError as error:
                failure = error if isinstance(error, WriteError) else WriteError(self.run_dir / KEPT, error)
        failed = failure is not None
        if self.ctx.distributed:
            failed = distributed.mean_across_ranks(float(failed), self.ctx) > 0
        if failure is not None:
            raise failure
        if failed:
            raise WriteError(self.run_dir / KEPT, OSError(errno.EIO, "rank 0 could not keep the checkpoint"))

    def restore(self, saved: Checkpoint) -> int:
        """Load the checkpoint whose header is ``saved`` (from ``load_checkpoint(..., with_model=False)``).

        One without optimizer state, loader position or RNG (``s2hc upcycle``'s step 0) restores its weights
        alone: the run starts from them, with a fresh optimizer, at the beginning of the data. The optimizer's
        step counters end up where the optimizer keeps its own (:func:`keep_step_counters_on_host`). ValueError
        when its optimizer state was written by another optimizer than this run's (AdamW's into Muon's, or back)."""
        parts = optimizer_parts(self.optimizer)
        written, used = completed_settings(saved.config)["optimizer"], optimizer_name(self.optimizer)
        if saved.path.endswith(SHARDED):
            if written != used:
                raise ValueError(other_optimizer_refused(str(self.run_dir), written, used))
            state = dict(zip(("model", "optimizer"), get_state_dict(self.model, parts)))
            load_sharded_into(Path(saved.path), state, unused_state=True)
            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, parts, state["optimizer"],
                                     options=_without_unused_state(StateDictOptions()))
        else:
            full = load_checkpoint(saved.path, self.ctx.device, verify=False)  # verified when `saved` was read
            options = StateDictOptions(full_state_dict=True)
            if full.optimizer is None:  # `s2hc upcycle`'s step 0: weights only, the run starts from them
                set_model_state_dict(self.model, full.model, options=options)
            elif written != used:
                raise ValueError(other_optimizer_refused(str(self.run_dir), written, used))
            else:  # the model strictly; the optimizer without state for the parameters that had none (below)
                set_model_state_dict(self.model, full.model, options=options)
                set_optimizer_state_dict(self.model, parts, full.optimizer, options=_without_unused_state(options))
        for part in parts:
            keep_step_counters_on_host(part)
        if saved.loader is not None:  # an upcycled run has not read any data yet: its loader starts at the beginning
            self.loader.load_state_dict(saved.loader)
        if saved.rng is not None and saved.world_size == 1 and self.ctx.world_size == 1:  # per-rank streams
            set_rng_state(saved.rng)  # cannot be split
        self.last_step, self.last_path = saved.step, Path(saved.path)
        return saved.step


def _without_unused_state(options: StateDictOptions) -> StateDictOptions:
    """``options`` for loading an optimizer's state that has none for some parameters: those that never had a
    gradient when it was saved (an s2hc or isometric connection at 2 streams, an orthogonal one at 1, leave some of
    their parameters out of every product), of which the optimizer keeps no state; they get none again, as before
    the save. (torch's default, ``strict``, refuses such a state: "Missing optimizer state".) The model's state
    is loaded strictly, on its own."""
    return dataclasses.replace(options, strict=False)


def keep_step_counters_on_host(optimizer: torch.optim.Optimizer) -> None:
    """Put each parameter's ``step`` counter of ``optimizer``'s state where torch's Adam/AdamW keep a fresh one:
    a CPU scalar of the optimizer's scalar dtype (float32, float64 under a float64 default dtype), unless the
    group is ``capturable`` or ``fused`` (then ``load_state_dict`` has already put it on the parameter's device).

    ``Optimizer.load_state_dict`` leaves a loaded ``step`` on whatever device it was read onto: a checkpoint read
    onto the GPU (``load_checkpoint(path, cuda)``) would leave the counters there, and the foreach update reads
    each one on the host (``bias_correction = 1 - beta ** step.item()``): a device sync per parameter per step."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            plain = isinstance(step, torch.Tensor) and not hasattr(step, "to_local")  # a DTensor is FSDP's to place
            if plain and (step.device.type != "cpu" or step.dtype != dtype):
                state["step"] = step.detach().to("cpu", dtype)


def _tensors(value: Any, name: str):
    """``(name, tensor)`` for every tensor in nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{name}[{index}]")
