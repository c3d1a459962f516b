"""The variance-preserving residual: one stream, ``x' = α ⊙ x + β ⊙ F(x)`` with ``α² + β² = 1``
(:class:`VPResidual`).

Three released designs compute it (docs/mixers.md, "Production designs"), with the weights of the two terms either
learned per channel or fixed by depth:

- **learned** (``gate="learned"``, the default): transformers' ``MuseSparkResidualGate`` (``models/muse_spark``)
  and ``ErgoResidualGate`` (``models/ergo``). A parameter ``w ∈ R^C`` per sublayer::

      β = σ(w / τ)                                   the branch's weight, in (0, 1)
      α = √max(σ(−w/τ)(1 + β), floor)                = √max(1 − β², floor)       (alpha="clamped", Muse Spark)
      α = √(1 + β) · exp(−softplus(w/τ) / 2)         = √(1 − β²)                 (alpha="softplus", Ergo)

- **depth** (``gate="depth"``): transformers' ``depth_scaled_residual_add`` (``models/beam``). No parameters; the
  i-th add of the model (the embedding is the first, so sublayer ``s`` is add ``i = s + 2``) weighs
  ``β = 1/√i`` and ``α = √((i − 1)/i)``: the stream stays the running mean-square of unit-variance inputs.

The defaults are Muse Spark's (``temperature=0.3``, ``alpha="clamped"``, ``alpha_floor=1e-3``,
``gate_init="normal"``, N(0, 0.02²): transformers' ``residual_gate_temperature``, ``residual_gate_eps``,
``initializer_range``). Ergo is ``temperature=1, alpha="softplus", gate_init="zeros"`` (it writes no temperature,
keeps no floor and starts at β = 1/2); the two formulas of α are the same function and differ in rounding only
(the softplus one keeps α's relative accuracy where β → 1, the clamped one bounds α below by √floor ≈ 0.032, so
that a gate driven to β → 1 still passes a little of the stream), hence an option, not a preset.

Precision: the learned gate lives in float32 (Muse Spark's and Ergo's ``_keep_in_fp32_modules_strict``), ``α``
and ``β`` and the sum are computed in at least float32 (the streams' dtype promoted, as both do) and the result
written in the streams' dtype (Muse Spark's ``.to(residual.dtype)``; Ergo's stream is float32 already). Beam's add
runs in the streams' dtype with the scales as Python floats, which s2hc does too, so it is exact in every dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import check_float, check_int
from ...counts import Count, count
from ...init_rng import Draw
from ...mixers.base import coefficient_dtype
from ..base import Connection, _stream_precision, call_branch, check_stream_tensor
from .base import OneStreamForm

NAME = "vp-residual"
GATES = ("learned", "depth")
ALPHAS = ("clamped", "softplus")
GATE_INITS = ("normal", "zeros")
#: Its options and their defaults: Muse Spark's (transformers' MuseSparkTextConfig and MuseSparkResidualGate).
VP_RESIDUAL_OPTIONS: dict[str, Any] = {"gate": "learned", "temperature": 0.3, "alpha": "clamped",
                                       "alpha_floor": 1e-3, "gate_init": "normal", "init_std": 0.02}


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"family option {name!r} of {NAME!r} must be one of {list(allowed)}, got {value!r}")
    return str(value)


def depth_scales(sublayer: int) -> tuple[float, float]:
    """``(α, β)`` of sublayer ``sublayer`` (0-based over the model's sublayers) under ``gate="depth"``: Beam's
    ``depth_scaled_residual_add`` at ``residual_add_idx = sublayer + 2``, computed as Beam computes them."""
    i = check_int("sublayer", sublayer, minimum=0) + 2
    return math.sqrt((i - 1) / i), 1.0 / math.sqrt(i)


class VPResidual(Connection):
    """``x' = α ⊙ x + β ⊙ F(x)``, ``α² + β² = 1``, around one branch (the module docstring): ``forward(x, branch,
    *args, **kwargs)``, ``x`` ``(B, T, 1, C)`` -> ``(B, T, 1, C)``, the branch given ``(B, T, C)``.

    Args:
        dim: the width C.
        n_streams: 1 (the form has one stream).
        layer_index: the block's index (bookkeeping).
        sublayer: the branch's index over the model (attention ``2·layer``, MLP ``2·layer + 1``): the depth gate's i.
        gate, temperature, alpha, alpha_floor, gate_init, init_std: the options (module docstring).

    Parameters: ``gate`` ``(C,)`` float32 (``gate="learned"`` only; transformers' ``gate`` in Muse Spark, ``weight``
    in Ergo). It is no token-driven matrix (``projections`` is empty: weight decay's "matrices" leaves it) and its
    neutral value is 0 (β = 1/2 at w = 0), so it is no unit parameter either.
    """

    family = NAME

    def __init__(self, dim: int, n_streams: int = 1, layer_index: int = 0, *, sublayer: int = 0,
                 gate: str = "learned", temperature: float = 0.3, alpha: str = "clamped", alpha_floor: float = 1e-3,
                 gate_init: str = "normal", init_std: float = 0.02):
        super().__init__()
        VP_RESIDUAL.check_streams(n_streams)
        self.dim, self.n_streams = check_int("dim", dim), n_streams
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        self.sublayer = check_int("sublayer", sublayer, minimum=0)
        self.gate_kind = _choice("gate", gate, GATES)
        self.alpha_kind = _choice("alpha", alpha, ALPHAS)
        self.gate_init = _choice("gate_init", gate_init, GATE_INITS)
        self.temperature = check_float("temperature", temperature, positive=True)
        self.alpha_floor = check_float("alpha_floor", alpha_floor, minimum=0.0, maximum=1.0)
        self.init_std = check_float("init_std", init_std, minimum=0.0)
        if self.gate_kind == "learned":
            start = torch.zeros(dim, dtype=torch.float32)
            self.gate = nn.Parameter(start.normal_(0.0, self.init_std) if self.gate_init == "normal" else start)
        else:
            self.register_parameter("gate", None)

    def random_init(self) -> dict[str, Draw]:
        """The parameters that start random (:mod:`s2hc.init_rng`): the learned gate under ``gate_init="normal"``."""
        if self.gate is None or self.gate_init != "normal":
            return {}
        return {"gate": Draw("normal", self.init_std)}

    def scales(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``(α, β)``: tensors ``(C,)`` in ``dtype`` (at least float32) for the learned gate, differentiable; Python
        floats for the depth gate."""
        if self.gate is None:
            return depth_scales(self.sublayer)
        w = self.gate.to(coefficient_dtype(dtype)) / self.temperature
        beta = torch.sigmoid(w)
        if self.alpha_kind == "softplus":
            return torch.sqrt(1.0 + beta) * torch.exp(-0.5 * F.softplus(w)), beta
        return torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=self.alpha_floor)), beta

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        return self  # one stream: every compute option computes the same add (as the residual's)

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        check_stream_tensor(x, 1, self.dim, self)
        out = call_branch(branch, x.squeeze(-2), args, kwargs).unsqueeze(-2)  # the one part under autocast
        with _stream_precision(x):
            alpha, beta = self.scales(x.dtype)
            if self.gate is None:  # Beam: in the streams' dtype, the scales Python floats
                return out.to(x.dtype) * beta + x * alpha
            dtype = coefficient_dtype(x.dtype)
            return (alpha * x.to(dtype) + beta * out.to(dtype)).to(x.dtype)

    @torch.no_grad()
    def measures(self) -> dict[str, Any]:
        """What the gate does (reported by ``s2hc diagnose``, metrics.jsonl and the loggers): the branch's weight β
        and the stream's α over the channels (mean, min, max), and ``alpha_floor_hit``, the share of channels whose
        α the floor holds up."""
        alpha, beta = self.scales()
        alpha = torch.as_tensor(alpha, dtype=torch.float64).detach().cpu().double()
        beta = torch.as_tensor(beta, dtype=torch.float64).detach().cpu().double()
        out = {f"{name}_{stat}": float(getattr(value, stat)()) for name, value in (("beta", beta), ("alpha", alpha))
               for stat in ("mean", "min", "max")}
        if self.gate is not None and self.alpha_kind == "clamped":
            out["alpha_floor_hit"] = float((1.0 - beta**2 <= self.alpha_floor).double().mean())
        return out

    def extra_repr(self) -> str:
        if self.gate is None:
            return f"dim={self.dim}, gate='depth', sublayer={self.sublayer}"
        return (f"dim={self.dim}, layer_index={self.layer_index}, temperature={self.temperature}, "
                f"alpha={self.alpha_kind!r}, alpha_floor={self.alpha_floor}")


class VPResidualForm(OneStreamForm):
    name = NAME
    summary = "variance-preserving residual α x + β F(x), α² + β² = 1: learned per channel or fixed by depth"
    option_kinds = {"gate": {"str"}, "temperature": {"float"}, "alpha": {"str"}, "alpha_floor": {"float"},
                    "gate_init": {"str"}, "init_std": {"float"}}

    def options(self) -> dict[str, Any]:
        return dict(VP_RESIDUAL_OPTIONS)

    def check_option_values(self, options: Mapping[str, Any], n_streams: int) -> dict[str, Any]:
        checked = super().check_option_values(options, n_streams)
        for name, allowed in (("gate", GATES), ("alpha", ALPHAS), ("gate_init", GATE_INITS)):
            if name in checked:
                _choice(name, checked[name], allowed)
        if "temperature" in checked:
            check_float(f"family option 'temperature' of {NAME!r}", checked["temperature"], positive=True)
        if "alpha_floor" in checked:
            check_float(f"family option 'alpha_floor' of {NAME!r}", checked["alpha_floor"], minimum=0.0,
                        maximum=1.0)
        if "init_std" in checked:
            check_float(f"family option 'init_std' of {NAME!r}", checked["init_std"], minimum=0.0)
        return checked

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_options(options, "option(s)")
        return VPResidual(dim, n_streams, layer_index, sublayer=sublayer, **options)

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """``α ⊙ x``, ``β ⊙ F`` and their sum: 3·C per token (the gates are per channel, not per token)."""
        return count(0, 3 * dim)

    def upcycle_refusal(self) -> str | None:
        return ("it has one stream, and α x + β F(x) with α² + β² = 1 is never x + F(x): no start of it computes "
                "the residual model")


VP_RESIDUAL = VPResidualForm()
