"""Compiling a model block by block, as ``s2hc train --compile`` and ``s2hc bench --compile`` both do, and saying
when some of it runs eagerly.

:func:`compile_blocks` compiles each block in place (``nn.Module.compile``, which keeps parameter names, as
torchtitan does). Every block runs the same code (``Block.forward``), and dynamo keeps the graphs of one code
object in one cache, so blocks alike share one graph, and its recompile limit (``torch._dynamo.config
.recompile_limit``, 8) counts the graphs of all blocks together. Past it dynamo runs the blocks it has no graph
for eagerly, saying so only in one logged warning. Every family but AttnRes compiles its blocks to one graph per
mode (training, evaluation). AttnRes's blocks read a growing tuple of depth sources, a different input structure
per source count, so they compile to one graph per distinct source count and block position: Full AttnRes one per
block, Block AttnRes about two per AttnRes block (16 with its default eight blocks, at 16 layers as at 32).

So :func:`compile_blocks` gives the blocks dynamo's budget once per block: a recompile limit of the default times
the number of blocks, as if each block were compiled on its own. The trade-off: a deep Full AttnRes model compiles
one graph per block (its compile time grows with the depth, as a whole-model compile's would), and a block that
recompiles without end (a guard failing at every call) is stopped after that many graphs rather than 8, still
said by :class:`CompileWatch`. With a ``torch.compile`` that takes ``recompile_limit`` the limit is the blocks'
own; with an older one the global setting is raised to it (never lowered), as is the accumulated limit over all
code objects (256) for a model deeper than 32 blocks.

:class:`CompileWatch` reads, after a step, which blocks ran as compiled graphs
(:attr:`s2hc.models.transformer.Block.ran_compiled`) and dynamo's reasons for giving up (its counters since the
watch was made), and says in one line how many blocks ran eagerly and why, and any graph break.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: dynamo's recompile limit when nothing raised it: the budget of graphs each block gets.
DEFAULT_RECOMPILE_LIMIT = 8


def _dynamo_config() -> Any:
    import torch._dynamo

    return torch._dynamo.config


def _limit_names() -> tuple[str, str]:
    """The names of dynamo's per-code and accumulated limits in this PyTorch (renamed in 2.6)."""
    config = _dynamo_config()
    if hasattr(config, "recompile_limit"):
        return "recompile_limit", "accumulated_recompile_limit"
    return "cache_size_limit", "accumulated_cache_size_limit"


def recompile_limit(n_blocks: int) -> int:
    """The recompile limit :func:`compile_blocks` sets for ``n_blocks`` blocks: dynamo's default (or the
    configured limit, if higher) for each block."""
    per_code, _ = _limit_names()
    return max(getattr(_dynamo_config(), per_code), DEFAULT_RECOMPILE_LIMIT * max(n_blocks, 1))


def compile_blocks(blocks: Iterable[nn.Module], **options: Any) -> None:
    """``block.compile(**options)`` for each block (``options``: ``torch.compile``'s, e.g. ``backend``), with a
    recompile limit of :func:`recompile_limit` (module docstring): the compile of ``s2hc train --compile`` and
    ``s2hc bench --compile``."""
    blocks = list(blocks)
    limit = recompile_limit(len(blocks))
    config = _dynamo_config()
    per_code, accumulated = _limit_names()
    if getattr(config, accumulated, limit) < limit:  # the cap over all code objects, global in every version
        setattr(config, accumulated, limit)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        options = {"recompile_limit": limit, **options}
    elif getattr(config, per_code) < limit:
        setattr(config, per_code, limit)
    for block in blocks:
        block.compile(**options)


def _counts() -> dict[str, Counter]:
    """dynamo's reasons so far: why it gave up on a frame (``unimplemented``, the recompile limit among them) and
    why it broke a graph (``graph_break``), each with how often."""
    from torch._dynamo.utils import counters

    return {kind: Counter(counters[kind]) for kind in ("unimplemented", "graph_break")}


def _reason(text: str) -> str:
    """A reason of dynamo's in a few words: its recompile limit reached (with the number of graphs, where its
    message names it; the limit's name and wording differ between PyTorch versions), else its first line."""
    if re.search(r"recompile.?limit|cache.?size.?limit", text, re.IGNORECASE):
        limit = re.search(r"currently set to (\d+)", text)
        return "dynamo's recompile limit reached" + (f" ({limit.group(1)} graphs)" if limit else "")
    return text.strip().splitlines()[0].strip() if text.strip() else "no reason given"


class CompileWatch:
    """Which of ``blocks`` (compiled by :func:`compile_blocks`) ran eagerly on their last call, and why.

    Made before the first compiled step: dynamo's counters are process-wide, so only what they gained since is
    this model's."""

    def __init__(self, blocks: Iterable[nn.Module]):
        self.blocks = list(blocks)
        self._start = _counts()

    def eager_blocks(self) -> int:
        """How many blocks ran eagerly on their last call (a block not called yet is not counted)."""
        return sum(getattr(block, "ran_compiled", None) is False for block in self.blocks)

    def line(self, during: str = "") -> str | None:
        """The line: how many blocks ran eagerly on their last call (``during`` it, e.g. ``"training"``) and why,
        and the graph breaks so far with their reasons; None when there is neither."""
        now = _counts()
        gave_up, breaks = (now[kind] - self._start[kind] for kind in ("unimplemented", "graph_break"))
        eager = self.eager_blocks()
        parts = []
        if eager:
            why = "; ".join(sorted({_reason(text) for text in gave_up})) or "dynamo recorded no reason"
            where = f" in {during}" if during else ""
            parts.append(f"torch.compile ran {eager} of {len(self.blocks)} blocks eagerly{where} ({why})")
        if breaks:
            why = "; ".join(sorted({_reason(text) for text in breaks}))
            parts.append(f"{sum(breaks.values())} graph break(s) in compiled blocks, run eagerly between graphs "
                         f"({why})")
        return "; ".join(parts) or None
