"""Batches of next-token-prediction windows, shuffled, sharded and exactly resumable: from a 1-D token array
(:class:`TokenBatches`) or from a stream of token chunks (:class:`StreamBatches`).

The tokens (of the array, e.g. from :func:`s2hc.data.shards.prepare_tokens`, or of each chunk of a
:class:`~s2hc.data.stream.ChunkStream`) are cut into non-overlapping windows of ``seq_len + 1`` tokens starting at
``0, seq_len, 2·seq_len, ...`` (consecutive windows share one token, so every token but the first is a target
once per epoch); ``x`` is a window's first ``seq_len`` tokens and ``y`` its last ``seq_len`` (``x`` shifted by
one).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checks import check_int

STATE_VERSION = 1
STREAM_STATE_VERSION = 1


def _as_array(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {tuple(arr.shape)}")
    return arr


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts.tolist()]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _check_layout(seq_len: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int, int, int]:
    """``(seq_len, batch_size, rank, world_size)`` checked (each >= 1, ``0 <= rank < world_size``); ValueError naming
    the argument otherwise. What every loader of windows checks of its arguments."""
    seq_len, batch_size = check_int("seq_len", seq_len, 1), check_int("batch_size", batch_size, 1)
    world_size, rank = check_int("world_size", world_size, 1), check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank={rank!r} is not allowed with world_size={world_size}; use 0 <= rank < world_size")
    return seq_len, batch_size, rank, world_size


def _check_same_batches(state: dict[str, Any], mine: dict[str, Any], global_batch: int, keys: tuple[str, ...]) -> None:
    """ValueError listing where a saved loader ``state`` differs from this loader's own (``mine``, its
    ``state_dict()``) in ``keys``, where ``global_batch`` is ``batch_size × world_size`` (the same global batch with
    another process count is the same run)."""
    mine = {**mine, "global_batch": global_batch}
    state = {**state, "global_batch": state.get("batch_size", 0) * state.get("world_size", 0)}
    diff = [f"{k}: state {state.get(k)!r}, loader {mine[k]!r}" for k in keys if state.get(k) != mine[k]]
    if diff:
        raise ValueError("loader state does not match this loader (" + "; ".join(diff) + ")")


def _position(loader: TokenBatches | StreamBatches) -> dict[str, int]:
    """Where a loader is and the batches it is valid for, what both loaders' states hold."""
    return {"epoch": loader.epoch, "step_in_epoch": loader.step_in_epoch, "seed": loader.seed,
            "seq_len": loader.seq_len, "batch_size": loader.batch_size, "world_size": loader.world_size}


class TokenBatches:
    """An endless iterator of training batches ``(x, y)``: int64 CPU tensors of shape ``(batch_size, seq_len)``.

    Each epoch visits every window once in an order shuffled by ``(seed, epoch)`` (``numpy`` PCG64 seeded from
    ``SeedSequence([seed, epoch])``), in *global* batches of ``batch_size * world_size`` windows; rank ``r`` takes
    windows ``[r·batch_size, (r+1)·batch_size)`` of each global batch, so ranks never share a window and together
    see exactly what one process with ``world_size`` times the batch would. An epoch ends after
    ``batches_per_epoch = n_windows // (batch_size * world_size)`` batches (the leftover windows wait for
    another shuffle). ``state_dict()`` / ``load_state_dict()`` record and restore the position, so a resumed
    loader yields exactly the batches the uninterrupted one would have.

    ``tokens``: 1-D array-like of ids (``np.memmap``, ``np.ndarray``, torch tensor, list). Errors: ``ValueError``
    naming the sizes when the corpus has fewer than ``seq_len + 1`` tokens or fewer windows than one global
    batch, or when an argument is out of range."""

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.tokens = _as_array(tokens)
        self.seq_len, self.batch_size, self.rank, self.world_size = _check_layout(seq_len, batch_size, rank, world_size)
        self.seed = check_int("seed", seed, 0)
        n = len(self.tokens)
        if n < self.seq_len + 1:
            raise ValueError(
                f"corpus too small: {n} tokens, but seq_len={self.seq_len} needs at least {self.seq_len + 1}"
            )
        self.n_windows = (n - 1) // self.seq_len
        self.global_batch = self.batch_size * self.world_size
        if self.n_windows < self.global_batch:
            raise ValueError(
                f"corpus too small: {n} tokens make {self.n_windows} windows of seq_len={self.seq_len}, fewer than "
                f"one global batch of {self.global_batch} (batch_size={self.batch_size} x world_size={self.world_size})"
            )
        self.batches_per_epoch = self.n_windows // self.global_batch
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def steps(self) -> int:
        """Batches taken so far (by this rank; every rank takes the same number)."""
        return self.epoch * self.batches_per_epoch + self.step_in_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch`` (int64 array of window indices, the same on every rank)."""
        if self._perm_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        perm = self.permutation(self.epoch)
        start = self.step_in_epoch * self.global_batch + self.rank * self.batch_size
        windows = perm[start : start + self.batch_size]
        self.step_in_epoch += 1
        return _windows(self.tokens, windows * self.seq_len, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        """The position (plain ints: JSON- and ``torch.save``-safe) plus what it is only valid for."""
        return {"version": STATE_VERSION, **_position(self), "n_tokens": self.n_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from any rank of a run with the same data, seed, sequence length and
        global batch ``batch_size × world_size``: a run saved with 2 processes of 4 resumes with 1 of 8);
        ``ValueError`` listing what differs otherwise."""
        if state.get("kind", "array") != "array":
            raise ValueError(f"loader state is of a {state.get('kind')!r} loader (the run streamed its data), not of "
                             "a whole-array one; resume with the run's own streaming setting")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        _check_same_batches(state, self.state_dict(), self.global_batch,
                            ("seed", "seq_len", "global_batch", "n_tokens"))
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step <= self.batches_per_epoch:
            raise ValueError(f"loader state position epoch={epoch}, step_in_epoch={step} is out of range")
        self.epoch, self.step_in_epoch = epoch, step


@dataclass
class _Loaded:
    """A chunk the loader holds: its windows are the positions ``[start, start + n_windows)`` of the epoch."""

    chunk: Any  # s2hc.data.stream.Chunk
    start: int
    n_windows: int
    order: np.ndarray | None = None  # the window order within the chunk, made when first needed


class StreamBatches:
    """An endless iterator of training batches ``(x, y)`` (int64 CPU tensors, ``(batch_size, seq_len)``) from a
    :class:`~s2hc.data.stream.ChunkStream`, the streaming counterpart of :class:`TokenBatches`.

    Every chunk is cut into windows of its own (a window never spans two chunks) and its windows are visited in an
    order shuffled by ``(seed, epoch, chunk)`` (``numpy`` PCG64 seeded from ``SeedSequence([seed, epoch,
    chunk])``): a shuffle bounded by the chunk, so only the chunks being read are needed, in order. The windows of
    an epoch, chunk after chunk, make *global* batches of ``batch_size * world_size``; rank ``r`` takes windows
    ``[r·batch_size, (r+1)·batch_size)`` of each, as in :class:`TokenBatches`, so N processes see exactly what one
    process with N times the batch would. When the split ends (a finite dataset, or ``max_tokens``), the windows
    left that do not fill a global batch are dropped and the next epoch starts again at chunk 0, reshuffled.

    ``state_dict()`` records the position (epoch, batch, and the chunk it lies in with that chunk's first
    document, token and window), so ``load_state_dict()`` continues exactly, reading the chunk from the cache or
    tokenising it again from that document on, without the chunks before it. ``stream``: a
    :class:`~s2hc.data.stream.ChunkStream` (it is closed when the loader is collected). Errors: ``ValueError``
    naming the sizes when the whole split makes fewer windows than one global batch, or when an argument is
    out of range; the stream's errors."""

    def __init__(self, stream, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.stream = stream
        self.seq_len, self.batch_size, self.rank, self.world_size = _check_layout(seq_len, batch_size, rank, world_size)
        self.seed = check_int("seed", seed, 0)
        self.global_batch = self.batch_size * self.world_size
        self.epoch = 0
        self.step_in_epoch = 0
        self._loaded: list[_Loaded] = []
        self._restart(0, 0, 0, 0)
        weakref.finalize(self, stream.close)  # stops its background thread

    def _restart(self, chunk: int, start: int, doc_start: int, token_start: int) -> None:
        """Read on from chunk ``chunk`` (its first window is position ``start`` of the epoch)."""
        self._origin = (chunk, start, doc_start, token_start)
        self._loaded = []
        self.stream.seek(chunk, doc_start, token_start)

    def _covered(self) -> int:
        """The positions of this epoch the loaded chunks reach (exclusive)."""
        return self._loaded[-1].start + self._loaded[-1].n_windows if self._loaded else self._origin[1]

    def _load_until(self, position: int) -> bool:
        """Load chunks until they hold ``position - 1``; False when the split ends first."""
        while self._covered() < position:
            index = self._loaded[-1].chunk.index + 1 if self._loaded else self._origin[0]
            chunk = self.stream.get(index)
            if chunk is None:
                return False
            self._loaded.append(_Loaded(chunk, self._covered(), max(0, (chunk.n_tokens - 1) // self.seq_len)))
        return True

    def _order(self, loaded: _Loaded) -> np.ndarray:
        if loaded.order is None:
            entropy = [self.seed, self.epoch, loaded.chunk.index]
            loaded.order = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))).permutation(
                loaded.n_windows)
        return loaded.order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            first = self.step_in_epoch * self.global_batch
            if self._load_until(first + self.global_batch):
                break
            if self.step_in_epoch == 0:
                windows = self._covered()
                raise ValueError(
                    f"corpus too small: split {self.stream.split!r} makes {windows} windows of seq_len="
                    f"{self.seq_len} (each of its chunks cut on its own), fewer than one global batch of "
                    f"{self.global_batch} (batch_size={self.batch_size} x world_size={self.world_size})"
                )
            self.epoch += 1  # the split ended: the next epoch reads it again from its start, reshuffled
            self.step_in_epoch = 0
            self._restart(0, 0, 0, 0)
        mine = first + self.rank * self.batch_size
        rows, at = [], 0
        for position in range(mine, mine + self.batch_size):
            while self._loaded[at].start + self._loaded[at].n_windows <= position:
                at += 1
            loaded = self._loaded[at]
            start = int(self._order(loaded)[position - loaded.start]) * self.seq_len
            rows.append(loaded.chunk.tokens[start : start + self.seq_len + 1])
        self.step_in_epoch += 1
        self._drop_before(first + self.global_batch)
        t = torch.from_numpy(np.stack(rows).astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def _drop_before(self, position: int) -> None:
        """Forget the chunks that end at or before ``position`` (the next batch's first): the origin becomes the
        chunk that holds it, or the one after the last loaded."""
        while self._loaded and self._loaded[0].start + self._loaded[0].n_windows <= position:
            gone = self._loaded.pop(0)
            chunk = gone.chunk
            self._origin = (chunk.index + 1, gone.start + gone.n_windows, chunk.doc_end, chunk.token_end)
        if self._loaded:
            head = self._loaded[0]
            self._origin = (head.chunk.index, head.start, head.chunk.doc_start, head.chunk.token_start)

    def state_dict(self) -> dict[str, Any]:
        """The position (plain ints and strings: JSON- and ``torch.save``-safe) plus what it is only valid for
        (``stream_key``: the stream's cache key, which hashes the source, its options, the tokenizer and the chunk
        sizes)."""
        chunk, start, doc_start, token_start = self._origin
        return {
            "version": STREAM_STATE_VERSION,
            "kind": "stream",
            **_position(self),
            "stream_key": self.stream.key,
            "chunk": chunk,
            "chunk_window": start,
            "chunk_document": doc_start,
            "chunk_token": token_start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from any rank of a run with the same data, seed, sequence length and global
        batch ``batch_size × world_size``); ``ValueError`` listing what differs otherwise."""
        if state.get("kind") != "stream":
            raise ValueError("loader state is of a whole-array loader (the run tokenised its data whole before "
                             "training), not of a streaming one; resume with the run's own streaming setting")
        if state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(f"streaming loader state version {state.get('version')!r} is not {STREAM_STATE_VERSION}")
        _check_same_batches(state, self.state_dict(), self.global_batch,
                            ("seed", "seq_len", "global_batch", "stream_key"))
        names = ("epoch", "step_in_epoch", "chunk", "chunk_window", "chunk_document", "chunk_token")
        values = [state.get(name) for name in names]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values) or (
                values[3] > values[1] * self.global_batch):
            raise ValueError("loader state position " + ", ".join(f"{n}={v!r}" for n, v in zip(names, values))
                             + " is out of range")
        self.epoch, self.step_in_epoch = values[0], values[1]
        self._restart(*values[2:])


def eval_batches(
    tokens,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches ``(x, y)``, int64 ``(≤ batch_size, seq_len)``: the same on every call, in order.

    The windows are laid out in *global* batches of ``batch_size × world_size``, as :class:`TokenBatches` lays out
    training batches, so the validation set depends on the global batch alone, never on the process count: all
    ``n_windows = (len(tokens) - 1) // seq_len`` windows, or, with ``max_batches``, ``max_batches`` global batches
    of them spread evenly over the whole array (window ``i·n_windows // n_used``), so a capped evaluation still
    samples every part of the validation text. Rank ``r`` yields its share of each global batch of ``m`` windows:
    windows ``[r·m // world_size, (r+1)·m // world_size)`` of it (``[r·batch_size, (r+1)·batch_size)`` of a full
    one). Every rank yields the same number of batches; only the last global batch may be smaller, and a rank's
    share of it may then be empty (``(0, seq_len)`` tensors: a rank that runs a sharded model must still take part in
    that forward pass). Summed over the ranks, the token losses are those of one process with the global batch.
    ``ValueError`` naming the sizes when the array holds fewer than ``seq_len + 1`` tokens."""
    arr = _as_array(tokens)
    seq_len, batch_size, rank, world_size = _check_layout(seq_len, batch_size, rank, world_size)
    if max_batches is not None:
        max_batches = check_int("max_batches", max_batches, 1)
    n = len(arr)
    if n < seq_len + 1:
        raise ValueError(f"validation tokens too few: {n} tokens, but seq_len={seq_len} needs at least {seq_len + 1}")
    n_windows = (n - 1) // seq_len
    global_batch = batch_size * world_size
    n_used = n_windows if max_batches is None else min(n_windows, max_batches * global_batch)
    windows = (np.arange(n_used, dtype=np.int64) * n_windows) // n_used

    def gen():
        for start in range(0, n_used, global_batch):
            m = min(global_batch, n_used - start)
            mine = windows[start + rank * m // world_size : start + (rank + 1) * m // world_size]
            if len(mine):
                yield _windows(arr, mine * seq_len, seq_len)
            else:
                empty = torch.empty((0, seq_len), dtype=torch.int64)
                yield empty, empty.clone()

    return gen()
