"""Shared test helpers: tested (family, n) pairs, randomised parameters, small models, branches, tolerances."""

from __future__ import annotations

import torch

from s2hc import mixers

STREAMS = (2, 3, 4, 5, 8)
MAX_N = {"mhc-lite": 6}


def family_sizes(families=None):
    """Every (family, n) the guarantees are tested at: n in {2, 3, 4, 5, 8}, mhc-lite up to 6."""
    pairs = []
    for name in families or list(mixers.REGISTRY):
        sizes = [n for n in STREAMS if n <= MAX_N.get(name, 99)]
        if name == "mhc-lite":
            sizes.append(6)
        if name == "kromhc":
            sizes += [6, 12]  # mixed prime factors
        pairs += [(name, n) for n in sizes]
    return pairs


def randomize_(module: torch.nn.Module, generator: torch.Generator, spread: float) -> None:
    """Move every parameter far from its initialisation: p += spread · N(0, 1), α and γ included."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(spread * torch.randn(p.shape, generator=generator, dtype=p.dtype))


# A model small enough that a few training steps take a second on 2 CPU cores.
SMALL_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}
# What the Hub and datasets see in the tests that need them offline.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def small_config(corpus_file, root, **changes):
    """A ``TrainConfig`` of the ``tiny`` preset shrunk to ``SMALL_MODEL``, s2hc with n = 4, on ``corpus_file``."""
    from s2hc.train import TrainConfig

    values = dict(
        preset="tiny", family="s2hc", n_streams=4, model_overrides=dict(SMALL_MODEL), seq_len=32, batch_size=4,
        max_steps=3, warmup_steps=1, eval_batches=2, data=str(corpus_file), cache_dir=str(root / "cache"),
        progress=False, out=str(root / "run"),
    )
    values.update(changes)
    return TrainConfig(**values)


def random_model(family="s2hc", n_streams=4, seed=0, **overrides):
    """A small model with every parameter moved far from its initialisation, so decoding is not trivial."""
    from s2hc.models import Transformer, get_preset

    config = dict(vocab_size=1024, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=64)
    config.update(overrides)
    preset = config.pop("preset", "tiny")
    torch.manual_seed(seed)
    model = Transformer(get_preset(preset, family=family, n_streams=n_streams, **config)).eval()
    randomize_(model, torch.Generator().manual_seed(seed), 0.5)
    return model


class Branch(torch.nn.Module):
    """A small nonlinear branch ``(..., c) -> (..., c)`` for connection tests: ``tanh(linear(h))``."""

    def __init__(self, c):
        super().__init__()
        self.linear = torch.nn.Linear(c, c)

    def forward(self, h):
        return torch.tanh(self.linear(h))


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5,
                          scale: float = 1.0) -> None:
    """Equal to ``tol`` relative to ``expected``'s largest entry (at least ``scale``): for results of sums, whose
    rounding errors grow with the size of the sum, not of each entry. Pass ``scale`` where a result is a small
    difference of larger terms, whose rounding errors grow with those terms."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = max(scale, expected.abs().max().item()) if expected.numel() else scale
    torch.testing.assert_close(actual, expected, atol=tol * scale, rtol=tol)


def grads_of(module: torch.nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``tensors``, then of every parameter of ``module`` (zeros where none arrived)."""
    return [t.grad.clone() for t in tensors] + [
        torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()
    ]


def capture_of(res, pre=None, post=None, *, family=None, **fields):
    """What :func:`s2hc.diagnostics.summary.summarize` takes, made from tensors: a
    :class:`~s2hc.diagnostics.collect.Capture` of ``res`` (and ``pre`` / ``post``), its connections labelled ``"0"``,
    ``"1"``, ... and each of ``family`` (None: none named), the other fields as given (``inert``, ``output``, ...)."""
    from s2hc.diagnostics.collect import Capture

    families = [family] * len(res) if family is not None else []
    similarity = fields.pop("similarity", None)
    return Capture(names=None, families=families, res=res, pre=pre, post=post, similarity=similarity, **fields)


def run_connection(hc, branch, x, weights, **options) -> list[torch.Tensor]:
    """``[out, dX, *parameter gradients]`` of a copy of ``hc`` with ``options`` (``set_options``) on streams
    ``x`` around ``branch``, for the loss ``Σ out · weights`` (summed in float64)."""
    import copy

    hc = copy.deepcopy(hc).set_options(**options)
    x = x.detach().clone().requires_grad_()
    out = hc(x, branch)
    (out.double() * weights.double()).sum().backward()
    return [out.detach(), *grads_of(hc, x)]


def crash_after_checkpoint(config, step: int) -> None:
    """Train ``config`` and stop as a crash would right after the checkpoint of ``step`` is written."""
    import pytest

    import s2hc.train.checkpointer as state
    from s2hc.train import train

    real = state.save_checkpoint

    def save_then_crash(path, payload):
        real(path, payload)
        if payload.step == step:
            raise KeyboardInterrupt

    state.save_checkpoint = save_then_crash
    try:
        with pytest.raises(KeyboardInterrupt):
            train(config)
    finally:
        state.save_checkpoint = real


def tiny_checkpoint(step: int, model: dict, **entries):
    """A :class:`s2hc.rundir.Checkpoint` of ``model`` (a name -> tensor dict, not a real model's) at ``step``,
    for tests of the file format alone."""
    from s2hc.rundir import Checkpoint

    return Checkpoint(config={}, model_config={}, step=step, model=model, **entries)


def at_logged_step(monkeypatch, step: int, action) -> None:
    """Call ``action()`` right after the training loop logs step ``step`` (``s2hc.train.loop._Run.log``): a Ctrl-C
    (``signal.raise_signal(signal.SIGINT)``: the run saves a checkpoint there and stops), or a crash (an exception
    no s2hc handler catches: nothing more is saved, as after a kill -9)."""
    from s2hc.train import loop

    real = loop._Run.log

    def log(self):
        real(self)
        if self.step == step:
            action()

    monkeypatch.setattr(loop._Run, "log", log)


def ctrl_c() -> None:
    import signal

    signal.raise_signal(signal.SIGINT)


def crash() -> None:
    raise KeyboardInterrupt("killed")


def poison_loss_at(monkeypatch, call: int) -> dict:
    """Make the training loop's ``call``-th cross-entropy (1-based, one per micro-step) NaN; returns the counter
    ``{"n": calls so far}``."""
    import s2hc.train.loop as loop

    calls = {"n": 0}
    real = loop.F.cross_entropy

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == call else loss

    monkeypatch.setattr(loop.F, "cross_entropy", poisoned)
    return calls


def cli_args(config) -> list[str]:
    """The ``s2hc train`` arguments of a small ``TrainConfig`` (:func:`small_config`'s fields), for CLI tests."""
    import json

    return [
        "--preset", config.preset, "--family", config.family, "--streams", str(config.n_streams),
        "--set", "model_overrides=" + json.dumps(config.model_overrides),
        "--data", config.data, "--cache-dir", config.cache_dir, "--seq-len", str(config.seq_len),
        "--batch-size", str(config.batch_size), "--max-steps", str(config.max_steps),
        "--warmup-steps", str(config.warmup_steps), "--lr", str(config.lr), "--eval-every", str(config.eval_every),
        "--set", f"eval_batches={config.eval_batches}", "--checkpoint-every", str(config.checkpoint_every),
        "--log-every", "1", "--no-progress", "--out", config.out,
    ]  # fmt: skip
