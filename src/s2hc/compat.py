"""A drop-in for ``get_init_and_expand_reduce_stream_functions`` of the ``hyper-connections`` package.

Code written for lucidrains' ``hyper-connections`` (0.4.x) switches to s2hc's connections by changing
one import::

    from hyper_connections import get_init_and_expand_reduce_stream_functions   # before
    from s2hc.compat import get_init_and_expand_reduce_stream_functions         # after

>>> import torch
>>> from s2hc.compat import get_init_and_expand_reduce_stream_functions
>>> init, expand_stream, reduce_stream = get_init_and_expand_reduce_stream_functions(4)
>>> block = init(dim=64, branch=torch.nn.Linear(64, 64), layer_index=0)
>>> residual = expand_stream(torch.randn(2, 8, 64))       # (b, t, d) -> (b*s, t, d)
>>> residual.shape
torch.Size([8, 8, 64])
>>> reduce_stream(block(residual)).shape                   # (b*s, t, d) -> (b, t, d)
torch.Size([2, 8, 64])

The streams are folded into the batch axis as in that package: ``(b*s, ..., d)``, batch outer and
streams inner (row ``i*s + j`` is stream ``j`` of sample ``i``). Each connection unfolds them to
``(b, T, s, d)``, runs :class:`s2hc.HyperConnection` and folds the result back.

Differences from the package: ``num_fracs`` and ``add_stream_embed`` accept only their defaults;
``init`` takes only ``dim``, ``branch`` and ``layer_index`` (no ``tanh``, ``dropout``, ``channel_first``
...); and ``layer_index=None`` means 0, where the package picks a random stream, so that a model
built twice starts the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import mixers
from .checks import check_int
from .connection import HyperConnection

__all__ = ["CompatHyperConnection", "ExpandStreams", "ReduceStreams", "get_init_and_expand_reduce_stream_functions"]


def _split_leading(residual: torch.Tensor, n_streams: int) -> int:
    """The batch size b of a folded residual ``(b*s, ..., d)``; ValueError if it is not one."""
    if residual.dim() < 2:
        raise ValueError(f"residual must have shape (batch * streams, ..., dim), got shape {tuple(residual.shape)}")
    if residual.shape[0] % n_streams:
        raise ValueError(
            f"residual's leading dimension must be divisible by num_streams={n_streams} "
            f"(shape (batch * streams, ..., dim)), got shape {tuple(residual.shape)}"
        )
    return residual.shape[0] // n_streams


class ExpandStreams(nn.Module):
    """``(b, ...) -> (b*s, ...)``: each sample repeated ``num_streams`` times, streams inner."""

    def __init__(self, num_streams: int):
        super().__init__()
        self.num_streams = num_streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.num_streams, dim=0)


class ReduceStreams(nn.Module):
    """``(b*s, ...) -> (b, ...)``: the sum over the streams of each sample."""

    def __init__(self, num_streams: int):
        super().__init__()
        self.num_streams = num_streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = _split_leading(x, self.num_streams)
        return x.reshape(batch, self.num_streams, *x.shape[1:]).sum(dim=1)


def _first_and_rest(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """A branch may return a tuple or list: its first element is the branch output, the rest pass through."""
    if isinstance(out, (tuple, list)):
        if not out:
            raise ValueError("branch returned an empty tuple; its first element must be the branch output")
        return out[0], lambda first: type(out)((first, *out[1:]))
    return out, lambda first: first


class CompatHyperConnection(nn.Module):
    """One connection in the package's calling conventions, on folded residuals ``(b*s, ..., d)``.

    ``hc`` is the :class:`s2hc.HyperConnection` doing the work, or ``None`` for a plain residual
    ``branch(x) + x`` (what ``disable=True`` gives; then ``num_streams`` is 1 and nothing is folded).

    - With ``branch``: ``module(residual, *args, **kwargs)`` calls ``branch(h, *args, **kwargs)`` on the
      branch input ``h`` ``(b, ..., d)`` and returns the new residual ``(b*s, ..., d)``; if the branch returns
      a tuple, its first element is the branch output and the rest are returned after the residual.
    - Without: ``branch_input, add_residual = module(residual)``, then
      ``residual = add_residual(branch(branch_input))``; or ``module.decorate_branch(branch)(residual)``.
    """

    def __init__(self, hc: HyperConnection | None, num_streams: int, branch: Callable | None = None):
        super().__init__()
        self.hc, self.num_streams, self.branch = hc, num_streams, branch

    def _unfold(self, residual: torch.Tensor) -> tuple[torch.Tensor, Callable, Callable, Callable]:
        """``(b*s, *mid, d) -> (b, T, s, d)`` with ``T = prod(mid)``, and the maps back.

        Returns the unfolded streams, ``fold`` for streams ``(b, T, s, d) -> (b*s, *mid, d)``, and
        ``to_branch`` / ``from_branch`` between the connection's ``(b, T, d)`` and the branch's ``(b, *mid, d)``.
        """
        batch, n = _split_leading(residual, self.num_streams), self.num_streams
        mid, dim = residual.shape[1:-1], residual.shape[-1]
        tokens = math.prod(mid)
        x = residual.reshape(batch, n, tokens, dim).transpose(1, 2)

        def fold(y: torch.Tensor) -> torch.Tensor:
            return y.transpose(1, 2).reshape(batch * n, *mid, dim)

        def to_branch(h: torch.Tensor) -> torch.Tensor:
            return h.reshape(batch, *mid, dim)

        def from_branch(out: torch.Tensor) -> torch.Tensor:
            if out.shape != (batch, *mid, dim):
                raise ValueError(
                    f"branch must return the shape it was given, {(batch, *mid, dim)}, got {tuple(out.shape)}"
                )
            return out.reshape(batch, tokens, dim)

        return x, fold, to_branch, from_branch

    def forward(self, residual: torch.Tensor, *args, **kwargs):
        if self.branch is None:
            if args or kwargs:
                raise TypeError("branch arguments were given, but no branch was passed to init(branch=...)")
            return self._split(residual)
        if self.hc is None:
            out, put_back = _first_and_rest(self.branch(residual, *args, **kwargs))
            return put_back(out + residual)
        x, fold, to_branch, from_branch = self._unfold(residual)
        extras: list[Callable] = []

        def branch(h: torch.Tensor, *a, **kw) -> torch.Tensor:
            out, put_back = _first_and_rest(self.branch(to_branch(h), *a, **kw))
            extras.append(put_back)
            return from_branch(out)

        new_residual = fold(self.hc(x, branch, *args, **kwargs))
        return extras[0](new_residual)

    def _split(self, residual: torch.Tensor) -> tuple[torch.Tensor, Callable[[Any], Any]]:
        """``(branch_input, add_residual)``: the same mixing as ``HyperConnection.forward``, in two halves."""
        if self.hc is None:
            def add_plain(branch_out: Any) -> Any:
                out, put_back = _first_and_rest(branch_out)
                return put_back(out + residual)

            return residual, add_plain
        x, fold, to_branch, from_branch = self._unfold(residual)
        h = self.hc.matrices(x)
        branch_input = to_branch(self.hc.read(x, h))

        def add_residual(branch_out: Any) -> Any:
            out, put_back = _first_and_rest(branch_out)
            return put_back(fold(self.hc.write(x, h, from_branch(out))))

        return branch_input, add_residual

    def decorate_branch(self, branch: Callable) -> Callable:
        """``fn(residual, *args, **kwargs)``: the connection around ``branch`` (only when init had no branch)."""
        if self.branch is not None:
            raise ValueError("decorate_branch needs a connection built without a branch; this one wraps one already")

        def forward_and_add_residual(residual: torch.Tensor, *args, **kwargs):
            branch_input, add_residual = self(residual)
            return add_residual(branch(branch_input, *args, **kwargs))

        return forward_and_add_residual


def get_init_and_expand_reduce_stream_functions(
    num_streams: int,
    num_fracs: int = 1,
    dim: int | None = None,
    add_stream_embed: bool = False,
    disable: bool | None = None,
    family: str = "s2hc",
    **family_options: Any,
) -> tuple[Callable[..., CompatHyperConnection], nn.Module, nn.Module]:
    """``(init, expand_stream, reduce_stream)`` as in ``hyper_connections``, built on :class:`s2hc.HyperConnection`.

    Args:
        num_streams: number of residual streams s.
        num_fracs: only 1 (frac-connections are not implemented).
        dim: if given, bound into ``init`` as its default ``dim``.
        add_stream_embed: only ``False``.
        disable: ``True`` gives plain residuals ``branch(x) + x`` and identity expand/reduce;
            ``None`` (default) means ``num_streams == 1``.
        family, **family_options: the mixing family and its options (:func:`s2hc.mixers.options`).

    ``init(*, dim, branch=None, layer_index=None)`` returns a :class:`CompatHyperConnection` (when
    disabled, ``dim`` and ``layer_index`` are ignored). ``layer_index=None`` is 0; the package picks
    a random stream instead. ``expand_stream`` maps ``(b, ..., d) -> (b*s, ..., d)`` (copies, streams
    inner) and ``reduce_stream`` ``(b*s, ..., d) -> (b, ..., d)`` (sum over streams).
    """
    check_int("num_streams", num_streams)
    if num_fracs != 1:
        raise ValueError(f"num_fracs must be 1 (the default; frac-connections are not supported), got {num_fracs!r}")
    if add_stream_embed:
        raise ValueError(f"add_stream_embed must be False (the default; not supported), got {add_stream_embed!r}")
    mixers.check_options(family, family_options)  # fail at the factory, not at the first init()
    if disable is None:
        disable = num_streams == 1
    default_dim = dim

    if disable:
        def init_residual(*, dim: int | None = None, branch: Callable | None = None, **ignored: Any):
            return CompatHyperConnection(None, 1, branch)

        return init_residual, nn.Identity(), nn.Identity()

    def init(*, dim: int | None = None, branch: Callable | None = None, layer_index: int | None = None):
        dim = default_dim if dim is None else dim
        if dim is None:
            raise TypeError("init() needs dim=... (or pass dim to get_init_and_expand_reduce_stream_functions)")
        layer_index = 0 if layer_index is None else layer_index
        hc = HyperConnection(dim, num_streams, family=family, layer_index=layer_index, **family_options)
        return CompatHyperConnection(hc, num_streams, branch)

    return init, ExpandStreams(num_streams), ReduceStreams(num_streams)
