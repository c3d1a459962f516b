"""Which module a family's connection is: :func:`build_connection`, and the module types every model-level tool
recognises (:data:`CONNECTIONS`, :data:`HEADS`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..mixers import GATED_RESIDUAL, check_family
from .gated import GATED_OPTIONS, GatedHead, GatedResidual
from .module import HyperConnection
from .streams import HyperHead

#: The connections around a branch: the papers' form (every family but one) and Qwen's gated residual.
CONNECTIONS = (HyperConnection, GatedResidual)
#: The learned final reads: DeepSeek-V4's HyperHead and Qwen's gated read.
HEADS = (HyperHead, GatedHead)


def build_connection(dim: int, n_streams: int, family: str = "s2hc", layer_index: int = 0,
                     **options: Any) -> HyperConnection | GatedResidual:
    """The connection of ``family`` around one branch: a :class:`GatedResidual` for ``"gated-residual"`` (its options:
    ``rank``, ``eps``), else a :class:`HyperConnection` (every option of its constructor). ValueError naming an
    option the gated residual does not take."""
    check_family(family)
    if family != GATED_RESIDUAL:
        return HyperConnection(dim, n_streams, family=family, layer_index=layer_index, **options)
    unknown = sorted(set(options) - set(GATED_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for family {GATED_RESIDUAL!r}; allowed: {list(GATED_OPTIONS)}")
    return GatedResidual(dim, n_streams, layer_index=layer_index, **options)


def is_mixing_connection(module: nn.Module) -> bool:
    """Whether ``module`` is a connection with several streams (a :data:`CONNECTIONS` instance, not ``residual``)."""
    return isinstance(module, CONNECTIONS) and not module.is_residual
