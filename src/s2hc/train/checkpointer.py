"""What a training checkpoint holds and how it is put back: model, optimizer, data position, RNG and step.

:class:`Checkpointer` is the training side of :mod:`s2hc.rundir.checkpoint` (which owns the file formats):
it collects the state of a run through ``torch.distributed.checkpoint.state_dict`` (so a DDP-, FSDP2- or
un-wrapped model saves the same names), writes one file with one process and shards with several or
under FSDP, and restores either into the current wrapping, resharding when the process count changed.
Nothing is written unless every tensor of the state is finite (:class:`~s2hc.rundir.checkpoint.NonFiniteError`
otherwise, on every rank).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..rundir.checkpoint import (
    NonFiniteError,
    load_checkpoint,
    load_sharded_into,
    save_checkpoint,
    save_sharded_checkpoint,
)
from ..rundir.layout import CHECKPOINT, SHARDED
from ..rundir.schema import Checkpoint
from . import distributed


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

    ``save(checkpoint)`` writes a :class:`~s2hc.rundir.schema.Checkpoint` (configs, step, history) with the
    model, the optimizer, the data loader's position and every RNG filled in; ``restore(saved)`` puts one read
    by :func:`~s2hc.rundir.checkpoint.load_checkpoint` back and returns its step. Collective under
    ``torch.distributed``: every rank calls both. ``last_step`` and ``last_path``: the checkpoint of this run
    written or restored last (None before the first), the one a failed run keeps.
    """

    def __init__(self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader,
                 ctx: distributed.Context):
        self.run_dir, self.model, self.optimizer, self.loader, self.ctx = Path(run_dir), model, optimizer, loader, ctx
        self.sharded = ctx.distributed or ctx.parallel == "fsdp"
        self.last_step: int | None = None
        self.last_path: Path | None = None

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

    def save(self, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` with this run's training state: NonFiniteError (nothing written) when the state
        is not finite, :class:`~s2hc.io.WriteError` (the previous checkpoint kept) when the disk refuses it."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        checkpoint = dataclasses.replace(checkpoint, loader=self.loader.state_dict(), rng=rng_state(),
                                         world_size=self.ctx.world_size)
        if self.sharded:
            self._check_finite({"model": model_state, "optimizer": optimizer_state})
            path = self.run_dir / SHARDED
            save_sharded_checkpoint(path, {"model": model_state, "optimizer": optimizer_state},
                                    checkpoint, is_main=self.ctx.is_main, barrier=lambda: distributed.barrier(self.ctx))
        else:  # save_checkpoint checks finiteness itself, in the pass that computes the checksum
            path = self.run_dir / CHECKPOINT
            save_checkpoint(path, dataclasses.replace(checkpoint, model=model_state, optimizer=optimizer_state))
        self.last_step, self.last_path = checkpoint.step, path
        if self.ctx.is_main:  # the other kind, if a run changed its process count, is older now
            stale = self.run_dir / (CHECKPOINT if self.sharded else SHARDED)
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)

    def restore(self, saved: Checkpoint) -> int:
        """Load the checkpoint whose header is ``saved`` (from ``load_checkpoint(..., with_model=False)``).

        One without optimizer state, loader position or RNG (``s2hc upcycle``'s step 0) restores its weights
        alone: the run starts from them, with a fresh optimizer, at the beginning of the data."""
        if saved.path.endswith(SHARDED):
            state = dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer)))
            load_sharded_into(Path(saved.path), state)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            full = load_checkpoint(saved.path, self.ctx.device, verify=False)  # verified when `saved` was read
            options = StateDictOptions(full_state_dict=True)
            if full.optimizer is None:  # `s2hc upcycle`'s step 0: weights only, the run starts from them
                set_model_state_dict(self.model, full.model, options=options)
            else:
                set_state_dict(self.model, self.optimizer, model_state_dict=full.model,
                               optim_state_dict=full.optimizer, options=options)
        if saved.loader is not None:  # an upcycled run has not read any data yet: its loader starts at the beginning
            self.loader.load_state_dict(saved.loader)
        if saved.rng is not None and saved.world_size == 1 and self.ctx.world_size == 1:  # per-rank streams
            set_rng_state(saved.rng)  # cannot be split
        self.last_step, self.last_path = saved.step, Path(saved.path)
        return saved.step


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
