"""GPU checks (marker ``cuda``, run by ``benchmarks/gpu_check.sh``): every family's connection on the device
against the CPU reference in float32 and bfloat16, the Triton kernels compiled for the device against the
PyTorch fast path, a few bf16-autocast training steps per family eager and compiled, and checkpoint resume.

Skipped without CUDA. ``S2HC_TEST_DEVICE=cpu`` runs them on the CPU instead (the script's ``--dry-run``):
bf16 autocast on the CPU, the Triton kernels under the interpreter (the root conftest sets
``TRITON_INTERPRET=1`` without a GPU), smaller shapes, and compiled training for s2hc only unless
``S2HC_TEST_COMPILE_ALL=1`` (each compile takes a minute or more on a CPU).

The last two tests, not marked, check ``benchmarks/gpu_check.py`` on synthetic files (CPU tests): the summary,
the raw archive and the rule that at most 8 files come back.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Branch, random_model, randomize_, run_connection, small_config

import s2hc
from s2hc import HyperConnection
from s2hc.connection import forms
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import train

ROOT = Path(__file__).resolve().parent.parent
cuda = pytest.mark.cuda
TRAIN_FAMILIES = ("residual", "hc", "mhc", "mhc-lite", "kromhc", "s2hc")
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
    if compiled and not on_gpu(cuda_device) and family != "s2hc" and not os.environ.get("S2HC_TEST_COMPILE_ALL"):
        pytest.skip("compiled training on a CPU: s2hc only (S2HC_TEST_COMPILE_ALL=1 runs every family)")
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


# --------------------------------------------------- benchmarks/gpu_check.py summarize (a CPU test)


def _bench_rows(preset, compiled, families, n):
    """Synthetic ``s2hc bench --json`` rows: residual 100 ms, then each ``(label, ratio, peak MiB)``."""
    rows = []
    for label, ratio, mib in [("residual", 1.0, 100), *families]:
        family = label.split(":")[0] if not label.startswith("hyper-connections") else "hyper-connections:mhc"
        rows.append({
            "preset": preset, "family": family, "label": label, "n_streams": 1 if label == "residual" else n,
            "compiled": compiled, "batch_size": 8, "seq_len": 1024, "step_s": 0.1 * ratio,
            "step_ratio_vs_residual": ratio, "step_ratio_min": ratio - 0.01, "step_ratio_max": ratio + 0.01,
            "tokens_per_s": 8192 / (0.1 * ratio), "peak_mem_bytes": mib * 2**20,
            "peak_mem_ratio_vs_residual": mib / 100,
            "params": 124_000_000, "device": "cuda",
        })  # fmt: skip
    return rows


def test_gpu_check_summary_from_synthetic_files(tmp_path):
    """``gpu_check.py summarize`` on a made-up OUT_DIR of loose files (the older layout, one file per result):
    step statuses, JUnit counts, the ratio and memory tables, s2hc's overhead against mHC's published 6.7 %,
    and a failed bench without JSON."""
    out = tmp_path / "out"
    out.mkdir()
    eager = _bench_rows("gpt2-small", False, [("mhc", 1.25, 180), ("s2hc", 1.10, 150),
                                              ("s2hc:kernels=triton", 1.05, 140),
                                              ("hyper-connections:mhc", 1.5, 250)], 4)  # fmt: skip
    compiled = _bench_rows("gpt2-small", True, [("mhc", 1.2, 170), ("s2hc", 1.08, 140)], 4)
    wide = _bench_rows("gpt2-small", False, [("s2hc", 1.3, 200)], 8)
    for name, rows in (("gpt2-n4-eager", eager), ("gpt2-n4-compiled", compiled), ("gpt2-n8-eager", wide)):
        (out / f"bench-{name}.json").write_text(json.dumps({"machine": "test GPU", "device": "cuda", "steps": rows,
                                                             "coefficients": [], "params": [], "peer": "present"}))
    (out / "bench-qwen3-n4-eager.json").write_text("")  # a bench that died before printing
    steps = [
        dict(name="tests", kind="tests", status="failed", rc=1, seconds=80, limit_s=240, args=""),
        dict(name="gpt2-n4-eager", kind="bench", status="ok", rc=0, seconds=30, limit_s=120,
             args="--preset gpt2-small --streams 4 --families mhc,s2hc"),
        dict(name="gpt2-n4-compiled", kind="bench", status="ok", rc=0, seconds=90, limit_s=150,
             args="--preset gpt2-small --streams 4 --compile --layers 4"),
        dict(name="gpt2-n8-eager", kind="bench", status="ok", rc=0, seconds=20, limit_s=90, args="--streams 8"),
        dict(name="qwen3-n4-eager", kind="bench", status="timeout", rc=124, seconds=120, limit_s=120, args=""),
        dict(name="qwen3-n4-compiled", kind="bench", status="skipped", rc=None, seconds=0, limit_s=0, args=""),
    ]
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / "tests.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda" name="test_b">'
        '<failure message="boom">trace</failure></testcase><testcase classname="tests.test_cuda" name="test_c">'
        '<skipped message="no"/></testcase><testcase classname="tests.test_cuda" name="test_d"/>'
        '<testcase classname="tests.test_cuda" name="test_e"/></testsuite></testsuites>'
    )
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "summarize", str(out)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tests"][0]["counts"] == {"total": 5, "passed": 3, "failed": 1, "errors": 0, "skipped": 1,
                                             "failures": ["tests.test_cuda.test_b"]}  # fmt: skip
    assert summary["step_counts"] == {"ok": 3, "failed": 1, "timeout": 1, "skipped": 1, "cut": 0}
    runs = {run["name"]: run for run in summary["benches"]}
    assert runs["qwen3-n4-eager"]["rows"] == [] and "no JSON" in runs["qwen3-n4-eager"]["error"]
    assert runs["gpt2-n4-compiled"]["layers"] == 4 and runs["gpt2-n4-compiled"]["compiled"] is True
    s2hc_row = next(r for r in runs["gpt2-n4-eager"]["rows"] if r["label"] == "s2hc")
    assert s2hc_row["step_ratio"] == pytest.approx(1.10) and s2hc_row["peak_mem_mib"] == pytest.approx(150)
    overhead = {(o["run"], o["label"]): o for o in summary["s2hc_vs_mhc_published"]}
    assert set(overhead) == {("gpt2-n4-eager", "s2hc"), ("gpt2-n4-eager", "s2hc:kernels=triton"),
                             ("gpt2-n4-compiled", "s2hc")}  # n = 8 is not compared  # fmt: skip
    eager_s2hc = overhead[("gpt2-n4-eager", "s2hc")]
    assert eager_s2hc["overhead_pct"] == pytest.approx(10.0)
    assert eager_s2hc["vs_published_pct_points"] == pytest.approx(10.0 - 6.7)
    assert eager_s2hc["mhc_overhead_pct"] == pytest.approx(25.0)
    assert eager_s2hc["peer_overhead_pct"] == pytest.approx(50.0)
    markdown = (out / "summary.md").read_text()
    assert "| s2hc | 4 | 110.0 ms | 1.10x [1.09, 1.11] |" in markdown
    assert "+10.0 %" in markdown and "6.7 %" in markdown and "timeout" in markdown

    # A test run cut short by its time limit leaves no XML: the verbose lines of tests.log are counted.
    (out / "tests.xml").unlink()
    (out / "tests.log").write_text(
        "tests/test_cuda.py::test_a[s2hc-float32] PASSED    [ 10%]\n"  # without xdist
        "[gw1] [ 20%] FAILED tests/test_cuda.py::test_b \n"  # with xdist
        "[gw0] [ 30%] SKIPPED tests/test_cuda.py::test_c \n"
        "FAILED tests/test_cuda.py::test_b - AssertionError: boom\n"  # -ra's summary repeats it
    )
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "summarize", str(out)], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    tests = json.loads((out / "summary.json").read_text())["tests"][0]["counts"]
    assert (tests["total"], tests["passed"], tests["failed"], tests["skipped"]) == (3, 1, 1, 1)
    assert tests["failures"] == ["tests/test_cuda.py::test_b"] and "partial" in tests


def _gpu_check(command: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), command, str(out)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _events(*events) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def test_gpu_check_returns_at_most_8_files_and_summarises_a_run_cut_short(tmp_path):
    """The script's protocol on synthetic steps: each step writes its files into ``current/``, adds its line to
    ``steps.jsonl``, then ``finish-step`` appends them to ``raw.tar`` and rebuilds the summary. After every step
    the folder holds at most the 8 files the device returns, ``raw.tar`` every finished step's files; a kernel
    case that failed is named; a bench cut by its time limit before its rows is summarised from the repetitions
    it finished; a run killed during a step still shows that step from its events in ``current/``."""
    import tarfile

    out = tmp_path / "out"
    current = out / "current"
    current.mkdir(parents=True)
    (out / "console.log").write_text("GPU check (gpu) ...\n")
    (out / "steps.jsonl").write_text("")
    written: list[str] = []

    def finish(name, kind, files, status="ok", rc=0, args=""):
        for file_name, text in files.items():
            (current / file_name).write_text(text)
        written.extend(files)
        step = dict(mode="gpu", name=name, kind=kind, status=status, rc=rc, seconds=5, limit_s=60, args=args, note="")
        with (out / "steps.jsonl").open("a") as stream:
            stream.write(json.dumps(step) + "\n")
        result = _gpu_check("finish-step", out)
        assert result.returncode == 0, result.stderr
        assert len([p for p in out.rglob("*") if p.is_file()]) <= 8 and not any(current.iterdir())
        return json.loads((out / "summary.json").read_text())

    finish("env", "setup", {"env.txt": "nvidia-smi ...\n", "env.json": json.dumps({"gpu": "NVIDIA H200"})})
    case = dict(kind="case", piece="read_mix", family=None, n=4, dim=768, K=None, tokens=8192, dtype="float32",
                ok=True, problems=[], worst_error={"triton": 1e-7, "torch": 2e-7},
                timing={"triton_fwd_ms": 0.05, "triton_fwd_gbs": 2000.0, "torch_fwd_ms": 0.08})  # fmt: skip
    wrong = dict(case, piece="norm_project", family="s2hc", n=16, K=257, ok=False,
                 problems=["triton error 3.00e-04 > 5e-05"], worst_error={"triton": 3e-4, "torch": 2e-7})  # fmt: skip
    kernels = _events({"kind": "environment", "device": "cuda", "gpu": "NVIDIA H200", "tokens": 8192, "dim": 768},
                      {"kind": "copy", "bytes": 2 << 30, "ms": 0.5, "gbs": 4295.0}, case, wrong,
                      {"kind": "done", "cases": 2, "failed": 1})  # fmt: skip
    finish("kernels", "kernels", {"kernels.jsonl": kernels, "kernels.log": "FAIL norm_project\n"}, "failed", 1)
    rows = [dict(row, dtype="bfloat16") for row in _bench_rows("gpt2-small", False, [("s2hc", 1.05, 120)], 4)]
    bench = {"machine": "H200", "device": "cuda", "dtype": "bfloat16", "steps": rows, "peer": "present"}
    finish("bench-gpt2-small-n4-bf16", "bench", {
        "bench-gpt2-small-n4-bf16.json": json.dumps(bench), "bench-gpt2-small-n4-bf16.log": "repetition 1/3\n",
        "bench-gpt2-small-n4-bf16.jsonl": _events(*({"event": "row", **row} for row in rows))},
        args="--preset gpt2-small --dtype bfloat16 --streams 4")  # fmt: skip
    # cut by its time limit after 2 of 3 repetitions: no JSON, a last event line cut in the middle
    start = {"event": "start", "preset": "gpt2-small", "dtype": "bfloat16", "device": "cuda", "compiled": True,
             "n_streams": 4, "batch_size": 8, "seq_len": 1024, "repeats": 3}  # fmt: skip
    built = [{"event": "built", "label": label, "family": label, "n_streams": n, "seconds": 40.0}
             for label, n in (("residual", 1), ("s2hc", 4))]  # fmt: skip
    repetitions = [{"event": "repetition", "repetition": i + 1, "repeats": 3, "step_s": {"residual": 0.1, "s2hc": s}}
                   for i, s in enumerate((0.11, 0.12))]  # fmt: skip
    summary = finish("bench-compiled", "bench", {
        "bench-compiled.json": "", "bench-compiled.log": "repetition 2/3\n",
        "bench-compiled.jsonl": _events(start, *built, *repetitions) + '{"event": "repet'},
        "timeout", 124, "--preset gpt2-small --dtype bfloat16 --streams 4 --compile --layers 2")  # fmt: skip

    with tarfile.open(out / "raw.tar") as tar:
        assert sorted(tar.getnames()) == sorted(written)
    (check,) = summary["kernels"]
    assert check["passed"] == 1 and [c["K"] for c in check["failed"]] == [257] and check["copy_gbs"] == 4295.0
    runs = {run["name"]: run for run in summary["benches"]}
    assert runs["bench-gpt2-small-n4-bf16"]["dtype"] == "bfloat16" and not runs["bench-gpt2-small-n4-bf16"]["partial"]
    cut = runs["bench-compiled"]
    assert cut["compiled"] and cut["layers"] == 2 and cut["built_s"] == {"residual": 40.0, "s2hc": 40.0}
    s2hc_row = next(row for row in cut["rows"] if row["label"] == "s2hc")
    assert s2hc_row["step_ratio"] == pytest.approx(1.15) and s2hc_row["ratio_max"] == pytest.approx(1.2)
    assert s2hc_row["tokens_per_s"] == pytest.approx(8192 / 0.115) and s2hc_row["peak_mem_mib"] is None
    assert "2 of 3 repetitions" in cut["partial"]
    overhead = {(o["run"], o["dtype"]): o["overhead_pct"] for o in summary["s2hc_vs_mhc_published"]}
    assert overhead == pytest.approx({("bench-gpt2-small-n4-bf16", "bfloat16"): 5.0,
                                      ("bench-compiled", "bfloat16"): 15.0})  # fmt: skip
    markdown = (out / "summary.md").read_text()
    assert "| norm_project s2hc K=257 | 16 | float32 | **no** | 3.0e-04 |" in markdown
    assert "Partial: 2 of 3 repetitions" in markdown and "bf16 autocast, compiled" in markdown

    # killed during a step: its files stay in current/ and are summarised from there
    qwen3 = _bench_rows("qwen3-0.6b", False, [("s2hc", 1.04, 120)], 4)
    (current / "bench-qwen3.jsonl").write_text(_events(dict(start, preset="qwen3-0.6b", compiled=False),
                                                       *({"event": "row", **row} for row in qwen3)))  # fmt: skip
    (current / "bench-qwen3.log").write_text("repetition 3/3\npeak memory: ...\n")
    assert _gpu_check("summarize", out).returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["returned"]["count"] == 7 and summary["returned"]["problems"] == []
    killed = next(run for run in summary["benches"] if run["name"] == "bench-qwen3")
    assert killed["status"] == "cut" and killed["preset"] == "qwen3-0.6b" and len(killed["rows"]) == 2
    assert summary["step_counts"]["cut"] == 1 and "Cut during a step" in (out / "summary.md").read_text()

    # the rules of what comes back are checked: a 9th file, a name with a space
    (current / "extra one.txt").write_text("x")
    (out / "stray.txt").write_text("x")
    assert _gpu_check("summarize", out).returncode == 0
    problems = json.loads((out / "summary.json").read_text())["returned"]["problems"]
    assert problems[0] == "9 files, more than 8" and any("extra one.txt" in p for p in problems)
