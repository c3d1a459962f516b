"""s2hc bench: shapes and keys of its rows on a tiny configuration (never a time)."""

from __future__ import annotations

import json

import pytest
import torch

from s2hc.bench import core
from s2hc.cli import main

TINY = dict(batch_size=1, seq_len=8, repeats=1, steps=1, warmup=1, overrides={"n_layers": 1})
STEP_KEYS = {"mixer", "label", "n_streams", "compiled", "step_s", "step_ratio_vs_residual", "step_ratio_min",
             "step_ratio_max", "tokens_per_s", "peak_mem_bytes", "peak_mem_ratio_vs_residual", "params"}  # fmt: skip


def test_step_rows_have_the_keys_and_residual_first():
    variants = [core.parse_variant("s2hc", 2), core.parse_variant("s2hc:recompute=True", 2)]
    rows = core.benchmark_steps("tiny", variants, **TINY)
    assert [r["label"] for r in rows] == ["residual", "s2hc", "s2hc:recompute=True"]
    for row in rows:
        assert STEP_KEYS <= set(row)
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
    assert rows[0]["step_ratio_vs_residual"] == 1.0 and rows[0]["peak_mem_ratio_vs_residual"] == 1.0
    assert rows[1]["n_streams"] == 2 and rows[1]["compiled"] is False
    assert "| s2hc:recompute=True | 2 |" in core.format_step_table(rows)


def test_peer_runs_in_the_same_model():
    pytest.importorskip("hyper_connections")
    rows = core.benchmark_steps("tiny", [core.Variant(core.PEER, 4)], memory=False, **TINY)
    assert rows[1]["mixer"] == core.PEER and rows[1]["peak_mem_ratio_vs_residual"] is None


def test_coefficient_rows():
    rows = core.benchmark_coefficients(["s2hc", "mhc"], n_streams=4, dim=8, tokens=16, repeats=1)
    assert [(r["mixer"], r["fused"]) for r in rows] == [("s2hc", True), ("s2hc", False), ("mhc", True), ("mhc", False)]
    assert all(r["ns_per_token"] > 0 for r in rows)
    assert rows[2]["ratio_vs_mhc"] == 1.0
    assert "| s2hc | fast |" in core.format_coefficient_table(rows)


def test_peak_memory_sees_a_known_allocation():
    def step():
        a = torch.ones(1 << 20)  # 4 MiB, alive together with b
        b = a + 1
        return float(b[0])

    assert core.peak_step_bytes(step) >= 2 * 4 * (1 << 20)


def test_parse_variant():
    assert core.parse_variant("residual", 4).n_streams == 1
    assert core.parse_variant("s2hc:fused=False", 4).options == {"fused": False}
    assert core.parse_variant("hyper-connections", 4).mixer == core.PEER
    with pytest.raises(ValueError, match="argument --mixers: unknown mixer 'sinkhorn'"):
        core.parse_variant("sinkhorn", 4)
    with pytest.raises(ValueError, match="must be KEY=VALUE"):
        core.parse_variant("s2hc:fused", 4)


def test_cli_json(capsys):
    argv = ["bench", "--preset", "tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "8", "--repeats", "1",
            "--steps", "1", "--mixers", "s2hc", "--streams", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"steps", "coefficients", "params", "machine", "peer"} <= set(out)
    required = {"mixer", "n_streams", "compiled", "step_ratio_vs_residual", "peak_mem_ratio_vs_residual", "tokens_per_s"}
    assert all(required <= set(row) for row in out["steps"])
    assert [row["mixer"] for row in out["params"]][:2] == ["residual", "s2hc"]


def test_cli_table_and_bad_mixer(capsys):
    argv = ["bench", "--preset", "tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "8", "--repeats", "1",
            "--steps", "1", "--mixers", "identity", "--no-peer", "--no-memory", "--no-coefficients"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| identity | 4 |" in text and "Hyper-connection parameters" in text
    assert main(["bench", "--mixers", "sinkhorn"]) == 2
    assert "unknown mixer 'sinkhorn'" in capsys.readouterr().err
