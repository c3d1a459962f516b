"""What every connection module is (:class:`ConnectionModule`, :class:`Connection`, :class:`StreamHead`); what every
compute path is (docs/design.md section 3): :class:`ComputePath`, the three n-wide operations a connection runs,
and the precision they run in (:func:`_stream_precision`); what every connection form checks
(:func:`check_stream_tensor`, :func:`call_branch`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mixers.base import autocast_off


def _stream_precision(x: torch.Tensor):
    """A context in which the stream operations on ``x`` run in ``x``'s dtype: autocast off for its device.

    Autocast would run ``H_res X`` and the projection in bfloat16 and round the whole residual stream at
    every sublayer; only the branch, called outside this context, should see autocast."""
    return autocast_off(x)


def check_stream_tensor(x: torch.Tensor, n_streams: int, dim: int, module: torch.nn.Module | None = None) -> None:
    """TypeError for anything but a floating tensor, ValueError for a shape other than ``(B, T, n_streams, dim)``
    or, with ``module``, a device other than that of the module's parameters (what every connection's ``forward``
    checks first)."""
    if not isinstance(x, torch.Tensor):
        hint = " (convert it with torch.from_numpy)" if type(x).__module__ == "numpy" else ""
        raise TypeError(f"x must be a torch.Tensor of shape (batch, time, n_streams, dim), got "
                        f"{type(x).__module__}.{type(x).__name__}{hint}")
    if not x.is_floating_point():
        raise TypeError(
            f"x must be a floating-point tensor (float32, bfloat16, float16 or float64: the connection computes "
            f"in x's dtype, its coefficients in at least float32), got dtype {x.dtype}"
        )
    if x.dim() < 3:
        raise ValueError(f"x must have shape (batch, time, n_streams, dim) (or any leading dimensions before "
                         f"n_streams, dim), got shape {tuple(x.shape)}")
    if x.shape[-2:] != (n_streams, dim):
        raise ValueError(
            f"x must have n_streams={n_streams} and dim={dim} in its last two dimensions, "
            f"got shape {tuple(x.shape)}"
        )
    if module is not None:
        check_device(x, module)


def check_device(x: torch.Tensor, module: torch.nn.Module, name: str = "x") -> None:
    """ValueError when ``x`` is on another device than ``module``'s parameters (a ``meta`` tensor given to a
    module on the CPU, or the reverse), before any operation mixes the two."""
    if torch.compiler.is_compiling():
        return
    parameter = next(module.parameters(), None)
    if parameter is not None and parameter.device != x.device:
        raise ValueError(f"{name} is on device {x.device}, the module's parameters on {parameter.device}; move "
                         f"one to the other (module.to({name}.device)) before the call")


def as_batch_time(x: torch.Tensor) -> torch.Tensor:
    """Streams ``(..., n, C)`` with any leading dimensions as the ``(B, T, n, C)`` the compute paths take: 4-D
    unchanged, otherwise every leading dimension flattened into T (``(1, prod(...), n, C)``, a view)."""
    return x if x.dim() == 4 else x.reshape(1, -1, *x.shape[-2:])


def call_branch(branch, h: torch.Tensor, args, kwargs) -> torch.Tensor:
    """``branch(h, *args, **kwargs)``, checked: a tensor of h's shape, or an error saying what came back (a dtype
    error from inside the branch gets a note on where h's dtype came from)."""
    if torch.compiler.is_compiling():
        out = branch(h, *args, **kwargs)
    else:
        try:
            out = branch(h, *args, **kwargs)
        except RuntimeError as error:  # e.g. a float32 nn.LayerNorm given float64 streams: say where h came from
            if "dtype" in str(error) and hasattr(error, "add_note"):
                error.add_note(f"s2hc: the branch was called with h of dtype {h.dtype}, the streams' dtype; "
                               "give the streams the branch's dtype, or call the connection under torch.autocast")
            raise
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"branch must return a tensor of the shape it was given, {tuple(h.shape)}, got "
            f"{type(out).__name__}" + (" (return only the hidden states)" if isinstance(out, tuple) else "")
        )
    if out.shape != h.shape:
        raise ValueError(f"branch must return the shape it was given, {tuple(h.shape)}, got {tuple(out.shape)}")
    return out


class ConnectionModule(nn.Module):
    """Base of every module a connection form builds: the connections around a branch (:class:`Connection`), the
    learned final reads (:class:`StreamHead`) and the learned stream scaling. What model-level tools ask of one is
    declared here, so that none asks a module's class: whether a parameter belongs to the multi-stream machinery
    (weight decay, Muon's routing, :meth:`s2hc.models.Transformer.num_connection_params`) is ``isinstance(module,
    ConnectionModule)``.

    ``projections``: the names of the parameters that are token-driven matrices, which weight decay's
    ``"matrices"`` setting decays (the rest, gates' biases and scales, never). ``unit_parameters``: those whose
    neutral value is 1 (a norm's weight applied as ``w``, not ``1 + w``), which weight decay's ``"all"`` setting
    decays toward 1 instead of 0. ``depth_read``: whether the module reads a softmax over depth sources (AttnRes's
    connections and output query), whose ``weights(sources)`` ``(B, T, S)`` the depth diagnostics measure."""

    projections: tuple[str, ...] = ()
    unit_parameters: tuple[str, ...] = ()
    depth_read: bool = False

    def state_streams(self, state: Any) -> Any:
        """The streams ``(..., n, C)`` in a state this module takes or returns (what the stream diagnostics
        sample): the state itself by default; a form whose state carries more beside them (DeepSeek-V4.1's
        single-pass mHC, its read weights) returns the streams alone."""
        return state


class Connection(ConnectionModule):
    """Base of every connection around one branch: ``forward(state, branch, *args, **kwargs) -> state``, where the
    state is what the form's :meth:`~s2hc.connection.forms.ConnectionForm.expand` made (streams ``(B, T, n, C)``,
    or AttnRes's tuple of sources) and ``branch(h, *args, **kwargs)`` maps ``(B, T, C)`` to ``(B, T, C)``.

    ``family`` names the connection's form (:func:`s2hc.connection.forms.get`)."""

    family: str = ""

    def set_options(self, fused: bool | None = None, recompute: bool | None = None, kernels: str | None = None):
        """Change how the connection computes (:data:`s2hc.connection.COMPUTE_OPTIONS`). A form with one way to
        compute refuses every option given a value; one with compute paths (:class:`s2hc.HyperConnection`)
        overrides this."""
        given = sorted(name for name, value in (("fused", fused), ("recompute", recompute), ("kernels", kernels))
                       if value is not None)
        if given:
            raise ValueError(f"family {self.family!r} has one way to compute: connection options {given} do not "
                             "apply to it")
        return self

    def start_as_residual(self, spread: float = 0.0) -> None:
        """Set the connection to the start upcycling gives it (:func:`s2hc.models.widen.upcycle`): one at which the
        model computes the residual model it was copied from. Nothing to do by default (a form that starts there
        already); a form that cannot is refused before by its form's
        :meth:`~s2hc.connection.forms.ConnectionForm.upcycle_refusal`."""

    def measures(self) -> dict[str, Any]:
        """What the connection's learned maps do, for a form without a residual matrix to measure (the wide
        residual's read and write maps): a flat dict of numbers and lists for reports and loggers; ``{}`` when the
        form has nothing of its own (its matrices are measured instead, or its diagnostics are elsewhere)."""
        return {}


class StreamHead(ConnectionModule):
    """Base of the learned final reads (``stream_reduce="head"``): ``forward(state) -> (B, T, C)``.

    ``output_read`` names how the diagnostics describe what the head takes from each stream (a key of
    :data:`s2hc.diagnostics.summary.OUTPUT_READS`, or ``"unknown"``); a head that reads streams gives
    :meth:`stream_contributions`."""

    output_read: str = "unknown"

    def stream_contributions(self, x: torch.Tensor) -> torch.Tensor:
        """What the head takes from each stream of ``x`` ``(N, n, C)``, in size: ``(N, n)`` float64."""
        raise ValueError(f"{type(self).__name__} does not read streams: it has no per-stream contributions")


class ComputePath:
    """How a connection runs its three n-wide operations; :func:`select_path` picks one.

    Shapes: streams ``x`` ``(B, T, n, C)``; ``pre``, ``post`` ``(B, T, n)`` and ``res`` ``(B, T, n, n)`` in
    the coefficient dtype (at least float32); the branch's output ``(B, T, C)``. ``read_mix`` and
    ``write`` return results in the streams' dtype, ``norm_project`` in the coefficient dtype. One call of a
    connection runs ``norm_project``, ``read_mix`` and ``write`` on the instance :meth:`for_call` gives.
    """

    name: str = ""
    #: whether the constraint map runs the family's broadcast form (``Mixer(d_res, fused=True)``)
    fused_mixer: bool = False

    def for_call(self) -> ComputePath:
        """The instance one call of a connection runs its three operations on (forward, and their backward): the
        path itself; a path whose backward joins the three's gradients (the Triton path's one ``dX``) gives a
        fresh one that ties them together."""
        return self

    def norm_project(
        self, flat: torch.Tensor, norm_weight: torch.Tensor, projection: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``d = RMSNorm(flat) W``: ``flat`` ``(..., nC)`` (the flattened streams, in their dtype), the norm's
        ``norm_weight`` ``(nC,)`` (or None: no weight) and ``projection`` W ``(nC, K)`` -> ``(..., K)`` in the
        coefficient dtype."""
        raise NotImplementedError

    def read_mix(self, x: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The branch input ``H_pre X`` ``(B, T, C)`` and what :meth:`write` needs for ``H_res X``: the mixed
        streams ``(B, T, n, C)``, or (a path that mixes in its write, reading X again) the streams and ``res``."""
        raise NotImplementedError

    def write(self, mixed: Any, post: torch.Tensor, branch_out: torch.Tensor) -> torch.Tensor:
        """The new streams ``H_res X + H_postᵀ F`` ``(B, T, n, C)`` from :meth:`read_mix`'s ``mixed``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<compute path {self.name!r}>"

