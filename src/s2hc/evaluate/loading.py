"""Load a checkpoint for evaluation: the model (eval mode, on a device, in a dtype) and its tokenizer."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` / None: CUDA when available, else the CPU; otherwise ``torch.device(name)``."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_for_eval(checkpoint: str | os.PathLike, device: str | torch.device | None = "auto", dtype=None):
    """``(model, tokenizer, train_config)`` of a checkpoint (a run directory or a checkpoint file).

    ValueError in one sentence when the path does not exist or is not an s2hc checkpoint, or for a bad
    ``device`` / ``dtype``.
    """
    from ..data.tokenizer import get_tokenizer
    from ..train.checkpoint import load_model

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
