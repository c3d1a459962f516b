"""Parameter counts of the hyper-connections of a model shape, from modules actually built.

Every wrapped sublayer (``layers × sublayers_per_layer`` of them, attention and MLP by default) gets its
own :class:`s2hc.HyperConnection`; the count is the ``numel`` sum of their parameters. The modules are
built on the ``meta`` device, so even mHC-lite at n = 7 (about 2 B parameters at the paper's shape)
allocates nothing: the permutation families build only the shape of their table of n! permutations there.

Limits, stated: n <= :data:`s2hc.checks.MAX_STREAMS` for every family, and permutation mixtures of at most
:data:`MAX_PERMUTATION_SIZE` streams (12! = 479 001 600 inputs per token; the sizes a family declares in
:meth:`s2hc.mixers.Mixer.permutation_sizes`: mhc-lite's n, kromhc's prime factors of n), beyond which the counts
stop meaning anything and overflow 64-bit sizes; at most :data:`s2hc.checks.MAX_LAYERS` layers (one module is built
per sublayer, even on meta). A model that is trained builds permutation tables of at most 8 streams
(:data:`s2hc.mixers.mhc_lite.MAX_BUILT_PERMUTATION_SIZE`).

>>> count_connection_params("mhc", layers=2, dim=8, n_streams=2)
620
>>> count_connection_params("residual", layers=28, dim=1024, n_streams=7)
0
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from . import mixers
from .checks import MAX_LAYERS, check_int, check_streams
from .connection import build_connection, forms
from .connection.forms import check_family, families
from .flops import connection_flops
from .mixers import REFERENCE_FAMILY
from .mixers.mhc_lite import MAX_COUNTED_PERMUTATION_SIZE, permutation_limit_error
from .reports import count, human, ratio, table

__all__ = ["MAX_PERMUTATION_SIZE", "build_options", "count_connection_params", "count_hc_params", "format_table",
           "human", "param_table"]

#: The largest permutation mixture counted (:meth:`~s2hc.mixers.Mixer.permutation_sizes`): 12! = 479 001 600 inputs
#: per token.
MAX_PERMUTATION_SIZE = MAX_COUNTED_PERMUTATION_SIZE
#: Wrapped sublayers per layer counted (2: attention and MLP; a few more for exotic blocks).
MAX_SUBLAYERS_PER_LAYER = 16


def permutation_sizes(family: str, n_streams: int) -> list[int]:
    """The sizes of the permutation mixtures ``family`` builds at ``n_streams`` (each holds size! permutations), as
    its class declares them (:meth:`s2hc.mixers.Mixer.permutation_sizes`); none for ``residual``, and none for a name
    that is no family (checked where it is used)."""
    mixer = mixers.REGISTRY.get(family)
    return [] if mixer is None else mixer.permutation_sizes(n_streams)


def check_countable(family: str, n_streams: int, built: bool = False) -> None:
    """ValueError naming the family and the limit for more than :data:`~s2hc.checks.MAX_STREAMS` streams, or a
    permutation mixture beyond :func:`s2hc.mixers.mhc_lite.permutation_size_limit`: :data:`MAX_PERMUTATION_SIZE`
    streams for counting, 8 for a model that will be ``built`` (a run's config), whatever ``allow_large`` says."""
    check_streams("n_streams", n_streams)
    largest = max(permutation_sizes(family, n_streams), default=0)
    error = permutation_limit_error(f"{family} at n_streams={n_streams}", largest, built)
    if error is not None:
        raise error


def build_options(family: str, **family_options: Any) -> dict[str, Any]:
    """The options used to build ``family`` for counting: ``family_options`` plus ``allow_large=True``
    for every family whose constructor takes it (the permutation families), since counting builds nothing real.
    An explicit ``allow_large`` in ``family_options`` wins.
    """
    options = dict(family_options)
    if "allow_large" in forms.options(family):
        options.setdefault("allow_large", True)
    return options


def _count(
    family: str, *, layers: int, dim: int, n_streams: int, sublayers_per_layer: int, **family_options: Any
) -> dict[str, Any]:
    """Build one connection per wrapped sublayer on the meta device and count; also report K."""
    check_family(family)
    for name, value in (
        ("dim", dim),
        ("n_streams", n_streams),
    ):
        check_int(name, value)
    # one module is built per sublayer, even on meta: 10**12 layers would never finish
    check_int("layers", layers, maximum=MAX_LAYERS)
    check_int("sublayers_per_layer", sublayers_per_layer, maximum=MAX_SUBLAYERS_PER_LAYER)
    form = forms.get(family)
    if form.max_streams == 1:
        n_streams = 1  # a one-stream form (the residual, AttnRes) is one stream, whatever n the others use
    check_countable(family, n_streams)
    options = build_options(family, **family_options)
    sublayers = layers * sublayers_per_layer
    with torch.device("meta"):
        connections = [
            build_connection(dim, n_streams, family=family, layer_index=index // sublayers_per_layer, sublayer=index,
                             n_sublayers=sublayers, **options,
                             **form.sublayer_options(family_options, index, sublayers_per_layer))
            for index in range(sublayers)
        ]
        head = (form.build_head(dim, n_streams, norm_eps=1e-6, options=options)
                if form.default_stream_reduce == "head" else None)
    mixer = getattr(connections[0], "mixer", None)  # the gated residual has none
    num_inputs = 0 if mixer is None else mixer.num_inputs
    counts = [sum(p.numel() for p in connection.parameters()) for connection in connections]
    total = sum(counts)
    head_params = 0 if head is None else sum(p.numel() for p in head.parameters())
    return {
        "family": family,
        "K": num_inputs,
        "per_sublayer": counts[0] if len(set(counts)) == 1 else total / sublayers,
        "hc_params": total,
        # the family's learned final read at its default stream_reduce ("head": the gated residual's gated read,
        # AttnRes's output query), which a model of the family builds by default; 0 for "sum" / "mean"
        "head_params": head_params,
        # what a trained model counts as its connection parameters (Transformer.num_connection_params, a study
        # row's hc_params): the connections and that head
        "with_head": total + head_params,
        "n_streams": n_streams,
        "layers": layers,
        "dim": dim,
        "sublayers_per_layer": sublayers_per_layer,
        "sublayers": sublayers,
        # forward FLOPs per token of all the connections together (s2hc.flops: products and the rest)
        "flops_per_token": _flops(family, dim, n_streams, sublayers, sublayers_per_layer, **options),
    }


def _flops(family: str, dim: int, n_streams: int, sublayers: int, sublayers_per_layer: int,
           **family_options: Any) -> int:
    """Forward FLOPs per token of ``sublayers`` connections of ``family`` (:func:`s2hc.flops.connection_flops`)."""
    form = forms.get(family)
    counts = [connection_flops(family, dim, n_streams, sublayer=j, n_sublayers=sublayers, **family_options,
                               **form.sublayer_options(family_options, j, sublayers_per_layer))
              for j in range(sublayers)]
    return sum(c["matmul"] + c["elementwise"] for c in counts)


def count_connection_params(
    family: str, *, layers: int, dim: int, n_streams: int, sublayers_per_layer: int = 2, **family_options: Any
) -> int:
    """Parameters of the hyper-connections of a model with ``layers`` layers of width ``dim``.

    One ``HyperConnection(dim, n_streams, family=family, layer_index=i, **family_options)`` is built per
    wrapped sublayer ``i`` (``layers × sublayers_per_layer`` of them) on the meta device, and the
    ``numel`` of their parameters summed. ``allow_large=True`` is passed to the families that take it.
    ``"residual"`` is a single plain stream: counted with ``n_streams=1``, it has 0 parameters.
    ValueError naming the argument for an unknown family or a size below 1.
    """
    return _count(
        family,
        layers=layers,
        dim=dim,
        n_streams=n_streams,
        sublayers_per_layer=sublayers_per_layer,
        **family_options,
    )["hc_params"]


def count_hc_params(family: str, **kwargs: Any) -> int:
    """Deprecated name of :func:`count_connection_params` ("hc" alone names the HC family)."""
    warnings.warn("count_hc_params is deprecated; use count_connection_params", DeprecationWarning, stacklevel=2)
    return count_connection_params(family, **kwargs)


def param_table(
    names: Iterable[str | tuple[str, dict[str, Any]]] | None = None,
    *,
    layers: int,
    dim: int,
    n_streams: int,
    sublayers_per_layer: int = 2,
) -> list[dict[str, Any]]:
    """One row per family in ``names`` (default: every name in :func:`s2hc.families`), in that order; an entry may
    be ``(family, options)`` to count a family with options (``("gated-residual", {"rank": 16})``).

    Each row has ``family``, ``label`` (the family and its options, ``gated-residual:rank=16``), ``K`` (inputs per
    token of the constraint map, 0 for residual),
    ``per_sublayer``, ``hc_params`` (the connections' total), ``head_params`` (the family's learned final read at
    its default ``stream_reduce``, 0 where that is ``"sum"``), ``with_head`` (the two together: what a model of the
    family counts as its connection parameters, :meth:`s2hc.Transformer.num_connection_params`, a study row's
    ``hc_params``), ``n_streams`` (1 for residual), ``layers``, ``dim``, ``sublayers_per_layer``, ``sublayers`` and
    ``vs_mhc`` / ``vs_mhc_with_head``: the ratio of ``hc_params`` / ``with_head`` to ``mhc``'s
    (:data:`s2hc.mixers.REFERENCE_FAMILY`) when ``mhc`` is in the table, else None.
    """
    names = families() if names is None else list(names)
    if not names:
        raise ValueError("names must name at least one family, got none")
    variants = [(name, {}) if isinstance(name, str) else (name[0], dict(name[1])) for name in names]
    rows = []
    for family, options in variants:
        check_family(family)
        row = _count(family, layers=layers, dim=dim, n_streams=n_streams, sublayers_per_layer=sublayers_per_layer,
                     **options)
        row["label"] = family + "".join(f":{key}={value}" for key, value in options.items())
        if all(row["label"] != other["label"] for other in rows):
            rows.append(row)
    reference = next((row for row in rows if row["family"] == REFERENCE_FAMILY), None)
    for row in rows:
        row["vs_mhc"] = row["hc_params"] / reference["hc_params"] if reference and reference["hc_params"] else None
        row["vs_mhc_with_head"] = (row["with_head"] / reference["with_head"] if reference and reference["with_head"]
                                   else None)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`param_table` as a Markdown table, with a one-line caption."""
    first = rows[0]
    one_stream = [row["family"] for row in rows if forms.get(row["family"]).max_streams == 1]
    n_values = sorted({row["n_streams"] for row in rows if row["family"] not in one_stream})
    streams = f"n = {n_values[0]} streams" if len(n_values) == 1 else "n = 1 stream"
    if one_stream and n_values:
        streams += f" ({', '.join(dict.fromkeys(one_stream))}: 1)"
    lines = [
        f"Hyper-connection parameters: {first['layers']} layers x {first['sublayers_per_layer']} sublayers = "
        f"{first['sublayers']} connections, C = {first['dim']}, {streams}",
        "",
    ]
    cells = []
    for row in rows:
        per = row["per_sublayer"]
        per_text = f"{human(per)} ({per:,})" if isinstance(per, int) else f"{human(per)} ({per:,.1f})"
        total = f"{human(row['hc_params'])} ({row['hc_params']:,})"
        head = row.get("head_params", 0)
        with_head = row.get("with_head", row["hc_params"])
        flops = row.get("flops_per_token")
        cells.append([row.get("label", row["family"]), count(row["K"]), per_text, total, ratio(row["vs_mhc"]),
                      "–" if not head else f"{human(head)} ({head:,})", f"{human(with_head)} ({with_head:,})",
                      ratio(row.get("vs_mhc_with_head")), "–" if flops is None else human(flops)])
    # the FLOPs are the connections' alone (s2hc.flops.connection_flops), not the model's: the header says so
    header = ["family", "K", "per sublayer", "total", "vs mHC", "head", "with head", "vs mHC with head",
              "connection FLOPs / token (fwd)"]
    notes = ["", "total: the connections alone; head: the family's learned final read at its default stream_reduce "
             "(the gated residual's gated read, AttnRes's output query; – for a sum or mean); with head: the two "
             "together, what a trained model and a study row (hc_params) count as its connection parameters."]
    return "\n".join(lines + table(header, cells) + notes)
