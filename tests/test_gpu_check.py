"""The GPU check's own logic, on the CPU with made-up files (``benchmarks/gpu_check.sh``, ``benchmarks/gpu_check.py``,
``benchmarks/connection_time.py``): the summary of every kind of step, the archive and the rule that at most 8 files
come back, the verdict (a step cut for time is no failure, a test that failed inside one is), the plan (the
connection timing at B·T = 16 384, C = 4 096, n = 4 first; the core steps' limits adding up to the budget) and the
connection timing's records at a tiny size. The dry run itself (``benchmarks/gpu_check.sh --dry-run OUT``, a few
minutes) is not part of the suite: benchmarks/README.md says how to run it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _gpu_check(command: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), command, str(out)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _events(*events) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def _plan(*flags: str) -> tuple[dict, list[dict]]:
    """``gpu_check.sh --plan``: its settings line and its steps, in order."""
    result = subprocess.run(["bash", str(SCRIPT), "--plan", *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    return records[0], records[1:]


# ---------------------------------------------------------------------------------------------- the plan


def test_plan_times_the_connection_first_and_its_limits_add_up_to_the_budget():
    """On a GPU the first measuring step is the connection timing at B·T = 16 384, C = 4 096, n = 4; then the
    compiled training steps at 16 k tokens and more (all 12 layers of gpt2-small, Qwen3-0.6B), the tests, torchtitan:
    the core steps, whose limits and the reserve make the budget, at most 8 minutes; the extra steps after them."""
    settings, steps = _plan()
    assert settings["mode"] == "gpu" and settings["budget_s"] <= 8 * 60
    core = [s for s in steps if s["tier"] == "core"]
    assert sum(s["limit_s"] for s in core) == settings["core_s"]
    assert settings["core_s"] + settings["reserve_s"] == settings["budget_s"]
    assert [s["tier"] for s in steps] == ["core"] * len(core) + ["extra"] * (len(steps) - len(core))
    assert len({s["name"] for s in steps}) == len(steps)
    measuring = [s for s in core if s["step_kind"] != "setup"]
    assert [s["name"] for s in measuring] == ["connection", "bench-gpt2-small-n4-compiled",
                                              "bench-qwen3-0.6b-n4-compiled", "tests", "torchtitan"]  # fmt: skip
    connection = shlex.split(measuring[0]["args"])
    for flag, value in (("--tokens", "16384"), ("--dim", "4096"), ("--streams", "4")):
        assert connection[connection.index(flag) + 1] == value
    assert "benchmarks/connection_time.py" in measuring[0]["command"]
    for bench in measuring[1:3]:
        args = shlex.split(bench["args"])
        assert "--compile" in args and "--layers" not in args  # every layer, compiled per block
        tokens = int(args[args.index("--batch-size") + 1]) * int(args[args.index("--seq-len") + 1])
        assert tokens >= 16 * 1024
    assert "benchmarks/torchtitan_check.py" in measuring[-1]["command"]


def test_dry_run_plan_tries_every_step_on_the_cpu():
    """The dry run has the GPU plan's steps in the same order, the connection timing first among those that measure,
    shrunk; its budget holds every step's limit, so that each one is tried to its end."""
    settings, steps = _plan("--dry-run")
    _, gpu_steps = _plan()
    assert [s["name"] for s in steps] == [s["name"] for s in gpu_steps]
    assert settings["budget_s"] == settings["core_s"] + settings["extra_s"] + settings["reserve_s"]
    connection = next(s for s in steps if s["step_kind"] != "setup")
    assert connection["name"] == "connection" and "--tokens 32" in connection["args"]


# ------------------------------------------------------------------------------------- the verdict


def _step(name, kind, status, rc, tier="core", args="", note=""):
    return dict(mode="gpu", name=name, kind=kind, tier=tier, status=status, rc=rc, seconds=5, limit_s=60, args=args,
                note=note)  # fmt: skip


def _connection_events(ok: bool = True) -> str:
    env = {"kind": "environment", "device": "cuda", "meaningful": True, "gpu": "NVIDIA H200", "tokens": 16384,
           "dim": 4096, "streams": 4}  # fmt: skip
    floors = [{"kind": "floor", "family": family, "dtype": "bfloat16", "n": n, "K": k, "vectors_one_pass": one,
               "vectors_two_pass": two, "one_pass_bytes": one * 2**27, "two_pass_bytes": two * 2**27,
               "two_pass_ms": two * 0.03, "one_pass_ms": one * 0.03, "model_bytes": None, "model_ms": None}
              for family, n, k, one, two in (("s2hc", 4, 17, 23, 37), ("residual", 1, None, 6, 6))]  # fmt: skip
    case = dict(kind="case", dtype="bfloat16", path="torch", meaningful=True, ok=True, problems=[], fwd_ms=0.5,
                first_call_s=0.2)  # fmt: skip
    cases = [dict(case, family="s2hc", ms=2.22, bwd_ms=1.72, x_floor=2.0),
             dict(case, family="residual", ms=0.37, bwd_ms=0.2, x_floor=2.05),
             dict(case, family="s2hc", path="triton", ms=1.11, bwd_ms=0.61, x_floor=1.0, worst_error=1e-3, ok=ok,
                  problems=[] if ok else ["differs from the eager path by 1.0e-01 > 0.05"]),
             dict(case, family="residual", path="triton", skipped="the residual add has no kernels")]  # fmt: skip
    return _events(env, {"kind": "copy", "gbs": 4300.0, "ms": 0.5, "bytes": 2 << 30}, *floors, *cases)


def _run_dir(tmp_path: Path, steps: list[dict], files: dict[str, str]) -> Path:
    """An OUT_DIR as the script leaves it: ``steps.jsonl``, each step's files archived into ``raw.tar``."""
    out = tmp_path / "out"
    (out / "current").mkdir(parents=True)
    (out / "console.log").write_text("GPU check (gpu) ...\n")
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    for name, text in files.items():
        (out / "current" / name).write_text(text)
    assert _gpu_check("archive", out).returncode == 0
    return out


def test_a_step_cut_for_time_is_not_a_failure_but_a_test_that_failed_before_the_cut_is(tmp_path):
    """The verdict: steps ok, cut at their time limit (also under the older name ``timeout``) or skipped with their
    reason pass, exit 0, whatever was cut; a step that failed, a failed test in the log of a test step cut for time,
    a connection case that does not match eager fail, exit 1. At most 8 files, the summary rebuilt each time."""
    steps = [
        _step("env", "setup", "ok", 0),
        _step("connection", "connection", "ok", 0, args="--tokens 16384 --dim 4096 --streams 4"),
        _step("bench-gpt2-small-n4-compiled", "bench", "cut", 124, args="--preset gpt2-small --compile",
              note="cut for time at its 95s limit"),
        _step("tests", "tests", "cut", 124),
        _step("torchtitan", "tool", "timeout", 124),  # the older name of a cut
        _step("kernels", "kernels", "skipped", None, tier="extra", note="budget spent"),
    ]  # fmt: skip
    passed_log = ("tests/test_cuda.py::test_a[s2hc-float32] PASSED [ 10%]\n"
                  "[gw1] [ 20%] PASSED tests/test_cuda.py::test_b\n")
    files = {"connection.jsonl": _connection_events(), "connection.log": "ok\n", "tests.log": passed_log,
             "torchtitan.log": "step: 3 loss: 8.1\n", "bench-gpt2-small-n4-compiled.log": "building\n",
             "bench-gpt2-small-n4-compiled.json": ""}  # fmt: skip
    out = _run_dir(tmp_path, steps, files)
    result = _gpu_check("verdict", out)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"]["passed"] and summary["step_counts"] == {"ok": 2, "failed": 0, "cut": 3, "skipped": 1}
    assert "cut for time" in result.stdout and summary["returned"]["count"] <= 8
    markdown = (out / "summary.md").read_text()
    assert "**Verdict: passed" in markdown
    (connection,) = summary["connections"]
    s2hc = next(c for c in connection["cases"] if c["family"] == "s2hc" and c["path"] == "torch")
    assert connection["copy_gbs"] == 4300.0 and s2hc["vs_residual"] == pytest.approx(6.0)
    assert "| s2hc | bfloat16 | torch | 2.220 ms | 0.500 | 1.720 | 2.00x | 6.00x | 0.2 s | - |" in markdown
    assert "| residual | bfloat16 | triton | skipped: the residual add has no kernels |" in markdown

    # a test that failed before the cut fails the check, as does a connection case that does not match eager
    failed_log = passed_log + "[gw0] [ 30%] FAILED tests/test_cuda.py::test_c \n"
    (out / "current" / "tests.log").write_text(failed_log)
    result = _gpu_check("verdict", out)
    assert result.returncode == 1 and "1 tests failed in `tests` (cut)" in result.stdout
    (out / "current" / "tests.log").write_text(passed_log)
    (out / "current" / "connection.jsonl").write_text(_connection_events(ok=False))
    result = _gpu_check("verdict", out)
    assert result.returncode == 1 and "1 connection cases failed in `connection`" in result.stdout
    assert "**no**" in (out / "summary.md").read_text()

    # a step that failed fails it
    (out / "current" / "connection.jsonl").write_text(_connection_events())
    with (out / "steps.jsonl").open("a") as stream:
        stream.write(json.dumps(_step("aot", "tool", "failed", 1, tier="extra")) + "\n")
    result = _gpu_check("verdict", out)
    assert result.returncode == 1 and "step `aot` failed (exit 1)" in result.stdout
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in for the device's python3: the check's own summaries run for real, the timing step never ends, the tests
# fail, everything else (pip, the environment's probes) succeeds at once
case "$*" in
    *benchmarks/gpu_check.py*) exec {real} "$@" ;;
    *connection_time.py*) exec sleep 600 ;;
    *"-m pytest"*) echo "FAILED tests/test_cuda.py::test_x"; exit 1 ;;
    *) exit 0 ;;
esac
"""


def _run_script(tmp_path: Path, only: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``gpu_check.sh OUT`` (the GPU plan) with :data:`FAKE_PYTHON`, only the step ``only`` run, in a budget that
    leaves it about 6 s (17 s less the reserve of 10 and the second the setup steps take)."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.format(real=shlex.quote(sys.executable)))
    fake.chmod(0o755)
    out = tmp_path / f"out-{only}"
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_ONLY": only, "GPU_CHECK_BUDGET": "17",
           "GPU_CHECK_MIN_STEP": "1"}  # fmt: skip
    result = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120, env=env)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8
    return result, steps


def test_the_script_records_a_step_cut_for_time_as_cut_and_exits_0_and_1_only_for_a_failure(tmp_path):
    """The script itself: a step stopped at its time limit is recorded ``cut`` (rc 124) and the check exits 0; a
    step whose command fails is ``failed`` and the check exits 1. The steps not asked for are skipped, with that
    reason; peer and env always run."""
    result, steps = _run_script(tmp_path, "connection")
    by_name = {s["name"]: s for s in steps}
    assert result.returncode == 0, result.stdout[-3000:]
    assert by_name["connection"]["status"] == "cut" and by_name["connection"]["rc"] == 124
    assert "cut for time" in by_name["connection"]["note"]
    assert by_name["peer"]["status"] == by_name["env"]["status"] == "ok"
    assert {s["status"] for s in steps if s["name"] not in ("peer", "env", "connection")} == {"skipped"}
    assert len(steps) == len(_plan()[1])

    result, steps = _run_script(tmp_path, "tests")
    assert result.returncode == 1 and {s["name"]: s["status"] for s in steps}["tests"] == "failed"
    assert "a step failed" in result.stdout


def test_connection_timing_writes_its_records_on_the_cpu(tmp_path):
    """``connection_time.py`` at a tiny size on the CPU (the dry run's path): the copy, a floor per family and dtype
    from kernel_bytes (37 vectors of C at n = 4, the residual add 6), a case per path, each compared with eager."""
    jsonl = tmp_path / "connection.jsonl"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "connection_time.py"), "--tokens", "8", "--dim", "16",
         "--families", "s2hc,residual", "--dtypes", "float32", "--paths", "torch,compiled", "--repeats", "1",
         "--warmup", "0", "--compile-backend", "aot_eager", "--jsonl", str(jsonl)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[:2] == ["environment", "copy"] and kinds[-1] == "done"
    floors = {r["family"]: r for r in records if r["kind"] == "floor"}
    assert floors["s2hc"]["vectors_two_pass"] == 37 and floors["residual"]["vectors_two_pass"] == 6
    assert floors["s2hc"]["two_pass_bytes"] == 37 * 8 * 16 * 4
    cases = {(r["family"], r["path"]): r for r in records if r["kind"] == "case"}
    assert set(cases) == {("s2hc", "torch"), ("residual", "torch"), ("s2hc", "compiled"), ("residual", "compiled")}
    assert all(c["ok"] and c["ms"] > 0 and not c["meaningful"] for c in cases.values())
    assert cases[("s2hc", "compiled")]["worst_error"] < 1e-5


# ------------------------------------------------------------------------------- the summary of each kind


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
    assert summary["step_counts"] == {"ok": 3, "failed": 1, "cut": 1, "skipped": 1}  # the older "timeout" is a cut
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
    assert "+10.0 %" in markdown and "6.7 %" in markdown and "| qwen3-n4-eager | bench | - | cut |" in markdown

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


def test_gpu_check_returns_at_most_8_files_and_summarises_a_run_cut_short(tmp_path):
    """The script's protocol on synthetic steps: each step writes its files into ``current/``, adds its line to
    ``steps.jsonl``, then ``finish-step`` appends them to ``raw.tar`` and rebuilds the summary. After every step
    the folder holds at most the 8 files the device returns, ``raw.tar`` every finished step's files; a kernel
    case that failed is named; a bench cut by its time limit before its rows is summarised from the repetitions
    it finished; a run killed during a step still shows that step from its events in ``current/``."""
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
        "cut", 124, "--preset gpt2-small --dtype bfloat16 --streams 4 --compile --layers 2")  # fmt: skip

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
    assert summary["step_counts"]["cut"] == 2 and "Cut during a step" in (out / "summary.md").read_text()

    # the rules of what comes back are checked: a 9th file, a name with a space
    (current / "extra one.txt").write_text("x")
    (out / "stray.txt").write_text("x")
    assert _gpu_check("summarize", out).returncode == 0
    problems = json.loads((out / "summary.json").read_text())["returned"]["problems"]
    assert problems[0] == "9 files, more than 8" and any("extra one.txt" in p for p in problems)
