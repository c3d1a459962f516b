"""The Triton kernels (:mod:`s2hc.connection.kernels`) equal the PyTorch reference: each function's values and
gradients (float32 to 1e-5 on hypothesis-drawn shapes, float64 gradcheck, bf16 to its rounding), and the
whole connection with ``kernels="triton"`` against the fast and reference paths for every family. Without a
GPU the kernels run under Triton's CPU interpreter (the root conftest sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("triton")

from helpers import Branch, assert_close_to_scale, randomize_, run_connection  # noqa: E402

import s2hc  # noqa: E402
from s2hc import HyperConnection  # noqa: E402
from s2hc.connection import kernels as triton_kernels  # noqa: E402

if not (torch.cuda.is_available() or triton_kernels.interpreted()):
    pytest.skip("no GPU and TRITON_INTERPRET was not set before triton was imported", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and not triton_kernels.interpreted() else "cpu"


def reference_norm_project(x, weight, eps):
    return torch.nn.functional.rms_norm(x.to(weight.dtype), (x.shape[-1],), eps=eps) @ weight


def reference_read_mix(x, pre, res):
    return torch.einsum("tn,tnc->tc", pre, x), torch.einsum("tij,tjc->tic", res, x)


def reference_write(mixed, post, f):
    return mixed + post.unsqueeze(-1) * f.unsqueeze(-2)


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def values_and_grads(fn, inputs, weights):
    """Outputs of ``fn(*inputs)`` and the gradients of ``Σ outputs · weights`` with respect to the inputs."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = as_tuple(fn(*inputs))
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights))
    return [o.detach() for o in outputs], list(torch.autograd.grad(loss, inputs))


def assert_same(kernel_fn, reference_fn, inputs, generator, scales=None):
    """The kernel's outputs and input gradients equal the reference's to 1e-5 of their scale; ``scales(inputs,
    weights)`` may give a larger scale per compared tensor (outputs, then gradients; None keeps the default)."""
    with torch.no_grad():
        shapes = [o.shape for o in as_tuple(reference_fn(*inputs))]
    weights = [torch.randn(s, generator=generator, dtype=torch.float64).to(DEVICE) for s in shapes]
    out_k, grads_k = values_and_grads(kernel_fn, inputs, weights)
    out_r, grads_r = values_and_grads(reference_fn, inputs, weights)
    minimum = scales(inputs, weights) if scales else [None] * len(out_r + grads_r)
    for a, b, scale in zip(out_k + grads_k, out_r + grads_r, minimum, strict=True):
        assert_close_to_scale(a, b, scale=1.0 if scale is None else max(1.0, scale))


def norm_project_scales(inputs, weights):
    """The gradient of the normalised input is ``rstd · (ĝ − x̂ · mean(x̂ ĝ))`` with ``ĝ = weights · Wᵀ``: a
    difference of terms of size ``rstd · |ĝ|``, so its rounding error grows with them, not with the (possibly
    tiny) difference. At one feature the difference is zero up to the epsilon and only rounding remains."""
    x, weight = (t.double() for t in inputs)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    g_hat = weights[0] @ weight.T
    return [None, (rstd * g_hat.abs()).max().item(), None]


def randn(generator, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=generator, dtype=dtype).to(DEVICE)


# Shapes: token counts across the projection's 16-token blocks, widths across its 64-feature blocks, K
# across its 64-column blocks (mhc at n = 8 has K = 80), and the mixing kernels' C blocks (n = 8: 64
# columns), n from 1 to 8. The interpreter runs a mixing kernel at
# about 10 ms per token, so the mixing tests draw fewer tokens.
projection_shapes = st.tuples(st.integers(1, 40), st.integers(1, 8), st.integers(1, 100), st.integers(1, 150))
mixing_shapes = st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(1, 100))


@given(projection_shapes, st.integers(0, 2**16))
@example(shape=(1, 1, 1, 64), seed=100)  # one feature: the input's gradient is rounding alone (see above)
def test_norm_project_equals_reference(shape, seed):
    tokens, n, c, k = shape
    g = torch.Generator().manual_seed(seed)
    x, weight = randn(g, tokens, n * c), randn(g, n * c, k)
    assert_same(lambda x, w: triton_kernels.norm_project(x, w, 1e-6),
                lambda x, w: reference_norm_project(x, w, 1e-6), (x, weight), g, norm_project_scales)


@given(mixing_shapes, st.integers(0, 2**16))
def test_read_mix_equals_reference(shape, seed):
    tokens, n, c = shape
    g = torch.Generator().manual_seed(seed)
    inputs = randn(g, tokens, n, c), randn(g, tokens, n), randn(g, tokens, n, n)
    assert_same(triton_kernels.read_mix, reference_read_mix, inputs, g)


@given(mixing_shapes, st.integers(0, 2**16))
def test_write_equals_reference(shape, seed):
    tokens, n, c = shape
    g = torch.Generator().manual_seed(seed)
    inputs = randn(g, tokens, n, c), randn(g, tokens, n), randn(g, tokens, c)
    assert_same(triton_kernels.write, reference_write, inputs, g)


@pytest.mark.parametrize("n,c", [(2, 1500), (3, 300), (8, 130)])
def test_mixing_kernels_loop_over_several_c_blocks(n, c):
    """Widths above one C block (1 024 columns at n = 2, 256 at n = 3 or 4, 64 at n = 8)."""
    g = torch.Generator().manual_seed(c)
    x, pre, res, post, f = randn(g, 3, n, c), randn(g, 3, n), randn(g, 3, n, n), randn(g, 3, n), randn(g, 3, c)
    assert_same(triton_kernels.read_mix, reference_read_mix, (x, pre, res), g)
    assert_same(triton_kernels.write, reference_write, (x, post, f), g)


@pytest.mark.parametrize("n,c", [(9, 5), (16, 40), (33, 3)])
def test_mixing_kernels_from_16_streams_on(n, c):
    """From 16 padded streams on the mixing is a ``tl.dot`` (IEEE) in both directions instead of the broadcast
    sum: n = 9 (a 16-block with 7 masked rows, C below one 16-wide C block), 16 (exact, C over three blocks),
    33 (a 64-block; ``benchmarks/aot_compile.py`` checks the compiled form uses no TF32)."""
    g = torch.Generator().manual_seed(n)
    x, pre, res, post, f = randn(g, 2, n, c), randn(g, 2, n), randn(g, 2, n, n), randn(g, 2, n), randn(g, 2, c)
    assert_same(triton_kernels.read_mix, reference_read_mix, (x, pre, res), g)
    assert_same(triton_kernels.write, reference_write, (x, post, f), g)


@pytest.mark.parametrize("k", [65, 80, 257])
def test_norm_project_at_the_families_k(k):
    """K of s2hc at n = 8 (65) and 16 (257), of mhc at n = 8 (80): K not a multiple of 16 takes the backward's
    narrower K blocks (register pressure), K = 80 two 64-wide blocks, the second partly masked."""
    g = torch.Generator().manual_seed(k)
    x, weight = randn(g, 19, 8 * 12), randn(g, 8 * 12, k)
    assert_same(lambda x, w: triton_kernels.norm_project(x, w, 1e-6),
                lambda x, w: reference_norm_project(x, w, 1e-6), (x, weight), g, norm_project_scales)


def test_float64_gradcheck_of_the_wide_kernels():
    """float64 through the tl.dot forms: the mixing at n = 9 (a 16-block), the projection with K = 33 (three
    16-wide K blocks in the backward, the last one masked). ``fast_mode``: the Jacobian along random directions
    (the interpreter takes tens of ms per call at n = 9)."""
    g = torch.Generator().manual_seed(3)

    def leaf(*shape):
        return randn(g, *shape, dtype=torch.float64).requires_grad_()

    assert torch.autograd.gradcheck(triton_kernels.read_mix, (leaf(2, 9, 3), leaf(2, 9), leaf(2, 9, 9)), fast_mode=True)
    project = lambda x, w: triton_kernels.norm_project(x, w, 1e-6)  # noqa: E731
    assert torch.autograd.gradcheck(project, (leaf(3, 8), leaf(8, 33)), fast_mode=True)


def test_float64_gradcheck_of_every_kernel():
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return randn(g, *shape, dtype=torch.float64).requires_grad_()

    x, pre, res, post, f = leaf(2, 3, 4), leaf(2, 3), leaf(2, 3, 3), leaf(2, 3), leaf(2, 4)
    assert torch.autograd.gradcheck(triton_kernels.read_mix, (x, pre, res))
    assert torch.autograd.gradcheck(triton_kernels.write, (x, post, f))
    # 17 tokens: two token blocks, the second one masked
    assert torch.autograd.gradcheck(lambda x, w: triton_kernels.norm_project(x, w, 1e-6), (leaf(17, 6), leaf(6, 3)))


def test_bfloat16_streams_agree_to_their_rounding():
    """bf16 streams, float32 coefficients (the connection's dtypes): the kernels accumulate in float32,
    so they match the float32 reference on the bf16 inputs to one bf16 rounding of the outputs."""
    g = torch.Generator().manual_seed(1)
    x, f = randn(g, 6, 4, 96).bfloat16(), randn(g, 6, 96).bfloat16()
    pre, res, post, weight = randn(g, 6, 4), randn(g, 6, 4, 4), randn(g, 6, 4), randn(g, 384, 17)
    h, mixed = triton_kernels.read_mix(x, pre, res)
    h_ref, mixed_ref = reference_read_mix(x.float(), pre, res)
    assert h.dtype == mixed.dtype == torch.bfloat16
    torch.testing.assert_close(h.float(), h_ref, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(mixed.float(), mixed_ref, atol=1e-2, rtol=8e-3)
    out = triton_kernels.write(mixed, post, f)
    torch.testing.assert_close(out.float(), reference_write(mixed.float(), post, f.float()), atol=1e-2, rtol=8e-3)
    d = triton_kernels.norm_project(x.flatten(-2), weight, 1e-6)
    assert d.dtype == torch.float32  # the coefficient path stays in float32
    assert_close_to_scale(d, reference_norm_project(x.flatten(-2).float(), weight, 1e-6))


# ----------------------------------------------------------------------------------- the connection


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", list(s2hc.mixers.REGISTRY))
def test_connection_with_triton_kernels_equals_torch_paths(family, dtype):
    """Values and every gradient against the PyTorch fast path and the reference path, with and without
    recompute. float32 to 1e-5 of the largest entry (the gates' scalar gradients sum over all tokens with
    cancellation, so another summation order can move them by more at other seeds); float64 to 1e-10."""
    torch.manual_seed(0)  # the branch's initialisation
    g = torch.Generator().manual_seed(5)
    hc = HyperConnection(24, 4, family=family, layer_index=2)
    randomize_(hc, g, 0.5)
    hc, branch = hc.to(DEVICE, dtype), Branch(24).to(DEVICE, dtype)
    x, weights = randn(g, 2, 5, 4, 24, dtype=dtype), randn(g, 2, 5, 4, 24)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    triton_run = run_connection(hc, branch, x, weights, kernels="triton")
    for reference in (dict(kernels="torch"), dict(kernels="torch", fused=False)):
        for a, b in zip(triton_run, run_connection(hc, branch, x, weights, **reference)):
            assert_close_to_scale(a, b, tol)
    recomputed = run_connection(hc, branch, x, weights, kernels="triton", recompute=True)
    for a, b in zip(recomputed, triton_run):
        assert_close_to_scale(a, b, tol)


def test_connection_bfloat16_with_triton_kernels():
    """bf16 streams and weights: the Triton path and the reference path are each within bf16 rounding of
    the float32 computation on the same (bf16-valued) inputs, for the n-wide results: the new streams,
    dX, and the gradients of the projection and the norm weight. (The scalar gates' gradients are sums
    over all tokens with cancellation: in bf16 both paths get them only to a few percent of their size.)"""
    torch.manual_seed(0)  # the branch's initialisation
    g = torch.Generator().manual_seed(6)
    hc = HyperConnection(32, 4, family="s2hc")
    randomize_(hc, g, 0.5)
    hc, branch = hc.to(DEVICE).bfloat16(), Branch(32).to(DEVICE).bfloat16()
    x, weights = randn(g, 2, 6, 4, 32).bfloat16(), randn(g, 2, 6, 4, 32)
    truth = run_connection(copy.deepcopy(hc).float(), copy.deepcopy(branch).float(), x.float(), weights, fused=False)
    n_wide = slice(0, 4)  # out, dX, d norm_weight, d projection
    for options in (dict(kernels="triton"), dict(fused=False)):
        for a, b in zip(run_connection(hc, branch, x, weights, **options)[n_wide], truth[n_wide]):
            assert a.dtype == torch.bfloat16
            assert (a.float() - b).abs().max() <= 3e-2 * b.abs().max().clamp_min(1.0)


def test_model_with_triton_kernels_trains_like_torch():
    """A whole Transformer: one loss and its gradients, kernels set on every connection."""
    from helpers import random_model

    model = random_model("s2hc", 4).to(DEVICE)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(DEVICE)
    results = []
    for kernels in ("torch", "triton"):
        for module in model.modules():
            if isinstance(module, HyperConnection):
                module.set_options(kernels=kernels)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*results):
        assert_close_to_scale(a, b)


# ------------------------------------------------------------------------------------------ errors


def test_kernels_option_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"kernels must be one of \['torch', 'triton'\], got 'cuda'"):
        HyperConnection(8, 2, kernels="cuda")
    with pytest.raises(ValueError, match="kernels='triton' .* needs fused=True, got fused=False"):
        HyperConnection(8, 2, kernels="triton", fused=False)
    hc = HyperConnection(8, 2)
    with pytest.raises(ValueError, match="needs fused=True"):
        hc.set_options(kernels="triton", fused=False)
    assert (hc.fused, hc.kernels) == (True, "torch")  # a refused change changes nothing
    hc.set_options(kernels="triton")
    assert hc.compute_path(torch.zeros(1, 1, 2, 8, device=DEVICE)).name == "triton"
    assert hc.compute_path(torch.zeros(1, 1, 2, 8, device=DEVICE), fused=False).name == "reference"
    monkeypatch.setattr(triton_kernels, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="kernels='triton' runs on CUDA tensors.*got x on device 'cpu'"):
        hc(torch.randn(1, 2, 2, 8), torch.tanh)


def test_missing_triton_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ImportError, match=r"kernels='triton' needs the triton extra .*pip install 's2hc\[triton\]'"):
        HyperConnection(8, 2, kernels="triton")
