"""DeepSeek-V4's mHC (``family="mhc", variant="deepseek-v4"``) and :class:`s2hc.HyperHead` against transformers.

transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` are built from a tiny
``DeepseekV4Config`` made in place (no Hub), their parameters drawn from a seeded generator, and converted with
:mod:`s2hc.hf.deepseek_v4`. Compared in float32 to 1e-5: ``H_pre``, ``H_post``, ``H_res = combᵀ``, the
connection's output around a fixed branch on every compute path, the decoder layer's two connections (its
attention and MoE replaced by small branches), the gradients with respect to the streams and every parameter
(mapped through the converter), and the head. Round trips are exact; bad tensors are named.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from helpers import randomize_  # noqa: E402
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4DecoderLayer,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

import s2hc  # noqa: E402
from s2hc import HyperConnection, HyperHead, mixers  # noqa: E402
from s2hc.hf import deepseek_v4 as dv4  # noqa: E402
from s2hc.mixers.mhc import deepseek_v4_sinkhorn, log_sinkhorn  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
DIM, N = 16, 4
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def hf_config(n=N, dim=DIM, iterations=7, hc_eps=1e-4, rms_norm_eps=1e-5) -> DeepseekV4Config:
    """A tiny config; the two epsilons differ from each other and from the defaults, so a swap shows."""
    return DeepseekV4Config(
        hidden_size=dim, hc_mult=n, hc_sinkhorn_iters=iterations, hc_eps=hc_eps, rms_norm_eps=rms_norm_eps,
        num_hidden_layers=1, vocab_size=32, num_attention_heads=2, num_key_value_heads=1,
    )


def hf_connection(config, seed=0) -> DeepseekV4HyperConnection:
    """transformers' connection with seeded random parameters: fn ~ 0.3·N(0, 1), base ~ N(0, 1), scale in [0.5, 1.5)."""
    module = DeepseekV4HyperConnection(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fn.copy_(0.3 * torch.randn(module.fn.shape, generator=generator))
        module.base.copy_(torch.randn(module.base.shape, generator=generator))
        module.scale.copy_(0.5 + torch.rand(module.scale.shape, generator=generator))
    return module


def hf_head(config, seed=0) -> DeepseekV4HyperHead:
    module = DeepseekV4HyperHead(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.hc_fn.copy_(0.3 * torch.randn(module.hc_fn.shape, generator=generator))
        module.hc_base.copy_(torch.randn(module.hc_base.shape, generator=generator))
        module.hc_scale.copy_(0.5 + torch.rand(module.hc_scale.shape, generator=generator))
    return module


def streams(n=N, dim=DIM, seed=1, batch=2, time=5) -> torch.Tensor:
    return torch.randn(batch, time, n, dim, generator=torch.Generator().manual_seed(seed))


def branch(dim=DIM, seed=2) -> nn.Linear:
    """A linear branch drawn entirely from ``seed`` (not from the global generator)."""
    linear = nn.Linear(dim, dim)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in linear.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=generator))
    return linear


def hf_output(module, x, f):
    """The decoder layer's update around branch ``f``: ``post · F(collapsed) + combᵀ X``."""
    post, comb, collapsed = module(x)
    return post.unsqueeze(-1) * f(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)


def hf_grads(module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}


class RecordSigmoid(TorchFunctionMode):
    """Records every ``torch.sigmoid`` result: transformers' connection consumes ``pre`` internally and returns
    only ``collapsed = Σ pre_s X_s``; its first sigmoid is ``pre`` before ``+ hc_eps``."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.sigmoid:
            self.outputs.append(out)
        return out


# 1. The three matrices and the connection, on every compute path.


@pytest.mark.parametrize("fused", [False, True])
def test_matrices_equal_transformers(fused):
    config = hf_config()
    theirs = hf_connection(config)
    ours = dv4.connection_from_hf(config, theirs, fused=fused)
    x = streams()
    with RecordSigmoid() as record:
        post, comb, collapsed = theirs(x)
    h = ours.matrices(x)
    torch.testing.assert_close(h["pre"], record.outputs[0] + config.hc_eps, **TOL)
    torch.testing.assert_close(HyperConnection.read(x, h), collapsed, **TOL)  # H_pre X, its + hc_eps included
    torch.testing.assert_close(h["post"], post, **TOL)
    torch.testing.assert_close(h["res"], comb.mT, **TOL)  # s2hc's rows are output streams: H_res = combᵀ
    assert (h["res"] - comb).abs().max() > 0.1  # the transposition matters: comb is far from symmetric
    assert ours.norm_weight is None and "norm_weight" not in ours.state_dict()


def connection_and_gradients(ours, theirs, x, f):
    """Outputs and gradients of both connections around branch ``f`` (its copies) for one weighted loss, a
    mean over the tokens (so the parameters' gradients, sums over tokens, are O(1) and 1e-5 is float32's
    rounding of them, not of gradients a hundred times larger)."""
    tokens = x.shape[0] * x.shape[1]
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype).to(x.device) / tokens
    results = []
    for module, run in ((ours, lambda x, g: ours(x, g)), (theirs, lambda x, g: hf_output(theirs, x, g))):
        g, xi = copy.deepcopy(f), x.clone().requires_grad_()
        module.zero_grad()
        out = run(xi, g)
        (out * weights).sum().backward()
        results.append((out.detach(), xi.grad, dict(module.named_parameters()), g))
    return results


def assert_same_connection(ours, theirs, x, f, n=N, dim=DIM):
    (out, dx, params, g), (hf_out, hf_dx, hf_params, hf_g) = connection_and_gradients(ours, theirs, x, f)
    torch.testing.assert_close(out, hf_out, **TOL)
    torch.testing.assert_close(dx, hf_dx, **TOL)
    mapped = dv4.connection_state_from_hf({k: p.grad for k, p in hf_params.items()}, dim, n)
    assert set(mapped) == set(params)
    for name, grad in mapped.items():
        torch.testing.assert_close(params[name].grad, grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    for p, q in zip(g.parameters(), hf_g.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_connection_output_and_gradients_equal_transformers(fused, recompute):
    config = hf_config()
    theirs = hf_connection(config)
    ours = dv4.connection_from_hf(config, theirs, fused=fused, recompute=recompute)
    assert ours.compute_path(streams()).name == ("eager" if fused else "reference")
    assert_same_connection(ours, theirs, streams(), branch())


@TRITON
def test_triton_path_equals_transformers():
    from s2hc.connection import kernels as triton_kernels

    if not (torch.cuda.is_available() or triton_kernels.interpreted()):
        pytest.skip("no GPU and TRITON_INTERPRET was not set before triton was imported")
    device = "cuda" if torch.cuda.is_available() and not triton_kernels.interpreted() else "cpu"
    config = hf_config()
    theirs = hf_connection(config).to(device)
    ours = dv4.connection_from_hf(config, theirs, kernels="triton").to(device)
    x = streams().to(device)
    assert ours.compute_path(x).name == "triton"
    assert_same_connection(ours, theirs, x, branch().to(device))


@pytest.mark.slow
def test_compiled_path_equals_transformers():
    """The compiled path (fullgraph, no graph break) with the variant's offset and weightless norm."""
    torch._dynamo.reset()
    config = hf_config()
    theirs = hf_connection(config)
    ours = dv4.connection_from_hf(config, theirs)
    f, x = branch(), streams()
    compiled = torch.compile(lambda x: ours(x, f), fullgraph=True)
    xi = x.clone().requires_grad_()
    out = compiled(xi)
    (dx,) = torch.autograd.grad(out.square().sum(), (xi,))
    xh = x.clone().requires_grad_()
    hf_out = hf_output(theirs, xh, f)
    (hf_dx,) = torch.autograd.grad(hf_out.square().sum(), (xh,))
    torch.testing.assert_close(out, hf_out, **TOL)
    torch.testing.assert_close(dx, hf_dx, atol=1e-4, rtol=1e-4)


def test_decoder_layer_equals_two_connections():
    """transformers' decoder layer (attention and MoE replaced by linear branches, its norms kept) against two
    s2hc connections: the orientation as the decoder layer itself applies ``comb``."""

    class Attention(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, h, **kwargs):
            return self.linear(h), None

    class MLP(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, h, input_ids=None):
            return self.linear(h)

    config = hf_config()
    layer = DeepseekV4DecoderLayer(config, 0)
    layer.self_attn, layer.mlp = Attention(branch(seed=3)), MLP(branch(seed=4))
    layer.attn_hc.load_state_dict(hf_connection(config, seed=5).state_dict())
    layer.ffn_hc.load_state_dict(hf_connection(config, seed=6).state_dict())
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        randomize_(norm, torch.Generator().manual_seed(7), 0.3)
    attn_hc = dv4.connection_from_hf(config, layer.attn_hc, layer_index=0)
    ffn_hc = dv4.connection_from_hf(config, layer.ffn_hc, layer_index=0)
    x = streams(seed=8)
    with torch.no_grad():
        expected = layer(x)
        h = attn_hc(x, lambda h: layer.self_attn.linear(layer.input_layernorm(h)))
        ours = ffn_hc(h, lambda h: layer.mlp.linear(layer.post_attention_layernorm(h)))
    torch.testing.assert_close(ours, expected, **TOL)


@settings(max_examples=20)
@given(
    n=st.integers(1, 5),
    dim=st.integers(1, 12),
    iterations=st.integers(1, 6),
    hc_eps=st.sampled_from([0.0, 1e-6, 1e-3]),
    seed=st.integers(0, 2**16),
    fused=st.booleans(),
)
def test_random_shapes_equal_transformers(n, dim, iterations, hc_eps, seed, fused):
    config = hf_config(n=n, dim=dim, iterations=iterations, hc_eps=hc_eps, rms_norm_eps=1e-6)
    theirs = hf_connection(config, seed)
    ours = dv4.connection_from_hf(config, theirs, fused=fused)
    x = streams(n, dim, seed + 1, batch=1, time=3)
    post, comb, collapsed = theirs(x)
    h = ours.matrices(x)
    torch.testing.assert_close(h["post"], post, **TOL)
    torch.testing.assert_close(h["res"], comb.mT, **TOL)
    torch.testing.assert_close(HyperConnection.read(x, h), collapsed, **TOL)
    assert_same_connection(ours, theirs, x, branch(dim, seed + 2), n=n, dim=dim)


# 2. The head.


def test_head_equals_transformers_with_gradients():
    config = hf_config()
    theirs = hf_head(config)
    ours = dv4.head_from_hf(config, theirs)
    x = streams()
    weights = torch.randn(x.shape[:-2] + x.shape[-1:], generator=torch.Generator().manual_seed(3))
    outs, dxs = [], []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * weights).sum().backward()
        outs.append(out.detach())
        dxs.append(xi.grad)
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    torch.testing.assert_close(dxs[0], dxs[1], **TOL)
    mapped = dv4.head_state_from_hf(hf_grads(theirs), DIM, N)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, mapped[name], **TOL)


def test_head_at_initialisation_is_half_the_sum():
    head = HyperHead(DIM, N)
    x = streams()
    torch.testing.assert_close(head.weights(x), torch.full((2, 5, N), 0.5 + 1e-6))
    torch.testing.assert_close(head(x), (0.5 + 1e-6) * s2hc.reduce_streams(x))


def test_head_refuses_bad_streams_and_keeps_bfloat16():
    head = HyperHead(DIM, N)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, time, n_streams=4, dim=16\), got shape"):
        head(torch.zeros(2, 5, 3, DIM))
    assert head(streams().bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hc_eps must be a finite number >= 0, got -1"):
        HyperHead(DIM, N, hc_eps=-1)


# 3. Converters: round trips and bad input.


def test_round_trips_are_exact():
    config = hf_config()
    theirs = hf_connection(config)
    back = dv4.connection_state_to_hf(dv4.connection_state_from_hf(theirs, DIM, N), DIM, N)
    assert set(back) == {"fn", "base", "scale"}
    for name, value in theirs.state_dict().items():
        assert torch.equal(back[name], value), name
    ours = HyperConnection(**dv4.connection_options(config))
    randomize_(ours, torch.Generator().manual_seed(1), 0.5)
    hf = DeepseekV4HyperConnection(config)
    hf.load_state_dict(dv4.connection_to_hf(ours, config))
    again = dv4.connection_from_hf(config, hf)
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    head = HyperHead(**dv4.head_options(config))
    randomize_(head, torch.Generator().manual_seed(2), 0.5)
    hf_head_module = DeepseekV4HyperHead(config)
    hf_head_module.load_state_dict(dv4.head_to_hf(head, config))
    head_again = dv4.head_from_hf(config, hf_head_module)
    for name, value in head.state_dict().items():
        assert torch.equal(head_again.state_dict()[name], value), name


def test_options_follow_the_config():
    config = hf_config(n=3, dim=8, iterations=5, hc_eps=2e-4, rms_norm_eps=3e-6)
    assert dv4.connection_options(config) == dict(
        dim=8, n_streams=3, family="mhc", variant="deepseek-v4", iterations=5, hc_eps=2e-4, eps=3e-6
    )
    assert dv4.head_options(config.to_dict()) == dict(dim=8, n_streams=3, eps=3e-6, hc_eps=2e-4)
    defaults = DeepseekV4Config(hidden_size=8, num_hidden_layers=1)  # DeepSeek-V4's own constants
    assert dv4.connection_options(defaults)["iterations"] == 20 == mixers.options("mhc")["iterations"]
    assert dv4.connection_options(defaults)["hc_eps"] == s2hc.mixers.mhc.DEEPSEEK_V4_EPS


def test_bad_tensors_are_named_with_their_shapes():
    config = hf_config()
    state = hf_connection(config).state_dict()
    with pytest.raises(ValueError, match=r"tensor 'fn' has shape \(24, 64\), expected \(24, 80\) "
                                         r"\(hc_mult n=4, hidden_size C=20\)"):
        dv4.connection_state_from_hf(state, 20, N)  # wrong hidden size
    with pytest.raises(ValueError, match=r"tensor 'fn' has shape \(24, 64\), expected \(15, 48\)"):
        dv4.connection_state_from_hf(state, DIM, 3)  # wrong n
    with pytest.raises(ValueError, match=r"tensor 'scale' is missing; expected shape \(3,\)"):
        dv4.connection_state_from_hf({k: v for k, v in state.items() if k != "scale"}, DIM, N)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \{'extra': \(2,\)\}"):
        dv4.connection_state_from_hf({**state, "extra": torch.zeros(2)}, DIM, N)
    with pytest.raises(ValueError, match=r"'base' must be a tensor of shape \(24,\), got list"):
        dv4.connection_state_from_hf({**state, "base": [0.0] * 24}, DIM, N)
    paper = HyperConnection(DIM, N, family="mhc")
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \{'norm_weight': \(64,\)\}"):
        dv4.connection_state_to_hf(paper.state_dict(), DIM, N)
    with pytest.raises(ValueError, match=r"tensor 'hc_fn' has shape \(4, 64\), expected \(4, 32\)"):
        dv4.head_state_from_hf(hf_head(config), 8, N)
    with pytest.raises(ValueError, match=r"tensor 'bias' is missing; expected shape \(4,\)"):
        dv4.head_state_to_hf({"projection": torch.zeros(64, 4), "alpha": torch.zeros(1)}, DIM, N)


def test_connections_that_compute_something_else_are_refused():
    config = hf_config()
    with pytest.raises(ValueError, match="variant='deepseek-v4' and transpose_res=False.*got family='mhc', "
                                         "variant='paper'"):
        dv4.connection_to_hf(HyperConnection(DIM, N, family="mhc"))
    options = dv4.connection_options(config)
    with pytest.raises(ValueError, match="transpose_res=True"):
        dv4.connection_to_hf(HyperConnection(**options, transpose_res=True))
    with pytest.raises(ValueError, match="family='s2hc', variant=None"):
        dv4.connection_to_hf(HyperConnection(DIM, N, family="s2hc"))
    with pytest.raises(ValueError, match="the connection has iterations=20, but the DeepSeek-V4 config needs 7"):
        dv4.connection_to_hf(HyperConnection(**{**options, "iterations": 20}), config)
    with pytest.raises(ValueError, match="the head has hc_eps=1e-06, but the DeepSeek-V4 config needs 0.0001"):
        dv4.head_to_hf(HyperHead(DIM, N, eps=1e-5), config)
    with pytest.raises(ValueError, match="the DeepSeek-V4 config has no 'hc_mult'"):
        dv4.connection_options({"hidden_size": 8})


# 4. The variant as a family option; the defaults unchanged.


def test_variant_option_and_defaults():
    assert mixers.options("mhc") == {"iterations": 20, "alpha": 0.01, "variant": "paper", "hc_eps": None}
    paper = HyperConnection(DIM, N, family="mhc")
    assert paper.mixer.variant == "paper" and paper.mixer.pre_offset == 0.0 and paper.norm_weight is not None
    assert paper.mixer.guarantees == mixers.get("mhc").guarantees
    v4 = HyperConnection(DIM, N, family="mhc", variant="deepseek-v4")
    assert v4.mixer.hc_eps == 1e-6 == v4.mixer.pre_offset and not v4.mixer.weighted_norm
    assert v4.mixer.guarantees == mixers.Guarantees(nonnegative=True)
    assert "variant='deepseek-v4'" in repr(v4)
    with pytest.raises(ValueError, match=r"variant must be one of \['paper', 'deepseek-v4'\], got 'v4'"):
        HyperConnection(DIM, N, family="mhc", variant="v4")
    with pytest.raises(ValueError, match="hc_eps is DeepSeek-V4's constant and needs variant='deepseek-v4'"):
        HyperConnection(DIM, N, family="mhc", hc_eps=1e-6)
    with pytest.raises(ValueError, match="hc_eps must be a finite number >= 0, got -0.1"):
        HyperConnection(DIM, N, family="mhc", variant="deepseek-v4", hc_eps=-0.1)


def test_variant_through_the_configurations():
    from s2hc.config import check_family_options
    from s2hc.models import Transformer, get_preset
    from s2hc.params import count_connection_params

    assert check_family_options("mhc", 4, {"variant": "deepseek-v4", "hc_eps": "1e-5"}) == {
        "variant": "deepseek-v4", "hc_eps": 1e-5}
    with pytest.raises(ValueError, match="variant must be one of"):
        check_family_options("mhc", 4, {"variant": "v4"})
    model = Transformer(get_preset("tiny", family="mhc", n_streams=2, dim=32, n_layers=2, n_heads=2, ffn_dim=64,
                                   vocab_size=64, family_options={"variant": "deepseek-v4"}))
    assert all(block.attn_hc.norm_weight is None for block in model.blocks)
    assert torch.isfinite(model(torch.randint(0, 64, (2, 8)))).all()
    paper = count_connection_params("mhc", layers=2, dim=32, n_streams=2)
    assert count_connection_params("mhc", layers=2, dim=32, n_streams=2, variant="deepseek-v4") == paper - 4 * 2 * 32


def test_sinkhorn_without_eps_is_the_papers():
    """With hc_eps = 0 the plain-domain DeepSeek-V4 map is the paper's log-domain one (softmax = first column
    normalisation), in the same orientation: both end on the rows."""
    logits = 3 * torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for t in (1, 3, 20):
        torch.testing.assert_close(deepseek_v4_sinkhorn(logits, t, 0.0), log_sinkhorn(logits, t))
    h = deepseek_v4_sinkhorn(logits.float(), 20, 1e-6)
    assert (h > 0).all()
    torch.testing.assert_close(h.sum(-1), torch.ones(50, 4), atol=1e-5, rtol=0)


def test_variant_mixer_float64_gradcheck():
    mixer = mixers.build("mhc", 3, variant="deepseek-v4", hc_eps=1e-3, iterations=4).double()
    randomize_(mixer, torch.Generator().manual_seed(0), 0.5)
    d = torch.randn(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    assert torch.autograd.gradcheck(lambda d, a, b: mixer(d), (d, mixer.alpha, mixer.bias))


def test_a_model_reduces_its_streams_with_deepseeks_head(tmp_path):
    """``stream_reduce="head"``: the model's final reduction is a HyperHead, loaded from transformers' head it
    computes what ``DeepseekV4HyperHead`` computes before the final norm; at initialisation it is half the sum
    (the final norm sees the sum's direction); it learns; it exports; a residual model refuses it."""
    from s2hc.hf import S2HCForCausalLM
    from s2hc.hf.export import from_s2hc
    from s2hc.models import ModelConfig, Transformer

    shape = dict(vocab_size=64, dim=DIM, n_layers=2, n_heads=2, ffn_dim=32, family="mhc", n_streams=N,
                 family_options={"variant": "deepseek-v4", "hc_eps": 1e-4})
    torch.manual_seed(0)
    summed = Transformer(ModelConfig(**shape))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**shape, stream_reduce="head"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # half the sum, which the final RMSNorm (eps 1e-6) does not see but through its eps
        torch.testing.assert_close(model(ids), summed(ids), atol=1e-3, rtol=1e-3)
    config = hf_config(hc_eps=1e-4, rms_norm_eps=model.config.norm_eps)
    theirs = hf_head(config)
    model.stream_head.load_state_dict(dv4.head_state_from_hf(theirs, DIM, N))
    x = streams()
    torch.testing.assert_close(model.reduce_streams(x), theirs(x), **TOL)
    model(ids).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.stream_head.parameters())
    assert set(model.stream_head.parameters()) <= set(model.hyper_connection_parameters())
    from_s2hc(model).save_pretrained(tmp_path)
    reloaded = S2HCForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(ids), model(ids))
    with pytest.raises(ValueError, match="stream_reduce='head' weighs several streams"):
        ModelConfig(vocab_size=64, stream_reduce="head")
