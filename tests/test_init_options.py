"""The initialisation options: the connection's ``projection_init`` and ``gate_init``, the model's ``weight_init``.

- ``projection_init="normal"`` (the s²HC authors' code): the projection's sample std is ``sqrt(2 / (5C))`` (both
  the n·C form and HC's per-stream one), its mean 0, reproducible from the seed; zero by default.
- ``weight_init="neox"`` (the authors' ``initialize_weights``): the std of every kind of weight is its formula;
  ``"gpt2"`` (default) is today's (GPT-2's) formulas, bit for bit the model built without the field.
- ``gate_init="residual"``: for every sigmoid-gated family (and DeepSeek-V4's mHC), and for ``hc``'s tanh gates,
  the model computes the residual model's logits at step 0 (float32, ≤ 1e-5) when it holds the same weights; the
  residual model's weights are copied into it as upcycling does (``load_state_dict(strict=False)``; only the
  connections' parameters are left, at their initialisation). With the papers' sigmoid gates the logits differ;
  HC's own tanh gates are residual at step 0 already (the streams stay copies), the residual ones separate them.
  ``H_pre = 1/n`` and ``Σ H_post = n`` for every token.
- Bad values get one line naming the option and the allowed values; ``gate_init="residual"`` with
  ``stream_reduce="sum"`` is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from s2hc import HyperConnection, mixers
from s2hc.connection import HyperHead, build_connection
from s2hc.connection import init as connection_init
from s2hc.models import ModelConfig, Transformer, get_preset, widen

SIGMOID_GATED = [name for name, cls in mixers.REGISTRY.items() if cls.gate == "sigmoid"]
TANH_GATED = [name for name, cls in mixers.REGISTRY.items() if cls.gate == "tanh"]
# Every sigmoid-gated family with its defaults, and DeepSeek-V4's mHC (H_pre + hc_eps, a norm without a weight).
SIGMOID_CASES = [(family, {}) for family in SIGMOID_GATED] + [("mhc", {"variant": "deepseek-v4"})]
SMALL = dict(vocab_size=256, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)


def _model(seed: int = 0, **config) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(get_preset("tiny", **{**SMALL, **config})).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def _relative(sample: torch.Tensor, expected: float) -> float:
    return abs(sample.std().item() / expected - 1)


# ---- projection_init --------------------------------------------------------------------------------------


def test_the_families_are_found_by_their_gate():
    assert len(SIGMOID_GATED) >= 6 and TANH_GATED  # the registry holds both kinds


@pytest.mark.parametrize("family, dim, options", [("s2hc", 256, {}), ("mhc", 256, {}),
                                                  ("hc", 1024, {}), ("hc", 256, {"projection": "flat"})])
def test_a_normal_projection_has_the_authors_std(family, dim, options):
    """std = sqrt(2 / (5C)), C the stream width, for the n·C-wide projection and HC's C-wide per-stream one."""
    torch.manual_seed(0)
    hc = HyperConnection(dim, 4, family=family, projection_init="normal", **options)
    projection = hc.projection.detach()
    assert projection.shape[0] == (dim if hc.per_stream else 4 * dim)
    std = math.sqrt(2 / (5 * dim))
    assert connection_init.projection_std(dim) == pytest.approx(std, rel=1e-12)
    assert _relative(projection, std) < 0.04  # >= 6 000 samples: the sample std's error is about 1 %
    assert abs(projection.mean().item()) < 0.05 * std
    assert not HyperConnection(dim, 4, family=family, **options).projection.any()  # zero by default


def test_a_normal_projection_is_reproducible_from_the_seed():
    def projections(seed):
        model = _model(seed, family="s2hc", n_streams=4, family_options={"projection_init": "normal"})
        return [m.projection.detach().clone() for m in model.modules() if isinstance(m, HyperConnection)]

    first, again, other = projections(0), projections(0), projections(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    std = math.sqrt(2 / (5 * SMALL["dim"]))
    assert _relative(torch.cat([p.flatten() for p in first]), std) < 0.05  # init_weights leaves them alone


def test_the_options_are_saved_with_the_model_config():
    options = {"projection_init": "normal", "gate_init": "residual"}
    config = get_preset("tiny", family="s2hc", n_streams=4, stream_reduce="mean", weight_init="neox",
                        family_options=options)
    again = ModelConfig.from_dict(config.to_dict())
    assert again == config and again.family_options == options and again.weight_init == "neox"


# ---- weight_init ------------------------------------------------------------------------------------------

GPT2_LIKE = dict(vocab_size=2048, dim=256, n_layers=3, n_heads=4, ffn_dim=512, max_seq_len=512, norm="layernorm",
                 mlp="gelu", pos="learned", qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=False)
LLAMA_LIKE = dict(GPT2_LIKE, norm="rmsnorm", mlp="swiglu", pos="rope", qkv_bias=False, out_bias=False,
                  mlp_bias=False, qk_norm=True)


def _weights_by_kind(model: Transformer) -> dict[str, torch.Tensor]:
    def weights(modules):
        return torch.cat([m.weight.detach().flatten() for m in modules if m is not None])

    blocks = model.blocks
    return {"embed": weights([model.embed, model.pos_embed]), "lm_head": weights([model.lm_head]),
            "in_proj": weights([p for b in blocks for p in (b.attn.q_proj, b.attn.k_proj, b.attn.v_proj,
                                                             b.mlp.gate_proj, b.mlp.up_proj)]),
            "out_proj": weights([p for b in blocks for p in (b.attn.o_proj, b.mlp.down_proj)])}


def _check_biases_and_norms(model: Transformer) -> None:
    for name, p in model.named_parameters():
        if "_hc." in name:
            continue
        if name.endswith("bias"):
            assert not p.any(), name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


@pytest.mark.parametrize("shape", [GPT2_LIKE, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
@pytest.mark.parametrize("weight_init", ["gpt2", "neox"])
def test_the_weight_init_stds_follow_their_formulas(weight_init, shape):
    model = _model(0, weight_init=weight_init, family="s2hc", n_streams=4, **shape)
    C, L = GPT2_LIKE["dim"], GPT2_LIKE["n_layers"]
    if weight_init == "neox":  # the authors': sqrt(2 / 5 / n_embd), and 1 / sqrt(n_embd) / n_layer for proj
        std, out_std = math.sqrt(2 / (5 * C)), 1 / (math.sqrt(C) * L)
    else:  # GPT-2's (today's): init_std, and init_std / sqrt(2 · n_layers) for the residual output projections
        std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
    expected = {"embed": std, "lm_head": std, "in_proj": std, "out_proj": out_std}
    for kind, weights in _weights_by_kind(model).items():
        assert _relative(weights, expected[kind]) < 0.03, kind
        assert abs(weights.mean().item()) < 0.02 * expected[kind], kind
    _check_biases_and_norms(model)
    for hc in (m for m in model.modules() if isinstance(m, HyperConnection)):  # the connections keep theirs
        assert not hc.projection.any()
        b_pre, b_post = connection_init.gate_biases("papers", hc.mixer.gate, 4, hc.layer_index)
        assert torch.equal(hc.bias_pre, b_pre) and torch.equal(hc.bias_post, b_post)


def test_gpt2_is_the_default_and_unchanged():
    assert ModelConfig().weight_init == "gpt2"
    default, explicit = _model(3), _model(3, weight_init="gpt2")
    for (name, a), (_, b) in zip(default.state_dict().items(), explicit.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_stream_head_keeps_its_own_initialisation():
    config = dict(family="mhc", n_streams=4, stream_reduce="head", family_options={"variant": "deepseek-v4"})
    heads = [_model(5, weight_init=weight_init, **config).stream_head for weight_init in ("gpt2", "neox")]
    assert isinstance(heads[0], HyperHead)
    for a, b in zip(heads[0].parameters(), heads[1].parameters()):
        assert torch.equal(a, b)


# ---- gate_init="residual" ---------------------------------------------------------------------------------


def _widened(residual: Transformer, family: str, n: int, gate_init: str, **options) -> Transformer:
    """A ``family`` model at ``n`` streams holding ``residual``'s weights (its connections at their init)."""
    model = _model(1, family=family, n_streams=n, stream_reduce="mean",
                   family_options={"gate_init": gate_init, **options})
    missing, unexpected = model.load_state_dict(residual.state_dict(), strict=False)
    assert not unexpected and missing and all("_hc." in name for name in missing)
    return model


def _step0_difference(family: str, n: int, gate_init: str, **options) -> float:
    residual = _model(0)
    with torch.no_grad():
        expected = residual(_ids())
        got = _widened(residual, family, n, gate_init, **options)(_ids())
    assert expected.std() > 0.1  # logits that are not all alike
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("family, options", SIGMOID_CASES)
@pytest.mark.parametrize("n", [2, 4])
def test_residual_gates_compute_the_residual_model_at_step_0(family, options, n):
    assert _step0_difference(family, n, "residual", **options) <= 1e-5
    if mixers.get(family)(n, **options).start_biases(0) is not None:  # a release's own start: Hy4's ihc, below
        return
    assert _step0_difference(family, n, "papers", **options) > 1e-3  # the test can fail


@pytest.mark.parametrize("n", [2, 4])
def test_hy4s_start_is_the_residual_model_with_streams_as_copies(n):
    """Hy4's own start (``ihc``, ``gate_init="papers"``: reads 1/n + ε, writes 1 + ε, H_res = I) computes the
    residual model at step 0 up to ``hc_eps``, with the streams copies of each other (as HC's); the residual gates
    give the same function with the streams apart."""
    residual = _model(0)
    assert _step0_difference("ihc", n, "papers") <= 1e-5
    copies = _final_streams(_widened(residual, "ihc", n, "papers"))
    assert torch.equal(copies, copies[..., :1, :].expand_as(copies))
    apart = _final_streams(_widened(residual, "ihc", n, "residual"))
    assert (apart - apart.mean(-2, keepdim=True)).abs().max() > 0.05 * apart.abs().max()


def _final_streams(model: Transformer) -> torch.Tensor:
    captured = {}
    model.blocks[-1].register_forward_hook(lambda module, args, out: captured.setdefault("x", out))
    with torch.no_grad():
        model(_ids())
    return captured["x"]


@pytest.mark.parametrize("family", TANH_GATED)
@pytest.mark.parametrize("n", [2, 4])
def test_tanh_gates_are_residual_at_step_0_either_way_but_only_residual_ones_separate_the_streams(family, n):
    """HC's own gates (read one stream, write 1 to all, H_res = I) keep the streams copies of the residual stream:
    the residual model already, but one whose streams never differ at init. ``gate_init="residual"`` gives the
    same function with the streams apart."""
    residual = _model(0)
    for gate_init in ("papers", "residual"):
        assert _step0_difference(family, n, gate_init) <= 1e-5
    copies = _final_streams(_widened(residual, family, n, "papers"))
    apart = _final_streams(_widened(residual, family, n, "residual"))
    assert torch.equal(copies, copies[..., :1, :].expand_as(copies))
    assert (apart - apart.mean(-2, keepdim=True)).abs().max() > 0.05 * apart.abs().max()


@pytest.mark.parametrize("family, options", SIGMOID_CASES + [(family, {}) for family in TANH_GATED])
def test_residual_gates_read_one_nth_and_write_n_for_every_token(family, options):
    n, dim = 4, SMALL["dim"]
    model = _model(0, family=family, n_streams=n, stream_reduce="mean",
                   family_options={"gate_init": "residual", **options})
    x = torch.randn(2, 5, n, dim, generator=torch.Generator().manual_seed(2))
    for hc in (m for m in model.modules() if isinstance(m, HyperConnection)):
        with torch.no_grad():
            H = hc.matrices(x)
        torch.testing.assert_close(H["pre"], torch.full((2, 5, n), 1 / n), rtol=0, atol=1e-6)
        torch.testing.assert_close(H["post"].sum(-1), torch.full((2, 5), float(n)), rtol=0, atol=1e-5)
        favoured = torch.full((n,), 1 - 0.5 / (n - 1))
        favoured[hc.layer_index % n] = 1.5  # not uniform: the streams separate after the first write
        torch.testing.assert_close(H["post"], favoured.expand(2, 5, n), rtol=0, atol=1e-5)


def test_upcycling_uses_the_connections_biases():
    assert widen.upcycling_biases is connection_init.upcycling_biases
    assert widen.DEFAULT_SPREAD == connection_init.DEFAULT_SPREAD == 0.5
    pre, post = connection_init.gate_biases("residual", "sigmoid", 4, 5, pre_offset=1e-6)
    assert torch.equal(pre, widen.upcycling_biases(4, 5, pre_offset=1e-6)[0])
    assert torch.equal(post, widen.upcycling_biases(4, 5)[1])


# ---- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, allowed", [("projection_init", "['zero', 'normal']"),
                                             ("gate_init", "['papers', 'residual']")])
def test_an_unknown_connection_init_is_refused(option, allowed):
    message = f"^{option} must be one of {allowed}, got 'xavier'$".replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=message):
        HyperConnection(32, 4, family="s2hc", **{option: "xavier"})
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", family="s2hc", n_streams=4, stream_reduce="mean", family_options={option: "xavier"})


def test_an_unknown_weight_init_is_refused():
    with pytest.raises(ValueError, match=r"^weight_init must be one of \['gpt2', 'neox'\], got 'xavier'$"):
        get_preset("tiny", weight_init="xavier")


@pytest.mark.parametrize("reduce", ["sum", "head"])
def test_residual_gates_need_the_streams_mean(reduce):
    with pytest.raises(ValueError, match=f"^gate_init='residual' .*set stream_reduce='mean', "
                                         f"got stream_reduce='{reduce}'$"):
        get_preset("tiny", family="s2hc", n_streams=4, stream_reduce=reduce, family_options={"gate_init": "residual"})


def test_residual_gates_need_two_streams():
    with pytest.raises(ValueError, match="gate_init='residual' needs n_streams >= 2"):
        get_preset("tiny", family="s2hc", n_streams=1, stream_reduce="mean", family_options={"gate_init": "residual"})
    with pytest.raises(ValueError, match="gate_init='residual' needs n_streams >= 2"):
        HyperConnection(32, 1, family="s2hc", gate_init="residual")


def test_the_residual_family_takes_no_init_options():
    refused = r"family='residual' takes no option\(s\), got \['gate_init', 'projection_init'\]"
    with pytest.raises(ValueError, match=refused):
        build_connection(32, 1, "residual", gate_init="residual", projection_init="normal")
    with pytest.raises(ValueError, match=r"family must be one of \['identity'"):  # not a hyper-connection
        HyperConnection(32, 1, family="residual")
