"""Multi-process training on PyTorch's own engine: torchrun, DDP or FSDP2, NCCL on CUDA and Gloo on CPU.

The layout follows torchtitan: the model is built whole on every rank (same seed, so the same weights),
each block is compiled first (:func:`.compiling.compile_blocks`: ``nn.Module.compile``, which keeps parameter
names), then wrapped — FSDP2 ``fully_shard`` on every block and then on the root, or one DDP around the model.
Activation checkpointing (``--activation-checkpointing``) needs nothing of its own here: it sits inside
``Block.forward``, where torchtitan puts it (its checkpoint wrapper goes on the block before ``fully_shard``), so it
composes with all of them (:func:`wrap`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import PARALLEL_MODES
from ..connection.precision import lowers_precision, shard_connections
from ..devices import resolve_device
from . import compiling
from .processes import die_with_parent_env, dies_with_parent


@dataclass(frozen=True)
class Context:
    """Where this process sits: ``rank`` of ``world_size``, its device, and the wrapping in use."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    parallel: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device_name: str, parallel: str) -> Context:
    """Join the process group torchrun describes (if any) and pick this rank's device.

    ``parallel``: ``"auto"`` (DDP when there are several processes, else none), ``"none"``, ``"ddp"`` or
    ``"fsdp"`` (FSDP2; also allowed with one process, for testing the sharded path).
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {list(PARALLEL_MODES)}, got {parallel!r}")
    if not launched_by_torchrun():
        if parallel == "ddp":
            raise ValueError("parallel='ddp' needs several processes: launch with torchrun or `s2hc train --nproc N`")
        device = resolve_device(device_name)
        if parallel == "fsdp":
            _init_group(device, rank=0, world_size=1)
        return Context(device=device, parallel="fsdp" if parallel == "fsdp" else "none")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    _init_group(device, rank, world_size)
    mode = "ddp" if parallel == "auto" else parallel
    if world_size == 1 and mode == "ddp":
        mode = "none"
    return Context(rank, world_size, local_rank, device, mode)


def _init_group(device: torch.device, rank: int, world_size: int) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched_by_torchrun():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # a one-process group for FSDP without torchrun
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: Context, compile_blocks: bool, amp_dtype: torch.dtype | None) -> nn.Module:
    """Compile each block (optionally), then shard (FSDP2) or replicate (DDP); returns what to call forward on.

    The returned module's parameters are the training parameters (DTensors under FSDP2).

    FSDP2 with ``amp_dtype`` bfloat16 (or float16) rounds only the branches' parameters: every connection module is
    a float32 unit of its own (:func:`s2hc.connection.precision.shard_connections`), the blocks (``param_dtype``
    ``amp_dtype``) cast nothing they receive, and the root keeps float32, so the coefficient path computes from
    float32 parameters and the float32 streams are never rounded; the branches run in ``amp_dtype`` under the
    training loop's autocast. Without ``amp_dtype`` nothing is cast.

    Blocks checkpointed by :meth:`s2hc.models.Transformer.set_activation_checkpointing` (before this call, as the
    training loop does) compose with each step, because the checkpoint runs inside ``Block.forward``:
    ``block.compile()`` traces the non-reentrant checkpoint as one region and inductor's partitioner recomputes it
    in the backward pass (the compiled block keeps little but its inputs); FSDP2's hooks on the block (all-gather
    before forward and backward, reduce-scatter after) run once per pass, the recomputation running between the
    pre-backward all-gather and the reduce-scatter with the parameters unsharded; DDP's gradient hooks fire once
    per parameter, since the non-reentrant checkpoint computes each gradient once.
    ``tests/test_activation_checkpointing_train.py`` checks them (and the connections' own ``recompute`` nested
    inside): the same losses and weights as without, the blocks run twice, FSDP2's hooks as often as without.
    """
    if compile_blocks:
        compiling.compile_blocks(model.blocks)
    if ctx.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not lowers_precision(amp_dtype):
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            return model
        # bfloat16 for the branches only (docs/distributed.md, "Mixed precision"): the connections first, each a
        # float32 unit of its own; the blocks cast nothing they receive, so the float32 streams reach the
        # connections unrounded; the root (embedding, final norm, LM head) keeps float32, so the streams start
        # from the exact embedding, as under autocast alone.
        shard_connections(model)
        blocks = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for block in model.blocks:
            fully_shard(block, mp_policy=blocks)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False))
        return model
    if ctx.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, ctx: Context, enabled: bool):
    """Skip the gradient all-reduce on micro-steps that are not the last of an accumulation."""
    if ctx.parallel == "ddp" and not enabled:
        with wrapped.no_sync():
            yield
        return
    if ctx.parallel == "fsdp":
        wrapped.set_requires_gradient_sync(enabled)
    yield


def mean_across_ranks(value: float, ctx: Context) -> float:
    """The mean of a Python float over all ranks (the global batch's loss); the value itself when alone."""
    if not ctx.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor)
    return tensor.item() / ctx.world_size


def sum_across_ranks_(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """``tensor`` (on this rank's device) summed over all ranks in place and returned; ``tensor`` itself when
    alone. Unlike :func:`mean_across_ranks` nothing is read on the host: on NCCL the all-reduce is queued on the
    device like a kernel (no host sync), so a training step can reduce its values and read them later."""
    if ctx.distributed:
        dist.all_reduce(tensor)
    return tensor


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


def launch(nproc: int, argv: list[str]) -> int:
    """Re-run ``s2hc <argv>`` under torchrun with ``nproc`` processes on this node; returns its exit code.

    A launcher that dies with its parent (a run of ``s2hc study``, :mod:`s2hc.train.processes`) becomes torchrun
    instead (``exec``): torchrun then has its pid, its parent-death signal and its process group, so the study's
    signals reach torchrun, which passes them to its workers, and the workers, asked to die with torchrun, go
    with it when the study is killed outright. (A launcher that merely waited would die alone, leaving torchrun
    and its workers running.)"""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "s2hc",
        *argv,
    ]
    if dies_with_parent():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, die_with_parent_env())  # after exec, this pid is torchrun's
    return subprocess.call(command)
