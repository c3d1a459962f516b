"""The affine residual: one stream, a learned scale and bias per channel on both terms (:class:`AffineResidual`).

transformers' ``ZayaResidualScaling`` (``models/zaya``, Zyphra's ZAYA1), per sublayer::

    x' = (F(x) + b_F) ⊙ s_F + (x + b_x) ⊙ s_x        s_F, s_x start at 1, b_F, b_x at 0

so it starts as the plain residual ``x + F(x)``. Unlike the variance-preserving residual (``vp-residual``) the two
weights are free (no ``α² + β² = 1``) and each term has a bias, a per-channel offset added before the scale; with
fixed weights it would hold Beam's depth-scaled add too, but Beam learns nothing and keeps ``α² + β² = 1``, which
is why Beam is an option of ``vp-residual`` and this a form of its own.

Precision: ZAYA keeps its stream in float32 (``residual_in_fp32``) and its four vectors in the model's dtype, so
in bfloat16 its branch term is computed in bfloat16 and added to the float32 stream. s2hc computes both terms and
the sum in at least float32 (the streams' dtype promoted) and writes the streams' dtype: the same in float32 and
float64, to bfloat16's rounding of the branch term otherwise. ZAYA's model also scales and shifts the embeddings
once (``input_hidden_states_scale``, ``input_hidden_states_bias``), which is not a connection (docs/mixers.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...checks import check_int
from ...counts import Count, count
from ...mixers.base import coefficient_dtype
from ..base import Connection, _stream_precision, call_branch, check_stream_tensor
from .base import OneStreamForm

NAME = "affine-residual"
#: The parameters, s2hc's name -> transformers' (``ZayaResidualScaling``), and their neutral values.
AFFINE_PARAMETERS = {"branch_scale": 1.0, "branch_bias": 0.0, "residual_scale": 1.0, "residual_bias": 0.0}


class AffineResidual(Connection):
    """``x' = (F(x) + b_F) ⊙ s_F + (x + b_x) ⊙ s_x`` around one branch (the module docstring): ``forward(x, branch,
    *args, **kwargs)``, ``x`` ``(B, T, 1, C)`` -> ``(B, T, 1, C)``, the branch given ``(B, T, C)``.

    Parameters ``(C,)`` each (transformers' names in brackets): ``branch_scale`` [``hidden_states_scale``],
    ``branch_bias`` [``hidden_states_bias``], ``residual_scale`` [``residual_scale``], ``residual_bias``
    [``residual_bias``]. The scales are ``unit_parameters`` (weight decay's "all" pulls them toward 1); nothing is
    a token-driven matrix (``projections`` is empty)."""

    family = NAME
    unit_parameters = ("branch_scale", "residual_scale")

    def __init__(self, dim: int, n_streams: int = 1, layer_index: int = 0):
        super().__init__()
        AFFINE_RESIDUAL.check_streams(n_streams)
        self.dim, self.n_streams = check_int("dim", dim), n_streams
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        for name, value in AFFINE_PARAMETERS.items():
            setattr(self, name, nn.Parameter(torch.full((dim,), value)))

    @torch.no_grad()
    def start_as_residual(self, spread: float = 0.0) -> None:
        """Scales 1, biases 0: ``x + F(x)`` exactly (its own initial value)."""
        for name, value in AFFINE_PARAMETERS.items():
            getattr(self, name).fill_(value)

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        return self  # one stream: every compute option computes the same add (as the residual's)

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        check_stream_tensor(x, 1, self.dim, self)
        out = call_branch(branch, x.squeeze(-2), args, kwargs).unsqueeze(-2)  # the one part under autocast
        with _stream_precision(x):
            dtype = coefficient_dtype(x.dtype)
            p = {name: getattr(self, name).to(dtype) for name in AFFINE_PARAMETERS}
            written = (out.to(dtype) + p["branch_bias"]) * p["branch_scale"]
            kept = (x.to(dtype) + p["residual_bias"]) * p["residual_scale"]
            return (written + kept).to(x.dtype)

    @torch.no_grad()
    def measures(self) -> dict[str, Any]:
        """What the affine does (``s2hc diagnose``, metrics.jsonl, the loggers): each vector's mean, min and max
        over the channels, and the ratio of the scales' RMS (the branch's weight against the stream's)."""
        out: dict[str, Any] = {}
        for name in AFFINE_PARAMETERS:
            value = getattr(self, name).detach().double().cpu()
            out.update({f"{name}_{stat}": float(getattr(value, stat)()) for stat in ("mean", "min", "max")})
        rms = {name: float(getattr(self, name).detach().double().pow(2).mean().sqrt())
               for name in ("branch_scale", "residual_scale")}
        out["scale_ratio"] = rms["branch_scale"] / rms["residual_scale"] if rms["residual_scale"] else float("inf")
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, layer_index={self.layer_index}"


class AffineResidualForm(OneStreamForm):
    name = NAME
    summary = "affine residual (F + b_F) s_F + (x + b_x) s_x: learned scale and bias per channel on both terms"

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return AffineResidual(dim, n_streams, layer_index)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """Each term's bias and scale (2·C each) and their sum (C): 5·C per token."""
        return count(0, 5 * dim)

    def upcycle_refusal(self) -> str | None:
        return ("it has one stream, like the source: nothing to widen; it starts as x + F(x) (scales 1, biases 0), "
                "so a residual model's weights load into it with its function as they are")


AFFINE_RESIDUAL = AffineResidualForm()
