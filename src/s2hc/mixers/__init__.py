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
from .ihc import IHCMixer
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
        IHCMixer,
    )
}


#: The mixing family the parameter and coefficient-path tables give ratios against (their ``vs_mhc`` and
#: ``ratio_vs_mhc`` columns): mHC, the baseline of the papers.
REFERENCE_FAMILY = MHCMixer.name


def mixing_families() -> list[str]:
    """The families with an ``H_res`` constraint map, a :class:`Mixer` (the keys of :data:`REGISTRY`). Every family
    a model takes, these and the connection forms of their own: :func:`s2hc.families`."""
    return list(REGISTRY)


def options(name: str) -> dict[str, object]:
    """The keyword options mixing family ``name`` accepts, with their defaults (the connection's own, ``eps`` and
    those of :data:`s2hc.connection.forms.HYPER_CONNECTION_OPTIONS`, aside)."""
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
    "Guarantees",
    "Mixer",
    "REGISTRY",
    "MAX_PERMUTATION_STREAMS",
    "REFERENCE_FAMILY",
    "build",
    "check_options",
    "coefficient_dtype",
    "get",
    "mixing_families",
    "options",
]
