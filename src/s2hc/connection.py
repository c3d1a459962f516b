"""The hyper-connection around one branch (attention or MLP), and the stream expansion / reduction.

Per token, with streams ``X ∈ R^{n×C}`` (DESIGN.md section 1)::

    x̃ = RMSNorm(vec(X));  d = x̃ W  (W zero-initialised, nC × (2n + K))
    H_pre = gate(α_pre d_pre + b_pre);  H_post = 2·gate(α_post d_post + b_post);  H_res = M(d_res)
    X' = H_res X + H_postᵀ F(H_pre X)

The coefficient path (norm, projection, gates, constraint map) runs in at least float32 whatever the
model's dtype; the three matrices are cast back to the stream dtype for the mixing itself.

Two implementations of the same equations (``tests/test_fastpath.py`` checks they agree, values and
gradients): the reference (``fused=False``: ``F.rms_norm``, a projection of the normed features, the
family's :meth:`~s2hc.mixers.Mixer.mix`, einsum read and write) and the fast path (``fused=True``, the
default): the RMSNorm weight folded into the projection (``d = r · X (diag(w) W)``, ``r = 1/rms(X)``, so
no normed n·C-wide copy is written or stored), under ``torch.compile`` the family's ``mix_fused`` (no
batched tiny matrix products, so inductor fuses the constraint map), and the read ``H_pre X`` and mixing ``H_res X`` in one autograd function that stores only
``X`` and the matrices (eager), or as broadcast multiply-adds that ``torch.compile`` fuses into one
pass over ``X`` (compiled). ``kernels="triton"`` runs the fast path's three n-wide passes (norm and
projection, read and mix, write) as Triton kernels (:mod:`s2hc.triton_kernels`) on CUDA, or on CPU under
``TRITON_INTERPRET=1``. Measurements: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import mixers
from .checks import check_int
from .mixers import RESIDUAL, check_family, families
from .mixers.base import coefficient_dtype, scale_parameter

KERNELS = ("torch", "triton")
COMPUTE_OPTIONS = ("fused", "recompute", "kernels")  # how a connection computes, not what: HyperConnection.set_options


def expand_streams(h: torch.Tensor, n_streams: int) -> torch.Tensor:
    """Copy hidden states ``h`` ``(B, T, C)`` into ``n_streams`` streams ``(B, T, n, C)`` (after the embedding)."""
    check_int("n_streams", n_streams)
    if h.dim() != 3:
        raise ValueError(f"h must have shape (batch, time, dim), got shape {tuple(h.shape)}")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n_streams, h.shape[-1]).contiguous()


class _NormProject(torch.autograd.Function):
    """``d = RMSNorm(x) W`` with the norm's weight folded into ``weight`` ``(D, K)``: ``d = r · (x @ weight)``.

    Eager fast path of the coefficient projection. ``r = 1/rms(x)`` comes from one reduction pass; the
    backward is one GEMM and one in-place multiply-add over ``x`` (``dx = r dd Wᵀ − (r³/D)(dd · xW) x``),
    where autograd through the unfused form writes several D-wide temporaries. Saves ``x`` (a view of
    the streams, alive anyway), ``r`` and ``x @ weight`` (K per token).
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
        if ctx.needs_input_grad[1]:
            grad_weight = x.reshape(-1, x.shape[-1]).T @ grad_raw.reshape(-1, grad_raw.shape[-1])
        return grad_x, grad_weight, None


def norm_project(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) @ W`` for ``x`` ``(..., D)`` and ``weight = diag(norm weight) W`` ``(D, K)``: ``(..., K)``.

    Eager: :class:`_NormProject`; under ``torch.compile`` the plain formula, which inductor fuses.
    """
    if torch.compiler.is_compiling():
        return (x @ weight) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return _NormProject.apply(x, weight, eps)


class _ReadMix(torch.autograd.Function):
    """``(H_pre X, H_res X)`` for streams ``x`` ``(..., n, C)`` and ``pre`` ``(..., n)``, ``res`` ``(..., n, n)``.

    Eager fast path of the read and the mixing. Autograd through einsum would save permuted copies
    and run per-matrix GEMMs in backward; this saves only ``x`` (kept alive by the previous layer
    anyway) and the small matrices, and its backward is two batched products:
    ``dX = H_resᵀ dM + H_preᵀ dh`` and ``[dH_pre; dH_res] = [dh; dM] Xᵀ``.
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


def read_and_mix(x: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's ``(H_pre X (..., C), H_res X (..., n, C))`` for ``x`` ``(..., n, C)``, in x's dtype.

    Eager: :class:`_ReadMix`. Under ``torch.compile``: n broadcast multiply-adds over C per output,
    which inductor fuses into one loop over ``x`` (a batched GEMM would stay an opaque library call).
    """
    pre, res = pre.to(x.dtype), res.to(x.dtype)
    if torch.compiler.is_compiling():
        h = (pre.unsqueeze(-1) * x).sum(-2)
        mixed = (res.unsqueeze(-1) * x.unsqueeze(-3)).sum(-2)
        return h, mixed
    return _ReadMix.apply(x, pre, res)


def set_connection_options(model: nn.Module, **options: Any) -> nn.Module:
    """:meth:`HyperConnection.set_options` (``fused``, ``recompute``, ``kernels``) on every mixing connection
    of ``model``; returns ``model``. How the connections compute is not part of a model's configuration:
    a checkpoint trained with ``kernels="triton"`` on a GPU loads and runs anywhere."""
    unknown = sorted(set(options) - set(COMPUTE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown connection options {unknown}; allowed: {list(COMPUTE_OPTIONS)}")
    for module in model.modules():
        if isinstance(module, HyperConnection) and not module.is_residual:
            module.set_options(**options)
    return model


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """Sum streams ``x`` ``(B, T, n, C)`` into ``(B, T, C)`` (before the final norm)."""
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, time, n_streams, dim), got shape {tuple(x.shape)}")
    return x.sum(dim=-2)


class HyperConnection(nn.Module):
    """A multi-stream residual connection around a branch, with the stream-mixing family ``family``.

    Args:
        dim: width C of one stream (the branch's input and output width).
        n_streams: number of streams n (1 for ``family="residual"``).
        family: ``"residual"`` (plain ``x + F(x)``) or a family from :func:`s2hc.mixers.available`.
        layer_index: index of the wrapped sublayer; the read/write gates start favouring stream
            ``layer_index mod n``.
        eps: epsilon of the RMSNorm over all n·C features.
        fused: the fast path (default) or, with False, the reference implementation; both compute the
            same function (see the module docstring).
        recompute: recompute the coefficient path (norm, projection, gates, constraint map) in backward
            instead of storing its intermediates (``torch.utils.checkpoint``, non-reentrant). Costs one
            more coefficient pass; see ``docs/benchmarks.md`` for what it saves.
        kernels: ``"torch"`` (default) or ``"triton"``: the fast path's n-wide passes as Triton kernels
            (needs ``fused=True`` and the ``triton`` package; CUDA tensors, or CPU under
            ``TRITON_INTERPRET=1``). Under ``torch.compile`` the PyTorch forms run, which inductor fuses.
        **family_options: passed to the family (e.g. ``iterations`` for ``mhc``, ``rotation`` for ``s2hc``).

    ``forward(x, branch, *args, **kwargs)``: ``x`` ``(B, T, n, C)``, ``branch`` any callable
    ``(B, T, C) -> (B, T, C)`` called as ``branch(h, *args, **kwargs)``; returns ``(B, T, n, C)`` in x's dtype.
    """

    def __init__(
        self,
        dim: int,
        n_streams: int,
        family: str = "s2hc",
        layer_index: int = 0,
        eps: float = 1e-6,
        fused: bool = True,
        recompute: bool = False,
        kernels: str = "torch",
        **family_options: Any,
    ):
        super().__init__()
        check_int("dim", dim)
        check_int("n_streams", n_streams)
        check_int("layer_index", layer_index, minimum=0)
        check_family(family)
        self.dim, self.n_streams, self.family, self.layer_index, self.eps = dim, n_streams, family, layer_index, eps
        self.fused, self.recompute, self.kernels = True, False, "torch"
        self.set_options(fused=fused, recompute=recompute, kernels=kernels)
        if family == RESIDUAL:
            if n_streams != 1:
                raise ValueError(f"n_streams must be 1 for family='residual', got {n_streams}")
            if family_options:
                raise ValueError(f"family='residual' takes no options, got {sorted(family_options)}")
            self.mixer = None
            return
        self.mixer = mixers.build(family, n_streams, **family_options)
        n, width = n_streams, n_streams * dim
        self.norm_weight = nn.Parameter(torch.ones(width))
        self.projection = nn.Parameter(torch.zeros(width, 2 * n + self.mixer.num_inputs))
        self.alpha_pre = scale_parameter(0.01)
        self.alpha_post = scale_parameter(0.01)
        if self.mixer.gate == "tanh":  # HC: read one stream, write to all
            b_pre, b_post = torch.zeros(n), torch.ones(n)
            b_pre[layer_index % n] = 1.0
        else:  # mHC and after: sigmoid gates, bias −1 except +1 at the favoured stream
            b_pre = torch.full((n,), -1.0)
            b_pre[layer_index % n] = 1.0
            b_post = b_pre.clone()
        self.bias_pre = nn.Parameter(b_pre)
        self.bias_post = nn.Parameter(b_post)

    @property
    def is_residual(self) -> bool:
        return self.mixer is None

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        """Change how the connection computes (not what): ``fused``, ``recompute``, ``kernels`` as in the
        constructor; ``None`` keeps the current value. Checked together, so a bad combination changes nothing."""
        fused = self.fused if fused is None else fused
        recompute = self.recompute if recompute is None else recompute
        kernels = self.kernels if kernels is None else kernels
        for name, value in (("fused", fused), ("recompute", recompute)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
        if kernels == "triton" and self.family != RESIDUAL:
            if not fused:
                raise ValueError("kernels='triton' implements the fast path; it needs fused=True, got fused=False")
            if importlib.util.find_spec("triton") is None:
                raise ImportError("kernels='triton' needs the triton package (pip install 's2hc[triton]')")
        self.fused, self.recompute, self.kernels = fused, recompute, kernels
        return self

    def _triton(self, x: torch.Tensor):
        """The kernels module when this call runs the Triton path, else None."""
        if self.kernels != "triton" or torch.compiler.is_compiling():
            return None
        from . import triton_kernels

        if x.device.type != "cuda" and not triton_kernels.interpreted():
            raise ValueError(
                f"kernels='triton' runs on CUDA tensors, or on CPU with TRITON_INTERPRET=1 set before triton is "
                f"imported; got x on device {x.device.type!r}"
            )
        return triton_kernels

    def _check_streams(self, x: torch.Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(f"x must have shape (batch, time, n_streams, dim), got shape {tuple(x.shape)}")
        if x.shape[-2:] != (self.n_streams, self.dim):
            raise ValueError(
                f"x must have n_streams={self.n_streams} and dim={self.dim} in its last two dimensions, "
                f"got shape {tuple(x.shape)}"
            )

    def _call_branch(self, branch, h: torch.Tensor, args, kwargs) -> torch.Tensor:
        out = branch(h, *args, **kwargs)
        if out.shape != h.shape:
            raise ValueError(f"branch must return the shape it was given, {tuple(h.shape)}, got {tuple(out.shape)}")
        return out

    def matrices(self, x: torch.Tensor, fused: bool | None = None) -> dict[str, torch.Tensor]:
        """The per-token matrices for streams ``x`` ``(B, T, n, C)``, in at least float32.

        Returns ``pre`` ``(B, T, n)``, ``post`` ``(B, T, n)`` and ``res`` ``(B, T, n, n)``.
        ``fused`` (default: the module's setting) picks the fast or the reference implementation.
        """
        self._check_streams(x)
        dtype = coefficient_dtype(x.dtype)
        if self.is_residual:
            ones = torch.ones(*x.shape[:2], 1, dtype=dtype, device=x.device)
            return {"pre": ones, "post": ones, "res": ones.unsqueeze(-1)}
        fused = self.fused if fused is None else fused
        pre, post, res = self._coefficients(x, fused)
        return {"pre": pre, "post": post, "res": res}

    def _coefficients(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = coefficient_dtype(x.dtype)
        kernels = self._triton(x) if fused else None
        flat = x.flatten(-2) if kernels is not None else x.flatten(-2).to(dtype)  # the kernel reads any dtype
        if fused:  # RMSNorm(X) W = r · X (diag(w) W): the normed features are never materialised
            weight = self.norm_weight.to(dtype).unsqueeze(-1) * self.projection.to(dtype)
            d = (kernels.norm_project if kernels is not None else norm_project)(flat, weight, self.eps)
        else:
            normed = F.rms_norm(flat, (flat.shape[-1],), self.norm_weight.to(dtype), self.eps)
            d = normed @ self.projection.to(dtype)
        n = self.n_streams
        d_pre, d_post, d_res = d.split([n, n, self.mixer.num_inputs], dim=-1)
        alpha_pre, alpha_post = self.alpha_pre.to(dtype), self.alpha_post.to(dtype)
        bias_pre, bias_post = self.bias_pre.to(dtype), self.bias_post.to(dtype)
        if self.mixer.gate == "tanh":  # HC: b + α·tanh(d)
            pre = bias_pre + alpha_pre * torch.tanh(d_pre)
            post = bias_post + alpha_post * torch.tanh(d_post)
        else:
            pre = torch.sigmoid(alpha_pre * d_pre + bias_pre)
            post = 2.0 * torch.sigmoid(alpha_post * d_post + bias_post)
        # The families' broadcast forms (mix_fused) fuse under torch.compile (s2hc n = 4: 4.0 ms against
        # 18.9 ms compiled from the batched-GEMM form, 2 048 tokens); in eager the batched GEMMs are faster
        # on one thread (7.6 ms against 21 ms), so eager keeps them (docs/benchmarks.md).
        return pre, post, self.mixer(d_res, fused=fused and torch.compiler.is_compiling())

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        self._check_streams(x)
        if self.is_residual:
            return x + self._call_branch(branch, x.squeeze(-2), args, kwargs).unsqueeze(-2)
        if self.recompute and torch.is_grad_enabled():
            pre, post, res = checkpoint(self._coefficients, x, self.fused, use_reentrant=False)
        else:
            pre, post, res = self._coefficients(x, self.fused)
        if not self.fused:
            h = {"pre": pre, "post": post, "res": res}
            return self.write(x, h, self._call_branch(branch, self.read(x, h), args, kwargs))
        kernels = self._triton(x)
        if kernels is not None:
            branch_in, mixed = kernels.read_mix(x, pre, res)
            return kernels.write(mixed, post, self._call_branch(branch, branch_in, args, kwargs))
        branch_in, mixed = read_and_mix(x, pre, res)
        branch_out = self._call_branch(branch, branch_in, args, kwargs)
        return torch.addcmul(mixed, post.to(x.dtype).unsqueeze(-1), branch_out.unsqueeze(-2))

    @staticmethod
    def read(x: torch.Tensor, h: dict[str, torch.Tensor]) -> torch.Tensor:
        """Branch input ``H_pre X``: streams ``(B, T, n, C)`` -> ``(B, T, C)``, in x's dtype."""
        return torch.einsum("btn,btnc->btc", h["pre"].to(x.dtype), x)

    @staticmethod
    def write(x: torch.Tensor, h: dict[str, torch.Tensor], branch_out: torch.Tensor) -> torch.Tensor:
        """New streams ``H_res X + H_postᵀ F``: ``x`` ``(B, T, n, C)``, ``branch_out`` ``(B, T, C)`` -> ``(B, T, n, C)``."""
        res, post = h["res"].to(x.dtype), h["post"].to(x.dtype)
        return torch.einsum("btij,btjc->btic", res, x) + post.unsqueeze(-1) * branch_out.unsqueeze(-2)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, n_streams={self.n_streams}, family={self.family!r}, layer_index={self.layer_index}"
        if not self.is_residual:
            text += f", fused={self.fused}" + (", recompute=True" if self.recompute else "")
            text += ", kernels='triton'" if self.kernels == "triton" else ""
        return text
