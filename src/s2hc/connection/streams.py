"""Into and out of the streams: :func:`expand_streams` after the embedding (and optionally a learned
:class:`StreamScaling`), and :func:`reduce_streams` or a learned :class:`HyperHead` before the final norm
(docs/design.md section 1.1)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_float, check_int, check_streams
from ..init_rng import Draw
from ..mixers.base import coefficient_dtype, scale_parameter
from .base import ConnectionModule, StreamHead, _stream_precision, check_device


def expand_streams(h: torch.Tensor, n_streams: int) -> torch.Tensor:
    """Copy hidden states ``h`` ``(B, T, C)`` into ``n_streams`` streams ``(B, T, n, C)`` (after the embedding)."""
    check_streams("n_streams", n_streams)
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor of shape (batch, time, dim), got {type(h).__name__}")
    if h.dim() != 3:
        raise ValueError(f"h must have shape (batch, time, dim), got shape {tuple(h.shape)}")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n_streams, h.shape[-1]).contiguous()


class StreamScaling(ConnectionModule):
    """Learned stream scaling (LSS; brain-lab-research/hc-stream-collapse, ``StreamExpandLSS``): the expanded
    streams ``x`` ``(B, T, n, C)`` times a learned scale ``λ`` ``(n, C)``, per stream and channel, so that the
    streams start different instead of as n copies (against "stream collapse", one stream carrying the signal).

    ``λ`` starts at ``init`` plus Xavier-uniform noise, U(−a, a) with ``a = sqrt(6 / (n + C))`` (torch's
    ``xavier_uniform_`` on an ``(n, C)`` tensor), drawn from torch's global generator, as that code does; its
    default ``init`` there is 0.6. That code applies it after the embedding (and its dropout), before the first
    layer, and only for mHC-lite; s2hc offers it to every multi-stream family (``ModelConfig.lss_init``).
    """

    def __init__(self, dim: int, n_streams: int, init: float = 0.6):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_streams("n_streams", n_streams)
        self.init = check_float("init", init)
        self.scale = nn.Parameter(torch.empty(n_streams, dim))
        with torch.no_grad():
            nn.init.xavier_uniform_(self.scale)
            self.scale.add_(self.init)

    def random_init(self) -> dict[str, Draw]:
        """The parameters that start random, and how (:mod:`s2hc.init_rng`): ``λ`` ~ U(init − a, init + a)."""
        return {"scale": Draw("uniform", math.sqrt(6.0 / (self.n_streams + self.dim)), self.init)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x must be a floating-point torch.Tensor of shape (batch, time, n_streams, dim), got "
                            f"{got}")
        if x.dim() != 4 or x.shape[-2:] != (self.n_streams, self.dim):
            raise ValueError(f"x must have shape (batch, time, n_streams={self.n_streams}, dim={self.dim}), "
                             f"got {tuple(x.shape)}")
        check_device(x, self)
        return x * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}, init={self.init}"


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """Sum streams ``x`` ``(B, T, n, C)`` into ``(B, T, C)`` (before the final norm)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape (batch, time, n_streams, dim), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, time, n_streams, dim), got shape {tuple(x.shape)}")
    return x.sum(dim=-2)


class HyperHead(StreamHead):
    """A learned reduction of streams ``x`` ``(B, T, n, C)`` into ``(B, T, C)``: DeepSeek-V4's ``HyperHead``.

    Per token, with ``x̃ = RMSNorm(vec(X))`` over all n·C features (no weight, ``eps``)::

        w = σ(α · x̃ W + b) + hc_eps        W ∈ R^{nC × n}, α ∈ R, b ∈ R^n
        out = Σ_s w_s X_s

    An alternative to :func:`reduce_streams` before the final norm: a model's with ``stream_reduce="head"``,
    one's own models', DeepSeek-V4's (:mod:`s2hc.hf.deepseek_v4` converts ``hc_fn``, ``hc_base``,
    ``hc_scale``). Initialised like the connections: ``W = 0``, ``α = 0.01``, and ``b = bias_init``, 0 by
    default (DeepSeek-V4's), so every stream starts with weight ``0.5 + hc_eps``: half the sum, which a following
    RMSNorm turns into the sum's output up to its ``eps`` (Hy4's ``−log(n − 1)``: the mean, ``family="ihc"``).
    The weights are computed in at least float32 and
    so is the weighted sum (once per model, as DeepSeek-V4 does), cast back to x's dtype; autocast off.
    """

    projections: tuple[str, ...] = ("projection",)
    output_read = "hyper-head"

    def __init__(self, dim: int, n_streams: int, eps: float = 1e-6, hc_eps: float = 1e-6, bias_init: float = 0.0):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_streams("n_streams", n_streams)
        self.eps = check_float("eps", eps, positive=True)
        self.hc_eps = check_float("hc_eps", hc_eps, minimum=0.0)
        self.projection = nn.Parameter(torch.zeros(n_streams * dim, n_streams))
        self.alpha = scale_parameter(0.01)
        self.bias = nn.Parameter(torch.full((n_streams,), check_float("bias_init", bias_init)))

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point torch.Tensor of shape (batch, time, n_streams, dim), got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() != 4 or x.shape[-2:] != (self.n_streams, self.dim):
            raise ValueError(f"x must have shape (batch, time, n_streams={self.n_streams}, dim={self.dim}), "
                             f"got shape {tuple(x.shape)}")
        check_device(x, self)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token stream weights ``w`` ``(B, T, n)`` for streams ``x``, in at least float32."""
        self._check(x)
        dtype = coefficient_dtype(x.dtype)
        with _stream_precision(x):
            flat = x.flatten(-2).to(dtype)
            d = F.rms_norm(flat, (flat.shape[-1],), None, self.eps) @ self.projection.to(dtype)
            return torch.sigmoid(self.alpha.to(dtype) * d + self.bias.to(dtype)) + self.hc_eps

    def stream_contributions(self, x: torch.Tensor) -> torch.Tensor:
        """What the head takes from each stream of ``x`` ``(N, n, C)``: ``|w_s| ‖X_s‖``, ``(N, n)`` float64."""
        weights = self.weights(x.unsqueeze(0))[0]
        return weights.double().abs() * x.double().norm(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights(x)
        with _stream_precision(x):
            return (w.unsqueeze(-1) * x.to(w.dtype)).sum(dim=-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}, eps={self.eps}, hc_eps={self.hc_eps}"

