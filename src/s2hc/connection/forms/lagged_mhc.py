"""DeepSeek-V4.1's single-pass ("lagged") mHC: DeepSeek-V4's mHC, but each sublayer reads its streams with the
read weights ``H_pre`` the *previous* sublayer computed (family ``"mhc-lagged"``).

Released in ``nemo-automodel`` 0.7.0 (``nemo_automodel/components/models/deepseek_v41``: ``layers.py``'s
``DeepseekV41HyperConnection``, ``model.py``'s ``DeepseekV41Block`` and ``DeepseekV41Model``; not in transformers).
Per site (attention and FFN each), with streams ``X ∈ R^{n×C}`` entering it, the coefficients are DeepSeek-V4's,
all in float32 (``family="mhc", variant="deepseek-v4"``: one ``(fn, base, scale)`` per site, the norm without a
weight, ``pre = σ(·) + hc_eps``, ``post = 2σ(·)``, ``comb`` by ``hc_sinkhorn_iters`` plain-domain Sinkhorn rounds)::

    pre_l, post_l, comb_l = coefficients_l(X_l)
    X_{l+1} = combₗᵀ X_l + post_lᵀ F_l(pre_{l−1} X_l)        (pre_{−1} = e_0: the first read is stream 0)
    output  = norm(pre_{L−1} X_L)                               (the last FFN site's pre reads the final streams)

so attention collapses with the previous block's FFN pre, the FFN with its block's attention pre, and the final
norm's input with the last FFN's pre: one pass over the streams per site ("single-pass") instead of V4's two. The
state between sublayers is the pair ``(streams (B, T, n, C), pre (B, T, n))``, ``pre`` in at least float32 (the
release refuses carried coefficients in any other dtype than float32; here float64 streams carry a float64
``pre``), and :class:`LaggedHead` is the final collapse (``stream_reduce="head"``, the default; it has no
parameters). The carried ``pre`` gets its gradient from the next site's read, as in the release.

Conventions against the release (``s2hc.hf.deepseek_v41`` converts): s2hc mixes with ``H_res = combᵀ`` and keeps
the parameters as :class:`s2hc.HyperConnection`'s (``projection = fnᵀ`` with the comb columns transposed, the biases
and scales split), exactly as for DeepSeek-V4; the defaults are DeepSeek-V4.1's (``iterations=20``, ``hc_eps=1e-6``
and the norm's ``eps=1e-20``, its ``rms_norm_eps``). The release computes the read and the write in float32 and
rounds the result to the streams' dtype; s2hc computes them in the streams' dtype (the same in float32 and
float64; bfloat16 streams round differently). The start is s2hc's (the projection zero, ``H_res ≈ I``, the read
and write gates favouring stream ``layer mod n``), not the release's ``reset_parameters`` (``fn ~ N(0, 0.02²)``,
``base = 0``, ``scale = 1``). :meth:`LaggedHyperConnection.matrices` (what the stream diagnostics record) gives the
site's own ``pre``, the one the next site reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ... import mixers
from ...checks import check_float, check_int
from ...counts import Count, count
from ...mixers.base import Guarantees, coefficient_dtype
from ...mixers.mhc import DEEPSEEK_V4_EPS, MAX_ITERATIONS
from ..base import StreamHead, _stream_precision, check_stream_tensor
from ..module import HyperConnection
from .base import CoefficientProbe, ConnectionForm
from .hyper import HyperConnectionForm, coefficients_probe

NAME = "mhc-lagged"
#: DeepSeek-V4.1's ``rms_norm_eps`` (``DeepseekV41TextConfig``), the epsilon of the coefficient path's norm.
DEEPSEEK_V41_NORM_EPS = 1e-20
#: DeepSeek-V4.1's ``hc_sinkhorn_iters``.
DEEPSEEK_V41_ITERATIONS = 20
VARIANT = "deepseek-v4"


def check_state(state: Any, n_streams: int, dim: int, module: nn.Module,
                what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``state`` as ``(streams (..., n, C), pre (..., n))``, ``pre`` in the streams' coefficient dtype (at least
    float32); TypeError or ValueError naming what is wrong."""
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise TypeError(f"{what} takes the state (streams (batch, time, n, dim), pre (batch, time, n)) that "
                        f"LAGGED_MHC.expand makes and each connection returns, got {got}")
    x, pre = state
    check_stream_tensor(x, n_streams, dim, module)
    if not isinstance(pre, torch.Tensor) or pre.shape != x.shape[:-1]:
        got = tuple(pre.shape) if isinstance(pre, torch.Tensor) else type(pre).__name__
        raise ValueError(f"{what}: the carried pre must have shape {tuple(x.shape[:-1])} (the streams' without "
                         f"dim), got {got}")
    if pre.dtype != coefficient_dtype(x.dtype):
        raise TypeError(f"{what}: the carried pre must be {coefficient_dtype(x.dtype)} for {x.dtype} streams (the "
                        f"single-pass mHC carries its coefficients in at least float32), got {pre.dtype}; keep "
                        "mixed precision from casting the state")
    return x, pre


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Σ_s pre_s X_s``: streams ``(..., n, C)`` read with ``pre`` ``(..., n)``, in the streams' dtype."""
    with _stream_precision(x):
        return (pre.to(x.dtype).unsqueeze(-1) * x).sum(dim=-2)


class LaggedHyperConnection(HyperConnection):
    """DeepSeek-V4.1's single-pass mHC around one branch (module docstring): DeepSeek-V4's coefficients
    (:class:`s2hc.HyperConnection` with ``family="mhc", variant="deepseek-v4"``), the branch reading the streams
    with the previous site's ``pre``.

    Args:
        dim, n_streams, layer_index, fused, recompute, kernels, projection_init, gate_init: as
            :class:`s2hc.HyperConnection`'s.
        eps: the coefficient norm's epsilon (DeepSeek-V4.1's ``rms_norm_eps``, 1e-20).
        iterations: Sinkhorn rounds (``hc_sinkhorn_iters``, 20).
        alpha: the comb scale's start (the mixer's).
        hc_eps: DeepSeek-V4's ``hc_eps`` (1e-6).

    ``forward((x, pre), branch, *args, **kwargs)`` -> ``(x', pre')``: ``x`` ``(B, T, n, C)`` (or any leading
    dimensions), ``pre`` ``(B, T, n)`` the previous site's read weights in at least float32; the branch gets
    ``Σ_s pre_s X_s``; ``x' = H_res x + H_postᵀ F`` and ``pre'`` this site's read weights, for the next site.
    """

    def __init__(self, dim: int, n_streams: int, layer_index: int = 0, eps: float = DEEPSEEK_V41_NORM_EPS,
                 fused: bool = True, recompute: bool = False, kernels: str = "torch", projection_init: str = "zero",
                 gate_init: str = "papers", iterations: int = DEEPSEEK_V41_ITERATIONS, alpha: float = 0.01,
                 hc_eps: float = DEEPSEEK_V4_EPS):
        super().__init__(dim, n_streams, family="mhc", layer_index=layer_index, eps=eps, fused=fused,
                         recompute=recompute, kernels=kernels, projection_init=projection_init, gate_init=gate_init,
                         iterations=iterations, alpha=alpha, variant=VARIANT, hc_eps=hc_eps)
        self.family = NAME

    def forward(self, state: tuple[torch.Tensor, torch.Tensor], branch: Callable[..., torch.Tensor], *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, carried = check_state(state, self.n_streams, self.dim, self, type(self).__name__)
        if x.dim() != 4:  # other leading dimensions: flattened into T, the branch seeing the caller's shape
            lead = x.shape[:-2]

            def flat_branch(h, *a, **k):
                return branch(h.reshape(*lead, self.dim), *a, **k).reshape(h.shape)

            x4, pre4 = self.forward((x.reshape(1, -1, *x.shape[-2:]), carried.reshape(1, -1, x.shape[-2])),
                                    flat_branch, *args, **kwargs)
            return x4.reshape(x.shape), pre4.reshape(carried.shape)
        path = self.compute_path(x).for_call()
        with _stream_precision(x):
            pre, post, res = self._step_coefficients(x, path)
            branch_in, mixed = path.read_mix(x, carried, res)  # the previous site's read weights
        branch_out = self._call_branch(branch, branch_in, args, kwargs)
        with _stream_precision(x):
            return path.write(mixed, post, branch_out), pre

    def state_streams(self, state: Any) -> torch.Tensor:
        return state[0] if isinstance(state, (tuple, list)) else state

    def extra_repr(self) -> str:
        return super().extra_repr().replace(f"family={NAME!r}", f"family={NAME!r}, eps={self.eps}")


class LaggedHead(StreamHead):
    """The final collapse of DeepSeek-V4.1's single-pass mHC: the last site's ``pre`` reads the final streams,
    ``(x, pre)`` -> ``Σ_s pre_s X_s`` ``(B, T, C)`` (before the final norm). No parameters."""

    def __init__(self, dim: int, n_streams: int):
        super().__init__()
        self.dim, self.n_streams = check_int("dim", dim), check_int("n_streams", n_streams)

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, pre = check_state(state, self.n_streams, self.dim, self, type(self).__name__)
        return collapse(x, pre)

    def state_streams(self, state: Any) -> torch.Tensor:
        return state[0] if isinstance(state, (tuple, list)) else state

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}"


class LaggedMHCForm(ConnectionForm):
    """DeepSeek-V4.1's single-pass mHC as a form: :class:`LaggedHyperConnection` around each branch, the state
    ``(streams, pre)``, :class:`LaggedHead` its final read."""

    name = NAME
    summary = "DeepSeek-V4.1's single-pass mHC: V4's mHC, each sublayer reading with the previous sublayer's H_pre"
    default_stream_reduce = "head"
    stream_scaling = False  # the state is a pair, which stream scaling does not take
    compute_options = True
    has_res = True
    coefficient_paths = (True, False)
    connection_options = ("eps", "projection_init", "gate_init")
    option_kinds = {"eps": {"float"}, "projection_init": {"str"}, "gate_init": {"str"},
                    "iterations": {"int"}, "alpha": {"float"}, "hc_eps": {"float"}}

    def __init__(self):
        self._mhc = HyperConnectionForm("mhc")  # DeepSeek-V4's coefficients and their count

    def options(self) -> dict[str, Any]:
        return {"iterations": DEEPSEEK_V41_ITERATIONS, "alpha": 0.01, "hc_eps": DEEPSEEK_V4_EPS}

    def check_option_values(self, options: Mapping[str, Any], n_streams: int) -> dict[str, Any]:
        checked = super().check_option_values(options, n_streams)
        if "iterations" in checked:
            check_int(f"family option 'iterations' of {NAME!r}", checked["iterations"], maximum=MAX_ITERATIONS)
        if "hc_eps" in checked:
            check_float(f"family option 'hc_eps' of {NAME!r}", checked["hc_eps"], minimum=0.0)
        return checked

    def check_model(self, *, dim: int, n_streams: int, n_sublayers: int, stream_reduce: str, lss_init: float | None,
                    options: Mapping[str, Any]) -> None:
        """Also ``projection_init`` and ``gate_init`` as for the hyper-connections (``gate_init="residual"`` needs
        ``stream_reduce="mean"``)."""
        super().check_model(dim=dim, n_streams=n_streams, n_sublayers=n_sublayers, stream_reduce=stream_reduce,
                            lss_init=lss_init, options=options)
        hyper_options = {k: v for k, v in options.items() if k in ("projection_init", "gate_init")}
        self._mhc.check_model(dim=dim, n_streams=n_streams, n_sublayers=n_sublayers, stream_reduce=stream_reduce,
                              lss_init=lss_init, options=hyper_options)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        self.check_streams(n_streams)
        compute = {k: options.pop(k) for k in ("fused", "recompute", "kernels") if k in options}
        self.check_options(options, "option(s)")
        return LaggedHyperConnection(dim, n_streams, layer_index, **options, **compute)

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        return LaggedHead(dim, n_streams)

    def expand(self, h: torch.Tensor, n_streams: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams (n copies of ``h``) and the first read, one-hot on stream 0, in at least float32."""
        x = super().expand(h, n_streams)
        pre = torch.zeros(x.shape[:-1], dtype=coefficient_dtype(x.dtype), device=x.device)
        pre[..., 0] = 1
        return x, pre

    def reduce(self, x: Any, mean: bool = False) -> torch.Tensor:
        """Without the final collapse (``stream_reduce="sum"`` or ``"mean"``): the streams' sum or mean."""
        return super().reduce(x[0] if isinstance(x, (tuple, list)) else x, mean)

    def projection_width(self, n_streams: int, **options: Any) -> int | None:
        return 2 * n_streams + n_streams * n_streams

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """DeepSeek-V4's mHC connection (the coefficient path, the read, the mixing and the write): the read takes
        the previous site's weights instead of its own, the same count."""
        family = {k: v for k, v in options.items() if k in ("iterations", "alpha", "hc_eps")}
        return self._mhc.flops(dim, n_streams, sublayer=sublayer, n_sublayers=n_sublayers, variant=VARIANT,
                               **family)

    def head_flops(self, dim: int, n_streams: int, *, n_sublayers: int, options: Mapping[str, Any]) -> Count:
        """The final collapse: n·C products and (n − 1)·C sums."""
        return count(0, (2 * n_streams - 1) * dim)

    def coefficient_probe(self, dim: int, n_streams: int, generator: torch.Generator) -> CoefficientProbe:
        return coefficients_probe(LaggedHyperConnection(dim, n_streams), generator)

    def res_guarantees(self) -> Guarantees:
        """DeepSeek-V4's Sinkhorn with ``hc_eps``: entries > 0, its sums 1 only up to about ``hc_eps``."""
        return mixers.build("mhc", 2, variant=VARIANT).guarantees

    def upcycle_refusal(self) -> str | None:
        """None: the streams start as copies, so the one-hot first read is the embedding, and from then on the
        residual start's uniform reads and H_res (Sinkhorn: rows and columns 1 up to its tolerance) keep the
        streams' mean the residual model's, as for mHC."""
        return None


LAGGED_MHC = LaggedMHCForm()
