"""What a connection form declares: :class:`ConnectionForm`, the one object the rest of s2hc asks about a family.

A *form* is a kind of connection around a branch: the plain residual, a hyper-connection over a mixing family
(:mod:`s2hc.mixers`), Qwen's gated residual, Attention Residuals, the wide residual. Everything the model, the
configuration, the optimiser, the counts, the bench and the diagnostics need to know about a family that is not
its mixer's mathematics is an attribute or method here, so that a new form is one module in this package and one
line in its registry (:mod:`s2hc.connection.forms`), and no module outside asks a family by its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import mixers
from ...checks import check_bool, check_float, check_int, check_str
from ...counts import Count, count
from ...mixers.base import Guarantees
from ...mixers.mhc import DEEPSEEK_V4_EPS
from ..streams import HyperHead, expand_streams, reduce_streams


def check_option_value(family: str, name: str, value: Any, kinds: set[str]) -> Any:
    """``value`` of option ``name`` checked by the types it takes (``kinds``, as a constructor's annotation writes
    them: ``{"float"}``, ``{"int", "None"}``): a ``float`` option must be a finite number (``eps`` a positive one),
    an ``int`` an integer; a string is left to the family to check. ValueError naming the option otherwise."""
    where = f"family option {name!r} of {family!r}"
    if ("str" in kinds and isinstance(value, str)) or ("None" in kinds and value is None):
        return value  # the family checks the string itself
    if "bool" in kinds:
        return check_bool(where, value)
    if "float" in kinds:
        return check_float(where, value, positive=name == "eps")
    if "int" in kinds:
        return check_int(where, value)
    if "str" in kinds:
        return check_str(where, value)
    return value


@dataclass(frozen=True)
class CoefficientProbe:
    """What ``s2hc bench`` times as a form's coefficient path (the token-driven work before the branch, without the
    read and the write): ``module``, the connection built for it; ``run(x, fused)``, a scalar of the coefficients
    of streams ``x`` ``(tokens, 1, n, C)`` to call ``backward`` on, computed by the fast path (``fused`` True) or the
    reference (False)."""

    module: nn.Module
    run: Callable[[torch.Tensor, bool], torch.Tensor]


class ConnectionForm:
    """One kind of connection, as the rest of s2hc sees it. Subclasses set the class attributes and override
    :meth:`build` (and :meth:`build_head` when the form has a learned final read of its own).

    Attributes:
        name: the family name a model takes (``ModelConfig.family``).
        summary: one line for listings.
        min_streams, max_streams: the ``n_streams`` the form accepts (``max_streams`` None: no bound of its own).
        default_streams: what ``n_streams`` is when none is given.
        pre_norms: whether the branches keep their own pre-norm (the gated residual's read is normalised already).
        default_stream_reduce: what ``ModelConfig.stream_reduce=None`` resolves to.
        stream_reductions: the ``stream_reduce`` values the form accepts.
        stream_scaling: whether learned stream scaling (``lss_init``) applies (several streams to scale).
        compute_options: whether the connection takes ``fused`` / ``recompute`` / ``kernels``.
        mixes_streams: whether its connections hold several streams in ``(B, T, n, C)`` and give
            ``matrices(x)`` (``pre``, ``post``, ``res``): what the stream diagnostics read.
        has_res: whether those matrices include a residual matrix ``H_res`` that mixes the streams, so that the
            ``H_res`` measures (sums, spectral norms, composites over depth) mean something; the gated residual's
            ``res`` is the identity it never leaves.
        connection_options: the options beside the family's own that the connection takes (``eps``, ...).
        coefficient_paths: the ``fused`` values under which the bench times the connection's coefficient path
            alone (:meth:`coefficient_probe`): ``(True, False)``, its fast path and its reference; ``(True,)``, its
            one path; ``()``, nothing token-driven to time apart from the step (AttnRes's depth softmax, the wide
            residual's fixed maps).
        option_kinds: the types each of its options takes (``{"rank": {"int"}}``; type names as a constructor's
            annotation writes them), which :meth:`check_option_values` checks.
    """

    name: str = ""
    summary: str = ""
    min_streams: int = 1
    max_streams: int | None = None
    default_streams: int = 4
    pre_norms: bool = True
    default_stream_reduce: str = "sum"
    stream_reductions: tuple[str, ...] = ("sum", "mean", "head")
    stream_scaling: bool = True
    compute_options: bool = False
    mixes_streams: bool = True
    has_res: bool = False
    connection_options: tuple[str, ...] = ()
    option_kinds: Mapping[str, set[str]] = {}
    coefficient_paths: tuple[bool, ...] = ()

    # ---- options ---------------------------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The form's own options and their defaults (those a model's ``family_options`` may give)."""
        return {}

    def allowed_options(self) -> list[str]:
        """Every key a model's ``family_options`` may hold for this form, sorted."""
        return sorted({*self.options(), *self.connection_options})

    def check_options(self, options: Mapping[str, Any], what: str = "family_options") -> None:
        """ValueError naming the form and the allowed keys for an option it does not take (``what``: how the
        message names them, a model's ``family_options`` or a connection's ``option(s)``)."""
        unknown = sorted(set(options) - set(self.allowed_options()))
        if unknown and not self.allowed_options():
            raise ValueError(f"family={self.name!r} takes no {what}, got {unknown}")
        if unknown:
            raise ValueError(f"unknown {what} {unknown} for family {self.name!r}; allowed: {self.allowed_options()}")

    def check_option_values(self, options: Mapping[str, Any], n_streams: int) -> dict[str, Any]:
        """``options`` with each value checked by the type it takes (:attr:`option_kinds`; numeric strings of float
        options converted), so that a bad value fails when a run's configuration is read, before any data; unknown
        keys are left to :meth:`check_options`. A form whose values need more (a mixer to build) overrides it."""
        checked = dict(options)
        for name, kinds in self.option_kinds.items():
            if name in checked:
                checked[name] = check_option_value(self.name, name, checked[name], kinds)
        return checked

    def check_sizes(self, options: Mapping[str, Any], *, dim: int, n_streams: int, n_sublayers: int) -> None:
        """ValueError (one line, naming the option, its value and the range) for an option whose value the model's
        sizes bound: the gated residual's ``rank``, AttnRes's ``block_size``. Nothing to check by default."""

    def check_model(self, *, dim: int, n_streams: int, n_sublayers: int, stream_reduce: str, lss_init: float | None,
                    options: Mapping[str, Any]) -> None:
        """ValueError (one line naming the setting) unless a model of this form can be built with these settings:
        the stream count, the final read ``stream_reduce``, learned stream scaling ``lss_init`` (None: none), the
        option keys and the values the model's sizes bound (``dim``, ``n_sublayers`` wrapped branches). What
        :class:`s2hc.models.ModelConfig` and :class:`s2hc.Connections` check."""
        self.check_streams(n_streams)
        if stream_reduce == "head" and "head" not in self.stream_reductions and self.max_streams == 1:
            raise ValueError(f"stream_reduce='head' weighs several streams; family={self.name!r} has one, so use "
                             "'sum' (or choose a multi-stream family)")
        if stream_reduce not in self.stream_reductions:
            raise ValueError(f"stream_reduce must be one of {list(self.stream_reductions)} for family="
                             f"{self.name!r}, got {stream_reduce!r}")
        if lss_init is not None and not self.stream_scaling:
            raise ValueError(f"lss_init scales several streams; family={self.name!r} has one, got lss_init="
                             f"{lss_init!r} (leave it None or choose a multi-stream family)")
        self.check_options(options)
        self.check_sizes(options, dim=dim, n_streams=n_streams, n_sublayers=n_sublayers)

    def check_streams(self, n_streams: int, argument: str = "n_streams") -> int:
        """``n_streams`` when the form accepts it; ValueError naming the form and the accepted range otherwise."""
        check_int(argument, n_streams)
        low, high = self.min_streams, self.max_streams
        if n_streams < low or (high is not None and n_streams > high):
            allowed = f"{low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
            raise ValueError(f"{argument} must be {allowed} for family={self.name!r}, got {n_streams}")
        return n_streams

    # ---- modules -----------------------------------------------------------------------------------------------

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        """The connection around one branch. ``layer_index`` is the block's index (both sublayers of a block get
        it, as in the s²HC authors' code); ``sublayer`` the branch's index over the whole model (``2·layer`` for
        attention, ``2·layer + 1`` for the MLP) of ``n_sublayers``, for forms that carry state across them."""
        raise NotImplementedError

    def attention_inputs(self, options: Mapping[str, Any], local: bool = False) -> int:
        """How many inputs a layer's attention branch takes (``local``: a sliding-window layer): 1; a form that
        reads more (AttnRes's ``qkv_reads``: 3, the query, key and value inputs) builds that sublayer's connection
        with ``num_queries`` of them (:meth:`build`, :meth:`flops`), and the model gives each input its own
        pre-norm."""
        return 1

    def sublayer_options(self, options: Mapping[str, Any], sublayer: int, sublayers_per_layer: int = 2,
                         local: bool = False) -> dict[str, Any]:
        """The keywords :meth:`build` and :meth:`flops` take for sublayer ``sublayer`` beyond the family's options:
        ``num_queries`` for a layer's attention (its first sublayer) where :meth:`attention_inputs` gives it several
        inputs, else none. What the model, :class:`s2hc.Connections`, the FLOP and the parameter counts all ask."""
        inputs = self.attention_inputs(options, local)
        return {"num_queries": inputs} if inputs > 1 and sublayer % sublayers_per_layer == 0 else {}

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        """The learned final read of ``stream_reduce="head"``: DeepSeek-V4's :class:`~s2hc.HyperHead` unless the
        form has its own."""
        return HyperHead(dim, n_streams, eps=norm_eps, hc_eps=options.get("hc_eps", DEEPSEEK_V4_EPS))

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, **options: Any) -> Count:
        """Forward FLOPs per token of the connection around sublayer ``sublayer`` of ``n_sublayers`` with streams of
        width ``dim`` (:mod:`s2hc.counts`); ``options`` the family's, the connection's own keywords removed. A form
        must count itself: this default refuses, naming the form."""
        raise ValueError(f"no FLOP count for the connection form of {self.name!r} ({type(self).__name__}): define "
                         f"{type(self).__name__}.flops")

    def state_size(self, n_streams: int, n_sublayers: int, options: Mapping[str, Any]) -> int:
        """How many ``(B, T, C)`` tensors the last block hands on to the final read: the n streams by default
        (AttnRes: its sources)."""
        return n_streams

    def head_flops(self, dim: int, n_streams: int, *, n_sublayers: int, options: Mapping[str, Any]) -> Count:
        """Forward FLOPs per token of the learned final read (:meth:`build_head`): DeepSeek-V4's HyperHead by default
        (an RMSNorm over nC, an ``nC × n`` product, σ, and the weighted sum)."""
        n = n_streams
        return count(2 * n * dim * n, 3 * n * dim + 3 * n + 2 * n * dim)

    def coefficient_probe(self, dim: int, n_streams: int, generator: torch.Generator) -> CoefficientProbe:
        """The connection and the call ``s2hc bench`` times as the coefficient path (:class:`CoefficientProbe`), for
        a form with :attr:`coefficient_paths`; ``generator`` draws any parameter that would otherwise start at a
        value that lets a path skip work."""
        raise ValueError(f"family {self.name!r} has no coefficient path of its own to time apart from the step")

    def replaces_final_norm(self, stream_reduce: str) -> bool:
        """Whether the form's head is normalised itself, so the model has no final norm after it."""
        return False

    def expand(self, h: torch.Tensor, n_streams: int) -> Any:
        """The state the first block reads, from the embeddings ``h`` ``(B, T, C)``: n copies ``(B, T, n, C)``."""
        return expand_streams(h, n_streams)

    def reduce(self, x: Any, mean: bool = False) -> torch.Tensor:
        """The last block's state -> ``(B, T, C)`` without a learned head: the streams' sum (their mean with
        ``mean``)."""
        reduced = reduce_streams(x)
        return reduced / x.shape[-2] if mean else reduced

    def projection_width(self, n_streams: int, **options: Any) -> int | None:
        """Width of the connection's n·C-wide coefficient projection, None where it has none."""
        return None

    def res_guarantees(self) -> Guarantees:
        """What the matrix applied to the streams guarantees (:class:`~s2hc.mixers.Guarantees`): the identity's
        for a form that never mixes them (the gated and wide residuals)."""
        return mixers.get("identity").guarantees

    def upcycle_refusal(self) -> str | None:
        """Why a residual model cannot become this form with the same function (None: it can)."""
        return None

    def __repr__(self) -> str:
        return f"<connection form {self.name!r}>"


class OneStreamForm(ConnectionForm):
    """What every one-stream form declares (the plain residual, the variance-preserving and affine residuals): one
    stream, summed or averaged at the end, no stream scaling and no stream matrices; it takes the compute options
    every hyper-connection takes and ignores them (one stream: one way to add)."""

    min_streams = max_streams = default_streams = 1
    stream_reductions = ("sum", "mean")
    stream_scaling = False
    mixes_streams = False
    compute_options = True
