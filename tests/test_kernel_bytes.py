"""The byte model of the Triton fast path (``benchmarks/kernel_bytes.py``) equals what the kernels load and store,
counted under Triton's CPU interpreter: for one connection call (projection, read, write, their backward joined by a
Link), per kernel and argument, the distinct bytes touched and the bytes the loads and stores issue. And the model's
totals at n = 4: the layout replaced (65 vectors of C per token), today's (46 = 10n + 6) and the floor (37)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("kernel_bytes", ROOT / "benchmarks" / "kernel_bytes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_bytes", module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["kernel_bytes"])
    return sys.modules["kernel_bytes"]


tool = load_tool()


def interpreted() -> bool:
    from s2hc.connection import kernels

    return kernels.interpreted()


# n, C, tokens, stream dtype, family: token blocks and dW's token ranges (19, 33, 40 tokens), C over several blocks
# of the streams' backward (40 and 70 at n = 4: 32 columns; 100 at n = 2: 64), K across one projection column block
# and two (n = 8: 65), dW fused up to K = 128 and a GEMM beyond (n = 16: 257), every stream dtype
CASES = [
    (4, 40, 19, "float32", "s2hc"),
    (4, 70, 33, "bfloat16", "mhc"),
    (3, 24, 5, "bfloat16", "mhc-lite"),
    (2, 100, 40, "float64", "mhc"),
    (8, 12, 17, "float32", "s2hc"),
    (16, 4, 5, "bfloat16", "s2hc"),
]


@pytest.mark.skipif(not interpreted(), reason="counting loads and stores needs TRITON_INTERPRET=1 (no GPU here)")
@pytest.mark.parametrize("n,c,tokens,stream,family", CASES)
def test_model_equals_the_interpreters_count(n, c, tokens, stream, family):
    from s2hc.connection import projection_width

    k = projection_width(family, n)
    launches = tool.run_counted(n, c, k, tokens, stream)
    assert [launch.kernel for launch in launches] == [
        "_norm_project_fwd", "_read_fwd", "_write_fwd", "_write_bwd", "_read_bwd", "_streams_bwd"]
    assert tool.compare(tool.model(n, c, k, tokens, stream), launches) == []
    assert all(launch.issued for launch in launches)  # the count saw every kernel's loads and stores


def test_vectors_of_c_per_token_at_n_4():
    """C = 4 096, 16 384 tokens, s2hc's K = 17: the layout replaced moved 65 vectors of C per token in float32 (81 in
    bf16: dW's GEMM ran on a float32 copy of X), today's 46 = 10n + 6 in either, against a two-pass floor of 37."""
    n, c, k, tokens = 4, 4096, 17, 16384
    assert tool.floor(n) == {"one_pass": 23, "two_pass": 37}
    totals = {(layout, stream): tool.vectors_of_c(tool.model(n, c, k, tokens, stream, layout), c, tokens, stream)
              for layout in tool.LAYOUTS for stream in ("float32", "bfloat16")}
    assert totals == {("before", "float32"): 65, ("before", "bfloat16"): 81,
                      ("after", "float32"): 10 * n + 6, ("after", "bfloat16"): 10 * n + 6}
    after = tool.model(n, c, k, tokens, "float32")
    forward = tool.vectors_of_c(after, c, tokens, "float32", "forward")
    assert (forward, totals[("after", "float32")] - forward) == (4 * n + 2, 6 * n + 4)
    # the coefficients and W add under 0.2 % at this shape
    wide = totals[("after", "float32")] * tokens * c * 4
    assert wide < tool.total_bytes(after) < 1.002 * wide


def test_model_refuses_unknown_layouts_and_dtypes():
    with pytest.raises(ValueError, match=r"layout must be one of \['before', 'after'\], got 'fused'"):
        tool.model(4, 8, 17, 4, layout="fused")
    with pytest.raises(ValueError, match=r"stream must be one of .*, got 'int8'"):
        tool.model(4, 8, 17, 4, stream="int8")
