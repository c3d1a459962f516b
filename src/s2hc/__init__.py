"""s2hc: multi-stream residual connections (hyper-connections) with s²HC and the families it is compared to.

>>> import torch, s2hc
>>> connections = s2hc.Connections(dim=64, n_sublayers=2, family="s2hc")   # any of s2hc.families()
>>> x = connections.expand(torch.randn(2, 8, 64))                       # (B, T, n, C) for s2hc
>>> x = connections[0](x, torch.nn.Linear(64, 64))                      # the branch around sublayer 0
>>> connections.reduce(connections[1](x, torch.nn.Linear(64, 64))).shape
torch.Size([2, 8, 64])

The names below are imported on first use (PEP 562), so that ``import s2hc`` alone, and with it the ``s2hc``
command's start (``s2hc --version``, ``s2hc --help``), does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "Connections", "GatedHead", "GatedResidual", "HyperConnection", "HyperHead", "expand_streams", "families",
    "mixers", "reduce_streams", "__version__",
]

if TYPE_CHECKING:  # what the names are, for type checkers and readers; at run time __getattr__ imports them
    from . import mixers
    from .connection import (
        Connections,
        GatedHead,
        GatedResidual,
        HyperConnection,
        HyperHead,
        expand_streams,
        reduce_streams,
    )
    from .connection.forms import families


def __getattr__(name: str):
    """The public names, imported (and kept in the module) the first time one is asked for."""
    if name == "mixers":  # a submodule: `from . import mixers` here would ask this function again
        value = importlib.import_module(".mixers", __name__)
    elif name == "families":
        from .connection.forms import families as value
    elif name in __all__ and name != "__version__":
        from . import connection

        value = getattr(connection, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
