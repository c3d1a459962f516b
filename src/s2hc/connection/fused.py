"""The fast compute paths (``fused=True``, docs/design.md section 3): ``eager`` with its hand-written
autograd functions (:class:`_NormProject`, :class:`_ReadMix`), ``compiled`` for ``torch.compile``, and
``triton`` over the kernels of :mod:`s2hc.connection.kernels` (given to it, so that importing this module
does not import triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mixers.base import coefficient_dtype
from .base import ComputePath

# ------------------------------------------------------------------- the eager fast path's autograd functions


class _NormProject(torch.autograd.Function):
    """``d = RMSNorm(x) W`` with the norm's weight folded into ``weight`` ``(D, K)``: ``d = r · (x @ weight)``.

    ``r = 1/rms(x)`` comes from one reduction pass; the backward is one GEMM and one in-place
    multiply-add over ``x`` (``dx = r dd Wᵀ − (r³/D)(dd · xW) x``), where autograd through the unfused
    form writes several D-wide temporaries. Saves ``x`` (a view of the streams, alive anyway), ``r`` and
    ``x @ weight`` (K per token).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        inv_rms = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)
        raw = x @ weight
        ctx.save_for_backward(x, weight, inv_rms, raw)
        return raw * inv_rms

    @staticmethod
    def backward(ctx, grad_d):
        x, weight, inv_rms, raw = ctx.saved_tensors
        grad_raw = grad_d * inv_rms  # (..., K)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            coeff = -(grad_d * raw).sum(-1, keepdim=True) * inv_rms.pow(3) / x.shape[-1]
            grad_x = torch.addcmul(grad_raw @ weight.T, coeff, x)
        if ctx.needs_input_grad[1]:  # (ddᵀ X)ᵀ: for a skinny dd this layout runs ~1.6x faster than Xᵀ dd (6b)
            grad_weight = (grad_raw.reshape(-1, grad_raw.shape[-1]).T @ x.reshape(-1, x.shape[-1])).T
        return grad_x, grad_weight, None


class _ReadMix(torch.autograd.Function):
    """``(H_pre X, H_res X)`` for streams ``x`` ``(..., n, C)`` and ``pre`` ``(..., n)``, ``res`` ``(..., n, n)``.

    Autograd through einsum would save permuted copies and run per-matrix GEMMs in backward; this saves
    only ``x`` (kept alive by the previous layer anyway) and the small matrices, and its backward is two
    batched products: ``dX = H_resᵀ dM + H_preᵀ dh`` and ``[dH_pre; dH_res] = [dh; dM] Xᵀ``.
    """

    @staticmethod
    def forward(ctx, x, pre, res):
        ctx.save_for_backward(x, pre, res)
        h = torch.matmul(pre.unsqueeze(-2), x).squeeze(-2)
        return h, torch.matmul(res, x)

    @staticmethod
    def backward(ctx, grad_h, grad_m):
        x, pre, res = ctx.saved_tensors
        rows = torch.cat((pre.unsqueeze(-2), res), dim=-2)  # (..., n+1, n)
        grads = torch.cat((grad_h.unsqueeze(-2), grad_m), dim=-2)  # (..., n+1, C)
        grad_x = torch.matmul(rows.transpose(-1, -2).contiguous(), grads) if ctx.needs_input_grad[0] else None
        grad_rows = torch.matmul(grads, x.transpose(-1, -2)) if any(ctx.needs_input_grad[1:]) else None
        if grad_rows is None:
            return grad_x, None, None
        return grad_x, grad_rows[..., 0, :], grad_rows[..., 1:, :]



# ---------------------------------------------------------------------------------------- compute paths


def _folded_weight(norm_weight: torch.Tensor | None, projection: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``diag(w) W`` ``(nC, K)`` in ``dtype``: ``RMSNorm(X) W = r · X (diag(w) W)``, so the fast paths never
    write (or store for backward) the normed n·C-wide features. ``norm_weight=None`` (a norm without a weight,
    DeepSeek-V4's mHC): ``W`` itself."""
    if norm_weight is None:
        return projection.to(dtype)
    return norm_weight.to(dtype).unsqueeze(-1) * projection.to(dtype)



class EagerPath(ComputePath):
    """``fused=True`` outside ``torch.compile``: hand-written backward passes (:class:`_NormProject`,
    :class:`_ReadMix`) that store only ``X`` and per-token vectors, and the family's ``mix``: without a
    compiler each broadcast operation is its own pass over memory, where a batched GEMM is one call."""

    name = "eager"
    fused_mixer = False

    def norm_project(self, flat, norm_weight, projection, eps):
        dtype = coefficient_dtype(flat.dtype)
        return _NormProject.apply(flat.to(dtype), _folded_weight(norm_weight, projection, dtype), eps)

    def read_mix(self, x, pre, res):
        return _ReadMix.apply(x, pre.to(x.dtype), res.to(x.dtype))

    def write(self, mixed, post, branch_out):
        return torch.addcmul(mixed, post.to(mixed.dtype).unsqueeze(-1), branch_out.to(mixed.dtype).unsqueeze(-2))


class CompiledPath(EagerPath):
    """``fused=True`` under ``torch.compile``: the fold, read and mixing as plain broadcast multiply-adds
    (n per output over C) and the family's ``mix_fused``. Inductor fuses these, with the write's
    ``addcmul``, into a few loops over ``X``; an autograd function or a batched GEMM would stay an opaque
    call between fused kernels."""

    name = "compiled"
    fused_mixer = True

    def norm_project(self, flat, norm_weight, projection, eps):
        dtype = coefficient_dtype(flat.dtype)
        flat = flat.to(dtype)
        # W held column-major (a transposed view of a (K, nC) buffer): autograd then forms dW as (ddᵀ X)ᵀ,
        # which MKL runs ~1.6x faster than Xᵀ dd for K = 17 columns (docs/benchmarks.md 6b).
        weight = _folded_weight(norm_weight, projection, dtype).mT.contiguous().mT
        return (flat @ weight) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)

    def read_mix(self, x, pre, res):
        pre, res = pre.to(x.dtype), res.to(x.dtype)
        h = (pre.unsqueeze(-1) * x).sum(-2)
        mixed = (res.unsqueeze(-1) * x.unsqueeze(-3)).sum(-2)
        return h, mixed


class _Mixing(NamedTuple):
    """What the Triton path's write needs for ``H_res X``: it mixes there, reading the streams again."""

    x: torch.Tensor
    res: torch.Tensor


class TritonPath(ComputePath):
    """``fused=True, kernels="triton"`` outside ``torch.compile``: :mod:`s2hc.connection.kernels`, one pass
    over ``X`` per operation, forward and backward. The kernels read the streams in any dtype and accumulate
    in float32, so nothing is cast first. The read writes only ``H_pre X``: the write mixes (``H_res X`` is never
    stored). The instance of one call (:meth:`for_call`) holds a :class:`~s2hc.connection.kernels.Link`, so that
    the call's backward writes one ``dX`` (and ``dW`` in the same pass). The constraint map (tens of floats per
    token) stays in PyTorch."""

    name = "triton"
    fused_mixer = False

    def __init__(self, kernels, link=None):
        self.kernels, self.link = kernels, link

    def for_call(self) -> TritonPath:
        return TritonPath(self.kernels, self.kernels.Link())

    def norm_project(self, flat, norm_weight, projection, eps):
        weight = _folded_weight(norm_weight, projection, coefficient_dtype(flat.dtype))
        return self.kernels.norm_project(flat, weight, eps, self.link)

    def read_mix(self, x, pre, res):
        return self.kernels.read(x, pre, self.link), _Mixing(x, res)

    def write(self, mixed, post, branch_out):
        return self.kernels.write(mixed.x, mixed.res, post, branch_out, self.link)
