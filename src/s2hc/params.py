"""Parameter counts of the hyper-connections of a model shape, from modules actually built.

Every wrapped sublayer (``layers × sublayers_per_layer`` of them, attention and MLP by default) gets its
own :class:`s2hc.HyperConnection`; the count is the ``numel`` sum of their parameters. The modules are
built on the ``meta`` device, so even mHC-lite at n = 7 (about 2 B parameters at the paper's shape)
allocates nothing.

>>> count_aux_params("mhc", layers=2, dim=8, n_streams=2)
620
>>> count_aux_params("residual", layers=28, dim=1024, n_streams=7)
0
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from . import mixers
from .checks import check_int
from .connection import RESIDUAL, HyperConnection, methods

__all__ = ["build_options", "count_aux_params", "param_table"]


def _check_mixer(mixer: Any) -> None:
    if mixer not in methods():
        raise ValueError(f"mixer must be one of {methods()}, got {mixer!r}")


def build_options(mixer: str, **mixer_options: Any) -> dict[str, Any]:
    """The options used to build ``mixer`` for counting: ``mixer_options`` plus ``allow_large=True``
    for every family that takes it (mhc-lite, kromhc), since counting builds nothing real.
    An explicit ``allow_large`` in ``mixer_options`` wins.
    """
    _check_mixer(mixer)
    if mixer == RESIDUAL:
        return dict(mixer_options)
    options = dict(mixer_options)
    if "allow_large" in mixers.options(mixer):
        options.setdefault("allow_large", True)
    return options


def _count(
    mixer: str, *, layers: int, dim: int, n_streams: int, sublayers_per_layer: int, **mixer_options: Any
) -> dict[str, Any]:
    """Build one connection per wrapped sublayer on the meta device and count; also report K."""
    _check_mixer(mixer)
    for name, value in (
        ("layers", layers),
        ("dim", dim),
        ("n_streams", n_streams),
        ("sublayers_per_layer", sublayers_per_layer),
    ):
        check_int(name, value)
    if mixer == RESIDUAL:
        n_streams = 1  # a plain residual stream is one stream, whatever n the others use
    options = build_options(mixer, **mixer_options)
    sublayers = layers * sublayers_per_layer
    with torch.device("meta"):
        connections = [
            HyperConnection(dim, n_streams, mixer=mixer, layer_index=index, **options) for index in range(sublayers)
        ]
    first = connections[0]
    num_inputs = 0 if first.mixer is None else first.mixer.num_inputs
    counts = [sum(p.numel() for p in connection.parameters()) for connection in connections]
    total = sum(counts)
    return {
        "mixer": mixer,
        "K": num_inputs,
        "per_sublayer": counts[0] if len(set(counts)) == 1 else total / sublayers,
        "aux_params": total,
        "n_streams": n_streams,
        "layers": layers,
        "dim": dim,
        "sublayers_per_layer": sublayers_per_layer,
        "sublayers": sublayers,
    }


def count_aux_params(
    mixer: str, *, layers: int, dim: int, n_streams: int, sublayers_per_layer: int = 2, **mixer_options: Any
) -> int:
    """Parameters of the hyper-connections of a model with ``layers`` layers of width ``dim``.

    One ``HyperConnection(dim, n_streams, mixer=mixer, layer_index=i, **mixer_options)`` is built per
    wrapped sublayer ``i`` (``layers × sublayers_per_layer`` of them) on the meta device, and the
    ``numel`` of their parameters summed. ``allow_large=True`` is passed to the families that take it.
    ``"residual"`` is a single plain stream: counted with ``n_streams=1``, it has 0 parameters.
    ValueError naming the argument for an unknown mixer or a size below 1.
    """
    return _count(
        mixer,
        layers=layers,
        dim=dim,
        n_streams=n_streams,
        sublayers_per_layer=sublayers_per_layer,
        **mixer_options,
    )["aux_params"]


def param_table(
    mixers: Iterable[str] | None = None,  # shadows the module import, unused here
    *,
    layers: int,
    dim: int,
    n_streams: int,
    sublayers_per_layer: int = 2,
) -> list[dict[str, Any]]:
    """One row per family in ``mixers`` (default: every name in :func:`s2hc.methods`), in that order.

    Each row has ``mixer``, ``K`` (inputs per token of the constraint map, 0 for residual),
    ``per_sublayer``, ``aux_params`` (the total), ``n_streams`` (1 for residual), ``layers``, ``dim``,
    ``sublayers_per_layer``, ``sublayers`` and ``vs_mhc``: the ratio to ``mhc``'s total when ``mhc`` is in the table,
    else None.
    """
    names = methods() if mixers is None else list(dict.fromkeys(mixers))
    if not names:
        raise ValueError("mixers must name at least one family, got none")
    for name in names:
        _check_mixer(name)
    rows = [
        _count(name, layers=layers, dim=dim, n_streams=n_streams, sublayers_per_layer=sublayers_per_layer)
        for name in names
    ]
    reference = next((row["aux_params"] for row in rows if row["mixer"] == "mhc"), None)
    for row in rows:
        row["vs_mhc"] = row["aux_params"] / reference if reference else None
    return rows
