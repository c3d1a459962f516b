"""Whole-block activation checkpointing (Transformer.set_activation_checkpointing): the same values and gradients as
the plain model, blocks really run again in the backward pass, and nothing is checkpointed where it must not be
(evaluation, no_grad, decoding with a cache)."""

from __future__ import annotations

import functools

import helpers
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s2hc.connection import forms
from s2hc.models.transformer import KVCache

FAMILIES = ["residual", "mhc", "s2hc", "gated-residual", "attn-res", "wide-residual", "mhc-lagged"]


def model_for(family: str, seed: int = 0, **overrides):
    """A random 3-layer model of ``family`` (n = 1 for the one-stream forms, 3 otherwise), in training mode."""
    n = 1 if forms.get(family).max_streams == 1 else 3
    return helpers.random_model(family, n, seed=seed, n_layers=3, vocab_size=256, **overrides).train()


def loss_and_grads(model, ids):
    """A scalar of every logit (a random projection, so every logit matters) and the gradient of each parameter."""
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    loss = (logits * weights).sum()
    loss.backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class BlockRuns:
    """Counts the runs of every block (a pre-hook on its attention, the first thing a block runs: a checkpoint's
    recomputation may stop before the block's last module finishes, but never before its first one starts)."""

    def __init__(self, model):
        self.count = 0
        self.handles = [block.attn.register_forward_pre_hook(self._hook) for block in model.blocks]

    def _hook(self, *_):
        self.count += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), every=st.sampled_from([1, 2]), batch=st.integers(1, 2), length=st.integers(2, 9))
def test_checkpointed_gradients_equal_the_plain_models(family, seed, every, batch, length):
    model = model_for(family, seed)
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    plain_logits, plain = loss_and_grads(model, ids)
    model.set_activation_checkpointing(every_n_layers=every)
    assert model.activation_checkpointing
    assert [b.gradient_checkpointing for b in model.blocks] == [i % every == 0 for i in range(3)]
    runs = BlockRuns(model)
    logits, grads = loss_and_grads(model, ids)
    runs.remove()
    checkpointed = sum(b.gradient_checkpointing for b in model.blocks)
    assert runs.count == 3 + checkpointed  # each checkpointed block ran again in the backward pass
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=0)
    assert grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_custom_checkpoint_function_is_used_and_disabling_restores_the_plain_forward():
    model = model_for("s2hc")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = []

    def checkpoint_fn(function, *args):
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    model.set_activation_checkpointing(checkpoint_fn=checkpoint_fn)
    loss_and_grads(model, ids)
    assert len(calls) == 3
    model.set_activation_checkpointing(False)
    assert not model.activation_checkpointing
    runs = BlockRuns(model)
    loss_and_grads(model, ids)
    assert runs.count == 3 and len(calls) == 3


def test_reentrant_checkpointing_gives_the_same_gradients():
    model = model_for("mhc")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    _, plain = loss_and_grads(model, ids)
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    model.set_activation_checkpointing(checkpoint_fn=reentrant)
    _, grads = loss_and_grads(model, ids)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", ["s2hc", "gated-residual"])
def test_evaluation_no_grad_and_decoding_are_not_checkpointed(family):
    model = model_for(family)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    used = []
    model.set_activation_checkpointing(checkpoint_fn=lambda function, *args: used.append(1) or function(*args))
    with torch.no_grad():
        model(ids)  # training mode, but no gradients: nothing to recompute for
    model.eval()
    model(ids)
    model.train()
    cache = KVCache()  # a recomputation would append the keys and values twice
    out = model(ids[:, :4], cache=cache)
    step = model(ids[:, 4:], cache=cache)
    assert not used and cache.get_seq_length() == 6
    with torch.no_grad():
        helpers.assert_close_to_scale(torch.cat((out, step), dim=1), model(ids))
    assert len(used) == 0
    model(ids).sum().backward()
    assert len(used) == 3


def test_bad_arguments_are_refused():
    model = model_for("s2hc")
    with pytest.raises(ValueError, match="every_n_layers must be an integer >= 1, got 0"):
        model.set_activation_checkpointing(every_n_layers=0)
    with pytest.raises(ValueError, match="checkpoint_fn must be callable or None, got str"):
        model.set_activation_checkpointing(checkpoint_fn="checkpoint")
