"""What every residual-mixing family shares: the interface and the float32 coefficient rule."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_float, check_streams
from ..counts import Count


@dataclass(frozen=True, kw_only=True)
class Guarantees:
    """What a family promises of every ``H_res`` it produces, to float32 rounding.

    Tests and diagnostics read these flags, so a family claims only what its construction proves.
    """

    row_sums_one: bool = False  # H 1 = 1: a feature shared by all streams passes unchanged
    col_sums_one: bool = False  # 1ᵀ H = 1ᵀ: the mean over streams is preserved
    nonnegative: bool = False
    spectral_norm_at_most_one: bool = False  # no direction is amplified
    orthogonal: bool = False  # HᵀH = I
    closed_under_products: bool = False  # a product of such matrices keeps every flag above


def coefficient_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the coefficient path runs in: at least float32 (float64 stays float64 for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def autocast_off(x: torch.Tensor):
    """A context in which operations on ``x`` run in their own dtype: autocast off for ``x``'s device; nothing to
    turn off on a device without autocast (``meta``, where shapes are worked out without data)."""
    device = x.device.type
    if device in ("cpu", "cuda") or torch.amp.is_autocast_available(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


class Mixer(nn.Module):
    """Base class of a constraint map ``M``: ``d_res (..., K) -> H_res (..., n, n)``.

    Subclasses set ``num_inputs`` (K), ``guarantees``, ``gate`` (how the connection turns its
    ``d_pre``/``d_post`` into ``H_pre``/``H_post``: ``"sigmoid"`` as in mHC, ``"tanh"`` as in HC), and rarely
    ``pre_offset`` and ``weighted_norm`` (DeepSeek-V4's mHC: ``H_pre + ε`` and a norm without a weight), and
    ``post_scale`` and ``post_offset`` (Hy4's iHC: ``H_post = m·σ(·) + ε``), own their scales ``α``, static
    biases ``b`` and family parameters, and implement :meth:`mix`.
    The input is promoted to at least float32 before :meth:`mix` sees it, so the guarantees hold to
    float32 rounding whatever the model's dtype; the result stays in that dtype (the caller casts).
    """

    name: str = ""
    guarantees: Guarantees = Guarantees()
    gate: str = "sigmoid"
    #: Two connection settings a family may change (only ``mhc`` with ``variant="deepseek-v4"`` does): a
    #: constant added to ``H_pre`` after its gate, and whether the connection's RMSNorm over the n·C features
    #: has a learnable weight. The connection reads them from its mixer, so a variant stays one family.
    pre_offset: float = 0.0
    weighted_norm: bool = True
    #: Two more (only ``ihc``, Hy4's independent HC, changes them): ``H_post = post_scale · σ(·) + post_offset``,
    #: 2σ(·) for every other sigmoid-gated family.
    post_scale: float = 2.0
    post_offset: float = 0.0
    #: What ``ModelConfig.stream_reduce=None`` resolves to for the family (its form reads it): the sum, or ``"head"``
    #: for a family whose released model ends with a learned read (Hy4's).
    default_stream_reduce: str = "sum"

    def start_biases(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(bias_pre, bias_post)`` ``(n,)`` float32 the family's released code starts its gates at, which the
        connection takes with ``gate_init="papers"``; None (default): the papers' biases of
        :func:`s2hc.connection.init.gate_biases`."""
        return None

    @classmethod
    def head_bias(cls, n_streams: int) -> float:
        """The initial bias of every stream's weight in the family's learned final read (``stream_reduce="head"``,
        :class:`s2hc.HyperHead`): 0 (DeepSeek-V4's) by default."""
        return 0.0

    # What code outside the families asks of one (counting, configs, bench, upcycling) is declared here and
    # overridden by the family that differs, so that no module compares a family with a name.

    @classmethod
    def permutation_sizes(cls, n_streams: int) -> list[int]:
        """The sizes of the permutation mixtures this family builds at ``n_streams`` streams: each mixes all
        size! permutation matrices, so K and the built table grow factorially with it (``s2hc.params`` and a
        run's config refuse sizes beyond the limits of :mod:`s2hc.mixers.mhc_lite`). ``[]`` by default."""
        return []

    @classmethod
    def options_for_size(cls, n_streams: int) -> dict[str, object]:
        """The options without which this family refuses to be built at ``n_streams`` streams (the bench adds
        them to every family it times at that n). ``{}`` by default."""
        return {}

    @classmethod
    def projects_per_stream(cls, **family_options: object) -> bool:
        """Whether the connection with these options projects each stream on its own, C × (2 + n) per stream, rather
        than all n·C features at once (only HC's ``projection="per-stream"``); answered without building."""
        return False

    @classmethod
    def flops(cls, n_streams: int, **family_options: object) -> tuple[int, Count]:
        """``(K, count)``: the constraint map's inputs per token at ``n_streams`` and its forward FLOPs per token
        ``d_res (K) -> H_res (n × n)`` (:mod:`s2hc.counts`), with the family's options. Every family counts itself;
        this default refuses, naming the family."""
        raise ValueError(f"no FLOP count for mixing family {cls.name!r} ({cls.__name__}): define {cls.__name__}.flops")

    @classmethod
    def upcycle_refusal(cls) -> str | None:
        """Why a residual model upcycled into this family (:mod:`s2hc.models.widen`) would not keep its function,
        or None when it would; the reason completes the sentence "cannot start from a residual model with the
        same function: ...".

        The streams' mean follows the residual stream exactly when every ``H_res`` has columns summing to 1
        whatever the mixer's parameters (rows summing to 1 keep that mean the mixing's fixed point), so by
        default a family qualifies when its :attr:`guarantees` say both.
        """
        if cls.guarantees.row_sums_one and cls.guarantees.col_sums_one:
            return None
        return "its H_res is not guaranteed to have rows and columns summing to 1"

    def __init__(self, n_streams: int):
        super().__init__()
        check_streams("n_streams", n_streams)
        self.n_streams = n_streams
        self.num_inputs = 0

    def __init_subclass__(cls, **kwargs) -> None:
        """Every family's own :meth:`mix` and :meth:`mix_fused` check their input first (:meth:`check_inputs`), so
        that a call with the wrong width says so instead of failing inside the family's reshapes."""
        super().__init_subclass__(**kwargs)
        for name in ("mix", "mix_fused"):
            method = cls.__dict__.get(name)
            if method is not None:
                setattr(cls, name, _checking_inputs(method))

    def check_inputs(self, d_res: torch.Tensor) -> None:
        """TypeError unless ``d_res`` is a floating-point tensor, ValueError unless its last dimension is K."""
        if not isinstance(d_res, torch.Tensor) or not d_res.is_floating_point():
            got = f"dtype {d_res.dtype}" if isinstance(d_res, torch.Tensor) else type(d_res).__name__
            raise TypeError(f"d_res must be a floating-point torch.Tensor of shape (..., K={self.num_inputs}) for "
                            f"family {self.name!r}, got {got}")
        if d_res.shape[-1:] != (self.num_inputs,):
            raise ValueError(
                f"d_res must have last dimension K={self.num_inputs} for family {self.name!r} "
                f"with n_streams={self.n_streams}, got shape {tuple(d_res.shape)}"
            )

    def forward(self, d_res: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Map the raw dynamic projection ``d_res`` of shape ``(..., K)`` to ``H_res`` ``(..., n, n)``.

        ``fused=True`` runs :meth:`mix_fused`, the same map written without batched tiny matrix products
        (``tests/test_fastpath.py`` checks it equals :meth:`mix`, values and gradients).
        """
        self.check_inputs(d_res)
        d_res = d_res.to(coefficient_dtype(d_res.dtype))
        with autocast_off(d_res):  # the guarantees need float32 products
            return self.mix_fused(d_res) if fused else self.mix(d_res)

    def mix(self, d_res: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def mix_fused(self, d_res: torch.Tensor) -> torch.Tensor:
        """The fast path of :meth:`mix` (same values); families whose reference uses tiny batched
        matrix products override it. Default: :meth:`mix` itself."""
        return self.mix(d_res)

    def register_constant(self, name: str, value: torch.Tensor) -> None:
        """A fixed, non-learnable tensor that keeps its exact dtype when the module is cast.

        ``model.to(torch.bfloat16)`` would otherwise round e.g. the Helmert basis to 8 bits and break
        the family's guarantees; :meth:`_apply` restores the exact value on the new device.
        """
        exact = value.detach().cpu()
        self._constants = {**getattr(self, "_constants", {}), name: exact}
        # the buffer lives where parameters are being created (e.g. inside `with torch.device("meta")`)
        self.register_buffer(name, exact.to(torch.empty(0).device), persistent=False)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        for name, exact in getattr(self, "_constants", {}).items():
            self._buffers[name] = exact.to(device=self._buffers[name].device)
        return module

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}, num_inputs={self.num_inputs}"


def _checking_inputs(method):
    """``method`` (a family's ``mix`` or ``mix_fused``) calling :meth:`Mixer.check_inputs` on its input first."""

    @functools.wraps(method)
    def checked(self: Mixer, d_res: torch.Tensor) -> torch.Tensor:
        self.check_inputs(d_res)
        return method(self, d_res)

    return checked


def small_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for tiny matrices ``(..., p, q) @ (..., q, r)`` as q broadcast multiply-adds.

    Millions of 3 × 3 or 4 × 4 products per step are slow as a batched GEMM on CPUs (one small call per
    matrix, and a per-matrix loop in its backward); q elementwise passes over the batch are not, and
    ``torch.compile`` fuses them into one loop.
    """
    if a.shape[-1] == 0:  # an empty product (s2hc at n = 1: m = 0): zeros, as torch.matmul gives
        return torch.matmul(a, b)
    out = a[..., :, 0, None] * b[..., None, 0, :]
    for j in range(1, a.shape[-1]):
        out = out + a[..., :, j, None] * b[..., None, j, :]
    return out


def scale_parameter(value: float = 0.01, name: str = "alpha") -> nn.Parameter:
    """A learnable scale (``α``: docs/design.md starts every one at 0.01), of shape ``(1,)``; ValueError naming
    ``name`` (the option it comes from) unless ``value`` is a finite number.

    One element rather than a 0-d scalar: FSDP2's ``fully_shard`` refuses 0-d parameters; ``(1,)``
    broadcasts the same way.
    """
    return nn.Parameter(torch.full((1,), check_float(name, value)))
