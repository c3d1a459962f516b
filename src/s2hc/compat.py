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
streams inner (row ``i*s + j`` is stream ``j`` of sample ``i``); with ``channel_first=True`` the width is
axis 1, ``(b*s, d, ...)``. Each connection unfolds them to ``(b, T, s, d)``, runs
:class:`s2hc.HyperConnection` and folds the result back.

What the package's arguments do here (the README's table says the same):

- ``add_branch_out_to_residual=False``: as in the package, the connection only reads the streams into the
  branch and returns the branch's output itself (not a new residual); the streams and ``H_res`` are not
  used, so no mixing or write parameters are created.
- ``channel_first``, ``residual_transform``: the width is axis 1 of the residual and of the branch's input
  and output. ``residual_transform`` (e.g. a 1x1 convolution when a block changes the width) is applied
  to each mixed stream ``H_res X`` before the branch output is added (the package's ``Residual`` applies it
  to the residual the same way, and so does this module with ``disable=True``); it may change the width,
  not the token dimensions.
- ``dropout``: on the new residual streams, after the branch output is added, as the package does.
- ``num_input_views=v``: ``v`` reads of the streams, each with its own ``H_pre``, stacked first:
  the branch receives ``(v, b, ..., d)``.
- ``depth_residual_fn``: ``fn(branch_written, mixed_streams)`` instead of their sum, both folded.
- ``add_stream_embed``: a learned per-stream embedding (zeros at first) added by ``expand_stream``.
- ``num_fracs=f`` (frac-connections, arXiv 2503.14125): the width ``d`` is split into ``f`` fractions of
  ``d/f`` and each (stream, fraction) pair becomes a slot: ``s*f`` slots of width ``d/f``. The family's
  ``H_res`` mixes the slots; ``H_pre`` and ``H_post`` become ``f`` rows each (branch-input fraction ``j``
  is a mix of all slots, and output fraction ``j`` is written to all slots), so ``f`` fractions with one
  stream are the paper's frac-connections and ``s`` streams of ``f`` fractions its combination with HC.
  This is a reshaping in this module, not a family of :mod:`s2hc.mixers`: a family is the constraint map
  ``d_res -> H_res`` of n streams and leaves the read and write vectors alone, while fractions change what
  a stream is and turn those vectors into matrices; every family applies to the slots unchanged (for
  ``mhc-lite``, ``s*f`` counts against its n <= 6). At initialisation with ``family="hc"`` branch-input
  fraction ``j`` reads fraction ``j`` of stream ``layer_index % s`` and output fraction ``j`` is added to
  fraction ``j`` of every stream: the plain residual. The package's 0.4.11 starts elsewhere for ``f > 1``
  (it reads fraction 0 twice and adds every output fraction to every fraction), so numbers differ there.

Not supported, with an error that names the argument: ``tanh=False`` (``family="hc"`` has HC's tanh gates,
the package's default, and the other families their sigmoid gates), and the package's mHC-module options
(``sinkhorn_iters``, ``log_domain_sinkhorn``, ``residual_mix_constraint_fn``, ``num_dynamic_alpha_proposals``,
``forward_method_names``; use ``family="mhc"`` and its ``iterations``). ``layer_index=None`` means 0, where
the package picks a random stream, so that a model built twice starts the same. With ``disable=True``, as
in the package, a connection is ``branch(x) + residual_transform(x)`` and every other argument is accepted
and has no effect.

The simple case (one view, one fraction, no ``residual_transform``/``depth_residual_fn``, a branch given at
``init``) calls the :class:`~s2hc.HyperConnection` as a module, on its fast path, where
:mod:`s2hc.diagnostics` hooks see it; the other cases use its :meth:`~s2hc.HyperConnection.coefficients`
and the reference einsums here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import mixers
from .checks import check_bool, check_int, check_streams
from .connection import HyperConnection
from .connection.forms import RESIDUAL, check_family
from .mixers.base import autocast_off, coefficient_dtype, scale_parameter

__all__ = ["CompatHyperConnection", "ExpandStreams", "ReduceStreams", "get_init_and_expand_reduce_stream_functions"]

#: Arguments of the package's connections that this module does not implement, and what to use instead.
PACKAGE_ONLY = {
    "sinkhorn_iters": "use family='mhc' with its option iterations=N",
    "log_domain_sinkhorn": "family='mhc' always runs Sinkhorn in the log domain",
    "residual_mix_constraint_fn": "choose the constraint map with family=... (s2hc.families())",
    "num_dynamic_alpha_proposals": "not implemented; leave it out",
    "forward_method_names": "not implemented; call the branch's methods on the branch",
    "additional_input_paths": "the package's multi-input-stream module has no s2hc counterpart",
}


def _package_only(names) -> None:
    for name in names:
        if name in PACKAGE_ONLY:
            raise ValueError(f"{name} is an option of the hyper-connections package that s2hc.compat does not "
                             f"support: {PACKAGE_ONLY[name]}")


def _check_family_options(family: str, num_streams: int, family_options: dict[str, Any]) -> None:
    """ValueError (one line, naming the option, its value and what is allowed) for an unknown family, an option it
    does not take, or a value it refuses: the family is built once on the meta device (nothing allocated) at
    ``num_streams`` streams, the fewest slots an ``init`` builds, so its own checks run here."""
    check_family(family)
    if family not in mixers.REGISTRY:  # a connection form of its own: the package's API has no place for it
        raise ValueError(
            f"family={family!r} cannot be expressed in the hyper-connections API, which carries n streams summed "
            f"at the end and mixed by an n × n matrix: s2hc.compat takes 'residual' (as disable=True) and the "
            f"mixing families {list(mixers.REGISTRY)}; build {family!r} with s2hc.Connections")
    mixers.check_options(family, family_options)
    with torch.device("meta"):
        try:
            mixers.build(family, num_streams, **family_options)
        except TypeError as error:  # a value of a type the family's own checks did not expect
            raise ValueError(f"family_options {family_options!r} of family {family!r}: {error}") from None


def _check_callable(name: str, value: Any) -> None:
    """TypeError unless ``value`` is None or callable (a module or a function)."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable (a module or a function) or None, got {type(value).__name__} "
                        f"{value!r}")


def _split_leading(residual: torch.Tensor, n_streams: int) -> int:
    """The batch size b of a folded residual ``(b*s, ..., d)``; TypeError or ValueError if it is not one."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor of shape (batch * streams, ..., dim), got "
                        f"{type(residual).__name__}")
    if residual.dim() < 2:
        raise ValueError(f"residual must have shape (batch * streams, ..., dim), got shape {tuple(residual.shape)}")
    if residual.shape[0] % n_streams:
        raise ValueError(
            f"residual's leading dimension must be divisible by num_streams={n_streams} "
            f"(shape (batch * streams, ..., dim)), got shape {tuple(residual.shape)}"
        )
    return residual.shape[0] // n_streams


class ExpandStreams(nn.Module):
    """``(b, ...) -> (b*s, ...)``: each sample repeated ``num_streams`` times, streams inner.

    With ``add_stream_embed=True`` a learned embedding ``stream_embed`` ``(s, dim)`` (zeros at first, as in the
    package) is added to each stream, on the last axis."""

    def __init__(self, num_streams: int, dim: int | None = None, add_stream_embed: bool = False):
        super().__init__()
        self.num_streams = num_streams
        self.stream_embed = None
        if add_stream_embed:
            if dim is None:
                raise ValueError("add_stream_embed=True needs dim=... at get_init_and_expand_reduce_stream_functions")
            check_int("dim", dim)
            self.stream_embed = nn.Parameter(torch.zeros(num_streams, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = "dim" if self.stream_embed is None else self.stream_embed.shape[-1]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor of shape (batch, ..., {width}), got {type(x).__name__}")
        if x.dim() < 2 or (self.stream_embed is not None and x.shape[-1] != width):
            raise ValueError(f"x must have shape (batch, ..., {width}), got shape {tuple(x.shape)}")
        out = x.repeat_interleave(self.num_streams, dim=0)
        if self.stream_embed is None:
            return out
        embed = self.stream_embed.view(self.num_streams, *([1] * (x.dim() - 2)), -1).to(out.dtype)
        return (out.unflatten(0, (x.shape[0], self.num_streams)) + embed).flatten(0, 1)


class ReduceStreams(nn.Module):
    """``(b*s, ...) -> (b, ...)``: the sum over the streams of each sample."""

    def __init__(self, num_streams: int):
        super().__init__()
        self.num_streams = num_streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = _split_leading(x, self.num_streams)
        return x.reshape(batch, self.num_streams, *x.shape[1:]).sum(dim=1)


def _first_and_rest(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """A branch may return a tuple or list: its first element is the branch output, the rest pass through.
    TypeError naming what was expected when that output is not a tensor (a branch that forgot ``return``)."""
    rest: Callable[[torch.Tensor], Any] = lambda first: first  # noqa: E731
    if isinstance(out, (tuple, list)):
        if not out:
            raise ValueError("branch returned an empty tuple; its first element must be the branch output")
        out, rest = out[0], lambda first, whole=out: type(whole)((first, *whole[1:]))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"branch must return a tensor (or a tuple whose first element is one), the shape of its "
                        f"input, got {type(out).__name__}")
    return out, rest


def _streams_precision(x: torch.Tensor):
    """Stream operations run in the streams' dtype, outside autocast, as in :class:`s2hc.HyperConnection`."""
    return autocast_off(x)


class _Gates(nn.Module):
    """Read rows ``H_pre`` ``(B, T, R, N)`` and write rows ``H_post`` ``(B, T, W, N)`` over N slots, beyond the
    one row of each a :class:`s2hc.HyperConnection` has (extra views and fractions; all rows when there is no
    connection). Same form as the connection's gates: ``RMSNorm`` over the N slots' features, a zero-initialised
    projection, a scale ``α`` (0.01) and a static bias per row, then ``b + α·tanh(d)`` (``gate="tanh"``, HC) or
    ``σ(α·d + b)`` for reads and ``2σ(α·d + b)`` for writes."""

    def __init__(self, width: int, bias_pre: torch.Tensor, bias_post: torch.Tensor, gate: str, eps: float):
        super().__init__()
        self.reads, self.slots = bias_pre.shape
        self.writes = bias_post.shape[0]
        self.gate, self.eps = gate, eps
        self.norm_weight = nn.Parameter(torch.ones(self.slots * width))
        self.projection = nn.Parameter(torch.zeros(self.slots * width, (self.reads + self.writes) * self.slots))
        self.alpha_pre, self.bias_pre = scale_parameter(0.01), nn.Parameter(bias_pre.clone())
        if self.writes:
            self.alpha_post, self.bias_post = scale_parameter(0.01), nn.Parameter(bias_post.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = coefficient_dtype(x.dtype)
        with _streams_precision(x):
            flat = x.flatten(-2).to(dtype)
            d = F.rms_norm(flat, (flat.shape[-1],), self.norm_weight.to(dtype), self.eps) @ self.projection.to(dtype)
            d = d.unflatten(-1, (self.reads + self.writes, self.slots))
            d_pre, d_post = d[..., : self.reads, :], d[..., self.reads :, :]
            alpha, bias = self.alpha_pre.to(dtype), self.bias_pre.to(dtype)
            pre = bias + alpha * torch.tanh(d_pre) if self.gate == "tanh" else torch.sigmoid(alpha * d_pre + bias)
            if not self.writes:
                return pre, d_post
            alpha, bias = self.alpha_post.to(dtype), self.bias_post.to(dtype)
            if self.gate == "tanh":
                return pre, bias + alpha * torch.tanh(d_post)
            return pre, 2 * torch.sigmoid(alpha * d_post + bias)


def _row_biases(gate: str, streams: int, fracs: int, views: int, favoured: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static biases of the read rows ``(views*fracs, N)`` and write rows ``(fracs, N)``, slot ``j*streams + i`` =
    fraction j of stream i, in the connection's conventions: read row (v, j) favours fraction j of stream
    ``favoured``; HC (``tanh``) reads it alone and writes output fraction j to fraction j of every stream, the
    sigmoid families bias +1 there and -1 elsewhere."""
    n = streams * fracs
    off = 0.0 if gate == "tanh" else -1.0
    pre = torch.full((views, fracs, n), off)
    post = torch.full((fracs, n), off)
    for j in range(fracs):
        pre[:, j, j * streams + favoured] = 1.0
        if gate == "tanh":
            post[j, j * streams : (j + 1) * streams] = 1.0
        else:
            post[j, j * streams + favoured] = 1.0
    return pre.flatten(0, 1), post


#: What ``init`` passes on to :class:`CompatHyperConnection` beside its own arguments.
CONNECTION_OPTIONS = ("channel_first", "dropout", "residual_transform", "add_branch_out_to_residual",
                      "num_input_views", "depth_residual_fn")


class CompatHyperConnection(nn.Module):
    """One connection in the package's calling conventions, on folded residuals ``(b*s, ..., d)``.

    ``hc`` is the :class:`s2hc.HyperConnection` doing the work (with ``num_fracs=f``, over ``s*f`` slots of
    width ``d/f``), or ``None`` when disabled (a plain residual ``branch(x) + residual_transform(x)``; then
    ``num_streams`` is 1 and nothing is folded) or when ``add_branch_out_to_residual=False`` (only reads:
    ``gates`` holds them). ``gates`` holds the read and write rows beyond the connection's own (extra views,
    fractions), or None.

    - With ``branch``: ``module(residual, *args, **kwargs)`` calls ``branch(h, *args, **kwargs)`` on the
      branch input ``h`` ``(b, ..., d)`` and returns the new residual ``(b*s, ..., d)``; if the branch returns
      a tuple, its first element is the branch output and the rest are returned after the residual.
    - Without: ``branch_input, add_residual = module(residual)``, then
      ``residual = add_residual(branch(branch_input))``; or ``module.decorate_branch(branch)(residual)``.
    """

    def __init__(
        self,
        num_streams: int,
        dim: int | None,
        branch: Callable | None = None,
        *,
        family: str = "s2hc",
        family_options: dict[str, Any] | None = None,
        disable: bool = False,
        layer_index: int = 0,
        channel_first: bool = False,
        dropout: float = 0.0,
        residual_transform: Callable | None = None,
        add_branch_out_to_residual: bool = True,
        num_input_views: int = 1,
        depth_residual_fn: Callable | None = None,
        num_fracs: int = 1,
    ):
        super().__init__()
        callables = {"branch": branch, "residual_transform": residual_transform, "depth_residual_fn": depth_residual_fn}
        for name, value in callables.items():
            _check_callable(name, value)
        self.branch, self.residual_transform, self.depth_residual_fn = branch, residual_transform, depth_residual_fn
        self.disabled, self.hc, self.gates = disable, None, None
        if disable:
            self.num_streams, self.num_fracs, self.num_input_views = 1, 1, 1
            return
        flags = {"channel_first": channel_first, "add_branch_out_to_residual": add_branch_out_to_residual}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        check_int("num_input_views", num_input_views)
        check_int("num_fracs", num_fracs)
        check_int("layer_index", layer_index, minimum=0)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if dim % num_fracs:
            raise ValueError(f"dim={dim} must be divisible by num_fracs={num_fracs}")
        self.num_streams, self.num_fracs, self.num_input_views = num_streams, num_fracs, num_input_views
        self.dim = dim
        self.channel_first, self.add_branch_out_to_residual = channel_first, add_branch_out_to_residual
        self.layer_index = layer_index
        self.dropout = nn.Dropout(dropout) if dropout else None
        family_options = family_options or {}
        favoured, width, slots = layer_index % num_streams, dim // num_fracs, num_streams * num_fracs
        gate = mixers.get(family).gate
        bias_pre, bias_post = _row_biases(gate, num_streams, num_fracs, num_input_views, favoured)
        if not add_branch_out_to_residual:  # reads only, as the package: no H_res, no writes
            self.gates = _Gates(width, bias_pre, bias_post[:0], gate, eps=1e-6)
            return
        hc_index = layer_index if num_fracs == 1 else favoured  # slot `favoured` is fraction 0 of that stream
        self.hc = HyperConnection(width, slots, family=family, layer_index=hc_index, **family_options)
        if num_fracs > 1:
            with torch.no_grad():  # the connection's one write row is output fraction 0's
                self.hc.bias_post.copy_(bias_post[0])
        if num_fracs > 1 or num_input_views > 1:
            self.gates = _Gates(width, bias_pre[1:], bias_post[1:], gate, eps=self.hc.eps)

    @property
    def simple(self) -> bool:
        """Whether a call can run the :class:`~s2hc.HyperConnection` as a module (its fast path)."""
        return (
            self.hc is not None
            and self.gates is None
            and self.residual_transform is None
            and self.depth_residual_fn is None
        )

    # ------------------------------------------------------------------------------------------- layouts

    def _unfold(self, residual: torch.Tensor) -> tuple[torch.Tensor, Callable, Callable, Callable]:
        """``(b*s, *mid, d) -> (b, T, s, d)`` with ``T = prod(mid)`` (``(b*s, d, *mid)`` if channel-first), and
        the maps back.

        Returns the unfolded streams, ``fold`` for streams ``(b, T, s, d') -> (b*s, *mid, d')``, and
        ``to_branch`` / ``from_branch`` between ``(b, T, d)`` and the branch's ``(b, *mid, d)``
        (``from_branch(out, width)`` checks the width ``width``).
        """
        n = self.num_streams
        batch = _split_leading(residual, n)
        if not residual.is_floating_point():
            raise TypeError(f"residual must be a floating-point tensor, got dtype {residual.dtype}")
        width = residual.shape[1] if self.channel_first else residual.shape[-1]
        if width != self.dim:
            layout = "(batch * streams, dim, ...)" if self.channel_first else "(batch * streams, ..., dim)"
            raise ValueError(f"residual must have shape {layout} with dim={self.dim}, got shape "
                             f"{tuple(residual.shape)}")
        if self.channel_first:
            residual = residual.movedim(1, -1)
        mid, dim = residual.shape[1:-1], residual.shape[-1]
        tokens = math.prod(mid)
        x = residual.reshape(batch, n, tokens, dim).transpose(1, 2)

        def fold(y: torch.Tensor) -> torch.Tensor:
            y = y.transpose(1, 2).reshape(batch * n, *mid, y.shape[-1])
            return y.movedim(-1, 1) if self.channel_first else y

        def to_branch(h: torch.Tensor) -> torch.Tensor:
            h = h.reshape(*h.shape[:-3], batch, *mid, h.shape[-1])  # (v, b, T, d) or (b, T, d)
            return h.movedim(-1, -1 - len(mid)) if self.channel_first else h

        def from_branch(out: torch.Tensor, width: int = dim) -> torch.Tensor:
            if self.channel_first and out.dim() >= 2:
                out = out.movedim(1, -1)
            if out.shape != (batch, *mid, width):
                expected = (batch, width, *mid) if self.channel_first else (batch, *mid, width)
                got = tuple(out.movedim(-1, 1).shape) if self.channel_first else tuple(out.shape)
                raise ValueError(f"branch must return the shape {expected}, got {got}")
            return out.reshape(batch, tokens, width)

        return x, fold, to_branch, from_branch

    def _to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """Streams ``(b, T, s, d)`` -> slots ``(b, T, s*f, d/f)``, slot ``j*s + i`` = fraction j of stream i."""
        if self.num_fracs == 1:
            return x
        return x.unflatten(-1, (self.num_fracs, -1)).transpose(-3, -2).flatten(-3, -2)

    def _from_slots(self, y: torch.Tensor) -> torch.Tensor:
        """Slots ``(b, T, s*f, c)`` -> streams ``(b, T, s, f*c)``."""
        if self.num_fracs == 1:
            return y
        return y.unflatten(-2, (self.num_fracs, self.num_streams)).transpose(-3, -2).flatten(-2)

    # ------------------------------------------------------------------------------------------- calls

    def forward(self, residual: torch.Tensor, *args, **kwargs):
        if self.branch is None:
            if args or kwargs:
                raise TypeError("branch arguments were given, but no branch was passed to init(branch=...)")
            return self._split(residual)
        if self.disabled:
            out, put_back = _first_and_rest(self.branch(residual, *args, **kwargs))
            return put_back(out + self._transform(residual))
        if not self.simple:
            branch_input, add_residual = self._split(residual)
            return add_residual(self.branch(branch_input, *args, **kwargs))
        x, fold, to_branch, from_branch = self._unfold(residual)
        extras: list[Callable] = []

        def branch(h: torch.Tensor, *a, **kw) -> torch.Tensor:
            out, put_back = _first_and_rest(self.branch(to_branch(h), *a, **kw))
            extras.append(put_back)
            return from_branch(out)

        new_residual = self._drop(fold(self.hc(x, branch, *args, **kwargs)))
        return extras[0](new_residual)

    def _without_width(self, shape: torch.Size) -> tuple[int, ...]:
        """A folded residual's shape without its width axis (1 if channel-first, else the last)."""
        return (shape[0], *shape[2:]) if self.channel_first else tuple(shape[:-1])

    def _transform(self, residual: torch.Tensor) -> torch.Tensor:
        return residual if self.residual_transform is None else self.residual_transform(residual)

    def _drop(self, residual: torch.Tensor) -> torch.Tensor:
        return residual if self.dropout is None else self.dropout(residual)

    def _rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``pre`` ``(b, T, v*f, N)``, ``post`` ``(b, T, f, N)`` and ``res`` ``(b, T, N, N)`` (None without writes)."""
        if self.hc is None:
            return self.gates(slots)[0], None, None
        pre, post, res = self.hc.coefficients(slots)
        pre, post = pre.unsqueeze(-2), post.unsqueeze(-2)
        if self.gates is not None:
            more_pre, more_post = self.gates(slots)
            pre, post = torch.cat([pre, more_pre], dim=-2), torch.cat([post, more_post], dim=-2)
        return pre, post, res

    def _split(self, residual: torch.Tensor) -> tuple[Any, Callable[[Any], Any]]:
        """``(branch_input, add_residual)``: the same computation as a call with a branch, in two halves."""
        if self.disabled:
            def add_plain(branch_out: Any) -> Any:
                out, put_back = _first_and_rest(branch_out)
                return put_back(out + self._transform(residual))

            return residual, add_plain
        x, fold, to_branch, from_branch = self._unfold(residual)
        slots = self._to_slots(x)
        pre, post, res = self._rows(slots)
        with _streams_precision(x):
            reads = torch.einsum("btrn,btnc->btrc", pre.to(x.dtype), slots)  # (b, T, v*f, d/f)
        reads = reads.unflatten(-2, (self.num_input_views, self.num_fracs)).flatten(-2).movedim(-2, 0)
        branch_input = to_branch(reads)  # (v, b, ..., d)
        if self.num_input_views == 1:
            branch_input = branch_input[0]

        if not self.add_branch_out_to_residual:
            return branch_input, lambda branch_out: branch_out

        def add_residual(branch_out: Any) -> Any:
            out, put_back = _first_and_rest(branch_out)
            with _streams_precision(x):
                mixed = torch.einsum("btij,btjc->btic", res.to(x.dtype), slots)
            mixed = fold(self._from_slots(mixed))  # H_res X, folded like the residual
            if self.residual_transform is not None:
                shape = mixed.shape
                mixed = self.residual_transform(mixed)
                if self._without_width(mixed.shape) != self._without_width(shape):
                    raise ValueError(f"residual_transform may change the width only: it turned the streams "
                                     f"{tuple(shape)} into {tuple(mixed.shape)}")
            width = mixed.shape[1] if self.channel_first else mixed.shape[-1]
            if width % self.num_fracs:
                raise ValueError(f"the width {width} after residual_transform must be divisible by "
                                 f"num_fracs={self.num_fracs}")
            out = from_branch(out, width)  # (b, T, d')
            with _streams_precision(x):
                out_fracs = out.to(x.dtype).unflatten(-1, (self.num_fracs, -1))  # (b, T, f, d'/f)
                written = self._from_slots(torch.einsum("btjn,btjc->btnc", post.to(x.dtype), out_fracs))
            written = fold(written)
            new = written + mixed if self.depth_residual_fn is None else self.depth_residual_fn(written, mixed)
            return put_back(self._drop(new))

        return branch_input, add_residual

    def decorate_branch(self, branch: Callable) -> Callable:
        """``fn(residual, *args, **kwargs)``: the connection around ``branch`` (only when init had no branch)."""
        if self.branch is not None:
            raise ValueError("decorate_branch needs a connection built without a branch; this one wraps one already")
        _check_callable("branch", branch)

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
        num_fracs: fractions f of the width (frac-connections): ``s*f`` slots of width ``d/f``.
        dim: if given, bound into ``init`` as its default ``dim`` (and the width of the stream embedding).
        add_stream_embed: ``expand_stream`` adds a learned per-stream embedding ``(s, dim)``; needs ``dim``.
        disable: ``True`` gives plain residuals ``branch(x) + residual_transform(x)`` and identity
            expand/reduce; ``None`` (default) means ``num_streams == 1 and num_fracs == 1``.
        family, **family_options: the mixing family and its options (:func:`s2hc.mixers.options`), or
            ``"residual"``, the same as ``disable=True``. The forms of their own (``"gated-residual"``,
            ``"attn-res"``, ``"wide-residual"``) do not fit this API and are refused in one line naming
            :class:`s2hc.Connections`, which builds them.

    ``init(*, dim, branch=None, layer_index=None, channel_first=False, dropout=0.0, residual_transform=None,
    add_branch_out_to_residual=True, num_input_views=1, depth_residual_fn=None, tanh=True, num_fracs=...)``
    returns a :class:`CompatHyperConnection` (the module docstring says what each argument does; when disabled
    only ``branch`` and ``residual_transform`` matter). ``layer_index=None`` is 0; the package picks a random
    stream instead. ``expand_stream`` maps ``(b, ..., d) -> (b*s, ..., d)`` (copies, streams inner) and
    ``reduce_stream`` ``(b*s, ..., d) -> (b, ..., d)`` (sum over streams).
    """
    check_streams("num_streams", num_streams)
    check_int("num_fracs", num_fracs)
    if dim is not None:
        check_int("dim", dim)
    if not isinstance(add_stream_embed, bool):
        raise ValueError(f"add_stream_embed must be True or False, got {add_stream_embed!r}")
    if disable is not None:
        check_bool("disable", disable)
    _package_only(family_options)
    residual = family == RESIDUAL.name  # the plain residual is the package's disable=True
    if residual and (family_options or disable is False):
        raise ValueError(f"family='residual' is the package's disable=True: it takes no family options and not "
                         f"disable=False, got family_options={family_options!r}, disable={disable!r}")
    if not residual:
        _check_family_options(family, num_streams, family_options)  # fail at the factory, not at the first init()
    if disable is None:
        disable = residual or (num_streams == 1 and num_fracs == 1)
    default_dim, default_fracs = dim, num_fracs

    def init(*, dim: int | None = None, branch: Callable | None = None, layer_index: int | None = None,
             tanh: bool = True, num_fracs: int | None = None, **options: Any) -> CompatHyperConnection:
        """The connection around ``branch``; ``options``: :class:`CompatHyperConnection`'s (``channel_first``,
        ``dropout``, ``residual_transform``, ``add_branch_out_to_residual``, ``num_input_views``,
        ``depth_residual_fn``)."""
        _package_only(options)
        unknown = sorted(set(options) - set(CONNECTION_OPTIONS))
        if unknown:
            raise TypeError(f"init() got unexpected keyword argument(s) {unknown}")
        if disable:  # the package's Residual: every other argument has no effect
            return CompatHyperConnection(1, None, branch, disable=True,
                                         residual_transform=options.get("residual_transform"))
        if tanh is not True:
            raise ValueError(
                f"tanh={tanh!r} is not supported: family='hc' has HC's tanh gates (the package's default, tanh=True) "
                "and the other families their sigmoid gates; leave tanh out"
            )
        dim = default_dim if dim is None else dim
        if dim is None:
            raise TypeError("init() needs dim=... (or pass dim to get_init_and_expand_reduce_stream_functions)")
        check_int("dim", dim)
        return CompatHyperConnection(
            num_streams,
            dim,
            branch,
            family=family,
            family_options=family_options,
            layer_index=0 if layer_index is None else layer_index,
            num_fracs=default_fracs if num_fracs is None else num_fracs,
            **options,
        )

    if disable:
        return init, nn.Identity(), nn.Identity()
    return init, ExpandStreams(num_streams, dim, add_stream_embed), ReduceStreams(num_streams)
