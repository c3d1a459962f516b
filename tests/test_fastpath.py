"""The fast path equals the reference path: every family's ``mix_fused``, the fused HyperConnection
(folded RMSNorm, read-and-mix autograd function), compiled against eager, recompute against storing."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import s2hc
from s2hc import HyperConnection
from s2hc.connection import _NormProject, _ReadMix, read_and_mix
from s2hc.mixers.base import small_matmul

from helpers import Branch, assert_close_to_scale, family_sizes, grads_of, randomize_, run_connection

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
    h, mixed = read_and_mix(x, pre, res)
    torch.testing.assert_close(h, torch.einsum("btn,btnc->btc", pre, x))
    torch.testing.assert_close(mixed, torch.einsum("btij,btjc->btic", res, x))


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

