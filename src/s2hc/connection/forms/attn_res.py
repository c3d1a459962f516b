"""Attention Residuals (AttnRes; Kimi, arXiv 2603.15031): each sublayer reads a softmax-weighted sum over the
outputs of the sublayers before it (Full) or over block summaries (Block), instead of their plain sum.

With sources ``v_0 = `` the embedding and ``v_j`` the output of sublayer ``j`` (attention and MLP each count as
one sublayer), sublayer ``l`` reads::

    h_l = Σ_i α_{i→l} v_i,   α_{·→l} = softmax_i( w_lᵀ RMSNorm(v_i) )

over its sources ``i``, with ``w_l ∈ R^C`` a learned pseudo-query per sublayer (zero at init: a uniform softmax)
and an RMSNorm with a learned weight on the keys only (the values are the raw sources), as the paper and
flash-linear-attention's ``fused_attnres`` have it. **Block** AttnRes groups the sublayers into blocks of
``block_size``: the sources are the embedding, the sum of each completed block's outputs and the partial sum of
the current block, so the state holds ``1 + ⌈l / block_size⌉`` tensors instead of ``l + 1``. ``block_size=1`` is
**Full** AttnRes. The model's output is read the same way by one more query (:class:`AttnResHead`), before the
final norm.

The state between sublayers is a tuple of ``(B, T, C)`` tensors (the sources), not a ``(B, T, n, C)`` tensor: a
growing concatenation would copy every source at every sublayer and keep each copy for the backward pass
(quadratic memory in depth). The logits are computed as ``(v_i · (w ⊙ g)) / rms(v_i)`` (``g`` the key norm's
weight), so a call keeps only its per-token scalars besides the sources themselves.

Released models differ from the paper in named options (:data:`CONVENTIONS`, :class:`DepthAttention`): Inkling-2
(``s2hc.hf.inkling2``) normalises its keys without a weight, reads the normalised sources as values, scales the
logits by ``C^-1/2``, gives its first sublayer no read, and reads three queries in its full-attention layers,
one each for the inputs of the query, key and value projections (the form's ``qkv_reads``: each global layer's
attention reads three, :meth:`AttnResForm.attention_inputs`; a connection's ``num_queries=3``); Kimi-K3
(``s2hc.hf.kimi_k3``) is the paper's read with blocks of 24 sublayers. ``block_size`` counts sublayers (a block of
k layers is ``2k``).

At init every query is zero, so each sublayer reads the *mean* of its sources. With pre-norm branches that is the
residual model's function (the mean and the residual sum differ by a positive factor per token, which the
branch's RMSNorm and the final norm remove, up to their epsilon), so an AttnRes model starts as the residual
model with the same weights.

Under ``torch.compile`` (``s2hc train --compile`` compiles each block, :mod:`s2hc.train.compiling`) a connection's
graph depends on what its forward reads of the module as constants: the count of sources comes from the tuple it
is handed (checked against ``sublayer`` only when not compiling) and whether it begins a block from the bool
``begins_block``, never from the integer ``sublayer``, so blocks differ only by the number of sources and where
they sit in an AttnRes block. A tuple of another length is another input structure, so Full AttnRes still compiles
one graph per block, and Block AttnRes about two per AttnRes block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...checks import check_bool, check_float, check_int
from ...counts import Count, count
from ...mixers.base import coefficient_dtype
from ..base import Connection, ConnectionModule, StreamHead, _stream_precision, call_branch, check_device
from .base import ConnectionForm

#: The paper's Block AttnRes: about eight blocks over the depth (``block_size=None`` chooses the size for that).
DEFAULT_BLOCKS = 8
VARIANTS = ("block", "full")
KEY_NORMS = ("weighted", "unweighted")
VALUES = ("raw", "normed")
#: The read's conventions: the paper's (the defaults) and each released model's that differs (docs/mixers.md,
#: "Production designs"; the converters in :mod:`s2hc.hf.inkling2` and :mod:`s2hc.hf.kimi_k3`).
CONVENTIONS = {
    "paper": dict(key_norm="weighted", values="raw", scaled_logits=False, read_first=True),
    "inkling2": dict(key_norm="unweighted", values="normed", scaled_logits=True, read_first=False),
    "kimi-k3": dict(key_norm="weighted", values="raw", scaled_logits=False, read_first=True),
}


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"family option {name!r} of 'attn-res' must be one of {list(choices)}, got {value!r}")
    return value


def _check_sources(sources: Any, count: int | None, dim: int, what: str) -> tuple[torch.Tensor, ...]:
    """``sources`` as a tuple of ``(B, T, dim)`` floating tensors (``count`` of them when given), or an error."""
    if isinstance(sources, torch.Tensor) or not isinstance(sources, (tuple, list)) or not sources:
        got = tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__
        raise TypeError(f"{what} takes the depth sources, a tuple of (batch, time, dim) tensors (the embedding, "
                        f"then each block's sum), got {got}")
    first = sources[0]
    for source in sources:
        if (not isinstance(source, torch.Tensor) or not source.is_floating_point() or source.dim() != 3
                or source.shape != first.shape or source.shape[-1] != dim):
            got = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
            raise ValueError(f"{what}: every source must be a floating (batch, time, dim={dim}) tensor of one "
                             f"shape, got {got}")
    if count is not None and len(sources) != count:
        raise ValueError(f"{what} expects {count} sources here (the embedding and each block so far), got "
                         f"{len(sources)}")
    return tuple(sources)


class DepthAttention(ConnectionModule):
    """The softmax read over depth sources: a pseudo-query ``query`` ``(C,)`` (zero at init) against the sources
    RMS-normalised with a learned weight ``key_norm_weight`` ``(C,)`` (one at init).

    The conventions (the paper's by default; each other value is a released model's, :data:`CONVENTIONS`):

    * ``key_norm``: ``"weighted"``, the keys' RMSNorm has a learned weight (the paper, Kimi-K3); ``"unweighted"``,
      it has none (Inkling-2's ``Inkling2UnweightedRMSNorm``): no ``key_norm_weight`` parameter.
    * ``values``: ``"raw"``, the values are the sources themselves (the paper, Kimi-K3); ``"normed"``, the values
      are the keys, the sources RMS-normalised (Inkling-2 hands the normalised states to attention as both).
    * ``scaled_logits``: False, the logits are ``wᵀ RMSNorm(v)`` (the paper, Kimi-K3); True, times ``C^-1/2``
      (Inkling-2 calls scaled dot-product attention with ``scaling=hidden_size**-0.5``).
    * ``num_queries``: queries read at once (Inkling-2's full-attention layers read three, the inputs of the
      query, key and value projections): ``query`` is ``(num_queries, C)`` when more than one, as Inkling-2's.
    * ``reads``: False for a connection that reads nothing and has no parameters (Inkling-2's first layer has no
      ``attention_input``: its attention takes the embedding itself; with ``values="normed"`` a one-source read
      would normalise it).

    ``weights(sources)``: a tuple of ``(B, T, C)`` -> ``(B, T, S)`` (``(B, T, Q, S)`` with ``num_queries > 1``) in
    at least float32 (sums to 1 over S); ``forward(sources)`` -> ``(B, T, C)`` in the sources' dtype."""

    depth_read = True

    def __init__(self, dim: int, eps: float = 1e-6, *, key_norm: str = "weighted", values: str = "raw",
                 scaled_logits: bool = False, num_queries: int = 1, reads: bool = True):
        super().__init__()
        self.dim = check_int("dim", dim)
        self.eps = check_float("eps", eps, positive=True)
        self.key_norm = _check_choice("key_norm", key_norm, KEY_NORMS)
        self.values = _check_choice("values", values, VALUES)
        self.scaled_logits = check_bool("scaled_logits", scaled_logits)
        self.num_queries = check_int("num_queries", num_queries)
        self.reads = check_bool("reads", reads)
        if reads:
            self.query = nn.Parameter(torch.zeros(dim) if num_queries == 1 else torch.zeros(num_queries, dim))
        else:
            self.register_parameter("query", None)
        if reads and key_norm == "weighted":
            self.key_norm_weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("key_norm_weight", None)

    @property
    def paper_conventions(self) -> bool:
        return self.key_norm == "weighted" and self.values == "raw" and not self.scaled_logits

    def _logits(self, sources: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """``(logits (B, T, Q, S), the sources cast, their inverse RMS (B, T) each)`` in the coefficient dtype."""
        dtype = coefficient_dtype(sources[0].dtype)
        query = self.query.to(dtype).reshape(-1, self.dim)
        if self.key_norm_weight is not None:
            query = query * self.key_norm_weight.to(dtype)
        cast = [source.to(dtype) for source in sources]
        inverse_rms = [torch.rsqrt(v.square().mean(-1) + self.eps) for v in cast]
        logits = torch.stack([(v @ query.T) * r[..., None] for v, r in zip(cast, inverse_rms)], dim=-1)
        if self.scaled_logits:
            logits = logits * self.dim ** -0.5
        return logits, cast, inverse_rms

    def weights(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        check_device(sources[0], self, "sources")
        if not self.reads:  # the branch takes the first source whole: weight 1 on one source
            shape = (*sources[0].shape[:-1], *((self.num_queries,) if self.num_queries > 1 else ()), 1)
            return torch.ones(shape, dtype=coefficient_dtype(sources[0].dtype), device=sources[0].device)
        if self.paper_conventions and self.num_queries == 1:
            dtype = coefficient_dtype(sources[0].dtype)
            scaled_query = self.query.to(dtype) * self.key_norm_weight.to(dtype)
            logits = [(v @ scaled_query) * torch.rsqrt(v.square().mean(-1) + self.eps)
                      for v in (source.to(dtype) for source in sources)]  # each source cast once
            return torch.softmax(torch.stack(logits, dim=-1), dim=-1)
        weights = torch.softmax(self._logits(sources)[0], dim=-1)
        return weights[..., 0, :] if self.num_queries == 1 else weights

    def read_all(self, sources: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(hs, weights)``: one weighted sum ``(B, T, C)`` per query in the sources' dtype and the weights
        ``(B, T, Q, S)``; without a read (``reads=False``), the first source for each query and no weights."""
        if not self.reads:
            return (sources[0],) * self.num_queries, sources[0].new_ones(*sources[0].shape[:-1], 1, 1)
        if self.paper_conventions and self.num_queries == 1:
            h, weights = self.read(sources)
            return (h,), weights[..., None, :]
        with _stream_precision(sources[0]):
            check_device(sources[0], self, "sources")
            logits, cast, inverse_rms = self._logits(sources)
            weights = torch.softmax(logits, dim=-1)
            values = [v * r[..., None] for v, r in zip(cast, inverse_rms)] if self.values == "normed" else cast
            dtype = sources[0].dtype
            hs = tuple(sum(weights[..., q, i, None] * value for i, value in enumerate(values)).to(dtype)
                       for q in range(self.num_queries))
        return hs, weights

    def read(self, sources: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, weights)``: the weighted sum ``(B, T, C)`` in the sources' dtype and the weights ``(B, T, S)``
        (one query)."""
        if not (self.paper_conventions and self.num_queries == 1):
            hs, weights = self.read_all(sources)
            if self.num_queries != 1:
                raise ValueError(f"{type(self).__name__} reads {self.num_queries} queries: use read_all")
            return hs[0], weights[..., 0, :]
        with _stream_precision(sources[0]):
            weights = self.weights(sources)
            dtype = sources[0].dtype
            h = sum(weights[..., i, None].to(dtype) * source for i, source in enumerate(sources))
        return h, weights

    def forward(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.read(_check_sources(sources, None, self.dim, type(self).__name__))[0]

    def read_bounds(self, num_sources: int) -> list[dict[str, float]]:
        """What the weights alone say this read can do over ``num_sources`` sources, whatever the sources hold
        (``s2hc diagnose --static``), one dict per query (none without a read). The logits are ``uᵀ k̂`` with ``u``
        the effective query (the pseudo-query, times the key norm's weight where it has one, times ``C^-1/2`` where
        the logits are scaled) and ``k̂`` a source RMS-normalised, ``‖k̂‖₂ ≤ √C``: so they lie within
        ``±‖u‖₂ √C``, their range is at most ``R = 2 ‖u‖₂ √C`` (``logit_range``), and the weight any one of the S
        sources can get lies between ``weight_min = 1 / (1 + (S − 1) e^R)`` and ``weight_max = e^R / (e^R + S −
        1)``, both ``1/S`` for a zero query (the initialisation: a uniform read). Also ``query_norm`` ``‖u‖₂``.
        Bounds, reached only by sources aligned with ``±u``; computed in float64."""
        num_sources = check_int("num_sources", num_sources)
        if not self.reads:
            return []
        query = self.query.detach().double().reshape(-1, self.dim)
        if self.key_norm_weight is not None:
            query = query * self.key_norm_weight.detach().double()
        if self.scaled_logits:
            query = query * self.dim ** -0.5
        bounds = []
        for norm in query.norm(dim=-1).tolist():
            spread = 2 * norm * math.sqrt(self.dim)
            # e^R / (e^R + S − 1) without overflow: 1 / (1 + (S − 1) e^−R)
            high = 1 / (1 + (num_sources - 1) * math.exp(-spread))
            low = 1 / (1 + (num_sources - 1) * math.exp(spread)) if spread < 700 else 0.0
            bounds.append({"query_norm": norm, "logit_range": spread, "weight_min": low, "weight_max": high})
        return bounds

    def conventions(self) -> dict[str, Any]:
        """The options that decide what the read computes (what a converter checks)."""
        return {"eps": self.eps, "key_norm": self.key_norm, "values": self.values,
                "scaled_logits": self.scaled_logits, "num_queries": self.num_queries, "reads": self.reads}


class AttnResConnection(DepthAttention, Connection):
    """Attention Residuals around one branch (module docstring).

    Args:
        dim: the width C.
        n_streams: 1 (the state holds depth sources, not parallel streams).
        layer_index: the block's index (bookkeeping).
        sublayer: this branch's index over the model's sublayers (0-based).
        block_size: sublayers per block (1: Full AttnRes).
        eps: the key norm's epsilon.
        key_norm, values, scaled_logits, num_queries: the read's conventions (:class:`DepthAttention`).
        read_first: False: sublayer 0 reads nothing and has no parameters (its branch takes the embedding).

    ``forward(sources, branch, *args, **kwargs)``: ``sources`` a tuple of ``1 + ⌈sublayer / block_size⌉``
    ``(B, T, C)`` tensors; calls ``branch(h, *args, **kwargs)`` on the weighted read ``h`` (with
    ``num_queries=Q > 1``, ``branch(h_1, ..., h_Q, *args, **kwargs)``, one read per query: Inkling-2's
    full-attention layers call ``branch(h_q, h_k, h_v)``) and returns the new sources: the branch output appended
    as a new block when ``sublayer`` starts one, else added to the last.
    """

    projections: tuple[str, ...] = ()  # the query and the norm weight are not token-driven matrices: no decay

    def __init__(self, dim: int, n_streams: int = 1, layer_index: int = 0, *, sublayer: int = 0, block_size: int = 1,
                 eps: float = 1e-6, key_norm: str = "weighted", values: str = "raw", scaled_logits: bool = False,
                 num_queries: int = 1, read_first: bool = True):
        read_first = check_bool("read_first", read_first)
        super().__init__(dim, eps, key_norm=key_norm, values=values, scaled_logits=scaled_logits,
                         num_queries=num_queries, reads=read_first or sublayer != 0)
        self.read_first = read_first
        if n_streams != 1:
            raise ValueError(f"n_streams must be 1 for family='attn-res' (its state is the depth sources), "
                             f"got {n_streams}")
        self.n_streams = 1
        self.layer_index = check_int("layer_index", layer_index, minimum=0)
        self.sublayer = check_int("sublayer", sublayer, minimum=0)
        self.block_size = check_int("block_size", block_size)
        # A bool, not the integers: torch.compile guards on what forward reads of the module, and the integers would
        # make every block's graph its own (module docstring).
        self.begins_block = sublayer % block_size == 0

    @property
    def family(self) -> str:
        return ATTN_RES.name

    @property
    def num_sources(self) -> int:
        """How many sources this sublayer reads: the embedding and one per block begun before it."""
        return sources_read(self.sublayer, self.block_size)

    def depth_weights(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The softmax weights ``(B, T, S)`` this sublayer gives its sources (the form's diagnostic)."""
        return self.weights(_check_sources(sources, self.num_sources, self.dim, type(self).__name__))

    def forward(self, sources: tuple[torch.Tensor, ...], branch: Callable[..., torch.Tensor], *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        # The count is checked eagerly; under torch.compile the tuple's length is the graph's own guard.
        count = None if torch.compiler.is_compiling() else self.num_sources
        sources = _check_sources(sources, count, self.dim, type(self).__name__)
        if self.num_queries == 1 and self.reads:
            h, _ = self.read(sources)
            out = call_branch(branch, h, args, kwargs).to(h.dtype)
        else:
            hs, _ = self.read_all(sources)
            out = call_branch(branch, hs[0], (*hs[1:], *args), kwargs).to(hs[0].dtype)
        if self.begins_block:
            return (*sources, out)
        return (*sources[:-1], sources[-1] + out)

    def extra_repr(self) -> str:
        conventions = "" if self.paper_conventions and self.num_queries == 1 and self.read_first else (
            f", key_norm={self.key_norm!r}, values={self.values!r}, scaled_logits={self.scaled_logits}, "
            f"num_queries={self.num_queries}, read_first={self.read_first}")
        return f"dim={self.dim}, sublayer={self.sublayer}, block_size={self.block_size}, eps={self.eps}{conventions}"


class AttnResHead(DepthAttention, StreamHead):
    """The model's output read over every source (the paper's last query): a tuple of ``(B, T, C)`` -> ``(B, T, C)``."""

    projections: tuple[str, ...] = ()

    def depth_weights(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.weights(_check_sources(sources, None, self.dim, type(self).__name__))


def block_size_for(variant: str, block_size: int | None, n_sublayers: int, bounded: bool = False) -> int:
    """Sublayers per block: 1 for ``"full"``; for ``"block"`` ``block_size``, or ``⌈n_sublayers / 8⌉`` when None
    (the paper's eight blocks). ``bounded``: ``block_size`` at most ``n_sublayers`` (a larger block is the one block
    of ``n_sublayers``, the same model under another name)."""
    if variant not in VARIANTS:
        raise ValueError(f"family option 'variant' of 'attn-res' must be one of {list(VARIANTS)}, got {variant!r}")
    if variant == "full":
        if block_size not in (None, 1):
            raise ValueError(f"variant='full' reads every sublayer (block_size 1), got block_size={block_size!r}")
        return 1
    if block_size is None:
        return max(1, math.ceil(n_sublayers / DEFAULT_BLOCKS))
    return check_int("family option 'block_size' of 'attn-res'", block_size, maximum=n_sublayers if bounded else None)


def sources_read(sublayer: int, block_size: int) -> int:
    """The sources ``sublayer`` reads: the embedding and one per block begun before it (the model's output read,
    after the last of ``L`` sublayers: ``sources_read(L, block_size)``)."""
    return 1 + math.ceil(sublayer / block_size)


def _read_flops(dim: int, sources: int, values: str = "raw", scaled_logits: bool = False, queries: int = 1) -> int:
    """A softmax read of ``queries`` queries over ``sources`` sources, all elementwise: per source its mean square
    and scale (``3C`` + 2) and, with ``values="normed"``, the source scaled by its inverse RMS (``C``), once; per
    source and query its dot with the query (``2C``; a matrix-vector product, which FlopCounterMode does not
    count), the softmax (5), the weighted sum (``2C``) and, with ``scaled_logits``, the logit times ``C^-1/2``
    (1)."""
    shared = 3 * dim + 2 + (dim if values == "normed" else 0)
    per_query = 2 * dim + 5 + 2 * dim + (1 if scaled_logits else 0)
    return sources * (shared + queries * per_query)


class AttnResForm(ConnectionForm):
    name = "attn-res"
    summary = "Attention Residuals: a softmax read over earlier sublayers (Full) or block sums (Block)"
    min_streams = max_streams = default_streams = 1
    default_stream_reduce = "head"
    stream_scaling = False
    mixes_streams = False
    connection_options = ("eps",)
    option_kinds = {"variant": {"str"}, "block_size": {"int", "None"}, "eps": {"float"}, "key_norm": {"str"},
                    "values": {"str"}, "scaled_logits": {"bool"}, "read_first": {"bool"}, "qkv_reads": {"bool"}}

    def options(self) -> dict[str, Any]:
        """``variant``, ``block_size`` (in sublayers: an attention and an MLP are two), the read's conventions,
        the paper's by default (:data:`CONVENTIONS`; Inkling-2's are ``key_norm="unweighted"``,
        ``values="normed"``, ``scaled_logits=True``, ``read_first=False``), and ``qkv_reads``: False, every
        sublayer reads one query (the paper); True, each global layer's attention reads three, one each for the
        inputs of its query, key and value projections, each through its own pre-norm (Inkling-2's full-attention
        layers; its sliding-window layers read one, as s2hc's local layers do)."""
        return {"variant": "block", "block_size": None, **CONVENTIONS["paper"], "qkv_reads": False}

    def attention_inputs(self, options: Mapping[str, Any], local: bool = False) -> int:
        """3 for a global layer's attention with ``qkv_reads`` (its query, key and value inputs), else 1."""
        return 3 if options.get("qkv_reads", False) and not local else 1

    def check_options(self, options: Mapping[str, Any], what: str = "family_options") -> None:
        super().check_options(options, what)
        block_size_for(options.get("variant", "block"), options.get("block_size"), 1)
        _check_choice("key_norm", options.get("key_norm", "weighted"), KEY_NORMS)
        _check_choice("values", options.get("values", "raw"), VALUES)

    def check_sizes(self, options: Mapping[str, Any], *, dim: int, n_streams: int, n_sublayers: int) -> None:
        block_size_for(options.get("variant", "block"), options.get("block_size"), n_sublayers, bounded=True)

    def build(self, dim: int, n_streams: int, layer_index: int = 0, *, sublayer: int = 0, n_sublayers: int = 1,
              **options: Any) -> nn.Module:
        num_queries = options.pop("num_queries", 1)  # the caller's, from attention_inputs: not a family option
        self.check_options(options, "option(s)")
        size = block_size_for(options.pop("variant", "block"), options.pop("block_size", None), n_sublayers)
        options.pop("qkv_reads", None)
        return AttnResConnection(dim, n_streams, layer_index, sublayer=sublayer, block_size=size,
                                 num_queries=num_queries, **options)

    def build_head(self, dim: int, n_streams: int, *, norm_eps: float, options: Mapping[str, Any]) -> nn.Module:
        return AttnResHead(dim, eps=options.get("eps", 1e-6), key_norm=options.get("key_norm", "weighted"),
                           values=options.get("values", "raw"), scaled_logits=options.get("scaled_logits", False))

    def expand(self, h: torch.Tensor, n_streams: int) -> tuple[torch.Tensor, ...]:
        if not isinstance(h, torch.Tensor) or h.dim() != 3:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(f"h must have shape (batch, time, dim), got {got}")
        return (h,)

    def reduce(self, x: tuple[torch.Tensor, ...], mean: bool = False) -> torch.Tensor:
        """Without the output query (``stream_reduce="sum"`` or ``"mean"``): the sources' sum, which is the
        residual stream (the embedding plus every output), or their mean."""
        sources = _check_sources(x, None, x[0].shape[-1] if isinstance(x, tuple) and x else 0, "reduce")
        total = sum(sources[1:], sources[0])
        return total / len(sources) if mean else total

    def flops(self, dim: int, n_streams: int, *, sublayer: int, n_sublayers: int, variant: str = "block",
              block_size: int | None = None, values: str = "raw", scaled_logits: bool = False,
              read_first: bool = True, num_queries: int = 1, **options: Any) -> Count:
        """Its softmax read of ``num_queries`` queries (:meth:`attention_inputs`) over its sources (none at
        sublayer 0 with ``read_first=False``), and the output added to the current block (or appended as a new
        one: no FLOP)."""
        size = block_size_for(variant, block_size, n_sublayers)
        read = 0 if sublayer == 0 and not read_first else _read_flops(dim, sources_read(sublayer, size), values,
                                                                        scaled_logits, num_queries)
        return count(0, read + (dim if sublayer % size else 0))

    def state_size(self, n_streams: int, n_sublayers: int, options: Mapping[str, Any]) -> int:
        """The sources the last sublayer hands on: the embedding and one per block."""
        size = block_size_for(options.get("variant", "block"), options.get("block_size"), n_sublayers)
        return sources_read(n_sublayers, size)

    def head_flops(self, dim: int, n_streams: int, *, n_sublayers: int, options: Mapping[str, Any]) -> Count:
        """The output query's read over every source."""
        return count(0, _read_flops(dim, self.state_size(n_streams, n_sublayers, options),
                                    options.get("values", "raw"), options.get("scaled_logits", False)))

    def upcycle_refusal(self) -> str | None:
        return ("its sublayers read the mean of their sources, the residual sum's direction but not its scale, so "
                "it starts as the source only up to the norms' epsilon")


ATTN_RES = AttnResForm()
