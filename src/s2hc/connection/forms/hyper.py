"""A hyper-connection over a mixing family (:class:`~s2hc.HyperConnection`): one form per family of
:data:`s2hc.mixers.REGISTRY`, whose mathematics its :class:`~s2hc.mixers.Mixer` class declares."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ... import mixers
from ...counts import Count, add, count
from ...mixers.mhc import DEEPSEEK_V4_EPS
from ...mixers.mhc_lite import permutation_limit_error
from ..init import check_gate_init, check_projection_init
from ..module import OPTION_KINDS, HyperConnection, _mixer_projection_width
from ..streams import HyperHead
from .base import CoefficientProbe, ConnectionForm

#: HyperConnection's own keywords (its RMSNorm epsilon; mixing with H_resᵀ; how its projection and its gates start),
#: accepted beside the family's options.
HYPER_CONNECTION_OPTIONS = tuple(OPTION_KINDS)


def _constructor_kinds(mixer: type[mixers.Mixer]) -> dict[str, set[str]]:
    """The types each option of a mixing family takes, from its constructor's annotation (``float | str`` ->
    ``{"float", "str"}``), or from its default's type where there is no annotation."""
    kinds = {}
    for name, parameter in inspect.signature(mixer.__init__).parameters.items():
        if name in ("self", "n_streams"):
            continue
        annotation = parameter.annotation
        if isinstance(annotation, str) and annotation:
            kinds[name] = {part.strip() for part in annotation.split("|")}
        elif parameter.default is not inspect.Parameter.empty and parameter.default is not None:
            kinds[name] = {type(parameter.default).__name__}
    return kinds


def coefficients_probe(hc: HyperConnection, generator: torch.Generator) -> CoefficientProbe:
    """The bench's probe of a hyper-connection's coefficient path: its projection drawn from ``generator`` (away
    from the zero start, so no path skips work), and a scalar of its three matrices."""
    with torch.no_grad():
        hc.projection.normal_(0, 0.1, generator=generator)

    def run(x: torch.Tensor, fused: bool) -> torch.Tensor:
        pre, post, res = hc.coefficients(x, fused)
        return pre.float().sum() + post.float().sum() + res.float().square().sum()

    return CoefficientProbe(hc, run)


class HyperConnectionForm(ConnectionForm):
    """The papers' connection, ``X' = H_res X + H_postᵀ F(H_pre X)``, with the constraint map of mixer ``name``."""

    compute_options = True
    has_res = True
    coefficient_paths = (True, False)
    connection_options = HYPER_CONNECTION_OPTIONS

    def __init__(self, name: str):
        self.mixer = mixers.get(name)
        self.name = name
        self.summary = f"hyper-connection, H_res from the {name} family"
        self.option_kinds = {**OPTION_KINDS, **_constructor_kinds(self.mixer)}
        self.default_stream_reduce = self.mixer.default_stream_reduce

    def options(self) -> dict[str, Any]:
        return mixers.options(self.name)

    def check_option_values(self, options: Mapping[str, Any], n_streams: int) -> dict[str, Any]:
        """The values checked by their types, then the family built on the meta device (nothing allocated), so that
        a value the family refuses (``rotation=foo``, n > 6 for mhc-lite without ``allow_large``) fails here; a
        permutation mixture too large to build is refused before it is built, even on meta."""
        largest = max(self.mixer.permutation_sizes(n_streams), default=0)
        error = permutation_limit_error(f"{self.name} at n_streams={n_streams}", largest, True)
        if error is not None:
            raise error
        checked = super().check_option_values(options, n_streams)
        family_options = {k: v for k, v in checked.items() if k not in OPTION_KINDS and k in self.option_kinds}
        with torch.device("meta"):
            try:
                mixers.build(self.name, n_streams, **family_options)
            except TypeError as error:  # a value of a type the family cannot take
                raise ValueError(f"family_options {family_options!r} of {self.name!r}: {error}") from None
        return checked

    def check_model(self, *, dim: int, n_streams: int, n_sublayers: int, stream_reduce: str, lss_init: float | None,
                    options: Mapping[str, Any]) -> None:
        """Also the connection's ``projection_init`` and ``gate_init``: a residual-equivalent start
        (``gate_init="residual"``) makes the streams' mean the residual stream, so the output must be that mean."""
        super().check_model(dim=dim, n_streams=n_streams, n_sublayers=n_sublayers, stream_reduce=stream_reduce,
                            lss_init=lss_init, options=options)
        check_projection_init(options.get("projection_init", "zero"))
        if check_gate_init(options.get("gate_init", "papers")) != "residual":
            return
        if stream_reduce != "mean":
            raise ValueError(f"gate_init='residual' makes the streams' mean the residual stream: set "
                             f"stream_reduce='mean', got stream_reduce={stream_reduce!r}")
        if n_streams < 2:
            raise ValueError(f"gate_init='residual' needs n_streams >= 2 (H_pre = 1/n), got n_streams={n_streams}")

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        return HyperConnection(dim, n_streams, family=self.name, layer_index=layer_index, **options)

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        """DeepSeek-V4's :class:`~s2hc.HyperHead`, its bias starting where the family's release starts it
        (``Mixer.head_bias``: 0, or Hy4's ``−log(n − 1)`` for ``ihc``)."""
        return HyperHead(dim, n_streams, eps=norm_eps, hc_eps=options.get("hc_eps", DEEPSEEK_V4_EPS),
                         bias_init=self.mixer.head_bias(n_streams))

    def projection_width(self, n_streams: int, **options: Any) -> int | None:
        return _mixer_projection_width(mixers.build(self.name, n_streams, **options))

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """The coefficient path (RMSNorm over n·C, the projection ``nC × (2n + K)``, the gates, the constraint map),
        the read ``H_pre X`` (n·C), the mixing ``H_res X`` (n²·C) and the write ``H_res X + H_postᵀ F`` (2·n·C,
        elementwise). HC's ``projection="per-stream"``: each stream normed over C and projected by ``C × (2 + n)``."""
        n = n_streams
        K, constraint = self.mixer.flops(n, **options)
        width = n * dim
        if self.mixer.projects_per_stream(**options):
            projection = count(2 * n * dim * (2 + n), 4 * width)
        else:
            projection = count(2 * width * (2 * n + K), 4 * width)  # RMSNorm over nC (square, sum, scale, weight)
        gates = count(0, 3 * n + 4 * n)  # H_pre = σ(α d + b), H_post = 2σ(α d + b)
        apply = count(2 * width + 2 * n * width, 2 * width)  # the read and the mixing (products), the write
        return add(projection, gates, constraint, apply)

    def coefficient_probe(self, dim: int, n_streams: int, generator: torch.Generator) -> CoefficientProbe:
        hc = HyperConnection(dim, n_streams, family=self.name, **self.mixer.options_for_size(n_streams))
        return coefficients_probe(hc, generator)

    def res_guarantees(self) -> mixers.Guarantees:
        return self.mixer.guarantees

    def upcycle_refusal(self) -> str | None:
        return self.mixer.upcycle_refusal()
