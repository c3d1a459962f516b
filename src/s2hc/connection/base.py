"""What every compute path is (docs/design.md section 3): :class:`ComputePath`, the three n-wide operations
a connection runs, and the precision they run in (:func:`_stream_precision`)."""

from __future__ import annotations

import torch


def _stream_precision(x: torch.Tensor):
    """A context in which the stream operations on ``x`` run in ``x``'s dtype: autocast off for its device.

    Autocast would run ``H_res X`` and the projection in bfloat16 and round the whole residual stream at
    every sublayer; only the branch, called outside this context, should see autocast."""
    return torch.autocast(x.device.type, enabled=False)



class ComputePath:
    """How a connection runs its three n-wide operations; :func:`select_path` picks one.

    Shapes: streams ``x`` ``(B, T, n, C)``; ``pre``, ``post`` ``(B, T, n)`` and ``res`` ``(B, T, n, n)`` in
    the coefficient dtype (at least float32); the branch's output ``(B, T, C)``. ``read_mix`` and
    ``write`` return results in the streams' dtype, ``norm_project`` in the coefficient dtype.
    """

    name: str = ""
    #: whether the constraint map runs the family's broadcast form (``Mixer(d_res, fused=True)``)
    fused_mixer: bool = False

    def norm_project(
        self, flat: torch.Tensor, norm_weight: torch.Tensor, projection: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``d = RMSNorm(flat) W``: ``flat`` ``(..., nC)`` (the flattened streams, in their dtype), the norm's
        ``norm_weight`` ``(nC,)`` (or None: no weight) and ``projection`` W ``(nC, K)`` -> ``(..., K)`` in the
        coefficient dtype."""
        raise NotImplementedError

    def read_mix(self, x: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch input ``H_pre X`` ``(B, T, C)`` and the mixed streams ``H_res X`` ``(B, T, n, C)``."""
        raise NotImplementedError

    def write(self, mixed: torch.Tensor, post: torch.Tensor, branch_out: torch.Tensor) -> torch.Tensor:
        """The new streams ``H_res X + H_postᵀ F`` ``(B, T, n, C)`` from ``mixed`` = ``H_res X``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<compute path {self.name!r}>"

