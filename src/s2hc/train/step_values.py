"""What each training step measures, kept on the device and read on the host only when the loop needs it.

Reading a CUDA tensor on the host (``loss.item()``, ``float(norm)``, ``bool(torch.isfinite(t))``) makes the host
wait until the device has run everything queued before it: done every step, the host never gets ahead of the
device, and every step pays for the launch gaps. :class:`PendingSteps` keeps what each step measured (its loss,
its gradient norm, the largest magnitude of its updated weights) as device tensors and reads all the steps taken
since the last read in one transfer (under torchrun after one all-reduce, also queued on the device) when the
loop needs their values: at a ``log_every`` step, before an evaluation, diagnostics or a checkpoint, and at the
end of a run. That read is the only host sync of those steps on CUDA.

So a non-finite step is seen at the next read, up to ``log_every`` steps after it, while the steps in between
run on (on non-finite weights). Each step keeps its own values, so the first non-finite one is still named
exactly, and since a read comes before every checkpoint, none of them is ever saved.

Step times follow from the reads: without a sync per step the host's time per step says nothing about the
device's on CUDA (the host runs ahead), so each read step gets the wall time of its interval (from the start of
the first step after the previous read to the end of this read, which waits for the device) divided by the
number of steps in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import distributed


@dataclass(frozen=True)
class StepValues:
    """One step as read.

    ``step``: the step's number (1-based: the count of steps after it); ``lr``: its learning rate; ``loss``: its
    training loss, the mean over its micro-steps and over the ranks; ``grad_norm``: its gradient norm before
    clipping (this rank's, the same on every rank); ``weights_finite``: whether this rank's weights (its shards)
    were all finite after its update, ``ranks_finite`` whether every rank's were; ``seconds``: the wall time per
    step of the interval it was read in (see the module)."""

    step: int
    lr: float
    loss: float
    grad_norm: float
    weights_finite: bool
    ranks_finite: bool
    seconds: float


class PendingSteps:
    """The steps taken since the last read, their values still on the device (see the module).

    Per step: :meth:`start` as it begins, :meth:`add` once its update is done; :meth:`read` (on every rank, since
    it all-reduces under torchrun) returns the :class:`StepValues` of the steps added since the last read, in
    order, and forgets them."""

    def __init__(self, ctx: distributed.Context):
        self.ctx = ctx
        self._steps: list[tuple[int, float]] = []  # (step, learning rate)
        self._losses: list[torch.Tensor] = []  # 0-dim float64: the mean over micro-steps, this rank's
        self._grad_norms: list[torch.Tensor] = []  # 0-dim
        self._weights: list[torch.Tensor] = []  # 0-dim: the largest |weight| after the update, this rank's shards
        self._started: float | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def start(self) -> None:
        """A step begins: the clock of the interval starts with the first step after a read."""
        if self._started is None:
            self._started = time.perf_counter()

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor, weights: torch.Tensor) -> None:
        """Step ``step`` (with learning rate ``lr``) measured, as 0-dim tensors on the device: ``loss``, this
        rank's mean over micro-steps (float64 keeps the sum exact as the host summed it); ``grad_norm``; ``weights``,
        the largest magnitude of this rank's updated weights (not finite exactly when one of them is not).
        Nothing is read."""
        self._steps.append((step, lr))
        self._losses.append(loss.detach())
        self._grad_norms.append(grad_norm.detach())
        self._weights.append(weights.detach())

    def read(self) -> list[StepValues]:
        """The values of the steps added since the last read, in order (empty when there are none): one
        all-reduce under torchrun (the losses' sum and the count of ranks with non-finite weights), then one
        device-to-host transfer of a ``(steps, 4)`` table."""
        if not self._steps:
            return []
        loss = torch.stack(self._losses).to(torch.float64)
        grad_norm = torch.stack(self._grad_norms).to(loss.device, torch.float64)
        weights_bad = ~torch.isfinite(torch.stack(self._weights).to(loss.device))
        shared = distributed.sum_across_ranks_(torch.stack([loss, weights_bad.to(torch.float64)], dim=1), self.ctx)
        table = torch.stack([shared[:, 0] / self.ctx.world_size, grad_norm, weights_bad.to(torch.float64),
                             shared[:, 1]], dim=1)
        rows = table.tolist()  # the one transfer (and, on CUDA, the one sync) of these steps
        seconds = (time.perf_counter() - self._started) / len(rows)
        steps = self._steps
        self._steps, self._losses, self._grad_norms, self._weights, self._started = [], [], [], [], None
        return [StepValues(step=step, lr=lr, loss=mean, grad_norm=norm, weights_finite=not bad, ranks_finite=not ranks,
                           seconds=seconds)
                for (step, lr), (mean, norm, bad, ranks) in zip(steps, rows, strict=True)]
