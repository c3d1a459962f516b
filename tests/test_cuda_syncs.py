"""No host sync in a training step on the GPU (marker ``cuda``, run by the GPU check): the loop's steps run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that makes the host wait for the device
(``.item()``, a blocking copy, ``cudaStreamSynchronize`` inside a kernel's code, ...). Only a read of the steps'
values (a log, evaluation, diagnostics or checkpoint, outside ``_Run.optimizer_step``) may sync.

The first step of a run (or of a resume) runs without the check: lazy initialisation (cuBLAS handles, the
optimizer's state) may sync once; every later step is checked. bf16 autocast as training runs, eager (the
compiled blocks are not checked here), batches of 4 096 tokens (the embedding's backward takes its sorting path
above 3 072 indices).

Skipped without CUDA. ``S2HC_TEST_DEVICE=cpu`` (the GPU check's ``--dry-run``) runs the same runs on the CPU with
:class:`test_host_syncs.HostSyncs` (a dispatch mode) in place of the sync debug mode.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
from helpers import SMALL_MODEL, small_config
from test_host_syncs import HostSyncs, step_counters

from s2hc.rundir import checkpoint_paths, read_metrics
from s2hc.train import TrainingError, loop, train

cuda = pytest.mark.cuda


@contextlib.contextmanager
def no_sync(run, device: torch.device):
    """Raise at any host sync inside: the sync debug mode on CUDA, :class:`HostSyncs` elsewhere."""
    if device.type == "cuda":
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
        return
    with HostSyncs(step_counters(run.optimizer)) as mode:
        yield
    assert mode.calls == [], f"step {run.step}: {mode.calls}"


def check_steps(monkeypatch, device: torch.device) -> list[int]:
    """Run every ``_Run.optimizer_step`` but each run's first under :func:`no_sync`; returns the steps checked."""
    checked: list[int] = []
    real = loop._Run.optimizer_step

    def optimizer_step(self):
        if not getattr(self, "warmed_up", False):  # this run's (or resume's) first step: lazy initialisation
            self.warmed_up = True
            return real(self)
        with no_sync(self, device):
            real(self)
        checked.append(self.step)

    monkeypatch.setattr(loop._Run, "optimizer_step", optimizer_step)
    return checked


def gpu_config(corpus_file, root, device: torch.device, model_overrides=None, **changes):
    """bf16 autocast on ``device``, 8 steps logging every 4, evaluation and a checkpoint at the end only: on the
    GPU the tiny preset as it is with 32 x 128 tokens, on a CPU the small test model with 4 x 16."""
    on_gpu = device.type == "cuda"
    size = dict(seq_len=128, batch_size=32) if on_gpu else dict(seq_len=16, batch_size=4)
    model = {**({} if on_gpu else SMALL_MODEL), **(model_overrides or {})}
    values = dict(device=str(device), dtype="bfloat16", model_overrides=model, max_steps=8, log_every=4, lr=3e-3,
                  warmup_steps=1, eval_every=0, eval_batches=1, checkpoint_every=0, diagnostics_every=0, **size)
    values.update(changes)
    return small_config(corpus_file, root, **values)


CASES = [
    pytest.param("s2hc", 4, {}, id="s2hc-4"),
    pytest.param("s2hc", 8, {}, id="s2hc-8"),  # the batched solve (m = 7)
    pytest.param("mhc", 4, {}, id="mhc-4"),
    pytest.param("residual", 1, {"embed_scale": True}, id="residual-embed-scale"),  # Gemma's scaled embedding
]


@cuda
@pytest.mark.parametrize("family,n,overrides", CASES)
def test_training_steps_make_no_host_sync(family, n, overrides, cuda_device, corpus_file, tmp_path, monkeypatch):
    """Steps 2…8 of a bf16-autocast run raise at no sync; the run logs steps 4 and 8 with finite losses."""
    checked = check_steps(monkeypatch, cuda_device)
    config = gpu_config(corpus_file, tmp_path, cuda_device, family=family, n_streams=n, model_overrides=overrides)
    result = train(config)
    assert checked == list(range(2, 9)) and result.step == 8
    logged = [(r["step"], r["loss"]) for r in read_metrics(config.out) if "loss" in r]
    assert [s for s, _ in logged] == [4, 8] and all(math.isfinite(v) for _, v in logged)


@cuda
def test_training_with_triton_kernels_makes_no_host_sync(cuda_device, corpus_file, tmp_path, monkeypatch):
    """s2hc (n = 4) with ``connection={"kernels": "triton"}``: the kernels' launches make no sync either."""
    if cuda_device.type != "cuda":
        pytest.skip("the Triton kernels run on the GPU (the CPU interpreter reads tensors on the host)")
    pytest.importorskip("triton", reason="kernels='triton' needs the triton package")
    checked = check_steps(monkeypatch, cuda_device)
    train(gpu_config(corpus_file, tmp_path, cuda_device, connection={"kernels": "triton"}))
    assert checked == list(range(2, 9))


@cuda
def test_resumed_steps_make_no_host_sync(cuda_device, corpus_file, tmp_path, monkeypatch):
    """A run resumed from its step-4 checkpoint (read onto the device): AdamW's step counters are back on the
    host where the optimizer keeps them (a CUDA counter would make the update read each one: a sync per
    parameter), and steps 6…8 raise at no sync."""
    config = gpu_config(corpus_file, tmp_path, cuda_device, max_steps=4, checkpoint_every=4)
    train(config)
    runs = []
    real_init = loop._Run.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(loop._Run, "__init__", init)
    checked = check_steps(monkeypatch, cuda_device)
    train(config.replace(max_steps=8), resume=True)
    assert checked == [6, 7, 8]
    counters = [s["step"] for s in runs[0].optimizer.state.values()]
    assert counters and all(c.device.type == "cpu" and c.dtype == torch.float32 for c in counters)


@cuda
def test_a_non_finite_step_on_the_device_stops_the_run_at_the_read(cuda_device, corpus_file, tmp_path, monkeypatch):
    """A NaN loss at step 2 on the device: the steps run on without a sync, the read at step 4 names step 2, and
    no checkpoint is written."""
    real = loop.F.cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(loop.F, "cross_entropy", poisoned)
    checked = check_steps(monkeypatch, cuda_device)
    config = gpu_config(corpus_file, tmp_path, cuda_device, checkpoint_every=4)
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) or gradient at step 2; stopped; no checkpoint"):
        train(config)
    assert checked == [2, 3, 4]
    assert [r["step"] for r in read_metrics(config.out) if "diverged" in r] == [2]
    assert not checkpoint_paths(Path(config.out))
