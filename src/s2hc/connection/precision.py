"""FSDP2 mixed precision that keeps what must stay float32 (docs/design.md section 1.6, docs/distributed.md).

Under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` FSDP2 all-gathers every parameter of a sharded module in
bfloat16 and, with ``cast_forward_inputs=True`` (its default), casts the floating tensors a module receives to
bfloat16. Around a multi-stream connection that rounds what s2hc keeps in float32: the connections' parameters (the
coefficient path would run in float32 from bfloat16 values) and the streams a block receives. What fixes both,
shared by s2hc's training harness (:func:`s2hc.train.distributed.wrap`) and the torchtitan integration
(:mod:`s2hc.torchtitan.model`):

- :func:`shard_connections`: every :class:`~s2hc.connection.base.ConnectionModule` of the model (each connection,
  the learned head, the stream scaling) ``fully_shard`` ed first, as an FSDP unit of its own with
  :func:`connection_policy`: its parameters all-gathered in float32 and nothing it receives cast;
- the blocks then sharded with ``cast_forward_inputs=False``, so that the float32 streams reach the connections
  unrounded; the branch still runs in the low precision (under autocast in the harness, from its bfloat16
  parameters in torchtitan, whose blocks cast the branch's input to them).

A connection sharded this way is an FSDP unit nested in its block's: its hooks sit inside the block's forward, which
``torch.compile`` with ``fullgraph=True`` refuses (FSDP2's hooks are excluded from dynamo); a block compiled without
``fullgraph`` breaks its graph at each connection instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import ConnectionModule

__all__ = ["connection_modules", "connection_policy", "lowers_precision", "shard_connections"]


def connection_policy():
    """The ``MixedPrecisionPolicy`` of a connection's own FSDP unit: parameters all-gathered and gradients reduced
    in float32, the streams and branch it receives left as they are (``cast_forward_inputs=False``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def lowers_precision(param_dtype: torch.dtype | None) -> bool:
    """Whether an FSDP2 ``param_dtype`` rounds parameters below float32 (bfloat16, float16): then the connections
    need :func:`shard_connections`."""
    return param_dtype is not None and torch.finfo(param_dtype).bits < 32


def connection_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost :class:`~s2hc.connection.base.ConnectionModule` s of ``model`` that hold parameters, in module
    order (a connection module inside another is sharded with it)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, ConnectionModule) or next(module.parameters(), None) is None:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return [module for _, module in found]


def shard_connections(model: nn.Module, **options: Any) -> list[nn.Module]:
    """``fully_shard`` every connection module of ``model`` (:func:`connection_modules`) with
    :func:`connection_policy`, before the blocks that hold them are sharded; ``options`` go to ``fully_shard``
    (``mesh``, ``reshard_after_forward``, ``offload_policy``). Returns the modules sharded."""
    from torch.distributed.fsdp import fully_shard

    modules = connection_modules(model)
    for module in modules:
        fully_shard(module, mp_policy=connection_policy(), **options)
    return modules
