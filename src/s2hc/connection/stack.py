"""Every connection module of a model of one family, from one string: :class:`Connections`, the entry point for
wrapping the branches of one's own model (README, "Wrap a branch")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checks import check_float, check_int
from . import forms
from .streams import StreamScaling


class Connections(nn.Module):
    """The connections around every branch of a model, with the stream expansion, the final read and (for AttnRes)
    the sources carried between sublayers that family ``family`` needs: one string switches the method.

    Args:
        dim: the width C of the branches' input and output.
        n_sublayers: how many branches the model wraps, in the order it calls them (2 per transformer block:
            attention, then MLP).
        family: any of :func:`s2hc.families` (``"residual"``, ``"mhc"``, ``"s2hc"``, ``"gated-residual"``,
            ``"attn-res"``, ``"wide-residual"``, ...).
        n_streams: the streams n (None: the family's default, :func:`s2hc.connection.forms.default_streams`).
        stream_reduce: the final read (None: the family's default): ``"sum"`` or ``"mean"`` of the streams, or
            ``"head"``, the family's learned read (DeepSeek-V4's HyperHead for the hyper-connections, Qwen's gated
            read, AttnRes's output query).
        lss_init: learned stream scaling after the expansion, started at this value (None: none).
        sublayers_per_layer: branches per block: the connection around branch ``i`` gets ``layer_index = i //
            sublayers_per_layer``, so both sublayers of a block start favouring the same stream, as in the s²HC
            authors' code and :class:`s2hc.models.Transformer`.
        norm_eps: the epsilon of a learned head's norm.
        **options: the family's options and its connection's own (``eps``, ``transpose_res``, ...), as a model's
            ``family_options``.

    Use (``x`` is the state the family carries: streams ``(B, T, n, C)``, or AttnRes's tuple of sources; pass it
    on, never look inside)::

        x = connections.expand(h)                 # h (B, T, C), the embeddings
        x = connections[i](x, branch, *args)      # branch i, called as branch(h_i, *args): (B, T, C) -> (B, T, C)
                                                  # (AttnRes's qkv_reads: each layer's first branch, its attention,
                                                  # as branch(h_q, h_k, h_v, *args))
        out = connections.reduce(x)               # (B, T, C), before the final norm

    ``pre_norms``: whether the branches keep their own pre-norm (False for the gated residual, whose read is
    normalised); ``final_norm``: whether a final norm belongs after :meth:`reduce` (False where the learned head is
    normalised itself). A bad setting is one ValueError naming it, as for :class:`s2hc.models.ModelConfig`.
    """

    def __init__(self, dim: int, n_sublayers: int, family: str = "s2hc", *, n_streams: int | None = None,
                 stream_reduce: str | None = None, lss_init: float | None = None, sublayers_per_layer: int = 2,
                 norm_eps: float = 1e-6, **options: Any):
        super().__init__()
        form = forms.get(family)
        self.dim, self.n_sublayers = check_int("dim", dim), check_int("n_sublayers", n_sublayers)
        self.family = family
        self.n_streams = form.default_streams if n_streams is None else n_streams
        self.stream_reduce = form.default_stream_reduce if stream_reduce is None else stream_reduce
        check_int("sublayers_per_layer", sublayers_per_layer)
        if lss_init is not None:
            lss_init = check_float("lss_init", lss_init)
        form.check_model(dim=dim, n_streams=self.n_streams, n_sublayers=n_sublayers,
                         stream_reduce=self.stream_reduce, lss_init=lss_init, options=options)
        options = form.check_option_values(options, self.n_streams)
        self.connections = nn.ModuleList(
            form.build(dim, self.n_streams, sublayer // sublayers_per_layer, sublayer=sublayer,
                       n_sublayers=n_sublayers, **options,
                       **form.sublayer_options(options, sublayer, sublayers_per_layer))
            for sublayer in range(n_sublayers))
        self.scale = None if lss_init is None else StreamScaling(dim, self.n_streams, init=lss_init)
        self.head = None
        if self.stream_reduce == "head":
            self.head = form.build_head(dim, self.n_streams, norm_eps=norm_eps, options=options)
        self.pre_norms = form.pre_norms
        self.final_norm = not form.replaces_final_norm(self.stream_reduce)

    @property
    def form(self) -> forms.ConnectionForm:
        """The family's connection form (:mod:`s2hc.connection.forms`)."""
        return forms.get(self.family)

    def expand(self, h: torch.Tensor) -> Any:
        """The state the first branch reads, from the embeddings ``h`` ``(B, T, C)``: n copies ``(B, T, n, C)``
        (times the learned stream scaling), or AttnRes's sources ``(h,)``."""
        x = self.form.expand(h, self.n_streams)
        return x if self.scale is None else self.scale(x)

    def reduce(self, x: Any) -> torch.Tensor:
        """The last branch's state -> ``(B, T, C)``: the learned head's read, or the streams' sum or mean."""
        if self.head is not None:
            return self.head(x)
        return self.form.reduce(x, mean=self.stream_reduce == "mean")

    def forward(self, x: Any, sublayer: int, branch: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """``self[sublayer](x, branch, *args, **kwargs)``: branch ``sublayer`` inside its connection."""
        return self.connections[sublayer](x, branch, *args, **kwargs)

    def __getitem__(self, sublayer: int) -> nn.Module:
        return self.connections[sublayer]

    def __len__(self) -> int:
        return len(self.connections)

    def __iter__(self):
        return iter(self.connections)

    def extra_repr(self) -> str:
        return (f"family={self.family!r}, dim={self.dim}, n_streams={self.n_streams}, "
                f"stream_reduce={self.stream_reduce!r}")
