"""GPU checks (marker ``cuda``, run by ``benchmarks/gpu_check.sh``): every CUDA path of a connection against eager
(the fast path on the device against the CPU reference in float32 and bfloat16, the compiled connection and the
Triton kernels compiled for the device against the eager fast path), a few bf16-autocast training steps per family
eager and compiled, and checkpoint resume.

Skipped without CUDA. ``S2HC_TEST_DEVICE=cpu`` runs them on the CPU instead (the script's ``--dry-run``):
bf16 autocast on the CPU, the Triton kernels under the interpreter (the root conftest sets
``TRITON_INTERPRET=1`` without a GPU), smaller shapes. Compiled training runs for residual, mhc and s2hc on a GPU
(the families the GPU check times) and for s2hc alone on a CPU, unless ``S2HC_TEST_COMPILE_ALL=1`` (every family;
each compile takes a minute or more on a CPU). The check's own summary and plan are tested in
``tests/test_gpu_check.py``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from helpers import Branch, grads_of, random_model, randomize_, run_connection, small_config

import s2hc
from s2hc import HyperConnection
from s2hc.connection import forms
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import train

cuda = pytest.mark.cuda
TRAIN_FAMILIES = ("residual", "hc", "mhc", "mhc-lite", "kromhc", "s2hc")
# Compiled training on a GPU: the families the GPU check times (each compile is most of a test's time); on a CPU s2hc.
COMPILED_ON_GPU = ("residual", "mhc", "s2hc")
# The families a HyperConnection is built with: the gated residual is a connection form of its own
# (s2hc.GatedResidual, one compute path, no Triton kernels), trained in test_gated_model.py; so are AttnRes and
# the wide residual (tests/test_forms.py).
HC_FAMILIES = [f for f in s2hc.families() if isinstance(forms.get(f), forms.HyperConnectionForm) or f == "residual"]


def streams(family: str, n: int = 4) -> int:
    return 1 if family == "residual" else n


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def assert_near(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """``actual`` (any device and dtype) equals ``expected`` to ``tol`` times the larger of 1 and
    ``expected``'s largest entry: results of sums, whose rounding grows with the size of the sum."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= tol * scale, f"{what}: max error {error:.3g} > {tol:g} x {scale:.3g}"


def result_names(hc: HyperConnection) -> list[str]:
    """The names of :func:`helpers.run_connection`'s results: ``out``, ``dX``, then each parameter."""
    return ["out", "dX", *(f"d{name}" for name, _ in hc.named_parameters())]


N_WIDE = ("out", "dX", "dnorm_weight", "dprojection")  # results with n·C entries per token (or per feature)


def connection_case(family: str, dtype: torch.dtype, c: int, tokens: tuple[int, int], seed: int = 3):
    """A randomised connection, branch, streams and loss weights, every value rounded to ``dtype`` (CPU)."""
    n = streams(family)
    torch.manual_seed(0)  # the branch's initialisation
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(c, n, family=family, layer_index=1)
    randomize_(hc, g, 0.5)
    x = torch.randn(*tokens, n, c, generator=g)
    weights = torch.randn(*tokens, n, c, generator=g, dtype=torch.float64)
    return hc.to(dtype), Branch(c).to(dtype), x.to(dtype), weights


# ------------------------------------------------------------------------------- the connection


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", HC_FAMILIES)
def test_connection_on_device_matches_the_cpu_reference(family, dtype, cuda_device):
    """Forward and every gradient of the default (fast) path on the device against the reference path
    (``fused=False``) on the CPU in float64, on the same values. float32: 1e-4 of scale, and recompute
    changes nothing. bfloat16: the n-wide results to 5e-2 of scale, the gradients of the scalar gates and
    biases (sums over all tokens with cancellation) to 0.15 (bf16 on a CPU: at most 7e-3 and 2e-2)."""
    hc, branch, x, weights = connection_case(family, dtype, c=48, tokens=(2, 16))
    reference = run_connection(copy.deepcopy(hc).double(), copy.deepcopy(branch).double(), x.double(), weights,
                               fused=False)  # fmt: skip
    hc_dev, branch_dev = copy.deepcopy(hc).to(cuda_device), copy.deepcopy(branch).to(cuda_device)
    x_dev, weights_dev = x.to(cuda_device), weights.to(cuda_device)
    actual = run_connection(hc_dev, branch_dev, x_dev, weights_dev)
    names = result_names(hc)
    assert actual[0].device.type == cuda_device.type and actual[0].dtype == dtype
    for name, a, b in zip(names, actual, reference):
        assert torch.isfinite(a).all(), f"{family} {name}: not finite"
        if dtype == torch.float32:
            assert_near(a, b, 1e-4, f"{family} {name}")
        else:
            assert_near(a, b, 5e-2 if name in N_WIDE else 0.15, f"{family} {name}")
    if dtype == torch.float32:
        recomputed = run_connection(hc_dev, branch_dev, x_dev, weights_dev, recompute=True)
        for name, a, b in zip(names, recomputed, actual):
            assert_near(a, b, 1e-5, f"{family} {name} (recompute)")


@cuda
@pytest.mark.parametrize("family", ["s2hc", "mhc"])
def test_connection_on_device_at_eight_streams(family, cuda_device):
    hc = HyperConnection(32, 8, family=family, layer_index=3)
    randomize_(hc, torch.Generator().manual_seed(4), 0.5)
    g = torch.Generator().manual_seed(5)
    x, weights = torch.randn(2, 8, 8, 32, generator=g), torch.randn(2, 8, 8, 32, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    branch = Branch(32)
    reference = run_connection(copy.deepcopy(hc).double(), copy.deepcopy(branch).double(), x.double(), weights,
                               fused=False)  # fmt: skip
    actual = run_connection(hc.to(cuda_device), branch.to(cuda_device), x.to(cuda_device), weights.to(cuda_device))
    for name, a, b in zip(result_names(hc), actual, reference):
        assert_near(a, b, 1e-4, f"{family} n=8 {name}")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["s2hc", "mhc"])
def test_compiled_connection_matches_eager(family, dtype, cuda_device):
    """The compiled path (``torch.compile`` of the connection and its branch, inductor) against the eager fast path
    on the device, values and every gradient: float32 to 1e-4 of scale, bf16 the n-wide results to 3e-2 of scale.
    On a GPU at 4 x 64 tokens, C = 256; on a CPU (the dry run) float32 at 1 x 5 tokens, C = 24 (a compile there
    takes most of a minute)."""
    if not on_gpu(cuda_device) and dtype != torch.float32:
        pytest.skip("on a CPU float32 only: each compile takes most of a minute")
    c, tokens = (256, (4, 64)) if on_gpu(cuda_device) else (24, (1, 5))
    hc, branch, x, weights = connection_case(family, dtype, c=c, tokens=tokens, seed=11)
    hc, branch, x, weights = hc.to(cuda_device), branch.to(cuda_device), x.to(cuda_device), weights.to(cuda_device)
    eager = run_connection(hc, branch, x, weights)
    compiled_hc = copy.deepcopy(hc)
    x_leaf = x.detach().clone().requires_grad_()
    out = torch.compile(compiled_hc)(x_leaf, branch)
    (out.double() * weights.double()).sum().backward()
    compiled = [out.detach(), *grads_of(compiled_hc, x_leaf)]
    for name, a, b in zip(result_names(hc), compiled, eager):
        what = f"{family} {name} (compiled)"
        assert a.dtype == b.dtype and torch.isfinite(a).all(), what
        if dtype == torch.float32:
            assert_near(a, b, 1e-4, what)
        elif name in N_WIDE:
            assert_near(a, b, 3e-2, what)


# ------------------------------------------------------------------------------- Triton kernels


def triton_device(cuda_device: torch.device) -> torch.device:
    """``cuda_device`` if the Triton kernels can run there (compiled on CUDA, interpreted on a CPU), else skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from s2hc.connection import kernels as triton_kernels

    if on_gpu(cuda_device) and triton_kernels.interpreted():
        pytest.skip("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled for the GPU")
    if not on_gpu(cuda_device) and not triton_kernels.interpreted():
        pytest.skip("no GPU and TRITON_INTERPRET was not set before triton was imported")
    return cuda_device


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", [f for f in HC_FAMILIES if f != "residual"])
def test_triton_kernels_match_the_torch_fast_path(family, dtype, cuda_device):
    """``kernels="triton"`` against ``kernels="torch"`` on the device, values and every gradient, with and
    without recompute. On a GPU at a shape of several token and feature blocks (4 x 64 tokens, C = 256);
    under the CPU interpreter at 1 x 5 tokens, C = 24. float32 to 1e-4 of scale; bf16 the n-wide results
    to 3e-2 of scale."""
    device = triton_device(cuda_device)
    c, tokens = (256, (4, 64)) if on_gpu(device) else (24, (1, 5))
    hc, branch, x, weights = connection_case(family, dtype, c=c, tokens=tokens, seed=7)
    hc, branch, x, weights = hc.to(device), branch.to(device), x.to(device), weights.to(device)
    torch_run = run_connection(hc, branch, x, weights, kernels="torch")
    for recompute in (False, True):
        triton_run = run_connection(hc, branch, x, weights, kernels="triton", recompute=recompute)
        for name, a, b in zip(result_names(hc), triton_run, torch_run):
            what = f"{family} {name} (triton, recompute={recompute})"
            assert a.dtype == b.dtype and torch.isfinite(a).all(), what
            if dtype == torch.float32:
                assert_near(a, b, 1e-4, what)
            elif name in N_WIDE:
                assert_near(a, b, 3e-2, what)


@cuda
def test_model_with_triton_kernels_matches_torch(cuda_device):
    """A whole Transformer (s2hc, n = 4) on the device: the loss and every gradient with the Triton kernels
    on every connection equal the PyTorch fast path's."""
    device = triton_device(cuda_device)
    model = random_model("s2hc", 4).to(device)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32 if on_gpu(device) else 8),
                           generator=torch.Generator().manual_seed(0)).to(device)  # fmt: skip
    results = []
    for kernels in ("torch", "triton"):
        s2hc.connection.set_connection_options(model, kernels=kernels)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for i, (a, b) in enumerate(zip(*results)):
        assert_near(a, b, 1e-4, "loss" if i == 0 else f"gradient {i}")


# ------------------------------------------------------------------------------------- training


def device_config(corpus_file, root: Path, device: torch.device, **changes):
    """A short bf16-autocast run on ``device``: the ``tiny`` preset as it is (4 x 128), 8 steps of 8 x 64 tokens,
    in which the loss falls from 8.3 to about 6.8 (a second on a CPU, eager)."""
    values = dict(device=str(device), dtype="bfloat16", model_overrides={}, seq_len=64, batch_size=8, max_steps=8,
                  lr=3e-3, warmup_steps=1, eval_every=0, eval_batches=1, checkpoint_every=0, log_every=1)  # fmt: skip
    values.update(changes)
    return small_config(corpus_file, root, **values)


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def assert_trains(config, decreasing: bool = True) -> list[float]:
    """Train ``config``; every loss finite, the last below the first (``decreasing``); returns the losses."""
    result = train(config)
    curve = [loss for _, loss in losses(config.out)]
    assert result.step == config.max_steps and len(curve) == config.max_steps
    assert all(math.isfinite(v) for v in curve), curve
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    if decreasing:
        assert curve[-1] < curve[0], f"the loss did not decrease: {curve}"
    return curve


@cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", TRAIN_FAMILIES)
def test_training_steps_with_bf16_autocast(family, compiled, cuda_device, corpus_file, tmp_path):
    """8 steps of the tiny preset with bf16 autocast on the device, eager and ``compile=True`` (each block
    compiled): finite losses that decrease, a finite validation loss."""
    compiled_families = COMPILED_ON_GPU if on_gpu(cuda_device) else ("s2hc",)
    if compiled and family not in compiled_families and not os.environ.get("S2HC_TEST_COMPILE_ALL"):
        pytest.skip(f"compiled training on this device: {', '.join(compiled_families)} (S2HC_TEST_COMPILE_ALL=1 "
                    "runs every family)")
    assert_trains(device_config(corpus_file, tmp_path, cuda_device, family=family, n_streams=streams(family),
                                compile=compiled))  # fmt: skip


@cuda
def test_training_with_triton_kernels(cuda_device, corpus_file, tmp_path):
    """s2hc trained with ``connection={"kernels": "triton"}`` (eager) under bf16 autocast: the loss curve of
    ``kernels="torch"`` to 1 % (the paths round differently in bf16; a wrong kernel changes the loss by far
    more). Under the CPU interpreter, 3 steps of 1 x 16 tokens (it takes milliseconds per token and kernel),
    too few to require a decrease."""
    device = triton_device(cuda_device)
    small = {} if on_gpu(device) else dict(max_steps=3, seq_len=16, batch_size=1)
    curves = [
        assert_trains(device_config(corpus_file, tmp_path / kernels, device, connection={"kernels": kernels},
                                    **small), decreasing=on_gpu(device))
        for kernels in ("torch", "triton")
    ]  # fmt: skip
    for step, (a, b) in enumerate(zip(*curves), 1):
        assert math.isclose(a, b, rel_tol=1e-2), f"step {step}: torch {a} vs triton {b}"


@contextlib.contextmanager
def deterministic(device: torch.device):
    """On CUDA: deterministic algorithms where torch has them (warning elsewhere) and the math attention
    kernel, whose backward has no atomics, so two runs of the same steps can be compared."""
    if not on_gpu(device):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_on_device_equals_uninterrupted(dtype, cuda_device, corpus_file, tmp_path, monkeypatch):
    """A run stopped right after its step-4 checkpoint and resumed gives the losses of an uninterrupted run,
    step for step: exactly on a CPU; on CUDA (deterministic settings) to 1e-5 relative in float32 and 2e-3
    in bfloat16, far below what a wrong data position, optimizer state or schedule would change."""
    import s2hc.train.checkpointer as state

    config = device_config(corpus_file, tmp_path / "a", cuda_device, family="s2hc", dtype=dtype, max_steps=6,
                           checkpoint_every=2)  # fmt: skip
    interrupted = config.replace(out=str(tmp_path / "b" / "run"))
    original = state.save_checkpoint

    def save_then_crash(path, payload):
        original(path, payload)
        if payload.step == 4:
            raise KeyboardInterrupt

    with deterministic(cuda_device):
        train(config)
        monkeypatch.setattr(state, "save_checkpoint", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            train(interrupted)
        monkeypatch.setattr(state, "save_checkpoint", original)
        assert load_checkpoint(interrupted.out).step == 4
        assert [step for step, _ in losses(interrupted.out)] == [1, 2, 3, 4]
        train(interrupted, resume=True)
    expected, actual = losses(config.out), losses(interrupted.out)
    assert [s for s, _ in actual] == [s for s, _ in expected] == list(range(1, 7))
    if not on_gpu(cuda_device):
        assert actual == expected
        return
    tol = 1e-5 if dtype == "float32" else 2e-3
    for (step, a), (_, b) in zip(actual, expected):
        assert math.isclose(a, b, rel_tol=tol), f"step {step}: resumed {a} vs uninterrupted {b}"
