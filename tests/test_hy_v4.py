"""Hy4's independent HC (``family="ihc"``) and its head against transformers' ``models/hy_v4``.

transformers' ``HYV4HyperConnection``, ``HYV4HyperHead`` and ``HYV4DecoderLayer`` are built from a tiny ``HYV4Config``
made in place (no Hub), their parameters drawn from seeded generators, and converted with :mod:`s2hc.hf.hy_v4`.
Compared in float32 to 1e-5 (float32 rounding: Hy4 computes in float32 whatever the input, ``.float()`` with
autocast off), and in float64 to 1e-10 relative with Hy4's ``.float()`` casts held at float64 (:class:`KeepFloat64`:
the released code's arithmetic, in float64): the read, the write, ``H_res = I``, the connection's output and its
gradients with respect to the streams and every parameter, the head, a decoder layer and a whole tiny model's
logits with its attention and MoE replaced by linear branches (Hy4's MLA with a DSA indexer, sinks and gated
heads is no s2hc attention). Round trips are exact; bad tensors are named.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")

from transformers import HYV4Config  # noqa: E402
from transformers.models.hy_v4.modeling_hy_v4 import (  # noqa: E402
    HYV4DecoderLayer,
    HYV4ForCausalLM,
    HYV4HyperConnection,
    HYV4HyperHead,
)

import s2hc  # noqa: E402
from s2hc import HyperConnection, HyperHead, mixers  # noqa: E402
from s2hc.hf import hy_v4  # noqa: E402
from s2hc.models import ModelConfig, Transformer  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
TOL64 = dict(atol=1e-12, rtol=1e-10)
DIM, N = 16, 4


def hf_config(n=N, dim=DIM, hc_eps=1e-4, magnitude=1.7, rms_norm_eps=1e-5, layers=2) -> HYV4Config:
    """A tiny config; hc_eps, the magnitude and the norm's eps differ from each other and from the defaults."""
    return HYV4Config(
        hidden_size=dim, hc_mult=n, hc_eps=hc_eps, hc_magnitude=magnitude, rms_norm_eps=rms_norm_eps,
        num_hidden_layers=layers, num_attention_heads=2, vocab_size=32, intermediate_size=32,
        moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1, q_lora_rank=8, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter of ``module`` seeded: projections ~ 0.3·N(0, 1), biases ~ N(0, 1), scales in [0.5, 1.5)."""
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


def streams(n=N, dim=DIM, seed=1, batch=2, time=5, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, time, n, dim, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def branch(dim=DIM, seed=2) -> nn.Linear:
    linear = nn.Linear(dim, dim)
    return randomize(linear, seed)


class KeepFloat64(TorchFunctionMode):
    """Hy4's ``.float()`` leaves float64 tensors as they are: the released arithmetic, run in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        return func(*args, **(kwargs or {}))


class RecordSigmoid(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.sigmoid:
            self.outputs.append(out)
        return out


def hf_output(module, x, f):
    """The decoder layer's update around branch ``f``, as ``HYV4DecoderLayer`` writes it (in float32)."""
    post, collapsed = module(x)
    return (post.float().unsqueeze(-1) * f(collapsed).float().unsqueeze(-2) + x.float()).to(x.dtype)


# 1. The matrices and the connection.


@pytest.mark.parametrize("fused", [False, True])
def test_matrices_equal_transformers(fused):
    config = hf_config()
    theirs = randomize(HYV4HyperConnection(config), 0)
    ours = hy_v4.connection_from_hf(config, theirs, fused=fused)
    x = streams()
    with RecordSigmoid() as record:
        post, collapsed = theirs(x)
    h = ours.matrices(x)
    torch.testing.assert_close(h["pre"], record.outputs[0] + config.hc_eps, **TOL)
    torch.testing.assert_close(h["post"], post, **TOL)
    torch.testing.assert_close(h["post"], config.hc_magnitude * record.outputs[1] + config.hc_eps, **TOL)
    assert torch.equal(h["res"], torch.eye(N).expand(2, 5, N, N))
    torch.testing.assert_close(HyperConnection.read(x, h), collapsed, **TOL)
    assert ours.norm_weight is None and set(ours.state_dict()) == {
        "projection", "alpha_pre", "alpha_post", "bias_pre", "bias_post"}


def outputs_and_gradients(ours, theirs, x, f):
    tokens = x.shape[0] * x.shape[1]
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype) / tokens
    results = []
    for module, run in ((ours, lambda x, g: ours(x, g)), (theirs, lambda x, g: hf_output(theirs, x, g))):
        g, xi = copy.deepcopy(f), x.clone().requires_grad_()
        module.zero_grad()
        out = run(xi, g)
        (out * weights).sum().backward()
        results.append((out.detach(), xi.grad, dict(module.named_parameters()), g))
    return results


def assert_same_connection(ours, theirs, x, f, tol, n=N, dim=DIM):
    (out, dx, params, g), (hf_out, hf_dx, hf_params, hf_g) = outputs_and_gradients(ours, theirs, x, f)
    torch.testing.assert_close(out, hf_out, **tol)
    torch.testing.assert_close(dx, hf_dx, **tol)
    mapped = hy_v4.connection_state_from_hf({k: p.grad for k, p in hf_params.items()}, dim, n)
    assert set(mapped) == set(params)
    for name, grad in mapped.items():
        torch.testing.assert_close(params[name].grad, grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    for p, q in zip(g.parameters(), hf_g.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_connection_output_and_gradients_equal_transformers_float32(fused, recompute):
    config = hf_config()
    theirs = randomize(HYV4HyperConnection(config), 0)
    ours = hy_v4.connection_from_hf(config, theirs, fused=fused, recompute=recompute)
    assert_same_connection(ours, theirs, streams(), branch(), TOL)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_connection_equals_transformers_float64(n, fused):
    """1e-10 relative: the same arithmetic. Without :class:`KeepFloat64`, Hy4's coefficients run in float32."""
    config = hf_config(n=n)
    theirs = randomize(HYV4HyperConnection(config), n).double()
    ours = hy_v4.connection_from_hf(config, theirs, fused=fused).double()
    x, f = streams(n, dtype=torch.float64), branch().double()
    with KeepFloat64():
        assert_same_connection(ours, theirs, x, f, TOL64, n=n)
    with torch.no_grad():  # the released code as it runs: float32 coefficients, so float32's rounding
        torch.testing.assert_close(ours(x, f), hf_output(theirs, x, f), **TOL)


def test_head_equals_transformers_float32_and_float64():
    config = hf_config()
    theirs = randomize(HYV4HyperHead(config), 3)
    ours = hy_v4.head_from_hf(config, theirs)
    x = streams()
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    theirs, ours, x = theirs.double(), ours.double(), x.double()
    with KeepFloat64():
        torch.testing.assert_close(ours(x), theirs(x), **TOL64)


class Attention(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden_states, **kwargs):
        return self.linear(hidden_states), None, None


class MLP(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden_states):
        return self.linear(hidden_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoder_layer_equals_two_connections(dtype):
    config = hf_config()
    layer = HYV4DecoderLayer(config, 0)
    layer.self_attn, layer.mlp = Attention(branch(seed=3)), MLP(branch(seed=4))
    randomize(layer, 5)
    layer = layer.to(dtype)
    attn_hc = hy_v4.connection_from_hf(config, layer.attn_hc, layer_index=0).to(dtype)
    ffn_hc = hy_v4.connection_from_hf(config, layer.ffn_hc, layer_index=0).to(dtype)
    x = streams(seed=8, dtype=dtype)
    with torch.no_grad(), KeepFloat64():
        expected, _ = layer(x)
        h = attn_hc(x, lambda h: layer.self_attn.linear(layer.input_layernorm(h)))
        ours = ffn_hc(h, lambda h: layer.mlp.linear(layer.post_attention_layernorm(h)))
    torch.testing.assert_close(ours, expected, **(TOL64 if dtype == torch.float64 else TOL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiny_model_logits_equal_transformers(dtype):
    """``HYV4ForCausalLM`` with every attention and MLP a linear branch: embedding, n copies, the connections, the
    head, the final norm, the LM head, against s2hc's modules with ``model_options``' settings."""
    config = hf_config(layers=3)
    model = HYV4ForCausalLM(config)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn, layer.mlp = Attention(branch(seed=10 + i)), MLP(branch(seed=20 + i))
    randomize(model, 6)
    model = model.to(dtype).eval()
    options = hy_v4.model_options(config)
    assert options["stream_reduce"] == "head" == s2hc.models.model_config.default_stream_reduce("ihc")
    hcs = [(hy_v4.connection_from_hf(config, layer.attn_hc, i).to(dtype),
            hy_v4.connection_from_hf(config, layer.ffn_hc, i).to(dtype)) for i, layer in enumerate(model.model.layers)]
    head = hy_v4.head_from_hf(config, model.model.hc_head).to(dtype)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), KeepFloat64():
        expected = model(ids).logits
        x = s2hc.expand_streams(model.model.embed_tokens(ids), N)
        for layer, (attn_hc, ffn_hc) in zip(model.model.layers, hcs):
            x = attn_hc(x, lambda h, layer=layer: layer.self_attn.linear(layer.input_layernorm(h)))
            x = ffn_hc(x, lambda h, layer=layer: layer.mlp.linear(layer.post_attention_layernorm(h)))
        logits = model.lm_head(model.model.norm(head(x)))
    torch.testing.assert_close(logits, expected, **(TOL64 if dtype == torch.float64 else TOL))


# 2. Defaults: the released code's.


def test_defaults_are_hy4s():
    defaults = HYV4Config(hidden_size=8, num_hidden_layers=1)
    options = hy_v4.connection_options(defaults)
    assert mixers.options("ihc") == {"hc_eps": options["hc_eps"], "hc_magnitude": options["hc_magnitude"]}
    assert options["eps"] == 1e-5 and options["n_streams"] == 4
    for n in (1, 2, 4):
        ours = HyperConnection(DIM, n, family="ihc", layer_index=3)
        base = -math.log(max(n - 1, 1))
        assert torch.equal(ours.bias_pre, torch.full((n,), base)) and torch.equal(ours.bias_post, torch.zeros(n))
        assert ours.alpha_pre.item() == ours.alpha_post.item() == pytest.approx(0.01)
        head = s2hc.connection.forms.get("ihc").build_head(DIM, n, norm_eps=1e-5, options={})
        assert torch.equal(head.bias, torch.full((n,), base)) and head.hc_eps == 1e-6
    x = streams()
    h = HyperConnection(DIM, N, family="ihc").matrices(x)
    torch.testing.assert_close(h["pre"], torch.full((2, 5, N), 0.25 + 1e-6))
    torch.testing.assert_close(h["post"], torch.full((2, 5, N), 1.0 + 1e-6))


def test_transformers_init_is_the_start():
    """A model transformers initialises starts its gates where s2hc's ``ihc`` does (the projection aside: s2hc's
    starts at zero, Hy4 draws N(0, initializer_range²))."""
    model = HYV4ForCausalLM(hf_config(magnitude=2.0, hc_eps=1e-6))
    ours = HyperConnection(DIM, N, family="ihc")
    theirs = hy_v4.connection_state_from_hf(model.model.layers[0].attn_hc, DIM, N)
    for name in ("bias_pre", "bias_post", "alpha_pre", "alpha_post"):
        torch.testing.assert_close(theirs[name], getattr(ours, name).detach(), msg=name)
    head = hy_v4.head_state_from_hf(model.model.hc_head, DIM, N)
    torch.testing.assert_close(head["bias"], torch.full((N,), -math.log(3)))


def test_model_options_build_and_residual_start():
    model = Transformer(ModelConfig(vocab_size=64, n_layers=2, n_heads=2, ffn_dim=32,
                                    **hy_v4.model_options(hf_config())))
    assert model.stream_head is not None and model.blocks[0].attn_hc.mixer.hc_magnitude == 1.7
    assert torch.isfinite(model(torch.randint(0, 64, (2, 8)))).all()
    c = HyperConnection(DIM, N, family="ihc", hc_magnitude=1.7, gate_init="residual")
    h = c.matrices(streams())
    torch.testing.assert_close(h["pre"], torch.full((2, 5, N), 0.25))
    torch.testing.assert_close(h["post"].sum(-1), torch.full((2, 5), float(N)))
    with pytest.raises(ValueError, match=r"outside the write gate's range .* \(its magnitude 1.2\)"):
        HyperConnection(DIM, N, family="ihc", hc_magnitude=1.2, gate_init="residual")


# 3. Converters: round trips and bad input.


def test_round_trips_are_exact():
    config = hf_config()
    theirs = randomize(HYV4HyperConnection(config), 0)
    back = hy_v4.connection_state_to_hf(hy_v4.connection_state_from_hf(theirs, DIM, N), DIM, N)
    for name, value in theirs.state_dict().items():
        assert torch.equal(back[name], value), name
    ours = randomize(HyperConnection(**hy_v4.connection_options(config)), 1)
    hf = HYV4HyperConnection(config)
    hf.load_state_dict(hy_v4.connection_to_hf(ours, config))
    again = hy_v4.connection_from_hf(config, hf)
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    head = randomize(HyperHead(**hy_v4.head_options(config)), 2)
    hf_head = HYV4HyperHead(config)
    hf_head.load_state_dict(hy_v4.head_to_hf(head, config))
    for name, value in head.state_dict().items():
        assert torch.equal(hy_v4.head_from_hf(config, hf_head).state_dict()[name], value), name


def test_bad_tensors_and_settings_are_named():
    config = hf_config()
    state = HYV4HyperConnection(config).state_dict()
    with pytest.raises(ValueError, match=r"tensor 'fn' has shape \(8, 64\), expected \(8, 80\) "
                                         r"\(hc_mult n=4, hidden_size C=20\)"):
        hy_v4.connection_state_from_hf(state, 20, N)
    with pytest.raises(ValueError, match=r"Hy4 connection state: tensor 'scale' is missing; expected shape \(2,\)"):
        hy_v4.connection_state_from_hf({k: v for k, v in state.items() if k != "scale"}, DIM, N)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \{'norm_weight': \(64,\)\}"):
        hy_v4.connection_state_to_hf(HyperConnection(DIM, N, family="identity").state_dict(), DIM, N)
    with pytest.raises(ValueError, match="connection must be family='ihc' to compute Hy4's independent HC, got "
                                         "family='mhc'"):
        hy_v4.connection_to_hf(HyperConnection(DIM, N, family="mhc", variant="deepseek-v4"))
    with pytest.raises(ValueError, match="the connection has hc_magnitude=2.0, but the Hy4 config needs 1.7"):
        hy_v4.connection_to_hf(HyperConnection(DIM, N, family="ihc", eps=1e-5, hc_eps=1e-4), config)
    with pytest.raises(ValueError, match="the Hy4 config has no 'hc_magnitude'"):
        hy_v4.connection_options({"hidden_size": 8, "hc_mult": 4, "hc_eps": 1e-6})
    with pytest.raises(ValueError, match="hc_magnitude must be a finite number > 0, got 0"):
        HyperConnection(DIM, N, family="ihc", hc_magnitude=0)


# 4. s2hc diagnose --static of a checkpoint transformers saved.


def test_diagnose_static_of_a_saved_checkpoint(tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from s2hc.hf.static import diagnose_static

    model = HYV4ForCausalLM(hf_config(magnitude=2.0, hc_eps=1e-6))
    randomize(model.model.layers[1].ffn_hc, 7)
    model.save_pretrained(tmp_path)
    result = diagnose_static(tmp_path)
    assert (result["layout"], result["family"], result["n_streams"]) == ("hy_v4", "ihc", N)
    assert result["family_options"] == {"hc_eps": 1e-6, "hc_magnitude": 2.0, "eps": 1e-5}
    pre, post = (torch.tensor(result["matrices"][k], dtype=torch.float64) for k in ("pre", "post"))
    torch.testing.assert_close(pre[0], torch.full((N,), 0.25 + 1e-6, dtype=torch.float64))  # Hy4's start
    torch.testing.assert_close(post[0], torch.full((N,), 1 + 1e-6, dtype=torch.float64))
    moved = model.model.layers[1].ffn_hc
    expected = 2.0 * torch.sigmoid(moved.base[N:].double()) + 1e-6
    torch.testing.assert_close(post[3], expected)
    torch.testing.assert_close(torch.tensor(result["head_weights"], dtype=torch.float64),
                               torch.full((N,), 0.25 + 1e-6, dtype=torch.float64))
    run = subprocess.run([sys.executable, "-m", "s2hc", "diagnose", "--static", str(tmp_path), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "ihc (n = 4, hy_v4 layout)" in run.stdout
    weights = load_file(tmp_path / "model.safetensors")
    key = next(k for k in weights if k.endswith("hc_attn_layer.hc_base"))
    save_file({**weights, key: torch.zeros(7)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"needs a base of shape \(2n,\), found \(7,\)"):
        diagnose_static(tmp_path)
