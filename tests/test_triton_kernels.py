"""The Triton kernels (:mod:`s2hc.connection.kernels`) equal the PyTorch reference: each function's values and
gradients (float32 to 1e-5 on hypothesis-drawn shapes, float64 gradcheck, bf16 to its rounding), the three joined
by a :class:`~s2hc.connection.kernels.Link` (one dX, dW from the same pass) against the same composite in PyTorch,
and the whole connection with ``kernels="triton"`` against the fast and reference paths for every family. Without
a GPU the kernels run under Triton's CPU interpreter (the root conftest sets ``TRITON_INTERPRET=1``)."""

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


def reference_read(x, pre):
    return torch.einsum("tn,tnc->tc", pre, x)


def reference_write(x, res, post, f):
    return torch.einsum("tij,tjc->tic", res, x) + post.unsqueeze(-1) * f.unsqueeze(-2)


def coefficients(d, n):
    """``(H_pre, H_post, H_res)`` from ``d`` ``(T, K)`` by a small differentiable map standing in for a family's
    (every entry of H_res depends on d, as in every family but ``identity``)."""
    pre, post = torch.sigmoid(d[:, :n]), 2 * torch.sigmoid(d[:, n:2 * n])
    res = torch.tanh(d[:, :n, None] * d[:, None, n:2 * n] + d[:, -1:, None]) + torch.eye(n, dtype=d.dtype)
    return pre, post, res


def linked_call(x, weight, f, uses=("read", "write"), eps=1e-6):
    """One connection call on the kernels joined by a Link: projection, coefficients, ``h = H_pre X``, the branch
    ``F = h · f`` (so that dh reaches the read), ``X' = H_res X + H_postᵀ F``; ``uses`` drops the read from the
    branch (``"write"`` alone: F = f) or leaves the write out (``"read"`` alone: the outputs are d and h · f)."""
    link = triton_kernels.Link()
    n = x.shape[1]
    d = triton_kernels.norm_project(x.flatten(-2), weight, eps, link)
    pre, post, res = coefficients(d, n)
    h = triton_kernels.read(x, pre, link)
    if "write" not in uses:
        return d, h * f
    return triton_kernels.write(x, res, post, h * f if "read" in uses else f, link)


def reference_call(x, weight, f, uses=("read", "write"), eps=1e-6):
    n = x.shape[1]
    d = reference_norm_project(x.flatten(-2), weight, eps)
    pre, post, res = coefficients(d, n)
    h = reference_read(x, pre.to(x.dtype))
    if "write" not in uses:
        return d, h * f
    return reference_write(x, res.to(x.dtype), post.to(x.dtype), h * f if "read" in uses else f)


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
def test_read_equals_reference(shape, seed):
    tokens, n, c = shape
    g = torch.Generator().manual_seed(seed)
    inputs = randn(g, tokens, n, c), randn(g, tokens, n)
    assert_same(triton_kernels.read, reference_read, inputs, g)


@given(mixing_shapes, st.integers(0, 2**16))
def test_write_equals_reference(shape, seed):
    tokens, n, c = shape
    g = torch.Generator().manual_seed(seed)
    inputs = randn(g, tokens, n, c), randn(g, tokens, n, n), randn(g, tokens, n), randn(g, tokens, c)
    assert_same(triton_kernels.write, reference_write, inputs, g)


@pytest.mark.parametrize("n,c", [(2, 1500), (3, 300), (8, 130)])
def test_mixing_kernels_loop_over_several_c_blocks(n, c):
    """Widths above one C block (1 024 columns at n = 2, 256 at n = 3 or 4, 64 at n = 8; the streams' backward
    pass 64, 32 and 8 columns)."""
    g = torch.Generator().manual_seed(c)
    x, pre, res, post, f = randn(g, 3, n, c), randn(g, 3, n), randn(g, 3, n, n), randn(g, 3, n), randn(g, 3, c)
    assert_same(triton_kernels.read, reference_read, (x, pre), g)
    assert_same(triton_kernels.write, reference_write, (x, res, post, f), g)


@pytest.mark.parametrize("n,c", [(9, 5), (16, 40), (33, 3)])
def test_mixing_kernels_from_16_streams_on(n, c):
    """From 16 padded streams on the mixing is a ``tl.dot`` (IEEE) in both directions instead of the broadcast
    sum: n = 9 (a 16-block with 7 masked rows, C below one 16-wide C block), 16 (exact, C over three blocks),
    33 (a 64-block; ``benchmarks/aot_compile.py`` checks the compiled form uses no TF32)."""
    g = torch.Generator().manual_seed(n)
    x, pre, res, post, f = randn(g, 2, n, c), randn(g, 2, n), randn(g, 2, n, n), randn(g, 2, n), randn(g, 2, c)
    assert_same(triton_kernels.read, reference_read, (x, pre), g)
    assert_same(triton_kernels.write, reference_write, (x, res, post, f), g)


# --------------------------------------------------------------------------- the three joined by a Link


def assert_linked_same(inputs, generator, uses=("read", "write"), tol=1e-5):
    """The linked call's outputs and the gradients of ``Σ outputs · weights`` (x, W, f) against the composite in
    float64 on the same values, to ``tol`` of each result's largest entry. (Against the composite in float32 the
    difference is the composite's own rounding: the kernels' is 3 times smaller at n = 8.)"""
    with torch.no_grad():
        shapes = [o.shape for o in as_tuple(reference_call(*inputs, uses=uses))]
    weights = [torch.randn(s, generator=generator, dtype=torch.float64).to(DEVICE) for s in shapes]
    out_k, grads_k = values_and_grads(lambda *a: linked_call(*a, uses=uses), inputs, weights)
    out_r, grads_r = values_and_grads(lambda *a: reference_call(*a, uses=uses), [t.double() for t in inputs], weights)
    for a, b in zip(out_k + grads_k, out_r + grads_r, strict=True):
        assert_close_to_scale(a.double(), b, tol)


# tokens across the 16-token blocks and the token ranges of dW's partial sums, n from 1 to 8 (dW fused at every n
# here: K = 2n + n + 1 fits one tile), C across the streams' backward C blocks (8 columns at n = 8, 64 at n = 2)
linked_shapes = st.tuples(st.integers(1, 40), st.integers(1, 8), st.integers(1, 70))


@given(linked_shapes, st.integers(0, 2**16))
@example(shape=(33, 4, 40), seed=0)  # three token blocks, C over two 32-column blocks
def test_linked_call_equals_reference(shape, seed):
    """The three kernels joined by a Link (the projection's backward writes the one dX, with dW from the same
    pass) against the same composite in PyTorch: the new streams, dX, dW and dF."""
    tokens, n, c = shape
    k = 3 * n + 1
    g = torch.Generator().manual_seed(seed)
    inputs = randn(g, tokens, n, c), randn(g, n * c, k) * 0.3, randn(g, tokens, c)
    assert_linked_same(inputs, g)


@pytest.mark.parametrize("n,k", [(16, 257), (9, 200)])
def test_linked_call_with_k_beyond_one_tile(n, k):
    """K over 128 (s2hc at n = 16, 257): W's tile no longer fits beside dW's, so the streams' backward loops over K
    blocks and dW is a GEMM over X; n = 9 with K = 200 (padded 16 streams, K blocks of 16, the last one masked)."""
    g = torch.Generator().manual_seed(k)
    inputs = randn(g, 18, n, 5), randn(g, n * 5, k) * 0.1, randn(g, 18, 5)
    assert_linked_same(inputs, g)


@pytest.mark.parametrize("uses", [("write",), ("read",)])
def test_linked_call_when_the_read_or_the_write_has_no_gradient(uses):
    """A branch that ignores its input (no dh: the read's backward never runs) and a call whose write is left out
    (no dX'): the projection's backward adds what arrived, and nothing else."""
    g = torch.Generator().manual_seed(len(uses[0]))
    inputs = randn(g, 7, 3, 20), randn(g, 60, 10) * 0.3, randn(g, 7, 20)
    assert_linked_same(inputs, g, uses)


def test_linked_call_with_other_streams_or_no_gradient_for_x():
    """A read or write given other streams than the projection computes its own part of dX (unjoined), and with
    streams that need no gradient only the matrices' and W's gradients are formed: the same values either way."""
    g = torch.Generator().manual_seed(2)
    x, weight, f = randn(g, 5, 3, 8), randn(g, 24, 10) * 0.3, randn(g, 5, 8)
    other = x.clone().requires_grad_()
    x, weight = x.requires_grad_(), weight.requires_grad_()
    link = triton_kernels.Link()
    pre, post, res = coefficients(triton_kernels.norm_project(x.flatten(-2), weight, 1e-6, link), 3)
    out = triton_kernels.write(other, res, post, triton_kernels.read(x, pre, link) * f, link)
    ref_x, ref_other, ref_w = (t.detach().clone().requires_grad_() for t in (x, other, weight))
    pre, post, res = coefficients(reference_norm_project(ref_x.flatten(-2), ref_w, 1e-6), 3)
    ref = reference_write(ref_other, res, post, reference_read(ref_x, pre) * f)
    grads = torch.autograd.grad(out.sum(), (x, other, weight))
    for a, b in zip(grads, torch.autograd.grad(ref.sum(), (ref_x, ref_other, ref_w))):
        assert_close_to_scale(a, b)
    frozen = x.detach()
    out = linked_call(frozen, weight, f)
    (grad_w,) = torch.autograd.grad(out.sum(), (weight,))
    (ref_grad_w,) = torch.autograd.grad(reference_call(frozen, ref_w, f).sum(), (ref_w,))
    assert_close_to_scale(grad_w, ref_grad_w)


def test_linked_backward_writes_one_dx_and_no_torch_op_moves_streams():
    """The backward of a linked call: one launch of the streams' backward pass (the one kernel that stores dX), and
    no PyTorch operation computes on an n-wide tensor (no autograd sum of dX parts, no GEMM over X for dW, no copy
    of X): outside the kernels, n-wide tensors are only allocated and viewed."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    tokens, n, c = 20, 4, 12
    g = torch.Generator().manual_seed(0)
    x, weight, f = randn(g, tokens, n, c).requires_grad_(), randn(g, n * c, 17).requires_grad_(), randn(g, tokens, c)
    out = linked_call(x, weight, f)
    grad_out = torch.ones_like(out)
    launches, outside = [], []
    real_call = interpreter.GridExecutor.__call__

    class StreamOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            inside = launches and launches[-1] == "running"
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, result))
            if not inside and any(isinstance(t, torch.Tensor) and t.numel() == tokens * n * c for t in leaves):
                outside.append(func.overloadpacket.__name__)
            return result

    def running(self, *args, **kwargs):  # the interpreter's own copies of each argument happen inside a launch
        launches.append(self.fn.__name__)
        launches.append("running")
        try:
            return real_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter.GridExecutor.__call__ = running
    try:
        with StreamOps():
            torch.autograd.grad(out, (x, weight), grad_out)
    finally:
        interpreter.GridExecutor.__call__ = real_call
    assert launches == ["_write_bwd", "_read_bwd", "_streams_bwd"]
    assert set(outside) <= {"empty_like", "empty", "new_empty", "view", "_unsafe_view", "reshape", "alias"}, outside


@pytest.mark.parametrize("k", [65, 80, 257])
def test_norm_project_at_the_families_k(k):
    """K of s2hc at n = 8 (65) and 16 (257), of mhc at n = 8 (80): up to 128 the forward's one column block (and the
    backward's fused dW), 257 five 64-wide column blocks, the last partly masked, and the backward's 16-wide K
    blocks with dW a GEMM."""
    g = torch.Generator().manual_seed(k)
    x, weight = randn(g, 19, 8 * 12), randn(g, 8 * 12, k)
    assert_same(lambda x, w: triton_kernels.norm_project(x, w, 1e-6),
                lambda x, w: reference_norm_project(x, w, 1e-6), (x, weight), g, norm_project_scales)


def test_float64_gradcheck_of_the_wide_kernels():
    """float64 through the tl.dot forms: the mixing at n = 9 (a 16-block), the projection with K = 33, and the
    linked call at n = 9 with K = 150 (the streams' backward over K blocks, dW a GEMM). ``fast_mode``: the
    Jacobian along random directions (the interpreter takes tens of ms per call at n = 9)."""
    g = torch.Generator().manual_seed(3)

    def leaf(*shape, scale=1.0):
        return (randn(g, *shape, dtype=torch.float64) * scale).requires_grad_()

    assert torch.autograd.gradcheck(triton_kernels.read, (leaf(2, 9, 3), leaf(2, 9)), fast_mode=True)
    assert torch.autograd.gradcheck(triton_kernels.write, (leaf(2, 9, 3), leaf(2, 9, 9), leaf(2, 9), leaf(2, 3)),
                                    fast_mode=True)
    project = lambda x, w: triton_kernels.norm_project(x, w, 1e-6)  # noqa: E731
    assert torch.autograd.gradcheck(project, (leaf(3, 8), leaf(8, 33)), fast_mode=True)
    assert torch.autograd.gradcheck(linked_call, (leaf(3, 9, 2), leaf(18, 150, scale=0.1), leaf(3, 2)),
                                    fast_mode=True)


def test_float64_gradcheck_of_every_kernel():
    g = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (randn(g, *shape, dtype=torch.float64) * scale).requires_grad_()

    x, pre, res, post, f = leaf(2, 3, 4), leaf(2, 3), leaf(2, 3, 3), leaf(2, 3), leaf(2, 4)
    assert torch.autograd.gradcheck(triton_kernels.read, (x, pre))
    assert torch.autograd.gradcheck(triton_kernels.write, (x, res, post, f))
    # 17 tokens: two token blocks, the second one masked
    assert torch.autograd.gradcheck(lambda x, w: triton_kernels.norm_project(x, w, 1e-6), (leaf(17, 6), leaf(6, 3)))
    # joined: in full at 2 tokens; along random directions at 17 (two token blocks, dW's two token ranges)
    assert torch.autograd.gradcheck(linked_call, (leaf(2, 2, 3), leaf(6, 7, scale=0.3), leaf(2, 3)))
    assert torch.autograd.gradcheck(linked_call, (leaf(17, 3, 4), leaf(12, 10, scale=0.3), leaf(17, 4)),
                                    fast_mode=True)


def test_bfloat16_streams_agree_to_their_rounding():
    """bf16 streams, float32 coefficients (the connection's dtypes): the kernels accumulate in float32,
    so they match the float32 reference on the bf16 inputs to one bf16 rounding of the outputs; the linked call's
    dX and dW to bf16 rounding of dX (accumulated in float32 and rounded once)."""
    g = torch.Generator().manual_seed(1)
    x, f = randn(g, 6, 4, 96).bfloat16(), randn(g, 6, 96).bfloat16()
    pre, res, post, weight = randn(g, 6, 4), randn(g, 6, 4, 4), randn(g, 6, 4), randn(g, 384, 17)
    h = triton_kernels.read(x, pre)
    assert h.dtype == torch.bfloat16
    torch.testing.assert_close(h.float(), reference_read(x.float(), pre), atol=1e-2, rtol=8e-3)
    out = triton_kernels.write(x, res, post, f)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference_write(x.float(), res, post, f.float()), atol=1e-2, rtol=8e-3)
    d = triton_kernels.norm_project(x.flatten(-2), weight, 1e-6)
    assert d.dtype == torch.float32  # the coefficient path stays in float32
    assert_close_to_scale(d, reference_norm_project(x.flatten(-2).float(), weight, 1e-6))
    x, weight = x.requires_grad_(), (weight * 0.05).requires_grad_()
    out = linked_call(x, weight, f)
    grad_out = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (x, weight), grad_out)
    assert out.dtype == grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    ref_x, ref_w = x.detach().float().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = reference_call(ref_x, ref_w, f.float())
    ref_grads = torch.autograd.grad(ref, (ref_x, ref_w), grad_out.float())
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert (a.float() - b).abs().max() <= 1e-2 * b.abs().max()


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
    """A whole Transformer: one loss and its gradients, kernels set on every connection; and with every block's
    activations checkpointed (its forward recomputed in backward makes new links, while the original call's
    kernels run their backward through the original ones)."""
    from helpers import random_model

    model = random_model("s2hc", 4).to(DEVICE)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(DEVICE)
    results = []
    for kernels, checkpointed in (("torch", False), ("triton", False), ("triton", True)):
        for module in model.modules():
            if isinstance(module, HyperConnection):
                module.set_options(kernels=kernels)
        model.set_activation_checkpointing(checkpointed)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(other, results[0]):
            assert_close_to_scale(a, b)


def test_lagged_connection_with_triton_kernels():
    """DeepSeek-V4.1's single-pass mHC reads with the previous site's H_pre (carried in its state) while its own
    projection gives this site's: the link still joins this site's read, write and projection into one dX."""
    from s2hc.connection.forms.lagged_mhc import LaggedHyperConnection

    torch.manual_seed(0)  # the branch's initialisation
    g = torch.Generator().manual_seed(1)
    hc = LaggedHyperConnection(16, 4, layer_index=1)
    randomize_(hc, g, 0.3)
    hc, branch = hc.to(DEVICE), Branch(16).to(DEVICE)
    x0, pre0 = randn(g, 2, 3, 4, 16), torch.rand(2, 3, 4, generator=g).to(DEVICE)
    results = []
    for kernels in ("torch", "triton"):
        module = copy.deepcopy(hc).set_options(kernels=kernels)
        x, pre = x0.clone().requires_grad_(), pre0.clone().requires_grad_()
        out, pre_next = module((x, pre), branch)
        ((out * 1.3).sum() + pre_next.square().sum()).backward()
        results.append([out.detach(), pre_next.detach(), x.grad, pre.grad, *(p.grad for p in module.parameters())])
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
