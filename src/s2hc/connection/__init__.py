"""The hyper-connection around one branch (attention or MLP), and the stream expansion / reduction.

Per token, with streams ``X ∈ R^{n×C}`` (docs/design.md section 1)::

    x̃ = RMSNorm(vec(X));  d = x̃ W  (W zero-initialised by default, nC × (2n + K))
    H_pre = gate(α_pre d_pre + b_pre);  H_post = 2·gate(α_post d_post + b_post);  H_res = M(d_res)
    X' = H_res X + H_postᵀ F(H_pre X)

The coefficient path (norm, projection, gates, constraint map) runs in at least float32 whatever the
model's dtype; the three matrices are cast to the stream dtype for the mixing itself. Under
``torch.autocast`` only the branch runs autocast: the coefficients, the read, the mixing and the write run
in the streams' own dtype, so a float32 residual stream is never rounded to bfloat16 (as in a plain
residual model, where ``x + F(x)`` stays float32 and the branch output is the one low-precision term).

The n-wide work (norm and projection, read and mix, write) has four implementations, the compute paths
(:class:`ComputePath`); :func:`select_path` picks one per call, from ``fused``, ``kernels`` and whether
``torch.compile`` is tracing. All compute the same function (``tests/test_fastpath.py`` and
``tests/test_triton_kernels.py`` check values and gradients):

- ``reference`` (``fused=False``): ``F.rms_norm`` then the projection, the family's
  :meth:`~s2hc.mixers.Mixer.mix`, einsum read and write; the equations as written.
- ``eager`` (``fused=True``, the default, outside ``torch.compile``): the RMSNorm weight folded into the
  projection, ``d = r · X (diag(w) W)`` with ``r = 1/rms(X)``, so no normed n·C-wide copy is written or
  stored; the read and the mixing in one autograd function that stores only ``X`` and the matrices; the
  write as one ``addcmul``; the family's ``mix`` (without a compiler a batched GEMM is one call, where
  the broadcast form is one pass over memory per operation).
- ``compiled`` (``fused=True`` under ``torch.compile``, whatever ``kernels``): the same fold, read and
  mixing as broadcast multiply-adds, and the family's ``mix_fused``, which inductor fuses into a few
  loops over ``X``.
- ``triton`` (``fused=True, kernels="triton"``, outside ``torch.compile``): the three n-wide passes as
  Triton kernels (:mod:`s2hc.connection.kernels`), on CUDA, or on CPU under ``TRITON_INTERPRET=1``.

Measurements of each: ``docs/benchmarks.md``.

Every family is a *connection form* (:mod:`~s2hc.connection.forms`: what the rest of s2hc asks about a family, and
the modules it builds): the plain residual (:class:`~s2hc.connection.forms.ResidualConnection`), the hyper-connection
over each mixing family (:class:`HyperConnection`), Qwen's gated residual (:class:`GatedResidual` with its final read
:class:`GatedHead`: no compute paths, it has one), Attention Residuals
(:class:`~s2hc.connection.forms.AttnResConnection`) and the wide residual
(:class:`~s2hc.connection.forms.WideResidual`), the one-stream residuals of production models
(:class:`VPResidual`, :class:`AffineResidual`);
:func:`build_connection` (:mod:`~s2hc.connection.build`) builds the right module for a family, and
:class:`Connections` (:mod:`~s2hc.connection.stack`) every module a model of one family needs. Every one of them is a
:class:`ConnectionModule` (:class:`Connection` around a branch, :class:`StreamHead` as the final read).

The modules: :mod:`~s2hc.connection.module` (:class:`HyperConnection` and its compute options),
:mod:`~s2hc.connection.streams` (into and out of the streams), :mod:`~s2hc.connection.base` (what a compute
path is), :mod:`~s2hc.connection.init` (how a connection's projection and gates start: ``projection_init``,
``gate_init``), :mod:`~s2hc.connection.reference` and :mod:`~s2hc.connection.fused` (the paths),
:mod:`~s2hc.connection.paths` (which path a call takes) and :mod:`~s2hc.connection.kernels` (the Triton
kernels; it needs ``triton`` and is imported only when ``kernels="triton"`` is first asked for).
"""

from __future__ import annotations

from . import forms
from .base import ComputePath, Connection, ConnectionModule, StreamHead
from .build import build_connection, is_mixing_connection, projection_width, set_connection_options
from .forms import (
    AffineResidual,
    AttnResConnection,
    AttnResHead,
    GatedHead,
    GatedResidual,
    ResidualConnection,
    VPResidual,
    WideResidual,
)
from .fused import CompiledPath, EagerPath, TritonPath
from .init import GATE_INITS, PROJECTION_INITS, gate_biases, projection_std, residual_targets, upcycling_biases
from .module import COMPUTE_OPTIONS, HyperConnection
from .paths import COMPILED, EAGER, KERNELS, REFERENCE, select_path
from .reference import ReferencePath
from .stack import Connections
from .streams import HyperHead, StreamScaling, expand_streams, reduce_streams

__all__ = [
    "COMPILED", "COMPUTE_OPTIONS", "EAGER", "GATE_INITS", "KERNELS", "PROJECTION_INITS", "REFERENCE",
    "AffineResidual", "AttnResConnection", "AttnResHead", "CompiledPath", "ComputePath", "Connection",
    "ConnectionModule",
    "Connections", "EagerPath", "GatedHead", "GatedResidual", "HyperConnection", "HyperHead", "ReferencePath",
    "ResidualConnection", "StreamHead", "StreamScaling", "TritonPath", "VPResidual", "WideResidual",
    "build_connection", "expand_streams", "forms", "gate_biases", "is_mixing_connection", "projection_std",
    "projection_width", "reduce_streams", "residual_targets", "select_path", "set_connection_options",
    "upcycling_biases",
]
