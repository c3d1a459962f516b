"""The residual-mixing families (docs/design.md section 1) and a registry that builds them by name.

>>> import torch
>>> from s2hc import mixers
>>> mixer = mixers.build("s2hc", n_streams=4)
>>> mixer.num_inputs                     # K raw inputs per token
9
>>> mixer(torch.zeros(2, 9)).shape       # d_res (..., K) -> H_res (..., n, n)
torch.Size([2, 4, 4])
"""

from __future__ import annotations

import inspect

from .base import Guarantees, Mixer, coefficient_dtype
from .hc import HCMixer
from .identity import IdentityMixer
from .isometric import IsometricMixer
from .kromhc import KromHCMixer
from .mhc import MHCMixer
from .mhc_lite import MAX_PERMUTATION_STREAMS, MHCLiteMixer
from .orthogonal import OrthogonalMixer
from .s2hc import S2HCMixer

REGISTRY: dict[str, type[Mixer]] = {
    cls.name: cls
    for cls in (
        IdentityMixer,
        HCMixer,
        MHCMixer,
        MHCLiteMixer,
        KromHCMixer,
        S2HCMixer,
        OrthogonalMixer,
        IsometricMixer,
    )
}


RESIDUAL = "residual"  # the plain one-stream residual: a family with no mixer
#: Qwen's gated residual (transformers' qwen4_exp): a connection form of its own, s2hc.connection.GatedResidual,
#: whose H_res is I and whose read is a gate per stream and channel; a family with no mixer.
GATED_RESIDUAL = "gated-residual"
#: Its options and their defaults: the read gates' rank r, transformers' Qwen4ExpTextConfig.hc_lowrank default.
GATED_RESIDUAL_OPTIONS: dict[str, object] = {"rank": 320}
#: The mixing family the parameter and coefficient-path tables give ratios against (their ``vs_mhc`` and
#: ``ratio_vs_mhc`` columns): mHC, the baseline of the papers.
REFERENCE_FAMILY = MHCMixer.name


def families() -> list[str]:
    """Every family name a model accepts (``ModelConfig.family``): ``"residual"``, the mixing families (the keys of
    :data:`REGISTRY`) in the order of the design document's table, then :data:`GATED_RESIDUAL`. All but the last
    are :class:`s2hc.HyperConnection`'s; the gated residual is :class:`s2hc.GatedResidual`
    (:func:`s2hc.connection.build_connection` builds either)."""
    return [RESIDUAL, *REGISTRY, GATED_RESIDUAL]


def mixing_families() -> list[str]:
    """The families with an ``H_res`` constraint map, a :class:`Mixer` (the keys of :data:`REGISTRY`)."""
    return list(REGISTRY)


def check_family(name: object, argument: str = "family") -> str:
    """``name`` if it names a family; ValueError naming ``argument`` and the allowed names otherwise."""
    if name not in families():
        raise ValueError(f"{argument} must be one of {families()}, got {name!r}")
    return name


def default_streams(family: str) -> int:
    """Streams a family gets when none are given: 1 for ``residual``, else 4 (the papers' n)."""
    return 1 if family == RESIDUAL else 4


def options(name: str) -> dict[str, object]:
    """The keyword options family ``name`` accepts, with their defaults (the connection's own, ``eps`` and those
    of :data:`s2hc.models.model_config.CONNECTION_OPTIONS`, aside)."""
    if name == GATED_RESIDUAL:
        return dict(GATED_RESIDUAL_OPTIONS)
    signature = inspect.signature(get(name).__init__)
    return {p: v.default for p, v in signature.parameters.items() if p not in ("self", "n_streams")}


def get(name: str) -> type[Mixer]:
    """The class of family ``name``; ValueError naming the allowed names otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"family must be one of the mixing families {list(REGISTRY)}, got {name!r}")
    return REGISTRY[name]


def check_options(name: str, family_options: dict) -> None:
    """ValueError if ``name`` is unknown or takes none of some ``family_options`` (no silent ignoring)."""
    allowed = options(name)
    unknown = sorted(set(family_options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for family {name!r}; allowed: {sorted(allowed)}")


def build(name: str, n_streams: int, **family_options) -> Mixer:
    """Build family ``name`` for ``n_streams`` streams: a module mapping ``(..., K) -> (..., n, n)``."""
    check_options(name, family_options)
    return get(name)(n_streams, **family_options)


__all__ = [
    "GATED_RESIDUAL",
    "GATED_RESIDUAL_OPTIONS",
    "Guarantees",
    "Mixer",
    "REGISTRY",
    "MAX_PERMUTATION_STREAMS",
    "REFERENCE_FAMILY",
    "RESIDUAL",
    "build",
    "check_family",
    "check_options",
    "coefficient_dtype",
    "default_streams",
    "families",
    "get",
    "mixing_families",
    "options",
]
