"""Qwen's gated residual: :class:`GatedResidual` around a branch and :class:`GatedHead`, its final read.

The multi-stream residual of transformers' ``qwen4_exp`` models (``Qwen4ExpTextGatedResidual``). Per token, with
streams ``X ∈ R^{n×C}`` (docs/mixers.md, "Qwen's gated residual")::

    X̃_s = RMSNorm(X_s) ⊙ (1 + w_s)                  each stream normed alone; w ∈ R^{nC}, stored zero
    G   = σ(W_up · silu(W_down · vec(X̃) / n))       read gates (n × C), in (0, 1); W_down r × nC, W_up nC × r
    h   = (1/n) Σ_s G_s ⊙ X̃_s                        the branch input (C)
    p   = 2σ(W_w · vec(X̃) / n)                       write gates (n), in (0, 2); W_w n × nC
    X'  = X + p F(h)ᵀ                                 H_res = I: the streams are never mixed

What differs from the papers' connections (HC, mHC, s²HC): the read is a matrix per token (a gate per stream and
channel), not a vector ``H_pre``; it reads the normalised streams, so the branch has no pre-norm of its own; the
gates are a low-rank MLP of the normalised streams, with no static bias, no ``α`` scale and no preferred stream
at init (their ``W`` are random, N(0, 0.02²), transformers' ``initializer_range``); and nothing mixes the streams.
:class:`GatedHead` is the read alone (transformers' ``use_combine=False``): it ends the model in place of the
final norm.

The gates are computed in at least float32 (the streams' dtype promoted), the read's sum and the write in the
streams' dtype, with autocast off, as every s2hc connection does; transformers computes the gates in the model's
dtype, so in bfloat16 the two agree to bfloat16's rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import check_float, check_int, check_streams
from ...counts import Count, add, count
from ...init_rng import Draw
from ...mixers.base import coefficient_dtype
from ..base import Connection, StreamHead, _stream_precision, call_branch, check_stream_tensor
from .base import CoefficientProbe, ConnectionForm

NAME = "gated-residual"
#: Its options and their defaults: the read gates' rank r, transformers' Qwen4ExpTextConfig.hc_lowrank default.
GATED_RESIDUAL_OPTIONS: dict[str, object] = {"rank": 320}
#: The std of the gates' projections at init: transformers' ``initializer_range`` default (Qwen4ExpTextConfig).
GATE_INIT_STD = 0.02
#: Every option a model's ``family_options`` may give the gated residual: its own and its norm's ``eps``.
GATED_OPTIONS = tuple(sorted({*GATED_RESIDUAL_OPTIONS, "eps"}))


def check_rank(rank: object, n_streams: int, dim: int, name: str = "rank") -> int:
    """``rank`` if it is an integer in ``[1, max(n·C, 320)]``: the read gates' MLP maps the n·C normalised features
    through r, so a rank above n·C is no bottleneck, only n·C·r more parameters each way (``rank=10**9`` would ask
    for terabytes before the first step); transformers' default 320 stays allowed at any width. ValueError naming
    ``name``, the value and the range otherwise."""
    default = GATED_RESIDUAL_OPTIONS["rank"]
    maximum = max(n_streams * dim, default)
    if check_int(name, rank) > maximum:
        raise ValueError(f"{name} must be an integer in [1, {maximum}] (at most the n·C = {n_streams}·{dim} = "
                         f"{n_streams * dim} features the read gates see, or the default {default}), got {rank!r}")
    return int(rank)


class GatedHead(StreamHead):
    """The gated read of streams ``x`` ``(B, T, n, C)`` into ``(B, T, C)``: transformers' ``Qwen4ExpTextGatedResidual``
    with ``use_combine=False`` (the ``hyper_connection_mixer`` that ends a ``qwen4_exp`` model).

    Args:
        dim: the width C of one stream.
        n_streams: n, at least 2 (transformers refuses ``hc_count <= 1``).
        rank: r, the rank of the read gates' MLP (``hc_lowrank``; default 320, transformers' default).
        eps: the RMSNorm's epsilon (``rms_norm_eps``).

    Parameters (transformers' names in brackets): ``norm_weight`` ``(nC,)`` [``hc_norm.weight``], stored zero and
    applied as ``1 + w``; ``read_down`` ``(r, nC)`` [``input_mix_weight_down.weight``]; ``read_up`` ``(nC, r)``
    [``input_mix_weight_up.weight``]. ``projections`` names the token-driven ones (weight decay's "matrices").
    """

    projections: tuple[str, ...] = ("read_down", "read_up")
    output_read = "gated-head"

    def __init__(self, dim: int, n_streams: int, rank: int = GATED_RESIDUAL_OPTIONS["rank"], eps: float = 1e-6):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_streams("n_streams", n_streams)
        if n_streams < 2:
            raise ValueError(f"n_streams must be at least 2 for family={NAME!r} (one stream has nothing to "
                             f"gate; use family='residual'), got {n_streams}")
        self.rank = check_rank(rank, n_streams, dim)
        self.eps = check_float("eps", eps, positive=True)
        width = n_streams * dim
        self.norm_weight = nn.Parameter(torch.zeros(width))
        self.read_down = nn.Parameter(torch.empty(self.rank, width).normal_(0.0, GATE_INIT_STD))
        self.read_up = nn.Parameter(torch.empty(width, self.rank).normal_(0.0, GATE_INIT_STD))

    @property
    def family(self) -> str:
        return NAME

    def random_init(self) -> dict[str, Draw]:
        """The parameters that start random, and how (:mod:`s2hc.init_rng`): every projection N(0, 0.02²)."""
        return {name: Draw("normal", GATE_INIT_STD) for name in self.projections}

    def _check_streams(self, x: torch.Tensor) -> None:
        check_stream_tensor(x, self.n_streams, self.dim, self)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """``X̃``: every stream RMS-normalised alone, times ``1 + w``: ``(B, T, n, C)`` in at least float32."""
        dtype = coefficient_dtype(x.dtype)
        weight = 1.0 + self.norm_weight.to(dtype).view(self.n_streams, self.dim)
        return F.rms_norm(x.to(dtype), (self.dim,), None, self.eps) * weight

    def read_gates(self, normed: torch.Tensor) -> torch.Tensor:
        """The read gates ``G`` ``(B, T, n, C)`` in (0, 1) from ``normed`` = :meth:`normed` (its dtype)."""
        flat = normed.flatten(-2)
        hidden = F.silu(flat @ self.read_down.to(flat.dtype).T / self.n_streams)
        return torch.sigmoid(hidden @ self.read_up.to(flat.dtype).T).unflatten(-1, (self.n_streams, self.dim))

    @staticmethod
    def gated_read(normed: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``h = (1/n) Σ_s G_s ⊙ X̃_s``: ``(B, T, n, C)`` twice -> ``(B, T, C)``."""
        return (gates * normed).mean(dim=-2)

    def stream_contributions(self, x: torch.Tensor) -> torch.Tensor:
        """What the read takes from each stream of ``x`` ``(N, n, C)``: ``‖G_s ⊙ X̃_s‖`` (the common 1/n left out:
        the shares do not see it), ``(N, n)`` float64."""
        normed = self.normed(x.unsqueeze(0))
        return (self.read_gates(normed) * normed)[0].double().norm(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_streams(x)
        with _stream_precision(x):
            normed = self.normed(x)
            return self.gated_read(normed, self.read_gates(normed)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}, rank={self.rank}, eps={self.eps}"


class GatedResidual(GatedHead, Connection):
    """Qwen's gated residual around a branch (transformers' ``Qwen4ExpTextGatedResidual``): see the module docstring.

    Args: those of :class:`GatedHead`, and ``layer_index`` (kept for the model's bookkeeping; the gated residual
    starts the same at every layer, its projections random). Parameters: :class:`GatedHead`'s and ``write``
    ``(n, nC)`` [``block_inject_weight.weight``].

    ``forward(x, branch, *args, **kwargs)``: ``x`` ``(B, T, n, C)``, ``branch`` any callable ``(B, T, C) ->
    (B, T, C)`` called as ``branch(h, *args, **kwargs)`` with the normalised, gated read ``h`` (so the branch has no
    pre-norm); returns ``(B, T, n, C)`` in x's dtype. :meth:`matrices` gives what the diagnostics read.
    """

    projections = ("read_down", "read_up", "write")

    def __init__(self, dim: int, n_streams: int, layer_index: int = 0, rank: int = GATED_RESIDUAL_OPTIONS["rank"],
                 eps: float = 1e-6):
        super().__init__(dim, n_streams, rank=rank, eps=eps)
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        self.write = nn.Parameter(torch.empty(n_streams, n_streams * dim).normal_(0.0, GATE_INIT_STD))

    def write_gates(self, normed: torch.Tensor) -> torch.Tensor:
        """The write gates ``p`` ``(B, T, n)`` in (0, 2) from ``normed`` = :meth:`normed` (its dtype)."""
        flat = normed.flatten(-2)
        return 2.0 * torch.sigmoid(flat @ self.write.to(flat.dtype).T / self.n_streams)

    def gates(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``read`` ``(B, T, n, C)`` and ``write`` ``(B, T, n)``, the gates for streams ``x``, differentiable, in at
        least float32."""
        self._check_streams(x)
        with _stream_precision(x):
            normed = self.normed(x)
            return {"read": self.read_gates(normed), "write": self.write_gates(normed)}

    def matrices(self, x: torch.Tensor, fused: bool | None = None) -> dict[str, torch.Tensor]:
        """What :meth:`s2hc.HyperConnection.matrices` gives, for the diagnostics: ``pre`` ``(B, T, n)``, each stream's
        read weight ``mean_c G_s / n`` (the weight its normalised stream gets in ``h``, averaged over channels);
        ``post`` ``(B, T, n)``, the write gates; ``res`` ``(B, T, n, n)``, the identity; and ``read_spread``
        ``(B, T, n)``, the read gates' standard deviation over channels, divided by n like ``pre``. ``fused`` is
        accepted for the call's sake (there is one path)."""
        gates = self.gates(x)
        read = gates["read"] / self.n_streams
        eye = torch.eye(self.n_streams, dtype=read.dtype, device=read.device)
        return {"pre": read.mean(dim=-1), "post": gates["write"], "res": eye.expand(*read.shape[:2], -1, -1),
                "read_spread": read.std(dim=-1, correction=0)}

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_streams(x)
        with _stream_precision(x):
            normed = self.normed(x)
            h = self.gated_read(normed, self.read_gates(normed)).to(x.dtype)
            write = self.write_gates(normed).to(x.dtype)
        out = call_branch(branch, h, args, kwargs)  # the one part that runs under autocast
        with _stream_precision(x):
            return x + write.unsqueeze(-1) * out.to(x.dtype).unsqueeze(-2)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layer_index={self.layer_index}"


class GatedResidualForm(ConnectionForm):
    name = NAME
    summary = "Qwen's gated residual: per-channel read gates, H_res = I"
    min_streams = 2
    pre_norms = False  # its read is normalised already
    default_stream_reduce = "head"
    compute_options = False
    coefficient_paths = (True,)  # one path: its norm and its two gates
    connection_options = ("eps",)
    option_kinds = {"rank": {"int"}, "eps": {"float"}}

    def options(self) -> dict[str, Any]:
        return dict(GATED_RESIDUAL_OPTIONS)

    def check_sizes(self, options: Mapping[str, Any], *, dim: int, n_streams: int, n_sublayers: int) -> None:
        if "rank" in options:
            check_rank(options["rank"], n_streams, dim, f"family option 'rank' of {self.name!r}")

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return GatedResidual(dim, n_streams, layer_index=layer_index, **options)

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        return GatedHead(dim, n_streams, **options)

    def replaces_final_norm(self, stream_reduce: str) -> bool:
        return stream_reduce == "head"  # Qwen's gated read is normalised (its own RMSNorm with 1 + w)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int,
              rank: int = GATED_RESIDUAL_OPTIONS["rank"], **options: Any) -> Count:
        """The gated read, the write gates ``2σ(W_w x̃ / n)`` (an ``nC × n`` product) and ``X + p F(h)ᵀ`` (2·n·C)."""
        width = n_streams * dim
        return add(_read_flops(dim, n_streams, rank), count(2 * width * n_streams, 3 * n_streams + 2 * width))

    def head_flops(self, dim: int, n_streams: int, *, n_sublayers: int, options: Mapping[str, Any]) -> Count:
        return _read_flops(dim, n_streams, options.get("rank", GATED_RESIDUAL_OPTIONS["rank"]))

    def coefficient_probe(self, dim: int, n_streams: int, generator: torch.Generator) -> CoefficientProbe:
        gated = GatedResidual(dim, n_streams)  # its projections start random already

        def run(x: torch.Tensor, fused: bool) -> torch.Tensor:
            gates = gated.gates(x)
            return gates["read"].float().sum() + gates["write"].float().sum()

        return CoefficientProbe(gated, run)

    def upcycle_refusal(self) -> str | None:
        return ("its gates start random, so its start is not the source's function; the start that is (zero gate "
                "projections) keeps the streams identical copies under every gradient step")


def _read_flops(dim: int, n_streams: int, rank: int) -> Count:
    """:class:`GatedHead`'s read: every stream normed over C (times 1 + w), the read gates
    ``σ(W_up silu(W_down x̃ / n))`` (two rank-r products) and ``h = mean_s G_s ⊙ x̃_s``."""
    width = n_streams * dim
    return count(2 * width * rank * 2, 5 * width + 3 * rank + 2 * width + 2 * width)


GATED_RESIDUAL = GatedResidualForm()
