"""Compile every Triton kernel of ``s2hc.connection.kernels`` ahead of time for Hopper (sm_90) and Blackwell
(sm_100, where the installed triton's ptxas has it), with no GPU, and check what the compiler made of each.

A stub triton driver reports a CUDA target (compute capability 9.0 or 10.0, warp size 32) and no device. The
project's own launch wrappers (``norm_project``, ``read``, ``write``, alone and joined by a ``Link`` as a connection
call joins them, forward and backward through autograd) run on ``meta`` tensors of the shapes a training step gives
them (8 192 tokens, width C = 768 by default, n = 2..64, K from each family's real projection, streams in bf16 /
fp32 / fp64 with the coefficient dtypes the connection passes): each kernel launch of a wrapper becomes the kernel's
``warmup`` with the very arguments, grid, constexprs and launch options the wrapper passes, which compiles the
specialisation a launch would (triton's own binder and cache key) and launches nothing. Each distinct build compiles
once (triton's in-memory cache dedupes the rest).

For each build it reads the ptxas log (``ptxas -v``, captured at compile time) and the cubin (``cuobjdump
-res-usage``): registers per thread, spill stores (bytes per thread), the stack frame, shared memory (the launch's
dynamic request from the metadata plus the cubin's static), warps; and it scans the SASS (``nvdisasm``, bundled with
triton) and the PTX for tensor-core instructions. All the kernels are documented as exact: float32 products
accumulated in float32 (float64 for float64 streams), so any tensor-core instruction other than fp64 ``DMMA``
(``HMMA ... TF32``, ``mma.sync ... tf32``, ``HGMMA``/``wgmma``, ``tcgen05.mma``) fails. Exit status 1 on a
compile error, on spills above the bound (:func:`spill_bound`), on shared memory over the target's per-block
limit (227 KiB on sm_90 and sm_100) or on a tensor-core instruction; 3 when triton is not installed.

Run from the repository root (``TRITON_INTERPRET`` is dropped before triton is imported)::

    python benchmarks/aot_compile.py                                  # full grid, sm_90 and sm_100
    python benchmarks/aot_compile.py --subset ci --arch 90 --jobs 2   # what tests/test_aot_compile.py runs
    python benchmarks/aot_compile.py --json aot.json --markdown aot.md

Every run compiles for real: triton's cache is a fresh temporary directory unless ``--cache-dir`` is given (a warm
cache has no ptxas log; the cubin's register count and stack frame are used then). With a GPU present the stub is
installed all the same: nothing is launched, so the real driver is never needed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

TOKENS = 8192
WIDTH = 768
STREAMS = tuple(range(2, 65))
# stream dtype -> (stream dtype, coefficient dtype) as the connection passes them (coefficient_dtype)
DTYPES = {"bf16": ("bfloat16", "float32"), "fp32": ("float32", "float32"), "fp64": ("float64", "float64")}
# The CI subset: n values whose builds together are every distinct build of the full grid n = 2..64 on one target
# (checked by --coverage, which drives the wrappers over the full grid without compiling), picked greedily from the
# dry run's block configurations: each padded BLOCK_N (2 to 64) with n a multiple of 16 and not, and the families'
# K at these n giving every K block of the projection and of the streams' backward pass (fused dW or not), K a
# multiple of 16 and not. The full grid adds sm_100 and repeats these builds at other n.
CI_STREAMS = (2, 4, 6, 8, 11, 16, 24, 32, 38, 48)
SMEM_LIMIT = {90: 227 * 1024, 100: 227 * 1024}  # per block, the opt-in maximum (228 KiB per SM less 1 KiB)
# Tensor-core instructions in SASS (HMMA: warp-level, TF32 included; HGMMA/IGMMA/QGMMA: Hopper warpgroup;
# UTC*MMA: Blackwell tcgen05) and in PTX; DMMA / .f64 (exact fp64 products) is allowed in fp64 builds.
SASS_MMA = re.compile(r"\b(?:[HIQOB]MMA|[A-Z]*GMMA|UTC[A-Z]*MMA|DMMA)(?:\.\w+)*")
PTX_MMA = re.compile(r"\b(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)[\w.:]*")


def spill_bound(n: int, dtype: str) -> int:
    """Spill stores allowed, bytes per thread, for a build launched at ``n`` streams (its smallest) in ``dtype``:
    16, which admits what ptxas does at 56-128 registers, far from the limit (two 4-byte values stored once before
    the C or D loop and loaded once after it: the projection forward with bf16 streams and K < 16, the mix backward
    in float64 at n = 2), and nothing like a spill inside a loop (before the tl.dot forms the mix backward spilled
    17-47 KiB per thread at n > 32); 1 KiB for float64, the gradcheck dtype, from n = 17 on (triton 3.6: 72 B in
    the mix backward at n = 64)."""
    return 1024 if dtype == "fp64" and n > 16 else 16


@dataclass
class Build:
    """One distinct compiled kernel (one triton specialisation for one target)."""

    arch: int
    kernel: str
    constexprs: dict
    signature: str
    configs: list = field(default_factory=list)  # [n, family or "-", K or C, dtype] of each launch of it
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    smem_dynamic: int = 0
    smem_static: int = 0
    num_warps: int = 0
    sass_lines: int = 0
    tensor_core: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def smem(self) -> int:
        return self.smem_dynamic + self.smem_static

    @property
    def spills(self) -> int:
        return self.spill_stores if self.spill_stores is not None else (self.stack or 0)

    @property
    def dtype(self) -> str:
        return "fp64" if "fp64" in str(self.constexprs.get("ACC")) else "/".join(sorted({c[3] for c in self.configs}))

    def judge(self) -> list[str]:
        problems = []
        fp64 = "fp64" in str(self.constexprs.get("ACC"))
        bad = [op for op in self.tensor_core if not (fp64 and (op.startswith("DMMA") or ".f64" in op))]
        if bad:
            problems.append(f"tensor-core instructions in an exact kernel: {', '.join(bad)}")
        if self.smem > SMEM_LIMIT.get(self.arch, SMEM_LIMIT[90]):
            problems.append(f"shared memory {self.smem} B over the sm_{self.arch} limit {SMEM_LIMIT[90]} B")
        for dtype in {c[3] for c in self.configs}:
            bound = spill_bound(min(c[0] for c in self.configs if c[3] == dtype), dtype)
            if self.spills > bound:
                problems.append(f"spills {self.spills} B per thread over the bound {bound} B ({dtype})")
        return problems


def install_stub_driver(torch):
    """A triton driver that reports a CUDA target whose compute capability is the 'device' index (so triton's
    per-device caches keep one binder per target) and has no launcher: nothing can be launched through it."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    def refuse(name):
        def method(self, *args, **kwargs):
            raise RuntimeError(f"the ahead-of-time stub driver has no {name}: it launches nothing")

        return method

    class StubCudaDriver(DriverBase):
        """No GPU: ``GPUTarget("cuda", capability, 32)``; the device index is the capability."""

        capability = 90

        @classmethod
        def is_active(cls):
            return False

        def __init__(self):
            pass

        def get_current_target(self):
            return GPUTarget("cuda", self.capability, 32)

        def get_current_device(self):
            return self.capability

        def set_current_device(self, device):
            self.capability = device

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        get_benchmarker = refuse("benchmarker")
        map_python_to_cpp_type = refuse("launcher types")

    for name in getattr(DriverBase, "__abstractmethods__", ()):  # what other triton versions declare abstract
        if name not in vars(StubCudaDriver):
            setattr(StubCudaDriver, name, refuse(name))
    StubCudaDriver.__abstractmethods__ = frozenset()
    stub = StubCudaDriver()
    driver.set_active(stub)
    return stub


class _Recorder:
    """Stands in for one ``@triton.jit`` kernel of the kernels module: ``kernel[grid](*args, **kwargs)``
    compiles through ``kernel.warmup`` with the same arguments and options, launches nothing, records the build."""

    def __init__(self, tool, kernel):
        self.tool, self.kernel = tool, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.tool.compile(self.kernel, grid, args, kwargs)


class Compiler:
    """Drives the wrappers for each configuration and reads each new build."""

    def __init__(self, triton, torch, kernels, stub, sass: bool = True, dry: bool = False):
        self.triton, self.torch, self.kernels, self.stub, self.dry = triton, torch, kernels, stub, dry
        self.block_configs: set[str] = set()  # block_config() of every launch, compiled or (dry) not
        self.tools = bundled_tools(triton)
        self.sass = sass and bool(self.tools.get("nvdisasm") or self.tools.get("cuobjdump"))
        self.builds: dict[tuple, Build] = {}
        self.errors: list[dict] = []
        self.unsupported: dict[int, str] = {}
        self.config: list = []
        self.op = ""
        self.seconds_compiling = 0.0
        self.pending: list = []
        self.workdir = Path(tempfile.mkdtemp(prefix="s2hc-aot-"))

    def run(self, arch: int, dtype: str, op: str, streams, tokens: int, width: int, families=None):
        """``op`` "mix": read and write alone; "project": norm_project alone and a connection call (the three
        joined by a Link) for every family's K; at each n."""
        torch, kern = self.torch, self.kernels
        self.op = op
        stream_dtype, coeff_dtype = (getattr(torch, name) for name in DTYPES[dtype])
        self.stub.set_current_device(arch)

        def meta(*shape, dt):
            return torch.empty(*shape, dtype=dt, device="meta", requires_grad=True)

        def forward_backward(fn, *inputs):
            outputs = fn(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            torch.autograd.grad(outputs, inputs, [torch.empty_like(o) for o in outputs])

        def linked_call(x, weight, f):  # one connection call, its three kernels joined (the training step's builds)
            link, n = kern.Link(), x.shape[1]
            d = kern.norm_project(x.flatten(-2), weight, 1e-6, link)
            pre, post, res = d[:, :n].sigmoid(), d[:, n:2 * n].sigmoid(), d[:, :n, None] * d[:, None, n:2 * n]
            return kern.write(x, res, post, kern.read(x, pre, link) * f, link)

        for n in streams:
            if op == "mix":  # read and write alone: each backward gives its own part of dX
                self.config = [n, "-", width, dtype]
                x, coefficients = meta(tokens, n, width, dt=stream_dtype), meta(tokens, n, dt=coeff_dtype)
                forward_backward(kern.read, x, coefficients)
                forward_backward(kern.write, x, meta(tokens, n, n, dt=coeff_dtype), coefficients,
                                 meta(tokens, width, dt=stream_dtype))
                continue
            for family, k in family_ks(n, families).items():
                self.config = [n, family, k, dtype]
                forward_backward(lambda x, w: kern.norm_project(x, w, 1e-6), meta(tokens, n * width, dt=stream_dtype),
                                 meta(n * width, k, dt=coeff_dtype))
                forward_backward(linked_call, meta(tokens, n, width, dt=stream_dtype),
                                 meta(n * width, k, dt=coeff_dtype), meta(tokens, width, dt=stream_dtype))

    def compile(self, kernel, grid, args, kwargs):
        arch = self.stub.capability
        if arch in self.unsupported:
            return
        name = kernel.fn.__name__
        if not self.dry and not owns(self.op, name, kwargs):  # another piece compiles it (and records it)
            return
        self.block_configs.add(block_config(name, args, kwargs, unspecialised(kernel)))
        if self.dry:
            return
        log = io.StringIO()
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):
                compiled = kernel.warmup(*args, grid=grid, **kwargs)
        except Exception as error:  # noqa: BLE001 - every compile error is reported and the run goes on
            cause = f" (cause: {type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
            text = f"{type(error).__name__}: {error}{cause}"
            if arch >= 100 and re.search(r"sm_1\d\da?\b.*(not|unsupported|Unknown)|gpu-name|[Uu]nsupported gpu", text):
                self.unsupported[arch] = text.strip().splitlines()[-1][:300]
                return
            # one error per configuration, its n listed
            failed = f"sm_{arch} {block_config(name, args, kwargs, unspecialised(kernel))}"
            known = next((e for e in self.errors if e["key"] == failed), None)
            if known:
                known["streams"].append(self.config[0])
            else:
                self.errors.append(dict(key=failed, arch=arch, kernel=name, config=list(self.config),
                                        streams=[self.config[0]], error=text[-3000:]))
            return
        finally:
            self.seconds_compiling += time.perf_counter() - start
        key = (arch, name, getattr(compiled, "hash", id(compiled)))
        build = self.builds.get(key)
        if build is None:
            constexprs = {k: (v if isinstance(v, (int, float, bool)) else str(v)) for k, v in kwargs.items()}
            signature = ",".join(str(getattr(a, "dtype", type(a).__name__)).replace("torch.", "") for a in args)
            build = self.builds[key] = Build(arch, name, constexprs, signature)
            self.read(build, compiled, log.getvalue())
        build.configs.append(list(self.config))

    def read(self, build: Build, compiled, ptxas_log: str):
        meta = compiled.metadata
        build.smem_dynamic = int(getattr(meta, "shared", 0) or 0)
        build.num_warps = int(getattr(meta, "num_warps", 0) or 0)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
        if frame:
            build.stack, build.spill_stores, build.spill_loads = map(int, frame.groups())
        used = re.search(r"Used (\d+) registers", ptxas_log)
        build.regs = int(used.group(1)) if used else None
        cubin = self.workdir / f"{build.kernel}-sm{build.arch}-{len(self.builds)}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        if self.tools.get("cuobjdump"):
            usage = _output([self.tools["cuobjdump"], "-res-usage", str(cubin)])
            found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
            if found:
                regs, stack, build.smem_static = map(int, found.groups())
                build.regs = build.regs if build.regs is not None else regs
                build.stack = build.stack if build.stack is not None else stack
        build.tensor_core = sorted({m.group(0) for m in PTX_MMA.finditer(compiled.asm["ptx"])})
        if not self.sass:
            cubin.unlink()
            return
        # about half a second of CPU per build: run beside the next compiles, read when 8 are pending or at the end
        nvdisasm = self.tools.get("nvdisasm")
        command = [nvdisasm, "-c", str(cubin)] if nvdisasm else [self.tools["cuobjdump"], "-sass", str(cubin)]
        out = cubin.with_suffix(".sass")
        with open(out, "w") as sink:
            self.pending.append((build, cubin, out, subprocess.Popen(command, stdout=sink, stderr=subprocess.DEVNULL)))
        if len(self.pending) >= 8:
            self._collect(self.pending.pop(0))

    def _collect(self, item):
        build, cubin, out, process = item
        process.wait()
        sass = out.read_text()
        build.sass_lines = sass.count("\n")
        build.tensor_core = sorted(set(build.tensor_core) | {m.group(0) for m in SASS_MMA.finditer(sass)})
        out.unlink()
        cubin.unlink()

    def finish(self) -> None:
        while self.pending:
            self._collect(self.pending.pop(0))
        shutil.rmtree(self.workdir, ignore_errors=True)


def block_config(name: str, args, kwargs, unspecialised=()) -> str:
    """A launch's configuration, what makes one build differ from another on one target: the kernel, its pointer
    dtypes, its integer arguments' divisibility by 16 (triton specialises on it: K = 65 against K = 80 is 190
    registers against 86; not for the positions in ``unspecialised``, the kernel's ``do_not_specialize``), its
    constexprs and launch options."""
    kinds = [str(a.dtype).replace("torch.", "") if hasattr(a, "dtype") else "int" if i in unspecialised else
             ("1" if a == 1 else "16k" if a % 16 == 0 else "int") if isinstance(a, int) else type(a).__name__
             for i, a in enumerate(args)]
    return f"{name}({','.join(kinds)}) " + " ".join(f"{k}={v}" for k, v in sorted(kwargs.items()))


def unspecialised(kernel) -> set[int]:
    """The argument positions a ``@triton.jit`` kernel does not specialise on (its ``do_not_specialize``)."""
    return {p.num for p in getattr(kernel, "params", ()) if getattr(p, "do_not_specialize", False)}


def _output(command) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout


def bundled_tools(triton) -> dict:
    """cuobjdump and nvdisasm from triton's wheel (``triton/backends/nvidia/bin``), else from PATH."""
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    names = ("cuobjdump", "nvdisasm")
    return {name: str(here / name) if (here / name).exists() else shutil.which(name) for name in names}


def family_ks(n: int, families: list[str] | None = None) -> dict[str, int]:
    """K, the width of each family's projection at ``n`` streams (:func:`s2hc.connection.projection_width`): the
    families whose coefficient path is norm_project (not HC's per-stream projection); sizes a family refuses are
    left out."""
    import s2hc
    from s2hc.connection import projection_width

    ks = {}
    for family in families or list(s2hc.mixers.REGISTRY):
        try:
            k = projection_width(family, n)
        except ValueError:  # mhc-lite beyond its factorial limit
            continue
        if k is not None:
            ks[family] = k
    return ks


# ------------------------------------------------------------------------------------------- the report


def compress(values) -> str:
    """``[2, 3, 4, 9]`` -> ``"2-4,9"``."""
    parts: list[list[int]] = []
    for v in sorted(set(values)):
        if parts and v == parts[-1][1] + 1:
            parts[-1][1] = v
        else:
            parts.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


COLUMNS = ("arch", "kernel", "blocks", "warps", "n", "K_or_C", "dtype", "regs", "spills", "stack", "smem",
           "tensor_core", "ok")


def table_rows(builds: list[Build]) -> list[dict]:
    def order(b):
        return b.arch, b.kernel, b.dtype, min(c[0] for c in b.configs), str(b.constexprs)

    rows = []
    for b in sorted(builds, key=order):
        sizes = sorted({c[2] for c in b.configs})
        rows.append(dict(
            arch=f"sm_{b.arch}", kernel=b.kernel, warps=b.num_warps,
            blocks=" ".join(f"{k[6:]}={v}" for k, v in b.constexprs.items() if k.startswith("BLOCK_")),
            n=compress(c[0] for c in b.configs),
            K_or_C=compress(sizes) if len(sizes) < 6 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)} values)",
            dtype=b.dtype, regs=b.regs, spills=b.spills, stack=b.stack, smem=b.smem,
            tensor_core=" ".join(b.tensor_core) or "-", ok="FAIL" if b.problems else "ok",
        ))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]) + "\n"


def plain(rows: list[dict]) -> str:
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    return "\n".join(lines + ["  ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS) for r in rows]) + "\n"


# ------------------------------------------------------------------------------------------- running


def work_units(archs, dtypes) -> list[tuple[int, str, str]]:
    """(arch, dtype, op) pieces, each compiling builds no other piece shares (so workers never duplicate one)."""
    return [(arch, dtype, op) for arch in archs for dtype in dtypes for op in ("mix", "project")]


def owns(op: str, kernel: str, constexprs: dict) -> bool:
    """Whether the piece ``op`` compiles a launch of ``kernel``: "project" the projection's kernels (its forward and
    the streams' backward with its part, alone or in a connection call), "mix" the rest (the read's and the write's
    kernels, and the streams' backward without the projection's part). A connection call, driven by "project", also
    launches the read's and write's kernels: the same builds as "mix" compiles at that n, left to it, so that two
    workers never compile one build (the second would find it in the shared cache, without a ptxas log)."""
    projection = kernel == "_norm_project_fwd" or (kernel == "_streams_bwd" and bool(constexprs.get("NORM")))
    return projection == (op == "project")


_LOADED: dict = {}


def load_kernels():
    """triton with the stub driver, and the kernels module imported after it, without the interpreter (once)."""
    if not _LOADED:
        import torch
        import triton

        stub = install_stub_driver(torch)
        with contextlib.suppress(AttributeError):
            triton.knobs.nvidia.dump_ptxas_log = True  # the ptxas -v log on stdout, captured per compile
        if "s2hc.connection.kernels" in sys.modules:
            raise RuntimeError("s2hc.connection.kernels was imported before the stub driver")
        from s2hc.connection import kernels

        if kernels.interpreted():
            raise RuntimeError("the kernels were built for triton's interpreter (TRITON_INTERPRET was set)")
        _LOADED.update(triton=triton, torch=torch, kernels=kernels, stub=stub)
    return _LOADED["triton"], _LOADED["torch"], _LOADED["kernels"], _LOADED["stub"]


def compile_here(units, streams, args, dry: bool = False) -> dict:
    """Compile ``units`` in this process (``dry``: only record the block configurations the wrappers choose)."""
    triton, torch, kernels, stub = load_kernels()
    tool = Compiler(triton, torch, kernels, stub, sass=not args.no_sass, dry=dry)
    jitted = {name: obj for name, obj in vars(kernels).items() if isinstance(obj, triton.runtime.jit.JITFunction)}
    for name, obj in jitted.items():
        setattr(kernels, name, _Recorder(tool, obj))
    families = args.families.split(",") if args.families else None
    try:
        for arch, dtype, op in units:
            tool.run(arch, dtype, op, streams, args.tokens, args.width, families)
    finally:
        for name, obj in jitted.items():
            setattr(kernels, name, obj)
        tool.finish()
    return dict(
        triton=triton.__version__, torch=torch.__version__, kernels=sorted(jitted),
        builds=[asdict(b) for b in tool.builds.values()], errors=tool.errors,
        unsupported={str(k): v for k, v in tool.unsupported.items()}, seconds_compiling=tool.seconds_compiling,
        block_configs=sorted(tool.block_configs),
    )


def compile_in_workers(units, streams, args) -> dict:
    """Split ``units`` over ``args.jobs`` processes of this script (largest pieces first), merge their results."""
    cost = {"mix": 2.0, "project": 1.0}
    shares: list[list] = [[] for _ in range(args.jobs)]
    for unit in sorted(units, key=lambda u: -cost[u[2]] * (1.5 if u[1] == "fp64" else 1.0)):
        min(shares, key=lambda s: sum(cost[u[2]] for u in s)).append(unit)
    scratch = Path(tempfile.mkdtemp(prefix="s2hc-aot-jobs-"))
    processes = []
    for i, share in enumerate(s for s in shares if s):
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(share),
                   "--streams", ",".join(map(str, streams)), "--tokens", str(args.tokens), "--width", str(args.width),
                   "--json", str(scratch / f"{i}.json")]
        command += ["--no-sass"] if args.no_sass else []
        command += ["--families", args.families] if args.families else []
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    merged: dict = dict(builds=[], errors=[], unsupported={}, seconds_compiling=0.0, block_configs=[])
    for i, process in enumerate(processes):
        output, _ = process.communicate()
        path = scratch / f"{i}.json"
        if process.returncode != 0 or not path.exists():
            merged["errors"].append(dict(arch=0, kernel="worker", config=[], error=f"worker {i} exited "
                                         f"{process.returncode}: {output[-3000:]}"))
            continue
        part = json.loads(path.read_text())
        for key in ("triton", "torch", "kernels"):
            merged[key] = part[key]
        merged["builds"] += part["builds"]
        merged["errors"] += part["errors"]
        merged["unsupported"].update(part["unsupported"])
        merged["seconds_compiling"] += part["seconds_compiling"]
        merged["block_configs"] = sorted(set(merged["block_configs"]) | set(part["block_configs"]))
    shutil.rmtree(scratch, ignore_errors=True)
    return merged


def write_atomic(path: Path, text: str) -> None:
    from s2hc.io import atomic_write_text  # s2hc is importable: the tool compiles its kernels

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="90,100", help="compute capabilities, comma-separated (default 90,100)")
    parser.add_argument("--subset", choices=("full", "ci"), default="full",
                        help="full: n = 2..64; ci: n = " + ",".join(map(str, CI_STREAMS)) + " (see CI_STREAMS)")
    parser.add_argument("--streams", help="n values, comma-separated (instead of --subset)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="stream dtypes (default bf16,fp32,fp64)")
    parser.add_argument("--families", help="the families whose K norm_project is compiled for (default: all)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"tokens per launch (default {TOKENS})")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"C, one stream's width (default {WIDTH})")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    parser.add_argument("--no-sass", action="store_true", help="scan the PTX only, not the SASS")
    parser.add_argument("--cache-dir", help="triton's cache directory (default: a fresh temporary one)")
    parser.add_argument("--coverage", action="store_true",
                        help="also drive the wrappers over the full grid without compiling and fail on any block "
                        "configuration they choose that this run did not compile (for --subset ci)")
    parser.add_argument("--json", type=Path, help="write the builds, the table, errors and failures as JSON")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # JSON list of (arch, dtype, op): one --jobs process
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # triton reads TRITON_INTERPRET when a kernel is decorated, so it must be off before triton is imported
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, set to silence its warning
    # a fresh cache per run (its workers share it, through the environment), so that every build is compiled
    own_cache = args.worker is None and not args.cache_dir
    if args.worker is None:
        cache = os.environ["TRITON_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="s2hc-aot-cache-")
    src = Path(__file__).resolve().parents[1] / "src"
    if (src / "s2hc").is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    if "triton" in sys.modules:
        print("aot_compile: triton was imported before TRITON_INTERPRET could be unset", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("aot_compile: triton is not installed (pip install 's2hc[triton]')", file=sys.stderr)
        return 3
    started = time.perf_counter()
    streams = ([int(s) for s in args.streams.split(",")] if args.streams
               else list(CI_STREAMS if args.subset == "ci" else STREAMS))
    try:
        if args.worker is not None:
            result = compile_here([tuple(u) for u in json.loads(args.worker)], streams, args)
            write_atomic(args.json, json.dumps(result) + "\n")
            return 0
        archs = [int(a.strip().removeprefix("sm_")) for a in args.arch.split(",") if a.strip()]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        unknown = sorted(set(dtypes) - set(DTYPES))
        if unknown:
            print(f"aot_compile: --dtypes must be among {list(DTYPES)}, got {unknown}", file=sys.stderr)
            return 2
        units = work_units(archs, dtypes)
        result = (compile_in_workers if args.jobs > 1 else compile_here)(units, streams, args)
        if args.coverage:
            result["full_grid_block_configs"] = compile_here(units, STREAMS, args, dry=True)["block_configs"]
    finally:
        if own_cache and args.worker is None:
            shutil.rmtree(cache, ignore_errors=True)
    return report(result, archs, dtypes, streams, args, time.perf_counter() - started)


def report(result, archs, dtypes, streams, args, seconds) -> int:
    names = {f.name for f in fields(Build)}
    builds = [Build(**{k: v for k, v in b.items() if k in names}) for b in result["builds"]]
    for b in builds:
        b.problems = b.judge()
    rows = table_rows(builds)
    failures = [f"sm_{b.arch} {b.kernel} {b.constexprs} n={compress(c[0] for c in b.configs)} {b.dtype}: {p}"
                for b in builds for p in b.problems]
    failures += [f"sm_{e['arch']} {e['kernel']} config {e['config']} (n = {compress(e.get('streams', []))}): "
                 f"compile error: {e['error'][-800:]}" for e in result["errors"]]
    compiled = {b.kernel for b in builds}
    failures += [f"kernel {k} was never compiled" for k in result.get("kernels", []) if k not in compiled]
    if "full_grid_block_configs" in result:
        missing = sorted(set(result["full_grid_block_configs"]) - set(result["block_configs"]))
        failures += [f"block configuration chosen at some n = 2..64 but not compiled: {m}" for m in missing]
    if not builds and not failures:
        failures.append("nothing was compiled")
    print(plain(rows), end="")
    per_arch = ", ".join(f"sm_{a}: {sum(b.arch == a for b in builds)}" for a in archs)
    print(f"\ntriton {result.get('triton')}, torch {result.get('torch')}: {len(builds)} builds ({per_arch}); "
          f"n = {compress(streams)}, {','.join(dtypes)}, {args.tokens} tokens, C = {args.width}; {seconds:.0f} s "
          f"({result['seconds_compiling']:.0f} s compiling, {args.jobs} job(s))")
    for arch, why in result["unsupported"].items():
        print(f"sm_{arch}: not supported by this triton's ptxas, skipped ({why})")
    for failure in failures:
        print("FAIL", failure)
    print("PASSED" if not failures else f"FAILED: {len(failures)} problem(s)")
    if args.json:
        write_atomic(args.json, json.dumps(dict(
            triton=result.get("triton"), torch=result.get("torch"), archs=archs, dtypes=dtypes, streams=streams,
            tokens=args.tokens, width=args.width, jobs=args.jobs, seconds=round(seconds, 1),
            seconds_compiling=round(result["seconds_compiling"], 1), unsupported=result["unsupported"],
            smem_limit=SMEM_LIMIT, kernels=result.get("kernels", []), rows=rows,
            builds=[dict(asdict(b), smem=b.smem, spills=b.spills, dtype=b.dtype) for b in builds],
            block_configs=result["block_configs"], full_grid_block_configs=result.get("full_grid_block_configs"),
            errors=result["errors"], failures=failures, passed=not failures,
        ), indent=1) + "\n")
    if args.markdown:
        write_atomic(args.markdown, markdown(rows))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
