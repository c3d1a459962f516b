"""The hyper-connection around one branch (attention or MLP), and the stream expansion / reduction.

Per token, with streams ``X ∈ R^{n×C}`` (DESIGN.md section 1)::

    x̃ = RMSNorm(vec(X));  d = x̃ W  (W zero-initialised, nC × (2n + K))
    H_pre = gate(α_pre d_pre + b_pre);  H_post = 2·gate(α_post d_post + b_post);  H_res = M(d_res)
    X' = H_res X + H_postᵀ F(H_pre X)

The coefficient path (norm, projection, gates, constraint map) runs in at least float32 whatever the
model's dtype; the three matrices are cast back to the stream dtype for the mixing itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import mixers
from .mixers.base import coefficient_dtype, scale_parameter

RESIDUAL = "residual"


def methods() -> list[str]:
    """Every name ``HyperConnection(mixer=...)`` accepts: ``"residual"`` and the mixing families."""
    return [RESIDUAL, *mixers.available()]


def expand_streams(h: torch.Tensor, n_streams: int) -> torch.Tensor:
    """Copy hidden states ``h`` ``(B, T, C)`` into ``n_streams`` streams ``(B, T, n, C)`` (after the embedding)."""
    if not isinstance(n_streams, int) or isinstance(n_streams, bool) or n_streams < 1:
        raise ValueError(f"n_streams must be an integer >= 1, got {n_streams!r}")
    if h.dim() != 3:
        raise ValueError(f"h must have shape (batch, time, dim), got shape {tuple(h.shape)}")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n_streams, h.shape[-1]).contiguous()


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """Sum streams ``x`` ``(B, T, n, C)`` into ``(B, T, C)`` (before the final norm)."""
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, time, n_streams, dim), got shape {tuple(x.shape)}")
    return x.sum(dim=-2)


class HyperConnection(nn.Module):
    """A multi-stream residual connection around a branch, with the stream-mixing family ``mixer``.

    Args:
        dim: width C of one stream (the branch's input and output width).
        n_streams: number of streams n (1 for ``mixer="residual"``).
        mixer: ``"residual"`` (plain ``x + F(x)``) or a family from :func:`s2hc.mixers.available`.
        layer_index: index of the wrapped sublayer; the read/write gates start favouring stream
            ``layer_index mod n``.
        eps: epsilon of the RMSNorm over all n·C features.
        **mixer_options: passed to the family (e.g. ``iterations`` for ``mhc``, ``rotation`` for ``s2hc``).

    ``forward(x, branch, *args, **kwargs)``: ``x`` ``(B, T, n, C)``, ``branch`` any callable
    ``(B, T, C) -> (B, T, C)`` called as ``branch(h, *args, **kwargs)``; returns ``(B, T, n, C)`` in x's dtype.
    """

    def __init__(
        self,
        dim: int,
        n_streams: int,
        mixer: str = "s2hc",
        layer_index: int = 0,
        eps: float = 1e-6,
        **mixer_options: Any,
    ):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        if not isinstance(n_streams, int) or isinstance(n_streams, bool) or n_streams < 1:
            raise ValueError(f"n_streams must be an integer >= 1, got {n_streams!r}")
        if not isinstance(layer_index, int) or layer_index < 0:
            raise ValueError(f"layer_index must be an integer >= 0, got {layer_index!r}")
        if mixer not in methods():
            raise ValueError(f"mixer must be one of {methods()}, got {mixer!r}")
        self.dim, self.n_streams, self.method, self.layer_index, self.eps = dim, n_streams, mixer, layer_index, eps
        if mixer == RESIDUAL:
            if n_streams != 1:
                raise ValueError(f"n_streams must be 1 for mixer='residual', got {n_streams}")
            if mixer_options:
                raise ValueError(f"mixer='residual' takes no options, got {sorted(mixer_options)}")
            self.mixer = None
            return
        self.mixer = mixers.build(mixer, n_streams, **mixer_options)
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

    def matrices(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-token matrices for streams ``x`` ``(B, T, n, C)``, in at least float32.

        Returns ``pre`` ``(B, T, n)``, ``post`` ``(B, T, n)`` and ``res`` ``(B, T, n, n)``.
        """
        self._check_streams(x)
        dtype = coefficient_dtype(x.dtype)
        if self.is_residual:
            ones = torch.ones(*x.shape[:2], 1, dtype=dtype, device=x.device)
            return {"pre": ones, "post": ones, "res": ones.unsqueeze(-1)}
        flat = x.flatten(-2).to(dtype)
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
        return {"pre": pre, "post": post, "res": self.mixer(d_res)}

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        self._check_streams(x)
        if self.is_residual:
            return x + self._call_branch(branch, x.squeeze(-2), args, kwargs).unsqueeze(-2)
        h = self.matrices(x)
        return self.write(x, h, self._call_branch(branch, self.read(x, h), args, kwargs))

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
        return f"dim={self.dim}, n_streams={self.n_streams}, mixer={self.method!r}, layer_index={self.layer_index}"
