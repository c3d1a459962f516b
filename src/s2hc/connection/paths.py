"""Where the path is chosen, in one place (docs/design.md section 3): :func:`select_path` and the one
instance of each compute path."""

from __future__ import annotations

import functools

import torch

from .base import ComputePath
from .fused import CompiledPath, EagerPath, TritonPath
from .reference import ReferencePath

KERNELS = ("torch", "triton")

REFERENCE, EAGER, COMPILED = ReferencePath(), EagerPath(), CompiledPath()


@functools.cache
def _triton_path() -> TritonPath:
    from . import kernels  # needs the triton package: imported only when asked for

    return TritonPath(kernels)


def select_path(fused: bool, kernels: str, device: torch.device | str, compiling: bool) -> ComputePath:
    """The compute path for one call: ``fused`` and ``kernels`` as in :class:`HyperConnection`, ``device``
    the streams' device, ``compiling`` whether ``torch.compile`` is tracing the call
    (``torch.compiler.is_compiling()``, which dynamo resolves while tracing, so the choice costs no graph break).

    ``fused=False`` is the reference whatever ``kernels`` (``kernels`` picks among the fast paths;
    :meth:`HyperConnection.set_options` refuses the pair as a module setting). Under ``torch.compile`` the
    fast path is always the compiled one: inductor already emits fused Triton for it, and the
    hand-written kernels would be opaque calls between its kernels.

    >>> select_path(False, "torch", "cpu", compiling=False).name
    'reference'
    >>> select_path(True, "torch", "cpu", compiling=False).name
    'eager'
    >>> select_path(True, "triton", "cuda", compiling=True).name
    'compiled'
    """
    if not isinstance(fused, bool):
        raise ValueError(f"fused must be True or False, got {fused!r}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
    if not fused:
        return REFERENCE
    if compiling:
        return COMPILED
    if kernels == "torch":
        return EAGER
    path = _triton_path()
    device = torch.device(device)
    if device.type != "cuda" and not path.kernels.interpreted():
        raise ValueError(
            f"kernels='triton' runs on CUDA tensors, or on CPU with TRITON_INTERPRET=1 set before triton is "
            f"imported; got x on device {device.type!r}"
        )
    return path

