"""``--module torchtitan_cpu``: s2hc.torchtitan's configs with the CPU fixes of this package applied first."""

from __future__ import annotations

from . import apply

apply()

from s2hc.torchtitan import config_registry  # noqa: E402


def __getattr__(name: str):
    return getattr(config_registry, name)
