"""Activation checkpointing of whole blocks in training (``s2hc train --activation-checkpointing``): the same losses
and weights as the plain run, alone and with the connections' own recompute, compiled, under FSDP2 and DDP (2 Gloo
processes); the blocks really run again in the backward pass, FSDP2's hooks on a block still run once, and what
autograd keeps for the backward pass shrinks to the blocks' inputs (eager and compiled).

The model side (values and gradients of one forward and backward, what is never checkpointed) is
tests/test_activation_checkpointing.py."""

from __future__ import annotations

import collections

import pytest
import test_distributed as harness  # the multi-process harness, its reference run and its tolerances
import torch
from helpers import SMALL_MODEL, small_config
from test_distributed import data, single_run  # noqa: F401 - its fixtures, used here by name

import s2hc.train.distributed as distributed
from s2hc.models.transformer import Block
from s2hc.rundir import load_model, read_metrics
from s2hc.train import train

# A checkpointed block runs the same float32 kernels on the same inputs again, so its activations, and then the
# gradients, losses and weights, are expected to be bitwise those of the plain run (and they are, on this CPU:
# difference 0). The tolerance, 1e-6 relative for the losses and for ‖θ_ac − θ‖ / ‖θ‖, leaves room for a few
# float32 ulps (eps = 1.2e-7) should a library kernel round a recomputed product differently (another memory
# alignment, say); a real fault (a block recomputed with other weights or inputs, a gradient lost or counted
# twice) moves every learning weight by about lr · steps = 1e-2 relative, ten thousand times more. (Should a
# platform's kernels ever round the recomputation differently, AdamW would turn those ulps into up to ±lr steps on
# noise-level gradients, as tests/test_distributed.py explains: then test_distributed's PARAM_RTOL is the bound.)
RTOL = 1e-6
STEPS = 4
# What one block's input streams (B, T, n, C) take in float32: small_config's batch 4 x 32 tokens, n = 4.
STREAM_BYTES = 4 * 32 * 4 * SMALL_MODEL["dim"] * 4


def _config(corpus_file, root, **changes):
    values = dict(max_steps=STEPS, log_every=1, eval_every=0, checkpoint_every=0, lr=3e-3, warmup_steps=1)
    return small_config(corpus_file, root, **{**values, **changes})


def _train(config) -> tuple[list[float], torch.Tensor]:
    """Train ``config``: its losses, step by step, and its final parameters as one vector."""
    train(config)
    model, _ = load_model(config.out)
    return [r["loss"] for r in read_metrics(config.out) if "loss" in r], torch.nn.utils.parameters_to_vector(
        model.parameters())


def _assert_same_run(run, reference):
    (losses_, theta), (ref_losses, ref_theta) = run, reference
    assert len(losses_) == len(ref_losses) == STEPS
    torch.testing.assert_close(losses_, ref_losses, rtol=RTOL, atol=0)
    assert ((theta - ref_theta).norm() / ref_theta.norm()).item() <= RTOL


class SavedBytes(torch.nn.Module):
    """``inner`` (what :func:`s2hc.train.distributed.wrap` returned) called under a saved-tensors hook that adds up
    the bytes autograd keeps for the backward pass in each training forward (``per_forward``). A non-reentrant
    checkpoint keeps its tensors behind hooks of its own, so an eager checkpointed block adds nothing here; a
    compiled one adds what inductor's partitioner saves, its inputs."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.per_forward = inner, []

    def forward(self, x):
        if not torch.is_grad_enabled():
            return self.inner(x)
        total = [0]

        def pack(tensor):
            total[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = self.inner(x)
        self.per_forward.append(total[0])
        return out


def _recording(monkeypatch) -> list[SavedBytes]:
    """Make every run's forward a :class:`SavedBytes`; the list gets one per run."""
    made, real = [], distributed.wrap

    def wrap(*args, **kwargs):
        made.append(SavedBytes(real(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(distributed, "wrap", wrap)
    return made


@pytest.fixture(scope="module")
def plain(corpus_file, tmp_path_factory):
    """The reference: the run without activation checkpointing."""
    return _train(_config(corpus_file, tmp_path_factory.mktemp("plain") / "run"))


@pytest.mark.parametrize("connection", [{}, {"recompute": True}], ids=["alone", "with-connection-recompute"])
def test_checkpointed_training_equals_the_plain_run(connection, corpus_file, plain, tmp_path):
    run = _train(_config(corpus_file, tmp_path / "run", activation_checkpointing=True, connection=connection))
    _assert_same_run(run, plain)


def test_blocks_run_again_in_the_backward_pass_and_keep_only_their_inputs(corpus_file, tmp_path, monkeypatch):
    """Every training forward of a block runs twice (forward, then its recomputation in backward, both with
    gradients on; evaluation runs each once, without); what autograd keeps outside the checkpoints drops by at
    least what the plain blocks kept."""
    runs = collections.Counter()
    real = Block._forward

    def counted(self, *args, **kwargs):
        runs["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Block, "_forward", counted)
    saved = _recording(monkeypatch)
    counts = {}
    for checkpointed in (False, True):
        runs.clear()
        train(_config(corpus_file, tmp_path / str(checkpointed), activation_checkpointing=checkpointed, max_steps=2,
                      grad_accum=2))
        counts[checkpointed] = dict(runs)
    forwards = SMALL_MODEL["n_layers"] * 2 * 2  # blocks x micro-steps x steps
    evaluation = SMALL_MODEL["n_layers"] * 2  # eval_batches at the end
    assert counts[False] == {"grad": forwards, "no_grad": evaluation}
    assert counts[True] == {"grad": 2 * forwards, "no_grad": evaluation}
    plain_bytes, checkpointed_bytes = (max(recorder.per_forward) for recorder in saved)
    # a plain block keeps about 14 of its input's size here (norms, attention, MLP, the connections' pieces)
    assert plain_bytes - checkpointed_bytes >= SMALL_MODEL["n_layers"] * 4 * STREAM_BYTES


def test_fsdp_hooks_on_a_checkpointed_block_run_once(corpus_file, plain, tmp_path, monkeypatch):
    """FSDP2 (one process, in this process): the checkpoint sits inside Block.forward, so the all-gather before a
    block's forward and its backward, and the gradient reduction after, run as often as without checkpointing,
    while the block itself runs twice; the run equals the plain one."""
    groups = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                                 reason="counts calls of FSDP2's parameter groups (torch's private module)")
    calls = collections.Counter()
    for name in ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "reshard"):
        real = getattr(groups.FSDPParamGroup, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(groups.FSDPParamGroup, name, counted)
    block_runs = collections.Counter()
    real_forward = Block._forward

    def counted_forward(self, *args, **kwargs):
        block_runs[torch.is_grad_enabled()] += 1
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "_forward", counted_forward)
    seen = {}
    for checkpointed in (False, True):
        calls.clear()
        block_runs.clear()
        run = _train(_config(corpus_file, tmp_path / str(checkpointed), parallel="fsdp",
                             activation_checkpointing=checkpointed))
        _assert_same_run(run, plain)
        seen[checkpointed] = dict(calls), block_runs[True]
    assert seen[True][0] == seen[False][0] and seen[False][0]["pre_backward"] > 0
    assert seen[True][1] == 2 * seen[False][1] == 2 * SMALL_MODEL["n_layers"] * STEPS


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
@pytest.mark.parametrize("parallel,extra", [("ddp", []), ("fsdp", ["--set", "connection={recompute: true}"])],
                         ids=["ddp", "fsdp-with-connection-recompute"])
def test_two_processes_with_checkpointed_blocks_reach_the_parameters_of_one(parallel, extra, data, single_run,  # noqa: F811
                                                                            tmp_path):
    """2 Gloo processes with checkpointed blocks against tests/test_distributed.py's one plain process, to its
    tolerances (the all-reduce sums half-batch gradients in another order; measured 6.6e-6 with checkpointing, the
    same as without: with the same process count the two runs are bitwise equal)."""
    out = tmp_path / parallel
    argv = harness.args(data, out, batch_size=2, extra=["--parallel", parallel, "--activation-checkpointing", *extra])
    result = harness.run_s2hc(argv, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert harness.param_difference(out, single_run) <= harness.PARAM_RTOL
    torch.testing.assert_close(harness.losses(out), harness.losses(single_run), rtol=harness.LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_compiled_checkpointed_blocks_train_as_the_eager_plain_run(corpus_file, plain, tmp_path, monkeypatch):
    """``compile=True`` compiles each block over its checkpoint: the losses are the eager plain run's (inductor
    reorders float32 arithmetic inside a block: agreement to ~1e-6, not bitwise, as in tests/test_distributed.py),
    and the compiled blocks keep little more than their input streams for the backward pass: they recompute."""
    saved = _recording(monkeypatch)
    compiled_losses, _ = _train(_config(corpus_file, tmp_path / "compiled", compile=True,
                                        activation_checkpointing=True))
    torch.testing.assert_close(compiled_losses, plain[0], rtol=1e-4, atol=0)
    train(_config(corpus_file, tmp_path / "eager", activation_checkpointing=True, max_steps=1))
    compiled_bytes, eager_bytes = (max(recorder.per_forward) for recorder in saved)
    # each compiled checkpointed block keeps its input streams (and small tables); a compiled plain block keeps
    # about 7 times its input's size here
    assert 0 < compiled_bytes - eager_bytes <= SMALL_MODEL["n_layers"] * 2 * STREAM_BYTES
