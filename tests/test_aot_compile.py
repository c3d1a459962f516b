"""The Triton kernels compiled ahead of time for Hopper with no GPU (``benchmarks/aot_compile.py``).

The tool's CI subset runs in a subprocess with ``TRITON_INTERPRET`` unset (the root conftest sets it for this
process, and triton reads it at import): sm_90, streams in bf16 / fp32 / fp64, n = 2, 4, 6, 8, 11, 16, 24, 32, 38,
48 (``CI_STREAMS``: every distinct build of the full grid n = 2..64 on one target, which ``--coverage`` checks by
driving the wrappers over the full grid without compiling), K from every family's projection, 8 192 tokens,
C = 768, in a fresh triton cache, two processes. It fails on a compile error, on spills above
``spill_bound``, on shared memory over 227 KiB, on a tensor-core instruction in these exact kernels, and on a
block configuration of the full grid it did not compile. The full grid (sm_90 and sm_100, every n) is
``python benchmarks/aot_compile.py``. Skips only without triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "aot_compile.py"

pytestmark = pytest.mark.aot


def load_tool():
    spec = importlib.util.spec_from_file_location("aot_compile", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("aot_compile", module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["aot_compile"])  # the standard library only at import
    return sys.modules["aot_compile"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 's2hc[triton]'); the AOT compile needs its ptxas")
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, str(TOOL), "--subset", "ci", "--arch", "90", "--jobs", "2", "--coverage",
               "--json", str(out / "aot.json"), "--cache-dir", str(out / "triton-cache")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    if done.returncode == 3:
        pytest.skip(f"triton is not importable in the subprocess: {done.stderr.strip()[-300:]}")
    path = out / "aot.json"
    assert path.exists(), f"aot_compile.py exited {done.returncode} without a report:\n{done.stdout[-3000:]}\n" \
                          f"{done.stderr[-3000:]}"
    return done, json.loads(path.read_text())


def test_every_kernel_compiles_for_sm90_within_its_bounds(report):
    done, result = report
    assert result["passed"] and done.returncode == 0, "\n".join(result["failures"]) or done.stdout[-3000:]
    assert set(result["kernels"]) == {b["kernel"] for b in result["builds"]}  # every @triton.jit kernel was built
    assert result["full_grid_block_configs"] and set(result["full_grid_block_configs"]) <= set(result["block_configs"])
    for build in result["builds"]:
        assert build["regs"] and build["regs"] <= 255 and build["spill_stores"] is not None  # the ptxas log was read
        assert build["sass_lines"] > 0  # the SASS was scanned, not only the PTX


def test_fp64_builds_use_fp64_tensor_cores_only(report):
    """The float64 tl.dot forms compile to DMMA (exact); no float32 or bf16 build has any tensor-core instruction."""
    _, result = report
    for build in result["builds"]:
        if build["dtype"] == "fp64":
            assert all(op.startswith("DMMA") or ".f64" in op for op in build["tensor_core"]), build
        else:
            assert build["tensor_core"] == [], build


# --------------------------------------------------------------- the tool's judgement, on made-up builds


def made_up_build(tool, **fields):
    build = tool.Build(arch=90, kernel="_read_mix_fwd", constexprs=dict(ACC="fp32", BLOCK_N=16, BLOCK_C=16),
                       signature="float32", configs=[[12, "-", 768, "fp32"]], regs=64, spill_stores=0, stack=0)
    for key, value in fields.items():
        setattr(build, key, value)
    return build


def test_tensor_core_instructions_are_found_and_judged():
    tool = load_tool()
    sass = "HMMA.1688.F32.TF32 R4, R8, R12, R4 ;\n FFMA R1, R2, R3, R1 ;\n DMMA.8x8x4 R0, R2, R4, R0 ;"
    ptx = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}, ...;\n fma.rn.f32 %f1, %f2, %f3, %f1;"
    found = {m.group(0) for m in tool.SASS_MMA.finditer(sass)} | {m.group(0) for m in tool.PTX_MMA.finditer(ptx)}
    found = sorted(found)
    assert found == ["DMMA.8x8x4", "HMMA.1688.F32.TF32", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"]
    assert "tensor-core" in made_up_build(tool, tensor_core=["HMMA.1688.F32.TF32"]).judge()[0]
    assert made_up_build(tool, tensor_core=[]).judge() == []
    fp64 = dict(constexprs=dict(ACC="fp64", BLOCK_N=16, BLOCK_C=16), configs=[[12, "-", 768, "fp64"]])
    assert made_up_build(tool, tensor_core=["DMMA.8x8x4", "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64"],
                         **fp64).judge() == []
    assert made_up_build(tool, tensor_core=["HMMA.1688.F32.TF32"], **fp64).judge()


def test_spills_and_shared_memory_are_judged():
    tool = load_tool()
    bound = tool.spill_bound(12, "fp32")
    assert made_up_build(tool, spill_stores=bound).judge() == []
    assert made_up_build(tool, spill_stores=bound + 4).judge() == [
        f"spills {bound + 4} B per thread over the bound {bound} B (fp32)"]
    assert made_up_build(tool, spill_stores=None, stack=bound + 8).judge()  # no ptxas log: the stack frame counts
    assert "shared memory" in made_up_build(tool, smem_dynamic=228 * 1024).judge()[0]
    assert made_up_build(tool, smem_dynamic=200 * 1024, smem_static=1024).judge() == []
