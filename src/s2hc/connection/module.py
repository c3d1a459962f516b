"""The connection around one branch, :class:`HyperConnection`, and its compute options
(:func:`set_connection_options`, :data:`COMPUTE_OPTIONS`; docs/design.md section 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import mixers
from ..checks import check_float, check_int, check_streams
from ..extras import check_available
from ..init_rng import Draw
from ..mixers.base import coefficient_dtype, scale_parameter
from .base import ComputePath, Connection, _stream_precision, as_batch_time, call_branch, check_stream_tensor
from .init import (
    DEFAULT_SPREAD,
    check_gate_init,
    check_projection_init,
    gate_biases,
    initial_projection,
    projection_draw,
    upcycling_biases,
)
from .paths import KERNELS, select_path

COMPUTE_OPTIONS = ("fused", "recompute", "kernels")  # how a connection computes, not what: HyperConnection.set_options
#: HyperConnection's own keywords that a model's ``family_options`` may give beside the family's, and the types each
#: takes (as a constructor's annotation writes them): its RMSNorm epsilon, mixing with ``H_resᵀ``, how its
#: projection and its gates start. The one declaration the form, the configuration and the counts read.
OPTION_KINDS: dict[str, set[str]] = {"eps": {"float"}, "transpose_res": {"bool"}, "projection_init": {"str"},
                                     "gate_init": {"str"}}


def _projects_per_stream(mixer: mixers.Mixer) -> bool:
    """Whether the coefficients come from each stream alone (``hc`` with ``projection="per-stream"``)."""
    return bool(getattr(mixer, "per_stream", False))


def _mixer_projection_width(mixer: mixers.Mixer) -> int | None:
    return None if _projects_per_stream(mixer) else 2 * mixer.n_streams + mixer.num_inputs


class HyperConnection(Connection):
    """A multi-stream residual connection around a branch, with the stream-mixing family ``family``.

    Args:
        dim: width C of one stream (the branch's input and output width).
        n_streams: number of streams n, at most :data:`s2hc.checks.MAX_STREAMS`.
        family: a mixing family (:func:`s2hc.mixers.mixing_families`). Every other family (the plain residual,
            the gated residual, AttnRes, the wide residual) is a connection of its own: :class:`s2hc.Connections`
            builds any family's, with the expansion and the read it needs.
        layer_index: the index of the block the connection is in (both sublayers of a block, attention and MLP,
            get the same one, as the s²HC authors' code and :class:`s2hc.models.Transformer` do); the read/write
            gates start favouring stream ``layer_index mod n``.
        eps: epsilon of the RMSNorm over all n·C features.
        fused: a fast path (default) or, with False, the reference implementation; all compute the
            same function (see the module docstring).
        recompute: recompute the coefficient path (norm, projection, gates, constraint map) in backward
            instead of storing its intermediates (``torch.utils.checkpoint``, non-reentrant). Costs one
            more coefficient pass; see ``docs/benchmarks.md`` for what it saves.
        kernels: ``"torch"`` (default) or ``"triton"``: the fast path's n-wide passes as Triton kernels
            (needs ``fused=True`` and the ``triton`` package; CUDA tensors, or CPU under
            ``TRITON_INTERPRET=1``). Under ``torch.compile`` the PyTorch forms run, which inductor fuses.
        transpose_res: mix with ``H_resᵀ`` (``X' = H_resᵀ X + ...``), as the s²HC authors' released code
            does, instead of the mHC paper's ``X' = H_res X`` (default False; rows of the applied matrix are
            output streams either way). For s2hc, mhc-lite, kromhc, hc and the ablations the set of
            matrices is closed under transposition, so only the parameterisation changes; for mhc it swaps
            which sums are exact (rows by default, columns when transposed). :meth:`coefficients` returns
            the matrix as applied.
        projection_init: ``"zero"`` (default, the papers) or ``"normal"``, the s²HC authors' code: the
            coefficient projection ~ N(0, 2 / (5·dim)), drawn from torch's global generator here (the same
            std for HC's per-stream projection). See :mod:`s2hc.connection.init`.
        gate_init: ``"papers"`` (default: sigmoid biases −1 / +1, HC's one-hot read and unit writes) or
            ``"residual"``: ``H_pre = 1/n`` and ``Σ H_post = n`` at init, the gates upcycling sets, so that the
            streams' mean follows a residual model at step 0 (:func:`s2hc.connection.init.gate_biases`; needs
            ``n_streams >= 2``).
        **family_options: passed to the family (e.g. ``iterations`` for ``mhc``, ``rotation`` for ``s2hc``).

    ``forward(x, branch, *args, **kwargs)``: ``x`` ``(B, T, n, C)``, ``branch`` any callable
    ``(B, T, C) -> (B, T, C)`` called as ``branch(h, *args, **kwargs)``; returns ``(B, T, n, C)`` in x's dtype.
    Other leading dimensions work too: ``x`` ``(..., n, C)`` (``(tokens, n, C)``, ``(B, H, W, n, C)``), the branch
    given ``(..., C)`` and the result ``(..., n, C)``.
    ``x`` may be any floating dtype (float32, bfloat16, float16, float64), whatever the parameters' dtype: the
    connection follows x's dtype (its coefficients in at least float32), as under autocast, and ``h`` has x's
    dtype; a non-tensor or an integer ``x`` is refused with TypeError, a branch returning anything but a tensor too.
    ``self.family`` is the family's name, ``self.mixer`` its constraint map (a :class:`s2hc.mixers.Mixer`). Two
    settings come from the mixer: ``mixer.pre_offset`` is added to ``H_pre`` after
    its gate and ``mixer.weighted_norm=False`` leaves the RMSNorm without a weight (``self.norm_weight`` is
    None); only ``family="mhc", variant="deepseek-v4"`` (DeepSeek-V4's mHC) and ``family="ihc"`` (Hy4's) change
    them. ``ihc`` also sets ``H_post = mixer.post_scale · σ(·) + mixer.post_offset`` and, with
    ``gate_init="papers"``, the biases its release starts at (``mixer.start_biases``).
    """

    projections = ("projection",)
    unit_parameters = ("norm_weight",)

    def __init__(
        self,
        dim: int,
        n_streams: int,
        family: str = "s2hc",
        layer_index: int = 0,
        eps: float = 1e-6,
        fused: bool = True,
        recompute: bool = False,
        kernels: str = "torch",
        transpose_res: bool = False,
        projection_init: str = "zero",
        gate_init: str = "papers",
        **family_options: Any,
    ):
        super().__init__()
        check_int("dim", dim)
        check_streams("n_streams", n_streams)  # before anything n-sized is built
        check_int("layer_index", layer_index, minimum=0)
        if family not in mixers.REGISTRY:
            raise ValueError(f"family must be one of {list(mixers.REGISTRY)} for a HyperConnection, got {family!r} "
                             "(every family, these and the forms of their own: s2hc.Connections)")
        eps = check_float("eps", eps, positive=True)  # 0, a negative or NaN eps gives NaN streams silently
        if not isinstance(transpose_res, bool):
            raise ValueError(f"transpose_res must be True or False, got {transpose_res!r}")
        self.dim, self.n_streams, self.family, self.layer_index, self.eps = dim, n_streams, family, layer_index, eps
        self.transpose_res = transpose_res
        self.projection_init, self.gate_init = check_projection_init(projection_init), check_gate_init(gate_init)
        self.fused, self.recompute, self.kernels = True, False, "torch"
        self.set_options(fused=fused, recompute=recompute, kernels=kernels)
        self.mixer = mixers.build(family, n_streams, **family_options)
        n, width = n_streams, n_streams * dim
        if self.per_stream:  # the HC paper's form: each stream normed and projected alone, by shared weights
            self.norm_weight = nn.Parameter(torch.ones(dim))
            self.projection = nn.Parameter(initial_projection((dim, 2 + n), dim, projection_init))
        else:
            if self.mixer.weighted_norm:
                self.norm_weight = nn.Parameter(torch.ones(width))
            else:  # DeepSeek-V4's mHC: the norm has no weight (a None parameter keeps the attribute)
                self.register_parameter("norm_weight", None)
            self.projection = nn.Parameter(initial_projection((width, _mixer_projection_width(self.mixer)), dim,
                                                              projection_init))
        self.alpha_pre = scale_parameter(0.01)
        self.alpha_post = scale_parameter(0.01)
        if gate_init == "residual" and n < 2:
            raise ValueError(f"gate_init='residual' needs n_streams >= 2 (H_pre = 1/n), got n_streams={n}")
        start = self.mixer.start_biases(layer_index) if self.gate_init == "papers" else None
        b_pre, b_post = start if start is not None else gate_biases(
            gate_init, self.mixer.gate, n, layer_index, self.mixer.pre_offset, self.mixer.post_scale,
            self.mixer.post_offset)
        self.bias_pre = nn.Parameter(b_pre)
        self.bias_post = nn.Parameter(b_post)

    @property
    def per_stream(self) -> bool:
        """Whether the coefficients come from each stream alone (``hc`` with ``projection="per-stream"``)."""
        return _projects_per_stream(self.mixer)

    def random_init(self) -> dict[str, Draw]:
        """The parameters that start random, and how (:mod:`s2hc.init_rng`): the projection with
        ``projection_init="normal"``; nothing else (the gates' biases and the mixer's start are constants)."""
        if self.projection_init != "normal":
            return {}
        return {"projection": projection_draw(self.dim)}

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        """Change how the connection computes (not what): ``fused``, ``recompute``, ``kernels`` as in the
        constructor; ``None`` keeps the current value. Checked together, so a bad combination changes nothing."""
        fused = self.fused if fused is None else fused
        recompute = self.recompute if recompute is None else recompute
        kernels = self.kernels if kernels is None else kernels
        for name, value in (("fused", fused), ("recompute", recompute)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
        if kernels == "triton":
            if not fused:
                raise ValueError("kernels='triton' implements the fast path; it needs fused=True, got fused=False")
            check_available(("triton",), "kernels='triton'")
        self.fused, self.recompute, self.kernels = fused, recompute, kernels
        return self

    @torch.no_grad()
    def start_as_residual(self, spread: float = DEFAULT_SPREAD) -> None:
        """Upcycling's start (:func:`s2hc.connection.init.upcycling_biases`): the projection zero and the gates'
        biases such that the streams' mean follows the residual model the weights came from."""
        pre, post = upcycling_biases(self.n_streams, self.layer_index, spread, self.mixer.pre_offset,
                                     self.mixer.post_scale, self.mixer.post_offset)
        self.projection.zero_()
        self.bias_pre.copy_(pre)
        self.bias_post.copy_(post)

    def compute_path(self, x: torch.Tensor, fused: bool | None = None) -> ComputePath:
        """The :class:`ComputePath` a call on streams ``x`` takes (:func:`select_path` with this module's
        options; ``fused`` overrides the module's)."""
        fused = self.fused if fused is None else fused
        return select_path(fused, self.kernels, x.device, torch.compiler.is_compiling())

    def _check_streams(self, x: torch.Tensor) -> None:
        check_stream_tensor(x, self.n_streams, self.dim, self)

    def _call_branch(self, branch, h: torch.Tensor, args, kwargs) -> torch.Tensor:
        return call_branch(branch, h, args, kwargs)

    def coefficients(
        self, x: torch.Tensor, fused: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-token matrices ``(pre, post, res)`` for streams ``x`` ``(B, T, n, C)``, differentiable.

        ``pre`` ``(B, T, n)``, ``post`` ``(B, T, n)`` and ``res`` ``(B, T, n, n)``, in at least float32
        (x's dtype promoted to float32). ``fused`` (default: the module's setting) picks a fast path or the
        reference (:func:`select_path`). ``res`` is the matrix as applied, ``X' = res X`` (transposed with
        ``transpose_res``). Computed without autocast.
        """
        self._check_streams(x)
        with _stream_precision(x):
            return self._coefficients_on(x, self.compute_path(x, fused))

    def matrices(self, x: torch.Tensor, fused: bool | None = None) -> dict[str, torch.Tensor]:
        """:meth:`coefficients` as a dict: ``pre`` ``(B, T, n)``, ``post`` ``(B, T, n)``, ``res`` ``(B, T, n, n)``."""
        return dict(zip(("pre", "post", "res"), self.coefficients(x, fused)))

    def _coefficients_on(
        self, x: torch.Tensor, path: ComputePath
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = coefficient_dtype(x.dtype)
        n = self.n_streams
        if self.per_stream:
            d_pre, d_post, d_res = self._per_stream_projection(x.to(dtype))
        else:
            d = path.norm_project(x.flatten(-2), self.norm_weight, self.projection, self.eps)
            d_pre, d_post, d_res = d.split([n, n, self.mixer.num_inputs], dim=-1)
        alpha_pre, alpha_post = self.alpha_pre.to(dtype), self.alpha_post.to(dtype)
        bias_pre, bias_post = self.bias_pre.to(dtype), self.bias_post.to(dtype)
        if self.mixer.gate == "tanh":  # HC: b + α·tanh(d)
            pre = bias_pre + alpha_pre * torch.tanh(d_pre)
            post = bias_post + alpha_post * torch.tanh(d_post)
        else:
            pre = torch.sigmoid(alpha_pre * d_pre + bias_pre)
            post = self.mixer.post_scale * torch.sigmoid(alpha_post * d_post + bias_post)
        if self.mixer.pre_offset:  # DeepSeek-V4's mHC and Hy4's iHC: H_pre = σ(·) + hc_eps
            pre = pre + self.mixer.pre_offset
        if self.mixer.post_offset:  # Hy4's iHC: H_post = hc_magnitude · σ(·) + hc_eps
            post = post + self.mixer.post_offset
        res = self.mixer(d_res, fused=path.fused_mixer)
        return pre, post, res.mT if self.transpose_res else res

    def _step_coefficients(self, x: torch.Tensor, path: ComputePath):
        """``(pre, post, res)`` of a forward step on ``path``; with ``recompute`` (and gradients) not stored but
        computed again in the backward pass."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._coefficients_on, x, path, use_reentrant=False)
        return self._coefficients_on(x, path)

    def _per_stream_projection(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The HC paper's ``d``: stream s, normed alone, gives its read weight ``d[s, 0]``, its write weight
        ``d[s, 1]`` and row s of ``A_r`` ``d[s, 2:]``. ``d_res`` is returned as ``A_rᵀ`` flattened, so that the
        mixer's ``H_res[t, s] = B[t, s] + α tanh(A_r[s, t])`` has output streams in its rows like every family.
        The projection is C × (n + 2) per stream: the compute paths' n·C-wide fusions do not apply."""
        normed = F.rms_norm(x, (self.dim,), self.norm_weight.to(x.dtype), self.eps)
        d = normed @ self.projection.to(x.dtype)  # (B, T, n, 2 + n)
        return d[..., 0], d[..., 1], d[..., 2:].mT.flatten(-2)

    def forward(self, x: torch.Tensor, branch: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        self._check_streams(x)
        if x.dim() != 4:  # streams (..., n, C) with other leading dimensions: the branch sees (..., C)
            lead = x.shape[:-2]

            def flat_branch(h, *a, **k):  # checked at the caller's shape, so its errors name the caller's shape
                return call_branch(branch, h.reshape(*lead, self.dim), a, k).reshape(h.shape)

            return self.forward(as_batch_time(x), flat_branch, *args, **kwargs).reshape(x.shape)
        path = self.compute_path(x).for_call()
        with _stream_precision(x):
            pre, post, res = self._step_coefficients(x, path)
            branch_in, mixed = path.read_mix(x, pre, res)
        branch_out = self._call_branch(branch, branch_in, args, kwargs)  # the one part that runs under autocast
        with _stream_precision(x):
            return path.write(mixed, post, branch_out)

    @staticmethod
    def _check_matrices(x: torch.Tensor, h: Any, shapes: dict[str, tuple[int, ...]]) -> None:
        """TypeError for streams ``x`` that are not a floating ``(B, T, n, C)`` tensor; ValueError naming the
        argument when ``h`` lacks a matrix of ``shapes`` or holds one of another shape (:meth:`read`, :meth:`write`)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point torch.Tensor of shape (batch, time, n_streams, dim), got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"x must have shape (batch, time, n_streams, dim), got shape {tuple(x.shape)}")
        wanted = " and ".join(repr(key) for key in shapes)
        if not isinstance(h, dict) or any(not isinstance(h.get(key), torch.Tensor) for key in shapes):
            found = sorted(h) if isinstance(h, dict) else type(h).__name__
            raise ValueError(f"h must hold {wanted} tensors (as HyperConnection.matrices returns), got {found}")
        for key, shape in shapes.items():
            if tuple(h[key].shape) != shape:
                raise ValueError(f"h[{key!r}] must have shape {shape} for x of shape {tuple(x.shape)}, got "
                                 f"{tuple(h[key].shape)}")

    @staticmethod
    def read(x: torch.Tensor, h: dict[str, torch.Tensor]) -> torch.Tensor:
        """Branch input ``H_pre X``: streams ``(B, T, n, C)`` -> ``(B, T, C)``, in x's dtype (the reference's
        form; ``h`` as returned by :meth:`matrices`)."""
        HyperConnection._check_matrices(x, h, {"pre": tuple(x.shape[:3]) if isinstance(x, torch.Tensor) else ()})
        with _stream_precision(x):
            return torch.einsum("btn,btnc->btc", h["pre"].to(x.dtype), x)

    @staticmethod
    def write(x: torch.Tensor, h: dict[str, torch.Tensor], branch_out: torch.Tensor) -> torch.Tensor:
        """New streams ``H_res X + H_postᵀ F``: ``x`` ``(B, T, n, C)`` and ``branch_out`` ``(B, T, C)`` ->
        ``(B, T, n, C)``."""
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
        HyperConnection._check_matrices(x, h, {"res": (*shape[:3], *shape[2:3]), "post": shape[:3]})
        if not isinstance(branch_out, torch.Tensor) or tuple(branch_out.shape) != (*shape[:2], *shape[3:]):
            got = tuple(branch_out.shape) if isinstance(branch_out, torch.Tensor) else type(branch_out).__name__
            raise ValueError(f"branch_out must have shape {(*shape[:2], *shape[3:])} (the streams' batch, time and "
                             f"dim), got {got}")
        res, post = h["res"].to(x.dtype), h["post"].to(x.dtype)
        with _stream_precision(x):
            return torch.einsum("btij,btjc->btic", res, x) + post.unsqueeze(-1) * branch_out.to(x.dtype).unsqueeze(-2)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, n_streams={self.n_streams}, family={self.family!r}, layer_index={self.layer_index}"
        text += f", fused={self.fused}" + (", recompute=True" if self.recompute else "")
        text += ", kernels='triton'" if self.kernels == "triton" else ""
        text += ", transpose_res=True" if self.transpose_res else ""
        text += f", projection_init={self.projection_init!r}" if self.projection_init != "zero" else ""
        text += f", gate_init={self.gate_init!r}" if self.gate_init != "papers" else ""
        return text
