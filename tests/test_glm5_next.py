"""GLM-5.3's mHC (``family="mhc", variant="deepseek-v4"``, ``stream_reduce="mean"``) against transformers'
``models/glm5_next``.

``Glm5NextTextHyperConnection`` subclasses DeepSeek-V4's connection; built from a tiny ``Glm5NextTextConfig`` made in
place (no Hub), its parameters seeded, converted with :mod:`s2hc.hf.glm5_next`. Compared in float32 to 1e-5 (float32
rounding: the released code runs the coefficients in float32, ``.float()``) and in float64 to 1e-10 relative with its
``.float()`` casts held at float64 (:class:`KeepFloat64`): ``H_pre``, ``H_post``, ``H_res = combᵀ``, the connection's
output and gradients, a decoder layer, and the text model's final hidden states with every attention (Kimi delta
attention, MLA with a DSA indexer: no s2hc attention) and MLP replaced by linear branches, its final read the
streams' unweighted mean. Round trips are exact; bad tensors and settings are named.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

from transformers import Glm5NextConfig, Glm5NextTextConfig  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import (  # noqa: E402
    Glm5NextTextDecoderLayer,
    Glm5NextTextHyperConnection,
    Glm5NextTextModel,
)

import s2hc  # noqa: E402
from s2hc import HyperConnection  # noqa: E402
from s2hc.hf import deepseek_v4, glm5_next  # noqa: E402
from s2hc.models import ModelConfig, Transformer  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
TOL64 = dict(atol=1e-12, rtol=1e-10)
DIM, N = 16, 4
TEXT = dict(num_attention_heads=2, num_key_value_heads=2, vocab_size=32, intermediate_size=32, moe_intermediate_size=16,
            n_routed_experts=2, num_experts_per_tok=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
            v_head_dim=8, linear_head_dim=8, linear_num_heads=2, index_topk=16, index_head_dim=8, index_n_heads=2,
            index_kpool=4, pad_token_id=0)


def hf_config(n=N, dim=DIM, iterations=7, hc_eps=1e-4, rms_norm_eps=3e-5, layers=2) -> Glm5NextTextConfig:
    """A tiny text config; the two epsilons differ from each other and from the defaults, so a swap shows."""
    return Glm5NextTextConfig(hidden_size=dim, hc_mult=n, hc_sinkhorn_iters=iterations, hc_eps=hc_eps,
                              rms_norm_eps=rms_norm_eps, num_hidden_layers=layers, **TEXT)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
            elif name.endswith("base"):
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return module


def streams(n=N, dim=DIM, seed=1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, 5, n, dim, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def branch(dim=DIM, seed=2) -> nn.Linear:
    return randomize(nn.Linear(dim, dim), seed)


class KeepFloat64(TorchFunctionMode):
    """The released code's ``.float()`` leaves float64 tensors as they are: its arithmetic, run in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        return func(*args, **(kwargs or {}))


def hf_output(module, x, f):
    """The decoder layer's update around branch ``f``: ``post · F(collapsed) + combᵀ X`` in the streams' dtype."""
    post, comb, collapsed = module(x)
    return post.to(x.dtype).unsqueeze(-1) * f(collapsed).unsqueeze(-2) + torch.matmul(comb.to(x.dtype).mT, x)


def assert_same_connection(ours, theirs, x, f, tol):
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype) / 10
    results = []
    for module, run in ((ours, lambda x, g: ours(x, g)), (theirs, lambda x, g: hf_output(theirs, x, g))):
        g, xi = copy.deepcopy(f), x.clone().requires_grad_()
        module.zero_grad()
        out = run(xi, g)
        (out * weights).sum().backward()
        results.append((out.detach(), xi.grad, dict(module.named_parameters())))
    (out, dx, params), (hf_out, hf_dx, hf_params) = results
    torch.testing.assert_close(out, hf_out, **tol)
    torch.testing.assert_close(dx, hf_dx, **tol)
    mapped = glm5_next.connection_state_from_hf({k: p.grad for k, p in hf_params.items()}, ours.dim, ours.n_streams)
    for name, grad in mapped.items():
        torch.testing.assert_close(params[name].grad, grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("fused", [False, True])
def test_matrices_and_connection_equal_transformers_float32(fused):
    config = hf_config()
    theirs = randomize(Glm5NextTextHyperConnection(config), 0)
    ours = glm5_next.connection_from_hf(config, theirs, fused=fused)
    assert ours.eps == 3e-5 and ours.mixer.hc_eps == 1e-4 and ours.mixer.iterations == 7
    x = streams()
    post, comb, collapsed = theirs(x)
    h = ours.matrices(x)
    torch.testing.assert_close(h["post"], post, **TOL)
    torch.testing.assert_close(h["res"], comb.mT, **TOL)
    torch.testing.assert_close(HyperConnection.read(x, h), collapsed, **TOL)
    assert_same_connection(ours, theirs, x, branch(), TOL)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_connection_equals_transformers_float64(n, fused):
    config = hf_config(n=n)
    theirs = randomize(Glm5NextTextHyperConnection(config), n).double()
    ours = glm5_next.connection_from_hf(config, theirs, fused=fused).double()
    x, f = streams(n, dtype=torch.float64), branch().double()
    with KeepFloat64():
        assert_same_connection(ours, theirs, x, f, TOL64)
    with torch.no_grad():  # as released: float32 coefficients
        torch.testing.assert_close(ours(x, f), hf_output(theirs, x, f), **TOL)


class Linear(nn.Module):
    """A branch in place of GLM-5.3's attention (Kimi delta or MLA: returns the tensor alone) or its MLP."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden_states, **kwargs):
        return self.linear(hidden_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_text_model_equals_s2hc_connections_and_mean(dtype):
    """``Glm5NextTextModel`` (two layers of Kimi delta attention, the default schedule below 4 layers) with every
    attention and MLP a linear branch: n copies of the embedding, the connections, the streams' mean, the final norm,
    against s2hc's connections and an s2hc model's ``reduce_streams`` with :func:`model_options`."""
    config = hf_config()
    assert set(config.layer_types) == {"linear_attention"}
    model = Glm5NextTextModel(config)
    for i, layer in enumerate(model.layers):
        layer.self_attn, layer.mlp = Linear(branch(seed=10 + i)), Linear(branch(seed=20 + i))
    randomize(model, 6)
    model = model.to(dtype).eval()
    options = glm5_next.model_options(config)
    s2hc_model = Transformer(ModelConfig(vocab_size=32, n_heads=2, ffn_dim=32, **options))
    assert s2hc_model.config.stream_reduce == "mean" and s2hc_model.stream_head is None
    hcs = [(glm5_next.connection_from_hf(config, layer.attn_hc, i).to(dtype),
            glm5_next.connection_from_hf(config, layer.ffn_hc, i).to(dtype)) for i, layer in enumerate(model.layers)]
    ids = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), KeepFloat64():
        expected = model(ids).last_hidden_state
        x = s2hc.expand_streams(model.embed_tokens(ids), N)
        for layer, (attn_hc, ffn_hc) in zip(model.layers, hcs):
            x = attn_hc(x, lambda h, layer=layer: layer.self_attn.linear(layer.input_layernorm(h)))
            x = ffn_hc(x, lambda h, layer=layer: layer.mlp.linear(layer.post_attention_layernorm(h)))
        ours = model.norm(s2hc_model.reduce_streams(x))
    torch.testing.assert_close(ours, expected, **(TOL64 if dtype == torch.float64 else TOL))


def test_decoder_layer_with_indexed_attention_equals_two_connections():
    config = hf_config(layers=4)
    layer = Glm5NextTextDecoderLayer(config, 3)
    assert layer.block_type == "indexed_attention"

    class Indexed(Linear):
        def forward(self, hidden_states, **kwargs):
            return self.linear(hidden_states), None, None

    layer.self_attn, layer.mlp = Indexed(branch(seed=3)), Linear(branch(seed=4))
    randomize(layer, 5)
    attn_hc = glm5_next.connection_from_hf(config, layer.attn_hc, 3)
    ffn_hc = glm5_next.connection_from_hf(config, layer.ffn_hc, 3)
    x = streams(seed=8)
    with torch.no_grad():
        expected, _ = layer(x)
        h = attn_hc(x, lambda h: layer.self_attn.linear(layer.input_layernorm(h)))
        ours = ffn_hc(h, lambda h: layer.mlp.linear(layer.post_attention_layernorm(h)))
    torch.testing.assert_close(ours, expected, **TOL)


def test_options_follow_the_config_and_defaults_are_glms():
    assert glm5_next.connection_options(hf_config()) == dict(
        dim=DIM, n_streams=N, family="mhc", variant="deepseek-v4", iterations=7, hc_eps=1e-4, eps=3e-5)
    defaults = glm5_next.connection_options(Glm5NextTextConfig(hidden_size=8, num_hidden_layers=1))
    assert (defaults["n_streams"], defaults["iterations"], defaults["hc_eps"], defaults["eps"]) == (4, 20, 1e-6, 1e-5)
    nested = Glm5NextConfig(text_config=dict(hidden_size=8, num_hidden_layers=1, hc_eps=2e-6, **TEXT))
    assert glm5_next.connection_options(nested)["hc_eps"] == 2e-6
    assert glm5_next.connection_options(nested.to_dict())["hc_eps"] == 2e-6
    with pytest.raises(ValueError, match=r"model_type one of \['glm5_next', 'glm5_next_text'\], got 'hy_v4'"):
        glm5_next.connection_options({"model_type": "hy_v4"})
    with pytest.raises(ValueError, match="the GLM-5.3 config has no 'hc_mult'"):
        glm5_next.connection_options({"model_type": "glm5_next_text", "hidden_size": 8})


def test_round_trips_are_exact_and_bad_input_named():
    config = hf_config()
    theirs = randomize(Glm5NextTextHyperConnection(config), 0)
    back = glm5_next.connection_state_to_hf(glm5_next.connection_state_from_hf(theirs, DIM, N), DIM, N)
    for name, value in theirs.state_dict().items():
        assert torch.equal(back[name], value), name
    ours = randomize(HyperConnection(**glm5_next.connection_options(config)), 1)
    hf = Glm5NextTextHyperConnection(config)
    hf.load_state_dict(glm5_next.connection_to_hf(ours, config))
    for name, value in ours.state_dict().items():
        assert torch.equal(glm5_next.connection_from_hf(config, hf).state_dict()[name], value), name
    assert glm5_next.connection_state_from_hf is deepseek_v4.connection_state_from_hf  # DeepSeek-V4's layout
    with pytest.raises(ValueError, match=r"tensor 'fn' has shape \(24, 64\), expected \(24, 80\)"):
        glm5_next.connection_state_from_hf(theirs, 20, N)
    with pytest.raises(ValueError, match="the connection has eps=1e-06, but the GLM-5.3 config needs 3e-05"):
        glm5_next.connection_to_hf(HyperConnection(**{**glm5_next.connection_options(config), "eps": 1e-6}), config)
    with pytest.raises(ValueError, match="variant='deepseek-v4' and transpose_res=False"):
        glm5_next.connection_to_hf(HyperConnection(DIM, N, family="mhc"))


def test_diagnose_static_of_a_saved_checkpoint(tmp_path):
    """A tiny ``Glm5NextForConditionalGeneration`` saved by transformers (its vision tower too): DeepSeek-V4's
    connections under ``model.language_model``, settings from ``text_config``, no head (the mean)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from s2hc.hf.static import diagnose_static, read_static

    text = dict(hidden_size=DIM, num_hidden_layers=2, hc_mult=N, hc_sinkhorn_iters=5, hc_eps=1e-4, **TEXT)
    vision = dict(depth=1, hidden_size=16, out_hidden_size=16, num_heads=2, intermediate_size=16,
                  projection_intermediate_size=16)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision))
    randomize(model.model.language_model.layers[1].attn_hc, 3)
    model.save_pretrained(tmp_path)
    result = diagnose_static(tmp_path)
    assert (result["layout"], result["family"], result["n_streams"], result["head_weights"]) == (
        "glm5_next", "mhc", N, None)
    assert result["family_options"] == {"variant": "deepseek-v4", "iterations": 5, "hc_eps": 1e-4, "eps": 1e-5}
    hc = read_static(tmp_path).connections[2][1]
    ours = glm5_next.connection_from_hf(model.config, model.model.language_model.layers[1].attn_hc).double()
    zero = torch.zeros(1, 1, N, DIM, dtype=torch.float64)
    torch.testing.assert_close(hc.matrices(zero[..., :1])["res"], ours.matrices(zero)["res"])
