"""Bytes the Triton fast path (``HyperConnection(kernels="triton")``, :mod:`s2hc.connection.kernels`) moves per
token, kernel by kernel, against the memory-traffic floor; and a counter that checks the model against what the
kernels load and store under Triton's CPU interpreter.

    python benchmarks/kernel_bytes.py [--streams 4] [--dim 4096] [--tokens 16384] [--family s2hc]
                                      [--dtypes float32,bfloat16] [--bandwidth 4.8e12] [--check]

**The model** (:func:`model`): for one connection, forward and backward, each access of each kernel to each of its
tensors: ``unique`` bytes (the distinct elements touched: what DRAM must move at least) and ``issued`` bytes (what
its loads and stores ask for, re-reads included). Per launch, for ``T`` tokens, ``n`` streams of width ``C``, a
projection of width ``K``, streams in ``stream`` dtype, coefficients in float32 (float64 with float64 streams).
Accesses are of three kinds: ``wide`` (per token a multiple of C: the streams X, X', h, F and their gradients),
``small`` (per token a few floats: the coefficients d, H_pre, H_post, H_res, 1/rms and theirs) and ``call`` (once
per call: the folded projection W (nC, K), dW). Besides the Triton kernels the model lists the PyTorch operations
of the autograd functions that move wide tensors (a GEMM, a cast, autograd's sum of two gradients); PyTorch's
per-token coefficient operations (the gates, the constraint map, K-wide products: tens of floats per token each)
and the per-call fold of the norm's weight into W are left out. :func:`vectors_of_c` sums the wide accesses in
units of one vector of C in the stream dtype per token (:func:`dram_bytes`: a wide tensor's re-reads count, a small
one is read once).

Two layouts: ``"after"`` is today's kernels; ``"before"`` the kernels up to commit cd35c27 (read + mix writing
``M = H_res X``, a write reading M back, the dX of the read/mix and of the projection written separately and
summed by autograd, dW a GEMM over X), checked against the interpreter's count before they were replaced.

**The floor** (:func:`floor`), in vectors of C per token and connection (docs/design.md's "memory-traffic floor"):

- one pass each way, ``5n + 3``: forward reads X (n) and F (1), writes h (1) and X' (n); backward reads dX' (n)
  and X (n), writes dX (n) and dF (1), reads dh (1): every wide input read once and every output written once.
- two passes, ``8n + 5``: X does not stay in cache across the branch (or its backward). Forward: X read for the
  coefficients and h, written h (n + 1); after the branch X read again with F, X' written (2n + 1). Backward,
  before the branch's backward: dX', X and F read for dF, dH_post, dH_res, dF written (2n + 2); after it: dX', dh
  and X read again, dX written, with dH_pre, the coefficients' backward and dW in the same pass (3n + 1).
  37 at n = 4 (docs/design.md rounds to about 38).

**The count** (:func:`count`): a context manager that wraps the interpreter's masked load and store (every
``tl.load`` and ``tl.store`` goes through them) and its grid launch, attributing each active lane's address to
the kernel argument whose memory holds it; per launch and argument the issued bytes and the distinct addresses.
``--check`` (and ``tests/test_kernel_bytes.py``) runs a connection's kernels at small shapes and compares: the
unique bytes of every access, and the issued bytes of every wide one, equal the model's.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("before", "after")
H200_BANDWIDTH = 4.8e12  # bytes per second, HBM3e (the datasheet's figure)
H200_FP32 = 67e12  # FLOP per second, float32 on the CUDA cores (no tensor cores: the kernels' products are IEEE)


@dataclass(frozen=True)
class Access:
    """One kernel's reads (or writes) of one tensor, in one launch."""

    kernel: str  # a Triton kernel's name, or "torch: ..." for a PyTorch operation (not counted)
    tensor: str  # the kernel's argument name
    direction: str  # "read" or "write"
    unique: int  # bytes of the distinct elements touched
    issued: int  # bytes the loads or stores ask for (re-reads included)
    kind: str  # "wide", "small" or "call"
    phase: str  # "forward" or "backward"

    @property
    def counted(self) -> bool:
        """Whether the interpreter's count sees it (a Triton kernel, not a PyTorch operation)."""
        return not self.kernel.startswith("torch:")


def _pow2(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, value))))


def coefficient_dtype(stream: str) -> str:
    """The coefficient dtype the connection passes with ``stream`` streams (s2hc.mixers.base.coefficient_dtype)."""
    return "float64" if stream == "float64" else "float32"


def model(n: int, c: int, k: int, tokens: int, stream: str = "float32", layout: str = "after") -> list[Access]:
    """Every access of one connection's forward and backward on ``tokens`` tokens (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if stream not in SIZES:
        raise ValueError(f"stream must be one of {list(SIZES)}, got {stream!r}")
    return (_before if layout == "before" else _after)(n, c, k, tokens, stream)


class _Builder:
    def __init__(self, tokens: int, stream: str):
        self.t, self.s, self.q = tokens, SIZES[stream], SIZES[coefficient_dtype(stream)]
        self.accesses: list[Access] = []
        self.phase = "forward"

    def add(self, kernel, tensor, direction, elements, size, kind, issued_elements=None):
        issued = elements if issued_elements is None else issued_elements
        self.accesses.append(Access(kernel, tensor, direction, elements * size, issued * size, kind, self.phase))

    def wide(self, kernel, tensor, direction, per_token, size=None, issued_per_token=None):
        issued = None if issued_per_token is None else self.t * issued_per_token
        self.add(kernel, tensor, direction, self.t * per_token, size or self.s, "wide", issued)

    def small(self, kernel, tensor, direction, per_token, issued=None):
        self.add(kernel, tensor, direction, self.t * per_token, self.q, "small", issued)

    def call(self, kernel, tensor, direction, elements, issued=None):
        self.add(kernel, tensor, direction, elements, self.q, "call", issued)


def _before(n: int, c: int, k: int, tokens: int, stream: str) -> list[Access]:
    """The kernels up to commit cd35c27 (their block sizes: 16 tokens x 64 features, 16-64 columns)."""
    b, d = _Builder(tokens, stream), n * c
    token_blocks, col_blocks = math.ceil(tokens / 16), math.ceil(k / min(max(16, _pow2(k)), 64))
    # forward
    b.wide("_norm_project_fwd", "x_ptr", "read", d, issued_per_token=d * col_blocks)  # once per column block
    b.call("_norm_project_fwd", "w_ptr", "read", d * k, issued=token_blocks * d * k)
    for name in ("d_ptr", "raw_ptr"):
        b.small("_norm_project_fwd", name, "write", k)
    b.small("_norm_project_fwd", "inv_ptr", "write", 1)
    b.wide("_read_mix_fwd", "x_ptr", "read", d)
    b.small("_read_mix_fwd", "pre_ptr", "read", n)
    b.small("_read_mix_fwd", "res_ptr", "read", n * n)
    b.wide("_read_mix_fwd", "h_ptr", "write", c)
    b.wide("_read_mix_fwd", "mixed_ptr", "write", d)
    b.wide("_write_fwd", "mixed_ptr", "read", d)
    b.small("_write_fwd", "post_ptr", "read", n)
    b.wide("_write_fwd", "f_ptr", "read", c)
    b.wide("_write_fwd", "out_ptr", "write", d)
    # backward, in autograd's order: the write, (the branch), the read and mix, the projection
    b.phase = "backward"
    b.wide("_write_bwd", "grad_out_ptr", "read", d)
    b.small("_write_bwd", "post_ptr", "read", n)
    b.wide("_write_bwd", "f_ptr", "read", c)
    b.wide("_write_bwd", "grad_f_ptr", "write", c)
    b.small("_write_bwd", "grad_post_ptr", "write", n)
    b.wide("_read_mix_bwd", "x_ptr", "read", d)
    b.small("_read_mix_bwd", "pre_ptr", "read", n)
    b.small("_read_mix_bwd", "res_ptr", "read", n * n)
    b.wide("_read_mix_bwd", "grad_h_ptr", "read", c)
    b.wide("_read_mix_bwd", "grad_m_ptr", "read", d)
    b.wide("_read_mix_bwd", "grad_x_ptr", "write", d)
    b.small("_read_mix_bwd", "grad_pre_ptr", "write", n)
    b.small("_read_mix_bwd", "grad_res_ptr", "write", n * n)
    feature_blocks = math.ceil(d / 64)
    b.wide("_norm_project_bwd", "x_ptr", "read", d)
    b.call("_norm_project_bwd", "w_ptr", "read", d * k, issued=token_blocks * d * k)
    b.small("_norm_project_bwd", "grad_raw_ptr", "read", k, issued=tokens * k * feature_blocks)
    b.small("_norm_project_bwd", "coeff_ptr", "read", 1)
    b.wide("_norm_project_bwd", "grad_x_ptr", "write", d)
    if stream != coefficient_dtype(stream):  # x.to(float32) before the GEMM: a float32 copy of X
        b.wide("torch: X cast for dW", "x", "read", d)
        b.wide("torch: X cast for dW", "x (float32)", "write", d, size=b.q)
    b.wide("torch: dW = Xᵀ dd", "x", "read", d, size=b.q)
    b.small("torch: dW = Xᵀ dd", "grad_raw", "read", k)
    b.call("torch: dW = Xᵀ dd", "grad_weight", "write", d * k)
    # autograd adds the projection's dX into the read/mix's, in place: reads both, writes one
    b.wide("torch: autograd sums the two dX", "grad_x (both)", "read", 2 * d)
    b.wide("torch: autograd sums the two dX", "grad_x", "write", d)
    return b.accesses


def streams_grid(n: int, c: int, k: int, tokens: int, fuse_dw: bool = True, wide_acc: bool = False) -> dict[str, int]:
    """The launch of the streams' backward pass (``_streams_bwd``, as ``kernels._streams_backward`` sizes it): its
    C block, its number of C blocks and of token ranges, and whether dW is formed in it."""
    block_n, block_k = max(2, _pow2(n)), max(16, _pow2(k))
    fused_c = max(1, (16 if wide_acc else 32 if block_k > 64 else 64) // block_n)
    fused = fuse_dw and block_k <= 128 and block_n * fused_c * block_k <= 4096
    block_c = fused_c if fused else max(1, (16 if wide_acc else 64) // block_n)
    c_blocks, token_blocks = math.ceil(c / block_c), math.ceil(tokens / 16)
    splits = min(token_blocks, math.ceil(512 / c_blocks)) if fused else token_blocks
    split = math.ceil(token_blocks / splits) * 16
    return {"block_c": block_c, "c_blocks": c_blocks, "splits": math.ceil(tokens / split),
            "token_blocks": token_blocks, "fused": fused}


def _after(n: int, c: int, k: int, tokens: int, stream: str) -> list[Access]:
    """Today's kernels, one connection call with its :class:`~s2hc.connection.kernels.Link`: every n-wide input is
    read once per kernel and every output written once; W and the coefficients are re-read from cache."""
    b, d = _Builder(tokens, stream), n * c
    token_blocks, col_blocks = math.ceil(tokens / 16), 1 if k <= 128 else math.ceil(k / 64)
    # forward: the projection, the read (h only), the write (mixes, reading X again)
    b.wide("_norm_project_fwd", "x_ptr", "read", d, issued_per_token=d * col_blocks)  # once per column block
    b.call("_norm_project_fwd", "w_ptr", "read", d * k, issued=token_blocks * d * k)
    b.small("_norm_project_fwd", "d_ptr", "write", k)
    b.small("_norm_project_fwd", "inv_ptr", "write", 1)
    b.wide("_read_fwd", "x_ptr", "read", d)
    b.small("_read_fwd", "pre_ptr", "read", n)
    b.wide("_read_fwd", "h_ptr", "write", c)
    b.wide("_write_fwd", "x_ptr", "read", d)
    b.small("_write_fwd", "res_ptr", "read", n * n)
    b.small("_write_fwd", "post_ptr", "read", n)
    b.wide("_write_fwd", "f_ptr", "read", c)
    b.wide("_write_fwd", "out_ptr", "write", d)
    # backward: the write's (dF, dH_post, dH_res), (the branch's), the read's (dH_pre), (the constraint map's),
    # the projection's: the one dX, with dW from the same read of X
    b.phase = "backward"
    b.wide("_write_bwd", "grad_out_ptr", "read", d)
    b.wide("_write_bwd", "x_ptr", "read", d)
    b.small("_write_bwd", "post_ptr", "read", n)
    b.wide("_write_bwd", "f_ptr", "read", c)
    b.wide("_write_bwd", "grad_f_ptr", "write", c)
    b.small("_write_bwd", "grad_post_ptr", "write", n)
    b.small("_write_bwd", "grad_res_ptr", "write", n * n)
    b.wide("_read_bwd", "x_ptr", "read", d)
    b.wide("_read_bwd", "grad_h_ptr", "read", c)
    b.small("_read_bwd", "grad_pre_ptr", "write", n)
    grid = streams_grid(n, c, k, tokens, wide_acc=stream == "float64")
    blocks = grid["c_blocks"]  # each C block reads its tokens' coefficients
    b.wide("_streams_bwd", "x_ptr", "read", d)
    b.wide("_streams_bwd", "grad_out_ptr", "read", d)
    b.small("_streams_bwd", "res_ptr", "read", n * n, issued=tokens * n * n * blocks)
    b.wide("_streams_bwd", "grad_h_ptr", "read", c)
    b.small("_streams_bwd", "pre_ptr", "read", n, issued=tokens * n * blocks)
    b.small("_streams_bwd", "g_ptr", "read", k, issued=tokens * k * blocks)
    b.small("_streams_bwd", "coeff_ptr", "read", 1, issued=tokens * blocks)
    w_tiles = grid["splits"] if grid["fused"] else grid["token_blocks"]  # W once per program, or per token block
    b.call("_streams_bwd", "w_ptr", "read", d * k, issued=w_tiles * d * k)
    b.wide("_streams_bwd", "grad_x_ptr", "write", d)
    if grid["fused"]:
        b.call("_streams_bwd", "grad_w_ptr", "write", grid["splits"] * d * k)
        if grid["splits"] > 1:
            b.call("torch: dW = Σ partial dW", "partial", "read", grid["splits"] * d * k)
            b.call("torch: dW = Σ partial dW", "grad_weight", "write", d * k)
    else:
        if stream != coefficient_dtype(stream):  # x.to(float32) before the GEMM: a float32 copy of X
            b.wide("torch: X cast for dW", "x", "read", d)
            b.wide("torch: X cast for dW", "x (float32)", "write", d, size=b.q)
        b.wide("torch: dW = Xᵀ g", "x", "read", d, size=b.q)
        b.small("torch: dW = Xᵀ g", "g", "read", k)
        b.call("torch: dW = Xᵀ g", "grad_weight", "write", d * k)
    return b.accesses


def dram_bytes(access: Access) -> int:
    """What DRAM moves for ``access``, as the model estimates it: a wide tensor's every issued byte (it does not stay
    in cache: the projection forward's second 64-column block of K reads X again after the first has streamed all
    of it), a small or per-call tensor's distinct bytes once (W and the coefficients are re-read from cache)."""
    return access.issued if access.kind == "wide" else access.unique


def vectors_of_c(accesses: list[Access], c: int, tokens: int, stream: str, phase: str | None = None,
                 kernel: str | None = None) -> float:
    """The wide accesses' bytes (:func:`dram_bytes`) per token in vectors of C in the stream dtype (optionally of
    one ``phase`` or one ``kernel``)."""
    chosen = [a for a in accesses if a.kind == "wide" and phase in (None, a.phase) and kernel in (None, a.kernel)]
    return sum(dram_bytes(a) for a in chosen) / (tokens * c * SIZES[stream])


def total_bytes(accesses: list[Access]) -> int:
    """Every access's :func:`dram_bytes`: the streams, the coefficients and W."""
    return sum(dram_bytes(a) for a in accesses)


def projection_flops(n: int, c: int, k: int) -> int:
    """Floating-point operations per token of the projection, forward and backward: ``X W`` forward, ``r dd Wᵀ`` in
    dX and ``Xᵀ (r dd)`` for dW, ``2·nC·K`` each (the rest of the connection is O(n²C) per token). In IEEE float32
    they run on the CUDA cores, not tensor cores: with the bytes they say whether a connection is bound by memory."""
    return 6 * n * c * k


def floor(n: int) -> dict[str, int]:
    """The memory-traffic floor per token and connection, forward + backward, in vectors of C (module docstring)."""
    return {"one_pass": 5 * n + 3, "two_pass": 8 * n + 5}


def kernels_of(accesses: list[Access]) -> list[str]:
    return list(dict.fromkeys(a.kernel for a in accesses))


# ------------------------------------------------------------------------------------------- the count


@dataclass
class Launch:
    """One kernel launch under the interpreter: per argument, the bytes its loads and stores issued and the
    distinct addresses they touched."""

    kernel: str
    ranges: dict  # argument name -> (first address, end address, element size)
    issued: dict = field(default_factory=dict)  # (argument, "read"/"write") -> bytes
    addresses: dict = field(default_factory=dict)  # (argument, "read"/"write") -> [numpy arrays of addresses]
    stray: int = 0  # active lanes whose address is in no argument

    def unique(self, name: str, direction: str) -> int:
        import numpy as np

        parts = self.addresses.get((name, direction))
        if not parts:
            return 0
        return int(np.unique(np.concatenate(parts)).size) * self.ranges[name][2]


@contextlib.contextmanager
def count():
    """Count the loads and stores of every Triton kernel launched inside (under ``TRITON_INTERPRET=1``): yields
    the list of :class:`Launch` records, filled as the kernels run. CPU tensors only (the interpreter runs them
    in place, so an address names the argument that holds it)."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    if not os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("counting the kernels' loads and stores needs TRITON_INTERPRET=1 before triton is imported")
    launches: list[Launch] = []
    running: list[Launch] = []
    real_call = interpreter.GridExecutor.__call__
    real_load = interpreter.InterpreterBuilder.create_masked_load
    real_store = interpreter.InterpreterBuilder.create_masked_store

    def record(ptrs, mask, direction):
        if not running:
            return
        launch = running[-1]
        addresses = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        active = addresses[np.broadcast_to(mask.data, addresses.shape)].astype(np.uint64)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        found = np.zeros(active.shape, dtype=bool)
        for name, (start, end, _) in launch.ranges.items():
            inside = (active >= start) & (active < end)
            if inside.any():
                found |= inside
                key = (name, direction)
                launch.issued[key] = launch.issued.get(key, 0) + int(inside.sum()) * size
                launch.addresses.setdefault(key, []).append(active[inside])
        launch.stray += int((~found).sum())

    def call(self, *args, **kwargs):
        signature = inspect.signature(self.fn)  # launch options (num_warps) are not the kernel's arguments
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
        bound = bound.arguments
        ranges = {}
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                if value.device.type != "cpu":
                    raise RuntimeError(f"count() needs CPU tensors, got {name} on {value.device}")
                start = value.data_ptr()
                ranges[name] = (start, start + value.numel() * value.element_size(), value.element_size())
        launch = Launch(self.fn.__name__, ranges)
        running.append(launch)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            running.pop()
            launches.append(launch)

    def load(self, ptrs, mask, other, *rest):
        record(ptrs, mask, "read")
        return real_load(self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        record(ptrs, mask, "write")
        return real_store(self, ptrs, value, mask, *rest)

    interpreter.GridExecutor.__call__ = call
    interpreter.InterpreterBuilder.create_masked_load = load
    interpreter.InterpreterBuilder.create_masked_store = store
    try:
        yield launches
    finally:
        interpreter.GridExecutor.__call__ = real_call
        interpreter.InterpreterBuilder.create_masked_load = real_load
        interpreter.InterpreterBuilder.create_masked_store = real_store


def counted_accesses(launches: list[Launch]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """``(kernel, argument, direction) -> (unique bytes, issued bytes)``, summed over the launches of each kernel."""
    result: dict[tuple[str, str, str], tuple[int, int]] = {}
    for launch in launches:
        for (name, direction), issued in launch.issued.items():
            key = (launch.kernel, name, direction)
            unique, before = result.get(key, (0, 0))
            result[key] = (unique + launch.unique(name, direction), before + issued)
    return result


def modelled_accesses(accesses: list[Access]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """:func:`counted_accesses`'s form of the model's Triton accesses."""
    result: dict[tuple[str, str, str], tuple[int, int]] = {}
    for a in accesses:
        if a.counted:
            unique, issued = result.get((a.kernel, a.tensor, a.direction), (0, 0))
            result[(a.kernel, a.tensor, a.direction)] = (unique + a.unique, issued + a.issued)
    return result


def compare(accesses: list[Access], launches: list[Launch], issued: str = "all") -> list[str]:
    """Where the count and the model differ: unique bytes of every access, issued bytes of every one (``issued``
    "all") or of every wide one ("wide"); a launch's active lanes outside its arguments. An empty list when they
    agree."""
    counted, modelled = counted_accesses(launches), modelled_accesses(accesses)
    wide = {(a.kernel, a.tensor, a.direction) for a in accesses if issued == "all" or a.kind == "wide"}
    problems = [f"{launch.kernel}: {launch.stray} lanes outside its arguments" for launch in launches if launch.stray]
    for key in sorted(set(counted) | set(modelled)):
        got, want = counted.get(key, (0, 0)), modelled.get(key, (0, 0))
        if got[0] != want[0]:
            problems.append(f"{'.'.join(key)}: {got[0]} unique bytes counted, {want[0]} modelled")
        if key in wide and got[1] != want[1]:
            problems.append(f"{'.'.join(key)}: {got[1]} issued bytes counted, {want[1]} modelled")
    return problems


# ------------------------------------------------------------------------------------------ the report


def report_lines(n: int, c: int, k: int, tokens: int, stream: str, bandwidth: float) -> list[str]:
    lines = [f"n = {n}, C = {c}, K = {k}, {tokens} tokens, {stream} streams (vectors of C per token)"]
    size = SIZES[stream]
    for layout in LAYOUTS:
        try:
            accesses = model(n, c, k, tokens, stream, layout)
        except NotImplementedError:
            continue
        fwd = vectors_of_c(accesses, c, tokens, stream, "forward")
        bwd = vectors_of_c(accesses, c, tokens, stream, "backward")
        lines.append(f"  {layout:7s} forward {fwd:6.2f}  backward {bwd:6.2f}  total {fwd + bwd:6.2f}  "
                     f"({total_bytes(accesses) / 1e9:.2f} GB with the coefficients and W: "
                     f"{total_bytes(accesses) / bandwidth * 1e3:.2f} ms at {bandwidth / 1e12:.1f} TB/s)")
        for kernel in kernels_of(accesses):
            lines.append(f"      {kernel:34s} {vectors_of_c(accesses, c, tokens, stream, kernel=kernel):6.2f}")
    flops = projection_flops(n, c, k) * tokens
    lines.append(f"  the projection's {flops / 1e9:.0f} GFLOP (forward and backward): {flops / H200_FP32 * 1e3:.2f} ms "
                 f"at {H200_FP32 / 1e12:.0f} TFLOP/s (float32, CUDA cores)")
    for name, vectors in floor(n).items():
        nbytes = vectors * tokens * c * size
        lines.append(f"  floor, {name.replace('_', ' ')}: {vectors} ({nbytes / bandwidth * 1e3:.2f} ms)")
    return lines


def check(n: int, c: int, k: int, tokens: int, stream: str, layout: str = "after") -> list[str]:
    """Run one connection's kernels (forward and backward) under the interpreter and compare the count with the
    model: the problems, none when they agree."""
    launches = run_counted(n, c, k, tokens, stream, layout)
    # the layout that was replaced was checked on its wide accesses' issued bytes only
    return compare(model(n, c, k, tokens, stream, layout), launches, "wide" if layout == "before" else "all")


def run_counted(n: int, c: int, k: int, tokens: int, stream: str, layout: str = "after") -> list[Launch]:
    """The launches of one connection's kernels, forward and backward, with random inputs."""
    import torch

    from s2hc.connection import kernels

    dtype = getattr(torch, stream)
    coeff = getattr(torch, coefficient_dtype(stream))
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dt=coeff):
        return torch.randn(*shape, generator=g).to(dt).requires_grad_()

    x, weight, f = randn(tokens, n, c, dt=dtype), randn(n * c, k), randn(tokens, c, dt=dtype)
    with count() as launches:
        if layout == "before":
            if not hasattr(kernels, "read_mix"):
                raise NotImplementedError("the kernels of the layout 'before' were replaced (commit cd35c27 has them)")
            d = kernels.norm_project(x.flatten(-2), weight, 1e-6)
            pre, post, res = _coefficients(d, n)
            h, mixed = kernels.read_mix(x, pre, res)
            out = kernels.write(mixed, post, h * f)
        else:
            link = kernels.Link()
            d = kernels.norm_project(x.flatten(-2), weight, 1e-6, link)
            pre, post, res = _coefficients(d, n)
            h = kernels.read(x, pre, link)
            out = kernels.write(x, res, post, h * f, link)
        out.backward(torch.randn(out.shape, generator=g).to(dtype))
    return launches


def _coefficients(d, n: int):
    """``(H_pre, H_post, H_res)`` from ``d`` ``(T, K)`` by a small differentiable map (any map does for counting)."""
    import torch

    pre, post = torch.sigmoid(d[:, :n]), 2 * torch.sigmoid(d[:, n:2 * n])
    res = torch.tanh(d[:, :n, None] * d[:, None, n:2 * n]) + torch.eye(n, dtype=d.dtype)
    return pre, post, res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--family", default="s2hc", help="the family whose projection width K is used (s2hc)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes per second (H200: 4.8e12)")
    parser.add_argument("--check", action="store_true",
                        help="also count the kernels' loads and stores under the interpreter at small shapes")
    args = parser.parse_args(argv)
    if args.check:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    root = Path(__file__).resolve().parent.parent
    if str(root / "src") not in sys.path:
        sys.path.insert(0, str(root / "src"))
    from s2hc.connection import projection_width

    k = projection_width(args.family, args.streams)
    for stream in args.dtypes.split(","):
        print("\n".join(report_lines(args.streams, args.dim, k, args.tokens, stream, args.bandwidth)))
    if args.check:
        failed = 0
        for layout in LAYOUTS:
            for n, c, tokens, stream in ((4, 40, 19, "float32"), (3, 24, 5, "bfloat16"), (8, 12, 17, "float32")):
                try:
                    problems = check(n, c, projection_width(args.family, n), tokens, stream, layout)
                except NotImplementedError:
                    continue
                failed += bool(problems)
                print(f"check {layout} n={n} C={c} T={tokens} {stream}: " + ("; ".join(problems) or "model = count"))
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
