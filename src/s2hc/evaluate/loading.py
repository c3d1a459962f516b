"""Load a checkpoint for evaluation: the model (eval mode, on a device, in a dtype) and its tokenizer."""

from __future__ import annotations

import os

import torch

from ..data.tokenizer import check_tokenizer_fits, get_tokenizer
from ..devices import resolve_device, resolve_dtype
from ..rundir import load_model, resolve_checkpoint

__all__ = ["check_finite_weights", "load_for_eval"]


def load_for_eval(checkpoint: str | os.PathLike, device: str | torch.device | None = "auto", dtype=None, *,
                  step: int | str | None = None):
    """``(model, tokenizer, train_config)`` of a checkpoint (a run directory or a checkpoint file; with ``step``,
    the run directory's kept checkpoint of that step or ``"best"``, :func:`s2hc.rundir.resolve_checkpoint`).

    ValueError in one sentence when the path does not exist or is not an s2hc checkpoint, when its weights are
    not all finite (:func:`check_finite_weights`), for a step not kept, or for a bad ``device`` / ``dtype``.
    """
    target, dtype = resolve_device(device), resolve_dtype(dtype)
    if step is not None:
        checkpoint = resolve_checkpoint(checkpoint, step)  # named in the messages below
    model, train_config = load_model(checkpoint)
    check_finite_weights(model, checkpoint)
    model = model.to(device=target, dtype=dtype) if dtype is not None else model.to(target)
    tokenizer = get_tokenizer(train_config.tokenizer)
    check_tokenizer_fits(tokenizer, model.config.vocab_size, checkpoint)
    return model.eval(), tokenizer, train_config


def check_finite_weights(model: torch.nn.Module, checkpoint: str | os.PathLike) -> None:
    """ValueError naming ``checkpoint`` and the first tensors when any weight of ``model`` is NaN or infinite:
    such a model gives NaN perplexity, NaN logits and garbage text, so nothing is computed from it."""
    bad = [name for name, tensor in model.state_dict().items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has non-finite weights (NaN or inf in {len(bad)} tensor(s): {shown}); "
            "the run diverged before it was saved: use an earlier checkpoint, or retrain with a lower lr"
        )
