"""s2hc bench: shapes and keys of its rows on a tiny configuration (never a time), and its device handling
(CPU only here: the CUDA paths are checked with torch.cuda's functions replaced)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from s2hc.bench import BenchSettings, measure, run
from s2hc.cli import main
from s2hc.devices import resolve_device
from s2hc.flops import model_flops
from s2hc.models import Transformer, get_preset

TINY = BenchSettings(preset="tiny", batch_size=1, seq_len=8, repeats=1, steps=1, warmup=1, overrides={"n_layers": 1})
STEP_KEYS = {"family", "label", "n_streams", "compiled", "step_s", "step_ratio_vs_residual", "step_ratio_min",
             "step_ratio_max", "tokens_per_s", "peak_mem_bytes", "peak_mem_ratio_vs_residual", "params",
             "device"}  # fmt: skip
CLI_TINY = ["bench", "--preset", "tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "8", "--repeats", "1",
            "--steps", "1"]  # fmt: skip


def test_step_rows_have_the_keys_and_residual_first():
    variants = [measure.parse_variant("s2hc", 2), measure.parse_variant("s2hc:recompute=True", 2)]
    rows = measure.benchmark_steps(TINY, variants)
    assert [r["label"] for r in rows] == ["residual", "s2hc", "s2hc:recompute=True"]
    for row in rows:
        assert set(row) >= STEP_KEYS and row["device"] == "cpu"
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
    assert rows[0]["step_ratio_vs_residual"] == 1.0 and rows[0]["peak_mem_ratio_vs_residual"] == 1.0
    assert rows[1]["n_streams"] == 2 and rows[1]["compiled"] is False
    assert "| s2hc:recompute=True | 2 |" in measure.format_step_table(rows)
    assert "eager on cpu" in measure.format_step_table(rows)


def test_the_flop_ratio_is_the_models_count_against_residuals():
    rows = measure.benchmark_steps(replace(TINY, memory=False), [measure.parse_variant("mhc", 4)])
    counted = {family: model_flops(get_preset("tiny", n_layers=1, family=family, n_streams=n), 8)["train_per_token"]
               for family, n in (("residual", 1), ("mhc", 4))}
    assert rows[0]["flops_ratio_vs_residual"] == 1.0
    assert rows[1]["train_flops_per_token"] == counted["mhc"]
    assert rows[1]["flops_ratio_vs_residual"] == pytest.approx(counted["mhc"] / counted["residual"], rel=1e-12)
    assert rows[1]["flops_ratio_vs_residual"] > 1.0  # the connections add arithmetic: a wrong base would not
    assert f"| {rows[1]['flops_ratio_vs_residual']:.2f}× |" in measure.format_step_table(rows)


def test_peer_runs_in_the_same_model():
    pytest.importorskip("hyper_connections")
    rows = measure.benchmark_steps(replace(TINY, memory=False), [measure.Variant(measure.PEER, 4)])
    assert rows[1]["family"] == measure.PEER and rows[1]["peak_mem_ratio_vs_residual"] is None
    assert rows[1]["flops_ratio_vs_residual"] is None  # s2hc does not count the peer's model


def test_coefficient_rows():
    rows = measure.benchmark_coefficients(["s2hc", "mhc"], n_streams=4, dim=8, tokens=16, repeats=1)
    assert [(r["family"], r["fused"]) for r in rows] == [("s2hc", True), ("s2hc", False), ("mhc", True), ("mhc", False)]
    assert all(r["ns_per_token"] > 0 and r["device"] == "cpu" for r in rows)
    assert rows[2]["ratio_vs_mhc"] == 1.0
    assert "| s2hc | fast |" in measure.format_coefficient_table(rows)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("preset", "huge", "preset must be one of "),
    ("overrides", {"n_layer": 2}, "unknown model config key(s) ['n_layer']"),
    ("n_streams", 0, "n_streams must be an integer >= 1, got 0"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("repeats", 1.5, "repeats must be an integer >= 1, got 1.5"),
    ("warmup", -1, "warmup must be an integer >= 0, got -1"),
    ("compile", "yes", "compile must be true or false, got 'yes'"),
    ("peer", 1, "peer must be true or false, got 1"),
    ("device", "tpu", "device: invalid choice 'tpu'"),
    ("dtype", "bf16", "dtype must be one of ['auto', 'float32', 'bfloat16'], got 'bf16'"),
])
def test_bench_settings_refuse_a_bad_value_in_one_line(field, value, message):
    with pytest.raises(ValueError) as error:
        BenchSettings(**{field: value})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_bench_settings_keep_a_copy_and_the_resolved_device():
    overrides = {"n_layers": 1}
    settings = BenchSettings(preset="tiny", overrides=overrides, device="cpu")
    overrides["n_layers"] = 3
    assert settings.overrides == {"n_layers": 1} and settings.model_config().n_layers == 1
    assert settings.device == torch.device("cpu")


def test_the_run_adds_the_peer_and_the_reference(monkeypatch):
    variants = [measure.parse_variant("s2hc", 4), measure.parse_variant("residual", 4)]
    monkeypatch.setattr(measure, "peer_available", lambda: True)
    added, note = run.with_peer(TINY, variants)
    assert [v.label for v in added] == ["s2hc", "residual", measure.PEER] and note is None
    assert run.with_peer(replace(TINY, peer=False), variants) == (variants, None)
    monkeypatch.setattr(measure, "peer_available", lambda: False)
    absent, note = run.with_peer(TINY, variants)
    assert absent == variants and note.startswith(f"{measure.PEER}: absent (")
    assert run.coefficient_families([*added, measure.parse_variant("s2hc:fused=False", 4)]) == [
        "s2hc", "residual", "mhc"]  # benchmark_coefficients leaves out the residual, which has no coefficient path
    assert [row["family"] for row in run.param_rows(TINY, added)] == ["residual", "s2hc", "mhc"]


def test_peak_memory_sees_a_known_allocation():
    def step():
        a = torch.ones(1 << 20)  # 4 MiB, alive together with b
        b = a + 1
        return float(b[0])

    assert measure.peak_step_bytes(step) >= 2 * 4 * (1 << 20)


def test_parse_variant():
    assert measure.parse_variant("residual", 4).n_streams == 1
    assert measure.parse_variant("s2hc:fused=False", 4).options == {"fused": False}
    assert measure.parse_variant("hyper-connections", 4).family == measure.PEER
    with pytest.raises(ValueError, match="argument --families must be one of .*got 'sinkhorn'"):
        measure.parse_variant("sinkhorn", 4)
    with pytest.raises(ValueError, match="expects KEY=VALUE"):
        measure.parse_variant("s2hc:fused", 4)


def test_cli_json(capsys):
    argv = [*CLI_TINY, "--families", "s2hc", "--streams", "2", "--device", "cpu", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"steps", "coefficients", "params", "machine", "peer", "device"} <= set(out)
    required = {
        "family",
        "n_streams",
        "compiled",
        "step_ratio_vs_residual",
        "peak_mem_ratio_vs_residual",
        "tokens_per_s",
    }
    assert all(required <= set(row) for row in out["steps"])
    assert out["device"] == "cpu" and out["machine"].endswith("benchmarks ran on cpu")
    assert {row["device"] for row in out["steps"] + out["coefficients"]} == {"cpu"}
    assert [row["family"] for row in out["params"]][:2] == ["residual", "s2hc"]


def test_cli_dim_widens_the_model_and_its_mlp_alike(capsys):
    argv = [*CLI_TINY, "--families", "s2hc", "--streams", "2", "--dim", "64", "--no-memory", "--no-coefficients",
            "--json"]  # fmt: skip
    assert main(argv) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    tiny = get_preset("tiny")
    config = get_preset("tiny", n_layers=1, dim=64, ffn_dim=tiny.ffn_dim * 64 // tiny.dim)
    assert steps[0]["params"] == sum(p.numel() for p in Transformer(config).parameters())
    assert main([*CLI_TINY, "--dim", "100"]) == 2  # 100 / 4 heads: an odd head width, refused by the model config
    assert "head_dim" in capsys.readouterr().err


def test_cli_table_and_bad_mixer(capsys):
    argv = [*CLI_TINY, "--families", "identity", "--no-peer", "--no-memory", "--no-coefficients"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| identity | 4 |" in text and "Hyper-connection parameters" in text
    assert main(["bench", "--families", "sinkhorn"]) == 2
    assert "got 'sinkhorn'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- devices


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"argument --device: 'cuda' needs a CUDA GPU.*allowed: auto, cpu, cuda"):
        resolve_device("cuda", "argument --device")
    with pytest.raises(ValueError, match=r"argument --device: invalid choice 'tpu'; allowed: auto, cpu, cuda"):
        resolve_device("tpu", "argument --device")
    with pytest.raises(ValueError, match=r"^device: invalid choice 'cuda:x'"):
        resolve_device("cuda:x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_cli_cuda_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*CLI_TINY, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "argument --device: 'cuda' needs a CUDA GPU" in err and "allowed: auto, cpu, cuda" in err
    assert main([*CLI_TINY, "--device", "tpu"]) == 2
    assert "argument --device: invalid choice 'tpu'" in capsys.readouterr().err


def test_timing_synchronises_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    assert measure.timed(lambda: calls.append("step"), torch.device("cpu")) >= 0
    assert calls == ["step"]
    calls.clear()
    cuda = torch.device("cuda")
    measure.timed(lambda: calls.append("step"), cuda)  # the fake synchronize needs no GPU
    assert calls == [("sync", cuda), "step", ("sync", cuda)]


def test_cuda_peak_memory_is_baseline_plus_the_steps_own_peak(monkeypatch):
    """On CUDA: bytes of the baseline objects + (max_memory_allocated - memory_allocated before the step),
    with the peak statistics reset before the step (torch.cuda's functions replaced: no GPU needed)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10_000)  # other models included
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10_000 + 4096)
    baseline = torch.zeros(256)  # 1 KiB
    assert measure.peak_step_bytes(lambda: calls.append("step"), baseline, device="cuda") == 1024 + 4096
    assert calls == ["sync", "reset", "step", "sync"]


def _triton_runs_here() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from s2hc.connection import kernels as triton_kernels

    return triton_kernels.interpreted()  # set by the root conftest.py on machines without CUDA


TRITON_ARGV = [*CLI_TINY, "--families", "s2hc:kernels=triton", "--streams", "2", "--device", "cpu", "--no-peer",
               "--no-memory", "--no-coefficients"]  # fmt: skip


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton under TRITON_INTERPRET=1")
def test_cli_triton_kernels_under_the_interpreter(capsys):
    assert main([*TRITON_ARGV, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["label"], r["device"]) for r in rows] == [("residual", "cpu"), ("s2hc:kernels=triton", "cpu")]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_cli_triton_kernels_where_they_cannot_run_exits_2(monkeypatch, capsys):
    from s2hc.connection import kernels as triton_kernels

    monkeypatch.setattr(triton_kernels, "interpreted", lambda: False)  # as on a CPU without TRITON_INTERPRET=1
    assert main(TRITON_ARGV) == 2
    err = capsys.readouterr().err
    assert "s2hc:kernels=triton failed its first training step on cpu: kernels='triton' runs on CUDA tensors" in err


# ------------------------------------------------------------------------------ activation checkpointing


def test_a_checkpointed_variant_is_compared_with_its_plain_one_and_saves_memory():
    """The ratios of ``s2hc:activation_checkpointing=true`` are to ``s2hc`` in the same repetitions. At 4 x 64 tokens
    over 2 layers the blocks' activations outweigh the LM head's logits and the gradients, so the peak falls."""
    sizes = replace(TINY, batch_size=4, seq_len=64, overrides={"n_layers": 2})
    variants = [measure.parse_variant("s2hc", 4), measure.parse_variant("s2hc:activation_checkpointing=true", 4)]
    rows = measure.benchmark_steps(sizes, variants)
    assert [(r["label"], r["activation_checkpointing"]) for r in rows] == [
        ("residual", False), ("s2hc", False), ("s2hc:activation_checkpointing=True", True)]  # fmt: skip
    plain, twin = rows[1:]
    assert plain["step_ratio_vs_without_ac"] is None and plain["peak_mem_ratio_vs_without_ac"] is None
    assert twin["step_ratio_vs_without_ac"] == twin["step_s"] / plain["step_s"]  # one repetition of one step
    assert twin["peak_mem_ratio_vs_without_ac"] == twin["peak_mem_bytes"] / plain["peak_mem_bytes"] < 0.9
    assert twin["params"] == plain["params"]
    text = measure.format_step_table(rows)
    assert "| step vs without AC | memory vs without AC |" in text
    assert "| s2hc:activation_checkpointing=True | 4 |" in text and "| s2hc | 4 |" in text


def test_activation_checkpointing_as_a_variant_option():
    variant = measure.parse_variant("mhc:activation_checkpointing=true:iterations=5", 4)
    assert variant.activation_checkpointing and variant.family_options == {"iterations": 5}
    assert variant.compute_options == {}
    assert measure.parse_variant("s2hc:activation_checkpointing=false", 4) == measure.parse_variant("s2hc", 4)
    model = measure.build_model("tiny", variant, {"n_layers": 2})
    assert model.activation_checkpointing and not measure.build_model("tiny", variant.with_activation_checkpointing(
        False), {"n_layers": 2}).activation_checkpointing
    with pytest.raises(ValueError, match="option 'activation_checkpointing' of 's2hc' must be true or false, got 2"):
        measure.parse_variant("s2hc:activation_checkpointing=2", 4)
    # a checkpointed variant without its plain one in the run: no ratio to it; residual still gets its plain base
    rows = measure.benchmark_steps(replace(TINY, memory=False), [variant.with_activation_checkpointing(True)])
    assert [r["label"] for r in rows] == ["residual", "mhc:activation_checkpointing=True:iterations=5"]
    assert rows[1]["step_ratio_vs_without_ac"] is None and "without AC" not in measure.format_step_table(rows)


def test_cli_activation_checkpointing(capsys):
    argv = [*CLI_TINY, "--families", "s2hc", "--streams", "2", "--device", "cpu", "--no-peer", "--no-coefficients",
            "--activation-checkpointing", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    # every variant, residual included, is followed by its checkpointed twin, whose rows compare with it
    assert [(r["family"], r["activation_checkpointing"]) for r in rows] == [
        ("residual", False), ("residual", True), ("s2hc", False), ("s2hc", True)]  # fmt: skip
    assert all((r["step_ratio_vs_without_ac"] is None) != r["activation_checkpointing"] for r in rows)
    assert all((r["peak_mem_ratio_vs_without_ac"] is None) != r["activation_checkpointing"] for r in rows)
    assert rows[1]["peak_mem_ratio_vs_residual"] == rows[1]["peak_mem_ratio_vs_without_ac"]
    assert main(["bench", "--families", "s2hc:activation_checkpointing=yes please"]) == 2
    assert "must be true or false, got 'yes please'" in capsys.readouterr().err


# ------------------------------------------------------------------------ precision, progress, events


def test_bf16_autocast_runs_the_forward_in_bfloat16_with_float32_weights():
    """``dtype="bfloat16"``: the forward pass under CPU autocast (the LM head's output is bf16), the weights and
    the loss float32, as in the training loop; ``"auto"`` on a CPU is float32; a bad name is refused."""
    seen = []
    runner = measure.make_runner("tiny", measure.Variant("s2hc", 2), batch_size=1, seq_len=8, compile=False,
                                 overrides={"n_layers": 1}, dtype="bfloat16")  # fmt: skip
    runner.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    runner.step()
    assert seen == [torch.bfloat16] and runner.amp_dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
    assert measure.precision_name("auto", "cpu") == "float32"
    assert measure.precision_name("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'float32', 'bfloat16'\], got 'bf16'"):
        measure.precision_name("bf16", "cpu")


def test_cli_json_keeps_progress_on_stderr_and_writes_events(tmp_path, capsys):
    """With ``--json`` the progress still goes to stderr (stdout holds only the JSON object), and ``--jsonl``
    receives every event in order, the rows' precision among them."""
    events_file = tmp_path / "events.jsonl"
    argv = [*CLI_TINY, "--families", "s2hc", "--streams", "2", "--device", "cpu", "--no-peer", "--no-memory",
            "--dtype", "bfloat16", "--json", "--jsonl", str(events_file)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # nothing but the JSON object
    assert out["dtype"] == "bfloat16" and {row["dtype"] for row in out["steps"] + out["coefficients"]} == {"bfloat16"}
    assert "building s2hc (n=2, cpu, bfloat16)" in captured.err and "repetition 1/1:" in captured.err
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[:5] == ["start", "built", "built", "repetition", "row"] and kinds[-1] == "done"
    assert "coefficient" in kinds and kinds.count("row") == 2
    assert events[0]["dtype"] == "bfloat16" and events[0]["variants"] == ["s2hc"]
    assert set(events[3]["step_s"]) == {"residual", "s2hc"} and events[1]["seconds"] > 0
    assert [e["label"] for e in events if e["event"] == "row"] == [r["label"] for r in out["steps"]]
    assert main([*CLI_TINY, "--dtype", "bf16"]) == 2
    assert "argument --dtype: invalid choice: 'bf16'" in capsys.readouterr().err


def test_a_bench_cut_short_leaves_its_finished_repetitions(tmp_path, monkeypatch, capsys):
    """A bench stopped after its timed repetitions (here: the memory step fails) has already written the settings,
    the models built and each repetition's times to ``--jsonl``, and printed them to stderr."""
    def cut(*args, **kwargs):
        raise KeyboardInterrupt  # what a time limit's signal does to the process

    monkeypatch.setattr(measure, "peak_step_bytes", cut)
    events_file = tmp_path / "events.jsonl"
    argv = [*CLI_TINY, "--families", "mhc", "--streams", "2", "--device", "cpu", "--no-peer", "--repeats", "2",
            "--json", "--jsonl", str(events_file)]  # fmt: skip
    assert main(argv) == 130  # the CLI's answer to an interrupt
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "built", "built", "repetition", "repetition"]
    assert [e["repetition"] for e in events[3:]] == [1, 2] and set(events[4]["step_s"]) == {"residual", "mhc"}
    captured = capsys.readouterr()
    assert captured.out == "" and "repetition 2/2:" in captured.err and "interrupted" in captured.err


def test_the_memory_measure_leaves_no_profiler_lines_and_keeps_the_rest():
    """kineto writes ``USDT:... profiler_start`` / ``profiler_stop`` to the process's stderr at every profile; the
    bench's stderr keeps everything but those lines."""
    import subprocess
    import sys

    code = ("import os, torch\n"
            "from s2hc.bench.measure import peak_step_bytes\n"
            "def step():\n"
            "    os.write(2, b'a line of the step itself\\n')\n"
            "    return torch.ones(1000) * 2\n"
            "print(peak_step_bytes(step) > 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "a line of the step itself" in done.stderr
    assert "profiler_start" not in done.stderr and "ActivityProfiler" not in done.stderr
