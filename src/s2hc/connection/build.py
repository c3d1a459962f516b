"""Which module a family's connection is: :func:`build_connection`, built by each family's form
(:mod:`s2hc.connection.forms`); and what model-level tools do to every connection of a model
(:func:`set_connection_options`). Every module a form builds is a :class:`~s2hc.connection.base.ConnectionModule`."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..checks import check_streams
from . import forms
from .base import Connection
from .module import COMPUTE_OPTIONS
from .paths import KERNELS


def build_connection(dim: int, n_streams: int, family: str = "s2hc", layer_index: int = 0, *, sublayer: int = 0,
                     n_sublayers: int = 1, **options: Any) -> nn.Module:
    """The connection of ``family`` around one branch, built by its form (:meth:`ConnectionForm.build
    <s2hc.connection.forms.ConnectionForm.build>`): ``layer_index`` the block's index, ``sublayer`` the branch's
    index over the model's ``n_sublayers`` (for the forms that carry state across sublayers); ``options`` the
    family's and the connection's own. ValueError naming an option the form does not take."""
    return forms.get(family).build(dim, n_streams, layer_index, sublayer=sublayer, n_sublayers=n_sublayers,
                                   **options)


def is_mixing_connection(module: nn.Module) -> bool:
    """Whether ``module`` is a connection over several streams whose ``matrices(x)`` the stream diagnostics read
    (its form's ``mixes_streams``; not the plain residual, not AttnRes)."""
    return isinstance(module, Connection) and forms.get(module.family).mixes_streams


def projection_width(family: str, n_streams: int, **family_options: Any) -> int | None:
    """Width of the coefficient projection ``d`` (``2n + K``, K = the constraint map's inputs) that
    :class:`HyperConnection` builds for ``family`` at ``n_streams``; None where the connection has no n·C-wide
    projection (``"residual"``, ``"gated-residual"``, and HC's ``projection="per-stream"``). Raises ValueError
    where the family's constraint map refuses the size or an option, as the constructor does.

    >>> projection_width("s2hc", 4), projection_width("mhc", 4), projection_width("residual", 1)
    (17, 24, None)
    """
    check_streams("n_streams", n_streams)
    return forms.get(family).projection_width(n_streams, **family_options)


def set_connection_options(model: nn.Module, **options: Any) -> nn.Module:
    """:meth:`HyperConnection.set_options` (``fused``, ``recompute``, ``kernels``) on every mixing connection
    of ``model``; returns ``model``. How the connections compute is not part of a model's configuration:
    a checkpoint trained with ``kernels="triton"`` on a GPU loads and runs anywhere."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    unknown = sorted(set(options) - set(COMPUTE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown connection options {unknown}; allowed: {list(COMPUTE_OPTIONS)}")
    for name in ("fused", "recompute"):  # checked even where the model has no connection to set them on
        if name in options and not isinstance(options[name], bool):
            raise ValueError(f"{name} must be True or False, got {options[name]!r}")
    if "kernels" in options and options["kernels"] not in KERNELS:
        raise ValueError(f"kernels must be one of {list(KERNELS)}, got {options['kernels']!r}")
    connections = [module for module in model.modules() if isinstance(module, Connection)]
    fixed = sorted({module.family for module in connections if not forms.get(module.family).compute_options})
    if options and fixed:
        raise ValueError(f"family {fixed[0]!r} has one way to compute: connection options {sorted(options)} do not "
                         "apply to it")
    for module in connections:
        module.set_options(**options)
    return model
