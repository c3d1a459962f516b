"""s2hc: multi-stream residual connections (hyper-connections) with s²HC and the families it is compared to.

>>> import torch, s2hc
>>> hc = s2hc.HyperConnection(dim=64, n_streams=4, family="s2hc")
>>> x = s2hc.expand_streams(torch.randn(2, 8, 64), 4)        # (B, T, n, C)
>>> hc(x, torch.nn.Linear(64, 64)).shape
torch.Size([2, 8, 4, 64])
"""

from . import mixers
from .connection import GatedHead, GatedResidual, HyperConnection, HyperHead, expand_streams, reduce_streams
from .connection.forms import families

__version__ = "0.1.0"

__all__ = [
    "GatedHead", "GatedResidual", "HyperConnection", "HyperHead", "expand_streams", "families", "mixers",
    "reduce_streams", "__version__",
]
