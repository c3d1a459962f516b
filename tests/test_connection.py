"""HyperConnection: the equations of docs/design.md section 1, dtypes, compile, and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import randomize_
from torch import nn

import s2hc
from s2hc import HyperConnection, expand_streams, reduce_streams
from s2hc.connection import build_connection

FAMILIES = list(s2hc.mixers.REGISTRY)


def streams(b=2, t=5, n=4, c=8, dtype=torch.float32, seed=0):
    return torch.randn(b, t, n, c, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randomized(hc: HyperConnection, seed=0, spread=0.5) -> HyperConnection:
    """A connection moved away from its (zero-projection) initialisation, so every path is exercised."""
    randomize_(hc, torch.Generator().manual_seed(seed), spread)
    return hc


class Scale(nn.Module):
    """A branch with a keyword argument, standing in for an attention mask or positions."""

    def __init__(self, c):
        super().__init__()
        self.linear = nn.Linear(c, c)

    def forward(self, h, *, gain=1.0):
        return gain * torch.tanh(self.linear(h))


def reference_forward(hc: HyperConnection, x: torch.Tensor, branch) -> torch.Tensor:
    """The equations of docs/design.md section 1 in float64, sharing only the constraint map with the module."""
    n = hc.n_streams
    if hc.per_stream:  # HC paper: each stream normed and projected alone; H_res[t, s] from stream s's row
        xs = x.double()
        normed = xs / xs.pow(2).mean(-1, keepdim=True).add(hc.eps).sqrt() * hc.norm_weight.double()
        d = normed @ hc.projection.double()  # (B, T, n, 2 + n)
        d_pre, d_post, d_res = d[..., 0], d[..., 1], d[..., 2:].transpose(-1, -2).flatten(-2)
    else:
        flat = x.double().flatten(-2)
        normed = flat / flat.pow(2).mean(-1, keepdim=True).add(hc.eps).sqrt()
        if hc.norm_weight is not None:  # ihc's (and DeepSeek-V4's) norm has no weight
            normed = normed * hc.norm_weight.double()
        d = normed @ hc.projection.double()
        d_pre, d_post, d_res = d[..., :n], d[..., n : 2 * n], d[..., 2 * n :]
    if hc.mixer.gate == "tanh":
        pre = hc.bias_pre.double() + hc.alpha_pre.double() * torch.tanh(d_pre)
        post = hc.bias_post.double() + hc.alpha_post.double() * torch.tanh(d_post)
    else:  # H_pre = σ(·) + ε_pre, H_post = m σ(·) + ε_post: m = 2 and no ε but for DeepSeek-V4's mHC and Hy4's iHC
        pre = torch.sigmoid(hc.alpha_pre.double() * d_pre + hc.bias_pre.double()) + hc.mixer.pre_offset
        post = hc.mixer.post_scale * torch.sigmoid(hc.alpha_post.double() * d_post + hc.bias_post.double()) \
            + hc.mixer.post_offset
    res = hc.mixer.double()(d_res)
    hc.mixer.float()
    branch_out = branch((pre.unsqueeze(-1) * x.double()).sum(-2).float()).double()
    mixed = (res.unsqueeze(-1) * x.double().unsqueeze(-3)).sum(-2)  # Σ_j H_ij x_j
    return mixed + post.unsqueeze(-1) * branch_out.unsqueeze(-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_follows_the_equations(family):
    hc = randomized(HyperConnection(8, 4, family=family, layer_index=1))
    branch = Scale(8)
    x = streams()
    torch.testing.assert_close(hc(x, branch).double(), reference_forward(hc, x, branch), atol=1e-5, rtol=1e-5)


def test_residual_is_exactly_x_plus_branch():
    hc = build_connection(8, 1, "residual")
    branch = Scale(8)
    x = streams(n=1)
    assert torch.equal(hc(x, branch), x + branch(x[:, :, 0]).unsqueeze(2))
    assert list(hc.parameters()) == []


def test_identity_streams_are_independent_copies_mixed_only_through_pre_and_post():
    hc = randomized(HyperConnection(8, 3, family="identity"))
    branch = Scale(8)
    x = streams(n=3)
    h = hc.matrices(x)
    torch.testing.assert_close(h["res"], torch.eye(3).expand(2, 5, 3, 3))
    branch_out = branch(sum(h["pre"][..., j, None] * x[:, :, j] for j in range(3)))
    for i in range(3):
        torch.testing.assert_close(hc(x, branch)[:, :, i], x[:, :, i] + h["post"][..., i, None] * branch_out)


@pytest.mark.parametrize("family", FAMILIES)
def test_matrices_shapes_dtypes_and_initial_gates(family):
    n = 4
    hc = HyperConnection(8, n, family=family, layer_index=6)
    h = hc.matrices(streams(n=n, dtype=torch.bfloat16))
    assert h["pre"].shape == h["post"].shape == (2, 5, n) and h["res"].shape == (2, 5, n, n)
    assert all(v.dtype == torch.float32 for v in h.values())
    favoured = 6 % n
    if family == "hc":  # HC: read one stream, write to all
        expected_pre, expected_post = torch.zeros(n), torch.ones(n)
        expected_pre[favoured] = 1.0
    elif family == "ihc":  # Hy4's start: σ(−log(n − 1)) = 1/n read from every stream, 2σ(0) = 1 written, + hc_eps
        expected_pre, expected_post = torch.full((n,), 1 / n + 1e-6), torch.full((n,), 1.0 + 1e-6)
    else:
        logits = torch.full((n,), -1.0)
        logits[favoured] = 1.0
        expected_pre, expected_post = torch.sigmoid(logits), 2 * torch.sigmoid(logits)
    torch.testing.assert_close(h["pre"], expected_pre.expand(2, 5, n))
    torch.testing.assert_close(h["post"], expected_post.expand(2, 5, n))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_reaches_projection_norm_scales_and_biases(family):
    hc = randomized(HyperConnection(8, 4, family=family))
    branch = Scale(8)
    x = streams().requires_grad_()
    hc(x, branch).pow(2).sum().backward()
    for name, p in hc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_gradient_at_initialisation_reaches_the_projection():
    """The projection starts at zero; its gradient must not, or nothing would ever learn."""
    hc = HyperConnection(8, 4, family="s2hc")
    hc(streams(), Scale(8)).pow(2).sum().backward()
    assert hc.projection.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["s2hc", "mhc", "hc", "kromhc", "isometric"])
def test_float64_gradcheck_of_the_connection(family):
    hc = randomized(HyperConnection(3, 4, family=family)).double()
    branch = nn.Linear(3, 3).double()
    x = streams(b=1, t=2, n=4, c=3, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: hc(x, branch), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("module_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_forward_backward_with_float32_coefficients(family, module_dtype):
    from test_mixers import EXPECTED, check_guarantees

    hc = randomized(HyperConnection(16, 4, family=family)).to(module_dtype)
    branch = Scale(16).to(torch.bfloat16)
    x = streams(c=16, dtype=torch.bfloat16).requires_grad_()
    out = hc(x, branch)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert x.grad is not None and hc.projection.grad is not None
    res = hc.matrices(x.detach())["res"]
    assert res.dtype == torch.float32
    check_guarantees(res, EXPECTED[family])


def test_branch_keyword_arguments_pass_through():
    hc = randomized(HyperConnection(8, 4))
    branch = Scale(8)
    x = streams()
    assert not torch.allclose(hc(x, branch, gain=3.0), hc(x, branch))
    expected = hc(x, lambda h: branch(h, gain=3.0))
    torch.testing.assert_close(hc(x, branch, gain=3.0), expected)


def test_expand_and_reduce():
    h = torch.randn(2, 5, 8)
    x = expand_streams(h, 3)
    assert x.shape == (2, 5, 3, 8) and all(torch.equal(x[:, :, i], h) for i in range(3))
    torch.testing.assert_close(reduce_streams(x), 3 * h)


@pytest.mark.slow
def test_compiled_connection_with_fullgraph_equals_eager():
    torch._dynamo.reset()
    hc = randomized(HyperConnection(16, 4, family="s2hc"))
    branch = Scale(16)
    x = streams(c=16).requires_grad_()
    eager = hc(x, branch)
    (grad_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(lambda x: hc(x, branch), fullgraph=True)
    out = compiled(x)
    (grad_compiled,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_compiled, grad_eager, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(dim=8, n_streams=4, family="sinkhorn"),
            r"family must be one of \['identity'.*got 'sinkhorn' \(every family, these and the forms of their own: "
            r"s2hc.Connections\)",
        ),
        (dict(dim=8, n_streams=0), r"n_streams must be an integer >= 1, got 0"),
        (dict(dim=0, n_streams=4), r"dim must be an integer >= 1, got 0"),
        (dict(dim=8, n_streams=4, layer_index=-1), r"layer_index must be an integer >= 0, got -1"),
        (dict(dim=8, n_streams=4, family="residual"), r"family must be one of \['identity'.*got 'residual'"),
        (dict(dim=8, n_streams=8, family="mhc-lite"), r"n_streams=8 needs 40320 inputs"),
        (dict(dim=8, n_streams=4, family="mhc", rotation="cayley"), r"unknown option\(s\) \['rotation'\]"),
    ],
)
def test_bad_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HyperConnection(**kwargs)


@pytest.mark.parametrize(
    "shape,message",
    [
        ((2, 5, 4, 9), r"n_streams=4 and dim=8 .* got shape \(2, 5, 4, 9\)"),
        ((2, 5, 3, 8), r"n_streams=4 and dim=8 .* got shape \(2, 5, 3, 8\)"),
        ((2, 5, 32), r"n_streams=4 and dim=8 .* got shape \(2, 5, 32\)"),
        ((32,), r"x must have shape \(batch, time, n_streams, dim\) \(or any leading dimensions .*\(32,\)"),
    ],
)
def test_bad_stream_shapes_are_refused_not_reshaped(shape, message):
    hc = HyperConnection(8, 4)
    with pytest.raises(ValueError, match=message):
        hc(torch.zeros(shape), Scale(8))


@pytest.mark.parametrize("family", ["s2hc", "mhc", "hc", "residual"])
@pytest.mark.parametrize("lead", [(10,), (2, 3, 5)])
def test_streams_with_other_leading_dimensions(family, lead):
    """``(..., n, C)`` computes what the same tokens laid out as ``(B, T, n, C)`` compute; the branch is given
    ``(..., C)``, the caller's own layout."""
    n = 1 if family == "residual" else 4
    torch.manual_seed(0)
    hc = build_connection(8, n, family, layer_index=1)
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seen = []

    def branch(h):
        seen.append(tuple(h.shape))
        return torch.tanh(h * 2)

    x = torch.randn(*lead, n, 8)
    out = hc(x, branch)
    assert out.shape == x.shape and seen == [(*lead, 8)]
    torch.testing.assert_close(out, hc(x.reshape(1, -1, n, 8), lambda h: torch.tanh(h * 2)).reshape(x.shape))
    with pytest.raises(ValueError, match=rf"branch must return the shape it was given, \({lead[0]}, .*8\), got"):
        hc(x, lambda h: h[..., :4])


def test_branch_with_the_wrong_output_shape():
    hc = HyperConnection(8, 4)
    with pytest.raises(ValueError, match=r"branch must return the shape it was given, \(2, 5, 8\), got \(2, 5, 4\)"):
        hc(streams(), nn.Linear(8, 4))


def test_expand_and_reduce_bad_input():
    with pytest.raises(ValueError, match="n_streams must be an integer >= 1, got 0"):
        expand_streams(torch.zeros(2, 3, 4), 0)
    with pytest.raises(ValueError, match=r"h must have shape \(batch, time, dim\)"):
        expand_streams(torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, time, n_streams, dim\)"):
        reduce_streams(torch.zeros(2, 4, 8))


def test_set_connection_options_on_a_whole_model():
    from helpers import random_model

    from s2hc.connection import set_connection_options

    model = random_model("s2hc", 2)
    assert set_connection_options(model, recompute=True) is model
    connections = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert connections and all(m.recompute and m.fused for m in connections)
    with pytest.raises(
        ValueError, match=r"unknown connection options \['kernel'\]; allowed: \['fused', 'recompute', 'kernels'\]"
    ):
        set_connection_options(model, kernel="triton")
    with pytest.raises(ValueError, match="recompute must be True or False, got 'yes'"):
        set_connection_options(model, recompute="yes")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_projection_width_is_the_width_the_connection_builds(family, n):
    try:
        hc = HyperConnection(8, n, family=family)
    except ValueError:  # a size the family refuses is refused by the accessor too
        with pytest.raises(ValueError):
            s2hc.connection.projection_width(family, n)
        return
    width = s2hc.connection.projection_width(family, n)
    if hc.per_stream:
        assert width is None
    else:
        assert width == hc.projection.shape[-1] == 2 * n + hc.mixer.num_inputs


def test_projection_width_of_forms_without_a_projection_and_bad_input():
    assert s2hc.connection.projection_width("residual", 1) is None
    assert s2hc.connection.projection_width("gated-residual", 4) is None
    assert s2hc.connection.projection_width("hc", 4) is None  # the HC paper's per-stream projection
    assert s2hc.connection.projection_width("hc", 4, projection="flat") == 2 * 4 + 16
    with pytest.raises(ValueError, match="family must be one of .*got .nope."):
        s2hc.connection.projection_width("nope", 4)
    with pytest.raises(ValueError, match="n_streams"):
        s2hc.connection.projection_width("s2hc", 0)


# ------------------------------------------------------------------------------ the device of the streams


def test_a_connection_built_on_meta_works_out_shapes_on_meta():
    with torch.device("meta"):
        hc, gated, head = HyperConnection(8, 4, family="mhc"), s2hc.GatedResidual(8, 4, rank=4), s2hc.HyperHead(8, 4)
        branch = nn.Linear(8, 8)
    x = torch.zeros(2, 3, 4, 8, device="meta")
    assert hc(x, branch).shape == gated(x, branch).shape == x.shape
    assert head(x).shape == (2, 3, 8)


@pytest.mark.parametrize("build", [
    lambda: HyperConnection(8, 4, family="mhc"), lambda: HyperConnection(8, 4, family="hc"),
    lambda: s2hc.GatedResidual(8, 4, rank=4), lambda: s2hc.connection.WideResidual(8, 4),
])
@pytest.mark.parametrize(("x_device", "module_device"), [("meta", "cpu"), ("cpu", "meta")])
def test_streams_on_another_device_than_the_connection_are_one_line(build, x_device, module_device):
    with torch.device(module_device):
        connection = build()
    x = torch.zeros(2, 3, 4, 8, device=x_device)
    with pytest.raises(ValueError) as error:
        connection(x, nn.Identity())
    message = str(error.value)
    assert f"x is on device {x_device}, the module's parameters on {module_device}" in message and "\n" not in message


def test_heads_and_scaling_check_their_input():
    x = torch.zeros(2, 3, 4, 8, device="meta")
    for module in (s2hc.HyperHead(8, 4), s2hc.GatedHead(8, 4, rank=4), s2hc.connection.StreamScaling(8, 4)):
        with pytest.raises(ValueError, match="x is on device meta, the module's parameters on cpu"):
            module(x)
    with pytest.raises(TypeError, match=r"x must be a floating-point torch.Tensor .* got dtype torch.int64"):
        s2hc.connection.StreamScaling(8, 4)(torch.zeros(2, 3, 4, 8, dtype=torch.long))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor of shape \(batch, time, n_streams, dim\), got list"):
        reduce_streams([1.0, 2.0])


def test_set_connection_options_checks_its_values_without_connections():
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes'"):
        s2hc.connection.set_connection_options(nn.Linear(2, 2), fused="yes")
    with pytest.raises(ValueError, match=r"kernels must be one of \['torch', 'triton'\], got 'cuda'"):
        s2hc.connection.set_connection_options(nn.Linear(2, 2), kernels="cuda")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        s2hc.connection.set_connection_options(3, fused=True)
