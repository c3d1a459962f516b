"""The ``reference`` compute path (docs/design.md section 3): the equations as written."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mixers.base import coefficient_dtype
from .base import ComputePath


class ReferencePath(ComputePath):
    """``fused=False``: the equations as written (``F.rms_norm``, the projection, einsum read and mixing,
    the family's batched-matrix ``mix``), to check the other paths against."""

    name = "reference"
    fused_mixer = False

    def norm_project(self, flat, norm_weight, projection, eps):
        dtype = coefficient_dtype(flat.dtype)
        flat = flat.to(dtype)
        weight = None if norm_weight is None else norm_weight.to(dtype)
        normed = F.rms_norm(flat, (flat.shape[-1],), weight, eps)
        return normed @ projection.to(dtype)

    def read_mix(self, x, pre, res):
        h = torch.einsum("btn,btnc->btc", pre.to(x.dtype), x)
        return h, torch.einsum("btij,btjc->btic", res.to(x.dtype), x)

    def write(self, mixed, post, branch_out):
        return mixed + post.to(mixed.dtype).unsqueeze(-1) * branch_out.to(mixed.dtype).unsqueeze(-2)

