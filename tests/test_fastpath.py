"""The fast paths equal the reference path: every family's ``mix_fused``, the fused HyperConnection
(folded RMSNorm, read-and-mix autograd function), compiled against eager, recompute against storing;
and which compute path :func:`s2hc.connection.select_path` picks for each combination of options."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from helpers import Branch, assert_close_to_scale, family_sizes, grads_of, randomize_, run_connection
from torch import nn

import s2hc
from s2hc import HyperConnection
from s2hc.connection import COMPILED, EAGER, KERNELS, REFERENCE, ComputePath, select_path
from s2hc.connection.fused import _NormProject, _ReadMix
from s2hc.mixers.base import small_matmul

FAMILIES = list(s2hc.mixers.REGISTRY)
TOL = dict(atol=1e-5, rtol=1e-5)


def build(name, n, **options):
    if name in ("mhc-lite", "kromhc") and n > s2hc.mixers.MAX_PERMUTATION_STREAMS:
        options.setdefault("allow_large", True)
    return s2hc.mixers.build(name, n, **options)


def run_mixer(mixer, d, weights, fused):
    mixer.zero_grad(set_to_none=True)
    d = d.detach().clone().requires_grad_()
    h = mixer(d, fused=fused)
    if not h.requires_grad:  # identity: nothing to differentiate
        return h, []
    (h * weights).sum().backward()
    return h.detach(), grads_of(mixer, d)


def option_cases():
    """Every (family, n) of the guarantee tests, plus the rotation and exact-identity options where taken."""
    cases = []
    for name, n in family_sizes():
        for options in ({}, {"rotation": "expm"}, {"exact_identity_init": True}):
            if set(options) <= set(s2hc.mixers.options(name)):
                cases.append((name, n, options))
    return cases


@pytest.mark.parametrize("name,n,options", option_cases())
def test_mix_fast_equals_mix_with_gradients(name, n, options):
    g = torch.Generator().manual_seed(n)
    mixer = build(name, n, **options)
    randomize_(mixer, g, 0.5)
    d = 3 * torch.randn(64, mixer.num_inputs, generator=g)
    weights = torch.randn(64, n, n, generator=g)
    h_ref, g_ref = run_mixer(mixer, d, weights, fused=False)
    h_fast, g_fast = run_mixer(mixer, d, weights, fused=True)
    torch.testing.assert_close(h_fast, h_ref, **TOL)
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, **TOL)


def test_small_matmul_equals_matmul():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 3, 4, generator=g), torch.randn(7, 4, 5, generator=g)
    torch.testing.assert_close(small_matmul(a, b), a @ b, **TOL)


# ------------------------------------------------------------------------------------- the connection


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 4])
def test_fused_connection_equals_reference_float32(family, n):
    """Values and gradients to 1e-5 of each tensor's largest entry: the gates' scalar gradients are sums
    over all tokens with cancellation, where another summation order (or GEMM kernel) moves the last
    digits of the result by more than 1e-5 of its own size."""
    torch.manual_seed(0)  # the branch's initialisation
    g = torch.Generator().manual_seed(n)
    hc = HyperConnection(16, n, family=family, layer_index=1)
    randomize_(hc, g, 0.5)
    branch = Branch(16)
    x = torch.randn(2, 6, n, 16, generator=g)
    weights = torch.randn(2, 6, n, 16, generator=g)
    out_ref, *g_ref = run_connection(hc, branch, x, weights, fused=False)
    out_fast, *g_fast = run_connection(hc, branch, x, weights, fused=True)
    torch.testing.assert_close(out_fast, out_ref, **TOL)
    for a, b in zip(g_fast, g_ref):
        assert_close_to_scale(a, b, 1e-5)
    for key in ("pre", "post", "res"):
        torch.testing.assert_close(hc.matrices(x, fused=True)[key], hc.matrices(x, fused=False)[key], **TOL)


@pytest.mark.parametrize("family", ["s2hc", "mhc", "hc", "orthogonal", "isometric", "kromhc"])
def test_fused_connection_equals_reference_bfloat16(family):
    """bf16 streams: the two paths round differently, so they agree to bf16 rounding, not bitwise."""
    g = torch.Generator().manual_seed(0)
    hc = HyperConnection(32, 4, family=family).to(torch.bfloat16)
    randomize_(hc, g, 0.5)
    branch = Branch(32).to(torch.bfloat16)
    x = torch.randn(2, 6, 4, 32, generator=g).bfloat16()
    weights = torch.randn(2, 6, 4, 32, generator=g)
    out_ref, *g_ref = run_connection(hc, branch, x, weights, fused=False)
    out_fast, *g_fast = run_connection(hc, branch, x, weights, fused=True)
    assert out_fast.dtype == torch.bfloat16
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=3e-2, rtol=2e-2)
    for a, b in zip(g_fast, g_ref):  # gradients: bf16 rounding relative to the largest entry
        scale = b.float().abs().max().clamp_min(1.0)
        assert (a.float() - b.float()).abs().max() <= 3e-2 * scale


def test_read_mix_function_float64_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    pre = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    res = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_ReadMix.apply, (x, pre, res))
    for path in (EAGER, COMPILED):  # the compiled path's formulas run eagerly too
        h, mixed = path.read_mix(x, pre, res)
        torch.testing.assert_close(h, torch.einsum("btn,btnc->btc", pre, x))
        torch.testing.assert_close(mixed, torch.einsum("btij,btjc->btic", res, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_torch_path_computes_the_same_operations(dtype):
    """The three operations of the eager and compiled paths against the reference's, values and gradients,
    on bf16 or float32 streams with float32 coefficients (each path's own casts included)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 8, generator=g).to(dtype)
    pre, post = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    res = torch.randn(2, 3, 4, 4, generator=g)
    f = torch.randn(2, 3, 8, generator=g).to(dtype)
    norm_weight, projection = torch.randn(32, generator=g), torch.randn(32, 11, generator=g)

    def run(path):
        inputs = [t.detach().clone().requires_grad_() for t in (x, pre, post, res, f, norm_weight, projection)]
        xs, pre_, post_, res_, f_, w_, p_ = inputs
        d = path.norm_project(xs.flatten(-2), w_, p_, 1e-6)
        h, mixed = path.read_mix(xs, pre_, res_)
        out = path.write(mixed, post_, h + f_)
        assert d.dtype == torch.float32 and h.dtype == mixed.dtype == out.dtype == dtype
        (d.square().sum() + out.float().square().sum()).backward()
        return [d, h, out] + [t.grad for t in inputs]

    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the paths round at different steps
    for path in (EAGER, COMPILED):
        for a, b in zip(run(path), run(REFERENCE)):
            assert a.dtype == b.dtype
            assert_close_to_scale(a.float(), b.float(), tol)


def test_norm_project_function_float64_gradcheck_and_value():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _NormProject.apply(x, w, 1e-6), (x, weight))
    expected = torch.nn.functional.rms_norm(x, (12,), eps=1e-6) @ weight
    torch.testing.assert_close(_NormProject.apply(x, weight, 1e-6), expected)


@pytest.mark.parametrize("family", ["s2hc", "mhc"])
def test_fused_float64_gradcheck_of_the_connection(family):
    hc = HyperConnection(3, 4, family=family, fused=True)
    randomize_(hc, torch.Generator().manual_seed(1), 0.5)
    hc = hc.double()
    branch = nn.Linear(3, 3).double()
    x = torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: hc(x, branch), (x,), eps=1e-6, atol=1e-5)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", ["s2hc", "mhc"])
def test_recompute_equals_storing_and_saves_less(family, fused):
    g = torch.Generator().manual_seed(3)
    hc = HyperConnection(16, 4, family=family, fused=fused)
    randomize_(hc, g, 0.5)
    branch = Branch(16)
    x = torch.randn(2, 6, 4, 16, generator=g)
    weights = torch.randn(2, 6, 4, 16, generator=g)
    out_store, *g_store = run_connection(hc, branch, x, weights, recompute=False)
    out_re, *g_re = run_connection(hc, branch, x, weights, recompute=True)
    torch.testing.assert_close(out_re, out_store, atol=0, rtol=0)
    for a, b in zip(g_re, g_store):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    xs = x.clone().requires_grad_()
    _, stored = saved_bytes(lambda: hc(xs, branch))
    hc_re = copy.deepcopy(hc)
    hc_re.recompute = True
    _, recomputed = saved_bytes(lambda: hc_re(xs, branch))
    assert recomputed < stored


def test_fused_saves_no_normed_copy():
    """The folded RMSNorm stores no n·C-wide normed features: fewer saved bytes than the reference."""
    hc = HyperConnection(64, 4, family="s2hc")
    x = torch.randn(2, 32, 4, 64, requires_grad=True)
    branch = Branch(64)
    _, fused = saved_bytes(lambda: hc(x, branch))
    hc.fused = False
    _, reference = saved_bytes(lambda: hc(x, branch))
    assert reference - fused >= x.numel() * 4  # at least one n·C-wide float32 tensor


def test_bad_flags():
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes'"):
        HyperConnection(8, 4, fused="yes")
    with pytest.raises(ValueError, match="recompute must be True or False, got 1"):
        HyperConnection(8, 4, recompute=1)


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


# --------------------------------------------------------------------------------------- path selection


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_select_path_for_every_option_combination(kernels, compiling, device, monkeypatch):
    """fused=False: the reference, whatever the rest; under torch.compile: the compiled path, whatever
    ``kernels``; else the eager path for ``kernels="torch"`` and the Triton path for ``"triton"``."""
    assert set(KERNELS) == {"torch", "triton"}
    if kernels == "triton":  # CPU tensors need the interpreter; pretend it is on, whatever this machine has
        from s2hc.connection import kernels as triton_kernels

        monkeypatch.setattr(triton_kernels, "interpreted", lambda: True)
    assert select_path(False, kernels, device, compiling) is REFERENCE
    fast = select_path(True, kernels, device, compiling)
    assert isinstance(fast, ComputePath)
    if compiling:
        assert fast is COMPILED
    elif kernels == "torch":
        assert fast is EAGER
    else:
        assert fast.name == "triton" and fast.kernels is triton_kernels
    assert (REFERENCE.fused_mixer, EAGER.fused_mixer, COMPILED.fused_mixer) == (False, False, True)


def test_select_path_refuses_bad_options():
    with pytest.raises(ValueError, match=r"kernels must be one of \['torch', 'triton'\], got 'cuda'"):
        select_path(True, "cuda", "cpu", False)
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes'"):
        select_path("yes", "torch", "cpu", False)


@TRITON
def test_select_path_refuses_triton_on_cpu_without_the_interpreter(monkeypatch):
    from s2hc.connection import kernels as triton_kernels

    monkeypatch.setattr(triton_kernels, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="kernels='triton' runs on CUDA tensors.*got x on device 'cpu'"):
        select_path(True, "triton", "cpu", False)
    assert select_path(True, "triton", "cpu", True) is COMPILED  # compiled: no kernel of ours runs
    assert select_path(True, "triton", "cuda", False).name == "triton"
    monkeypatch.setattr(triton_kernels, "interpreted", lambda: True)
    assert select_path(True, "triton", "cpu", False).name == "triton"


@pytest.mark.parametrize("kernels", [pytest.param("torch"), pytest.param("triton", marks=TRITON)])
def test_torch_compile_selects_the_compiled_path_without_a_graph_break(kernels):
    """dynamo resolves the selection while tracing (fullgraph=True: no graph break), to the compiled path."""
    torch._dynamo.reset()
    hc = HyperConnection(8, 2, kernels=kernels)

    def probe(x):
        return x + (1.0 if hc.compute_path(x) is COMPILED else 0.0)

    x = torch.zeros(3)
    assert hc.compute_path(x) is not COMPILED
    assert torch.compile(probe, fullgraph=True, backend="eager")(x).tolist() == [1.0, 1.0, 1.0]


def test_coefficients_shapes_dtypes_and_matrices():
    hc = HyperConnection(8, 4, family="s2hc")
    randomize_(hc, torch.Generator().manual_seed(7), 0.5)
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(8)).bfloat16()
    for fused in (None, True, False):
        pre, post, res = hc.coefficients(x, fused=fused)
        assert pre.shape == post.shape == (2, 3, 4) and res.shape == (2, 3, 4, 4)
        assert pre.dtype == post.dtype == res.dtype == torch.float32
        h = hc.matrices(x, fused=fused)
        assert all(torch.equal(h[k], v) for k, v in zip(("pre", "post", "res"), (pre, post, res)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,kernels", [("s2hc", "torch"), ("mhc", "torch"), pytest.param("s2hc", "triton", marks=TRITON)]
)
def test_compiled_fused_connection_with_fullgraph_equals_eager(family, kernels):
    """fullgraph=True: no graph break in the fused connection (the compiled read/mix formulation included).
    With kernels="triton", eager runs the kernels and the compiled graph the PyTorch forms inductor fuses."""
    torch._dynamo.reset()
    hc = HyperConnection(16, 4, family=family, fused=True, kernels=kernels)
    randomize_(hc, torch.Generator().manual_seed(4), 0.5)
    branch = Branch(16)
    x = torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(5)).requires_grad_()
    eager = hc(x, branch)
    grads_eager = torch.autograd.grad(eager.square().sum(), (x, hc.projection))
    compiled = torch.compile(lambda x: hc(x, branch), fullgraph=True)
    out = compiled(x)
    grads_compiled = torch.autograd.grad(out.square().sum(), (x, hc.projection))
    torch.testing.assert_close(out, eager, **TOL)
    for a, b in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)



def test_s2hc_at_one_stream_compiles():
    """s²HC at n = 1 has m = 0: its per-token products are empty, which the broadcast form must give as zeros
    (it indexed a size-0 dimension under torch.compile before)."""
    assert small_matmul(torch.ones(2, 0, 0), torch.ones(2, 0, 0)).shape == (2, 0, 0)
    hc = HyperConnection(8, 1, family="s2hc")
    x = torch.randn(2, 3, 1, 8)
    compiled = torch.compile(lambda x: hc(x, torch.tanh), backend="eager")
    torch.testing.assert_close(compiled(x), hc(x, torch.tanh))
