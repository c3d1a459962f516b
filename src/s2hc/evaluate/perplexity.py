"""Perplexity of a model on a token source: the embedded corpus's held-out split by default.

The tokens are cut into the same non-overlapping windows as the training loop's validation loss
(:func:`s2hc.data.loader.eval_batches`: window ``i`` is tokens ``i·L .. i·L + L``, predicting the last ``L``
from the first ``L``; every token but the first is predicted once, with the context since its window's
start), so ``perplexity = exp(mean cross-entropy per predicted token)`` is comparable with the run's
``val_loss``. ``max_batches`` spreads a capped evaluation evenly over the whole split. A loss too large for
``exp`` gives perplexity ``inf``; a NaN loss (non-finite logits) is refused with ValueError at the first batch.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..data.loader import eval_batches
from ..data.shards import prepare_tokens, stored_cache_dir
from ..data.sources import spec_for
from ..data.stream import first_tokens, should_stream, validation_tokens
from ..rundir import peek_checkpoint
from .loading import load_for_eval


@dataclass
class PerplexityResult:
    """``loss``: mean cross-entropy in nats per predicted token; ``perplexity = exp(loss)``; ``bits_per_token``;
    ``tokens``: predicted tokens; ``windows``: sequences of ``seq_len`` scored; ``source`` / ``split``."""

    loss: float
    perplexity: float
    bits_per_token: float
    tokens: int
    windows: int
    seq_len: int
    source: str
    split: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"perplexity {self.perplexity:.3f} (loss {self.loss:.4f} nats/token, {self.bits_per_token:.4f} bits/token) "
            f"over {self.tokens:,} tokens of {self.source}:{self.split} in {self.windows:,} windows of {self.seq_len}"
        )


def exp_or_inf(loss: float) -> float:
    """``exp(loss)``, or ``inf`` where it overflows a float (a loss above about 709 nats: a model that is very
    wrong has an infinite perplexity, not an OverflowError)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def perplexity(
    model,
    tokens,
    seq_len: int,
    *,
    batch_size: int = 8,
    max_batches: int | None = None,
    progress: bool = True,
    source: str = "tokens",
    split: str = "-",
) -> PerplexityResult:
    """Perplexity of ``model`` (an s2hc :class:`~s2hc.models.Transformer`, or any module mapping ids ``(B, T)``
    to logits ``(B, T, V)``) on ``tokens`` (a 1-D array of ids) in windows of ``seq_len``."""
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_len is not None and seq_len > max_len:
        raise ValueError(f"seq_len={seq_len} is longer than the model's max_seq_len={max_len}")
    batches = eval_batches(tokens, seq_len, batch_size, max_batches)
    n_windows = (len(tokens) - 1) // seq_len
    n_used = n_windows if max_batches is None else min(n_windows, max_batches * batch_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count, windows = 0.0, 0, 0
    # disable=None: no bar where stderr is no terminal (a log file would keep every '\r' redraw of it)
    bar = tqdm(total=n_used, disable=None if progress else True, desc="perplexity", unit="seq")
    try:
        for x, y in batches:
            logits = model(x.to(device))
            total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
            count += y.numel()
            windows += x.shape[0]
            if math.isnan(total):  # stop at once: a NaN stays NaN over the rest of the split
                raise ValueError(
                    f"the model's loss is NaN on {source}:{split} (within its first {windows} windows): its logits are "
                    "not finite, so it has no perplexity; check the checkpoint's weights"
                )
            bar.update(x.shape[0])
            bar.set_postfix(ppl=f"{exp_or_inf(total / count):.2f}")
    finally:
        bar.close()
        model.train(was_training)
    if count == 0:
        raise ValueError(f"{source}:{split} has fewer than seq_len + 1 = {seq_len + 1} tokens: nothing to score")
    loss = total / count
    return PerplexityResult(
        loss=loss, perplexity=exp_or_inf(loss), bits_per_token=loss / math.log(2), tokens=count, windows=windows,
        seq_len=seq_len, source=source, split=split,
    )  # fmt: skip


def run_tokens(data: str, tokenizer, train_config, split: str, *, cache_dir, seq_len: int, batch_size: int,
               max_batches: int | None, progress: bool = False, processes: int = 1) -> np.ndarray:
    """The tokens of ``split`` of ``data`` that an evaluation of the run ``train_config`` scores, 1-D.

    On the run's own data the split is the run's own (all its data options, ``TrainConfig.source_spec``); on
    another source only the run's ``text_field``, ``data_split`` and ``validation_fraction`` apply
    (:func:`s2hc.data.sources.spec_for`). A split that streams (the run's ``streaming``,
    :func:`s2hc.data.stream.should_stream`: an ``hf:`` dataset, large local data) is read only as far as needed:
    ``max_batches`` batches of ``batch_size`` windows of ``seq_len``, or without ``max_batches`` the run's own
    validation set (what training evaluated: ``eval_batches`` global batches of the run's ``batch_size`` times
    ``processes``, the processes that trained it, the checkpoint's ``world_size``); its training split needs
    ``max_batches`` (ValueError otherwise).
    Any other split is tokenised whole (:func:`s2hc.data.shards.prepare_tokens`)."""
    spec = spec_for(data, train_config.data, train_config.source_spec())
    split_source = (spec.val_source or data) if split == "val" else data
    if not should_stream(spec.streaming, split_source):
        return prepare_tokens(data, tokenizer, cache_dir, split, progress=progress, spec=spec)
    if max_batches is not None:
        return first_tokens(data, tokenizer, cache_dir, split, max_batches * batch_size * seq_len + 1, spec=spec)
    if split == "val":
        return validation_tokens(data, tokenizer, cache_dir, spec=spec, seq_len=train_config.seq_len,
                                 batch_size=train_config.batch_size * processes,
                                 eval_batches=train_config.eval_batches)
    raise ValueError(f"data {data!r} streams (streaming={train_config.streaming!r}): its {split!r} split is read "
                     "only in part; give max_batches (--max-batches) to say how much")


def checkpoint_perplexity(
    checkpoint: str | os.PathLike,
    *,
    data: str | None = None,
    split: str = "val",
    seq_len: int | None = None,
    batch_size: int = 8,
    max_batches: int | None = None,
    cache_dir: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of a checkpoint on ``split`` (``"val"`` or ``"train"``) of ``data`` (any source
    :func:`s2hc.data.prepare_tokens` reads; default ``"embedded"``), tokenised with the checkpoint's tokenizer.
    ``seq_len`` defaults to the run's training ``seq_len``. On the run's own data (``data`` the run's ``data``)
    the split is the run's own, with all its data options (``TrainConfig.source_spec``: its validation
    source, fraction and caps); on another source only the run's ``text_field``, ``data_split`` and
    ``validation_fraction`` apply (:func:`s2hc.data.sources.spec_for`)."""
    model, tokenizer, train_config = load_for_eval(checkpoint, device=device, dtype=dtype)
    data = "embedded" if data is None else data
    seq_len = train_config.seq_len if seq_len is None else seq_len
    cache = stored_cache_dir(train_config.cache_dir) if cache_dir is None else cache_dir
    tokens = run_tokens(data, tokenizer, train_config, split, cache_dir=cache, seq_len=seq_len, batch_size=batch_size,
                        max_batches=max_batches, progress=progress, processes=peek_checkpoint(checkpoint).world_size)
    return perplexity(
        model, tokens, seq_len, batch_size=batch_size, max_batches=max_batches, progress=progress,
        source=str(data), split=split,
    )  # fmt: skip
