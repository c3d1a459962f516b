"""Every connection form, by family name: the registry the rest of s2hc asks instead of comparing names.

>>> from s2hc.connection import forms
>>> forms.get("gated-residual").pre_norms, forms.get("attn-res").default_stream_reduce, forms.default_streams("mhc")
(False, 'head', 4)

A family is a form: the plain residual (:mod:`~.residual`), a hyper-connection over each mixing family of
:data:`s2hc.mixers.REGISTRY` (:mod:`~.hyper`), Qwen's gated residual (:mod:`~.gated_residual`), Attention
Residuals (:mod:`~.attn_res`), the wide residual (:mod:`~.wide_residual`), and the one-stream residuals of
production models: the variance-preserving residual (:mod:`~.vp_residual`: Muse Spark, Ergo, Beam) and the affine
residual (:mod:`~.affine_residual`: ZAYA); and DeepSeek-V4.1's single-pass mHC (:mod:`~.lagged_mhc`). Adding a form
is one module here and one entry in :data:`FORMS` (docs/design.md section 4); what a form declares is
:class:`ConnectionForm`.
"""

from __future__ import annotations

from typing import Any

from ... import mixers
from .affine_residual import AFFINE_RESIDUAL, AffineResidual
from .attn_res import ATTN_RES, AttnResConnection, AttnResHead
from .base import CoefficientProbe, ConnectionForm
from .gated_residual import GATED_RESIDUAL, GatedHead, GatedResidual
from .hyper import HYPER_CONNECTION_OPTIONS, HyperConnectionForm
from .lagged_mhc import LAGGED_MHC, LaggedHead, LaggedHyperConnection
from .residual import RESIDUAL, ResidualConnection
from .vp_residual import VP_RESIDUAL, VPResidual
from .wide_residual import WIDE_RESIDUAL, WideResidual

#: Every form in the order ``s2hc.families()`` lists them: the residual, the mixing families in the design
#: document's order, then the forms of their own.
FORMS: tuple[ConnectionForm, ...] = (
    RESIDUAL,
    *(HyperConnectionForm(name) for name in mixers.REGISTRY),
    GATED_RESIDUAL,
    ATTN_RES,
    WIDE_RESIDUAL,
    VP_RESIDUAL,
    AFFINE_RESIDUAL,
    LAGGED_MHC,
)
REGISTRY: dict[str, ConnectionForm] = {form.name: form for form in FORMS}


def families() -> list[str]:
    """Every family name a model accepts (``ModelConfig.family``), in registry order."""
    return list(REGISTRY)


def check_family(name: object, argument: str = "family") -> str:
    """``name`` if it names a family; ValueError naming ``argument`` and the allowed names otherwise."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"{argument} must be one of {families()}, got {name!r}")
    return name


def get(name: object, argument: str = "family") -> ConnectionForm:
    """The form of family ``name``; ValueError naming ``argument`` and the allowed names otherwise."""
    return REGISTRY[check_family(name, argument)]


def default_streams(family: str) -> int:
    """Streams a family gets when none are given (1 for the one-stream forms, else the papers' 4)."""
    return get(family).default_streams


def options(family: str) -> dict[str, Any]:
    """The options family ``family`` takes and their defaults (the connection's own ``eps`` etc. aside)."""
    return get(family).options()


__all__ = [
    "AFFINE_RESIDUAL", "ATTN_RES", "FORMS", "GATED_RESIDUAL", "HYPER_CONNECTION_OPTIONS", "LAGGED_MHC", "REGISTRY",
    "RESIDUAL", "VP_RESIDUAL", "WIDE_RESIDUAL", "AffineResidual", "AttnResConnection", "AttnResHead",
    "CoefficientProbe", "ConnectionForm", "GatedHead", "GatedResidual", "HyperConnectionForm", "LaggedHead",
    "LaggedHyperConnection", "ResidualConnection", "VPResidual", "WideResidual", "check_family", "default_streams",
    "families", "get", "options",
]
