"""What ``s2hc train`` says before its first step (the parameters, total and the connections', the device, the
precision, the tokens per step, the optimizer and the run directory; "compiling…" with --compile, before the
compile), and that its stderr captured by a pipe or a log file (no terminal) is plain lines: no carriage return
of a progress bar, no escape code, the tokenising included. Checked by content, in a tiny run."""

from __future__ import annotations

import subprocess
import sys

import torch
from helpers import SMALL_MODEL

from s2hc.cli import main
from s2hc.reports import count
from s2hc.rundir import load_model

SMALL = "model_overrides={" + ", ".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "}"


def tiny_run(corpus_file, root, *extra: str) -> list[str]:
    """``s2hc train`` arguments of a run of a second; the progress bar left on (its default)."""
    return ["train", "--family", "s2hc", "--streams", "4", "--preset", "tiny", "--set", SMALL, "--max-steps", "2",
            "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--log-every", "1",
            "--data", str(corpus_file), "--cache-dir", str(root / "cache"), "--out", str(root / "run"), *extra]


def test_the_banner_names_what_is_trained_and_a_log_has_only_plain_lines(corpus_file, tmp_path):
    done = subprocess.run([sys.executable, "-m", "s2hc", *tiny_run(corpus_file, tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    for output in (err, done.stdout):
        assert "\r" not in output and "\x1b[" not in output, repr(output[-500:])
    model, _ = load_model(tmp_path / "run")
    lines = err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("s2hc train: "))
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2: "))
    assert head < first_step
    banner = "\n".join(lines[head:first_step])
    assert "s2hc with n = 4 streams" in banner and f"a new run in {tmp_path / 'run'}" in banner
    assert f"parameters  {count(model.num_params())} " in banner
    assert f"of which the connections {count(model.num_connection_params())} " in banner
    assert "device      cpu" in banner and "float32 (no autocast)" in banner
    assert "tokens      64 per step: batch 2 × seq_len 32 × grad_accum 1 × 1 process" in banner
    assert "optimizer   adamw, lr " in banner
    assert "compiling" not in banner
    assert any(line.startswith("tokenising train of ") for line in lines[:head])  # a line, not a bar


def test_compile_says_so_before_the_first_step(corpus_file, tmp_path, monkeypatch, capsys):
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    assert main(tiny_run(corpus_file, tmp_path, "--compile")) == 0
    assert compiled  # distributed.wrap asked for it (a no-op here: the real one takes minutes on a CPU)
    lines = capsys.readouterr().err.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("compiling… "))
    assert "first steps" in lines[said] and "tens of seconds" in lines[said]
    assert said < next(i for i, line in enumerate(lines) if line.startswith("step 1/2: "))
