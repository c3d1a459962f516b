"""The residual-mixing families (DESIGN.md section 1) and a registry that builds them by name.

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


def available() -> list[str]:
    """Names of every mixing family, in the order of DESIGN.md's table."""
    return list(REGISTRY)


def options(name: str) -> dict[str, object]:
    """The keyword options family ``name`` accepts, with their defaults."""
    signature = inspect.signature(get(name).__init__)
    return {p: v.default for p, v in signature.parameters.items() if p not in ("self", "n_streams")}


def get(name: str) -> type[Mixer]:
    """The class of family ``name``; ValueError naming the allowed names otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"mixer must be one of {available()}, got {name!r}")
    return REGISTRY[name]


def check_options(name: str, mixer_options: dict) -> None:
    """ValueError if ``name`` is unknown or takes none of some ``mixer_options`` (no silent ignoring)."""
    allowed = options(name)
    unknown = sorted(set(mixer_options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for mixer {name!r}; allowed: {sorted(allowed)}")


def build(name: str, n_streams: int, **mixer_options) -> Mixer:
    """Build family ``name`` for ``n_streams`` streams: a module mapping ``(..., K) -> (..., n, n)``."""
    check_options(name, mixer_options)
    return get(name)(n_streams, **mixer_options)


__all__ = [
    "Guarantees",
    "Mixer",
    "REGISTRY",
    "MAX_PERMUTATION_STREAMS",
    "available",
    "build",
    "check_options",
    "coefficient_dtype",
    "get",
    "options",
]
