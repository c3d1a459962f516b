"""Load a checkpoint for evaluation: the model (eval mode, on a device, in a dtype) and its tokenizer."""

from __future__ import annotations

import os

import torch

from ..data.tokenizer import get_tokenizer
from ..devices import resolve_device, resolve_dtype
from ..rundir import load_model


def load_for_eval(checkpoint: str | os.PathLike, device: str | torch.device | None = "auto", dtype=None):
    """``(model, tokenizer, train_config)`` of a checkpoint (a run directory or a checkpoint file).

    ValueError in one sentence when the path does not exist or is not an s2hc checkpoint, or for a bad
    ``device`` / ``dtype``.
    """
    target, dtype = resolve_device(device), resolve_dtype(dtype)
    model, train_config = load_model(checkpoint)
    model = model.to(device=target, dtype=dtype) if dtype is not None else model.to(target)
    tokenizer = get_tokenizer(train_config.tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the checkpoint's tokenizer {train_config.tokenizer!r} has {tokenizer.vocab_size} tokens, more than "
            f"the model's vocab_size={model.config.vocab_size}"
        )
    return model.eval(), tokenizer, train_config
