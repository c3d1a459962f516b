"""Qwen's gated residual against transformers' own ``Qwen4ExpTextGatedResidual`` (s2hc/hf/qwen4_exp.py).

The references are transformers' modules themselves: a connection (``use_combine=True``) used as its decoder layer
uses it, ``h, hyper_input, w = hf(x); out = hyper_input + (branch(h).unsqueeze(-2) * w.unsqueeze(-1)).flatten(-2)``,
and the head (``use_combine=False``, the model's ``hyper_connection_mixer``), with every weight random (the norm's
too). Then the gated residual's guarantees on random shapes and weights (hypothesis), float64 gradcheck, and every
refusal of the converters. Only the tests that use the ``tf`` fixture need transformers (they skip without it).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_to_scale
from hypothesis import given, settings
from hypothesis import strategies as st

import s2hc

N, DIM, RANK = 3, 8, 5


@pytest.fixture(scope="module")
def tf() -> SimpleNamespace:
    """transformers' qwen4_exp module (``tf.modeling``), its configs and s2hc's converters (``tf.conv``: s2hc.hf
    needs transformers): the tests that use it skip without transformers."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp",
                                   reason="this transformers has no qwen4_exp model (Qwen4ExpTextGatedResidual)")
    from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

    from s2hc.hf import qwen4_exp

    return SimpleNamespace(modeling=modeling, conv=qwen4_exp, TextConfig=Qwen4ExpTextConfig, Config=Qwen4ExpConfig)


def hf_config(tf, n: int = N, dim: int = DIM, rank: int = RANK, eps: float = 1e-6):
    """A Qwen4ExpTextConfig whose gated residual has these sizes (the rest tiny: it is never built)."""
    return tf.TextConfig(hidden_size=dim, hc_count=n, hc_lowrank=rank, rms_norm_eps=eps, num_experts=2,
                         num_experts_per_tok=1, vocab_size=32, num_hidden_layers=1)


def randomized(module: torch.nn.Module, seed: int, spread: float = 0.3) -> torch.nn.Module:
    """``module`` with every parameter N(0, spread²) from ``seed``, hc_norm.weight included (stored zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(spread * torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype))
    return module


def hf_connection(tf, config, seed: int = 0, spread: float = 0.3):
    return randomized(tf.modeling.Qwen4ExpTextGatedResidual(config), seed, spread)


def hf_head(tf, config, seed: int = 1, spread: float = 0.3):
    return randomized(tf.modeling.Qwen4ExpTextGatedResidual(config, use_combine=False), seed, spread)


def branch(dim: int, seed: int = 2) -> torch.nn.Module:
    """The sublayer both sides share (one copy each): a small MLP, C -> 2C -> C."""
    return randomized(torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                          torch.nn.Linear(2 * dim, dim)), seed, 0.5)


def streams(n: int, dim: int, seed: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Flat streams ``(B, T, nC)`` as transformers holds them, each stream of its own scale."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, 1, generator=generator) * 3 + 0.2
    return (torch.randn(2, 5, n, dim, generator=generator) * scales).flatten(-2).to(dtype)


def hf_sublayer(module, block, flat: torch.Tensor) -> torch.Tensor:
    """transformers' decoder layer around one sublayer (Qwen4ExpTextDecoderLayer.forward's two lines)."""
    h, hyper_input, w = module(flat)
    return hyper_input + (block(h).unsqueeze(-2) * w.unsqueeze(-1)).flatten(-2)


# ------------------------------------------------------------------------------------------ parity, float32


def test_a_sublayer_update_and_every_gradient_match_transformers(tf):
    config = hf_config(tf)
    hf, hf_block = hf_connection(tf, config), branch(DIM)
    ours, our_block = tf.conv.connection_from_hf(config, hf), copy.deepcopy(hf_block)
    assert isinstance(ours, s2hc.GatedResidual)
    x = streams(N, DIM)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = hf_sublayer(hf, hf_block, x_hf)
    actual = ours(x_ours.unflatten(-1, (N, DIM)), our_block).flatten(-2)
    assert_close_to_scale(actual, expected, 1e-5)
    assert (actual - x).abs().max() > 0.1  # the branch's update is large: the check is not of x against itself
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    (expected * cotangent).sum().backward()
    (actual * cotangent).sum().backward()
    assert_close_to_scale(x_ours.grad, x_hf.grad, 1e-5)
    grads = tf.conv.connection_state_from_hf({k: p.grad for k, p in hf.named_parameters()}, DIM, N, RANK)
    for name, p in ours.named_parameters():
        assert p.grad.abs().max() > 0, name
        assert_close_to_scale(p.grad, grads[name], 1e-5)
    for a, b in zip(our_block.parameters(), hf_block.parameters()):
        assert_close_to_scale(a.grad, b.grad, 1e-5)


def test_the_head_and_its_gradients_match_transformers(tf):
    config = hf_config(tf)
    hf = hf_head(tf, config)
    ours = tf.conv.head_from_hf(config, hf)
    assert type(ours) is s2hc.GatedHead
    x = streams(N, DIM, seed=4)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = hf(x_hf), ours(x_ours.unflatten(-1, (N, DIM)))
    assert actual.shape == expected.shape == (2, 5, DIM)
    assert_close_to_scale(actual, expected, 1e-5)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(8))
    (expected * cotangent).sum().backward()
    (actual * cotangent).sum().backward()
    assert_close_to_scale(x_ours.grad, x_hf.grad, 1e-5)
    grads = tf.conv.head_state_from_hf({k: p.grad for k, p in hf.named_parameters()}, DIM, N, RANK)
    for name, p in ours.named_parameters():
        assert_close_to_scale(p.grad, grads[name], 1e-5)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 6), dim=st.integers(1, 8), rank=st.integers(1, 6), seed=st.integers(0, 2**16),
       spread=st.floats(0.01, 1.0), eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_parity_holds_for_random_sizes(tf, n, dim, rank, seed, spread, eps):
    config = hf_config(tf, n, dim, rank, eps)
    hf, hf_block = hf_connection(tf, config, seed, spread), branch(dim, seed + 1)
    x = streams(n, dim, seed + 2)
    with torch.no_grad():
        expected = hf_sublayer(hf, hf_block, x)
        actual = tf.conv.connection_from_hf(config, hf)(x.unflatten(-1, (n, dim)), hf_block).flatten(-2)
        assert_close_to_scale(actual, expected, 1e-5)
        head = hf_head(tf, config, seed + 3, spread)
        assert_close_to_scale(tf.conv.head_from_hf(config, head)(x.unflatten(-1, (n, dim))), head(x), 1e-5)


# ------------------------------------------------------------------------------------------ bfloat16

# Both modules in bfloat16 agree to bfloat16's rounding, not exactly: transformers rounds its gates (and the
# normalised streams) to bfloat16, s2hc computes them in float32, and then both round h, the branch's output and
# the sum x + p F(h) to bfloat16 (unit roundoff 2^-8 each). Tolerance: 2^-6 (4 units) of the output's largest
# entry; measured on 20 seeds: at most 8.4e-3, about one bfloat16 ulp of the largest entries (in [4, 8)).
BF16_TOLERANCE = 2.0**-6


@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_modules_agree_to_bfloat16_rounding(tf, seed):
    n, dim, rank = 4, 32, 8
    config = hf_config(tf, n, dim, rank)
    hf, block, head = hf_connection(tf, config, seed), branch(dim, seed + 10), hf_head(tf, config, seed + 20)
    ours = tf.conv.connection_from_hf(config, hf).to(torch.bfloat16)
    our_head = tf.conv.head_from_hf(config, head).to(torch.bfloat16)
    hf, head, block = hf.to(torch.bfloat16), head.to(torch.bfloat16), block.to(torch.bfloat16)
    x = streams(n, dim, seed + 30, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, actual = hf_sublayer(hf, block, x), ours(x.unflatten(-1, (n, dim)), block).flatten(-2)
        read, our_read = head(x), our_head(x.unflatten(-1, (n, dim)))
    assert actual.dtype == expected.dtype == our_read.dtype == torch.bfloat16
    for a, b in ((actual, expected), (our_read, read)):
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= BF16_TOLERANCE * scale
    assert not torch.equal(actual, x)


# ------------------------------------------------------------------------------------------ round trips


def test_round_trips_are_exact_copies_and_load_into_transformers(tf):
    config = hf_config(tf)
    hf, head = hf_connection(tf, config), hf_head(tf, config)
    ours = tf.conv.connection_from_hf(config, hf, layer_index=3)
    assert ours.layer_index == 3
    back = tf.conv.connection_to_hf(ours, config)
    assert set(back) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        assert torch.equal(back[key], value) and back[key].data_ptr() != value.data_ptr()
    fresh = tf.modeling.Qwen4ExpTextGatedResidual(config)
    fresh.load_state_dict(back)  # strict: exactly transformers' tensors
    again = tf.conv.connection_from_hf(config, fresh)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    head_back = tf.conv.head_to_hf(tf.conv.head_from_hf(config, head), config)
    assert set(head_back) == set(head.state_dict())
    assert all(torch.equal(head_back[k], v) for k, v in head.state_dict().items())
    tf.modeling.Qwen4ExpTextGatedResidual(config, use_combine=False).load_state_dict(head_back)
    # the state functions alone, both ways, dtypes kept
    state = {k: v.double() for k, v in hf.state_dict().items()}
    mapped = tf.conv.connection_state_from_hf(state, DIM, N, RANK)
    assert all(v.dtype == torch.float64 for v in mapped.values())
    assert all(torch.equal(tf.conv.connection_state_to_hf(mapped, DIM, N, RANK)[k], v) for k, v in state.items())
    head_state = tf.conv.head_state_from_hf(head, DIM, N, RANK)
    back = tf.conv.head_state_to_hf(head_state, DIM, N, RANK)
    assert all(torch.equal(back[k], v) for k, v in head.state_dict().items())


def test_converted_tensors_are_copies_not_views(tf):
    config = hf_config(tf)
    hf = hf_connection(tf, config)
    ours = tf.conv.connection_from_hf(config, hf)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    for value in tf.conv.connection_to_hf(ours).values():
        value.zero_()
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    mapped = tf.conv.connection_state_from_hf(hf, DIM, N, RANK)
    mapped["write"].zero_()
    assert hf.block_inject_weight.weight.abs().min() > 0


def test_every_form_of_the_config_gives_the_same_options(tf):
    text = hf_config(tf, 4, 16, 7, 1e-5)
    expected = {"dim": 16, "n_streams": 4, "rank": 7, "eps": 1e-5}
    assert tf.conv.connection_options(text) == expected
    assert tf.conv.connection_options(text.to_dict()) == expected
    multimodal = tf.Config(text_config=text.to_dict())
    assert tf.conv.connection_options(multimodal) == expected
    assert tf.conv.connection_options(multimodal.to_dict()) == expected
    plain = {"hc_count": 4, "hc_lowrank": 7, "hidden_size": 16, "rms_norm_eps": 1e-5}
    assert tf.conv.connection_options(plain) == expected
    assert tf.conv.connection_from_hf(multimodal, hf_connection(tf, text)).rank == 7


# ------------------------------------------------------------------------------------------ guarantees


def gated(n: int, dim: int, rank: int, seed: int, spread: float) -> s2hc.GatedResidual:
    return randomized(s2hc.GatedResidual(dim, n, rank=rank).double(), seed, spread)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 6), dim=st.integers(1, 12), rank=st.integers(1, 8), seed=st.integers(0, 2**16),
       spread=st.floats(0.0, 0.5), scale=st.floats(1e-3, 1e3))
def test_the_gated_residuals_guarantees_hold_for_any_weights_and_input(n, dim, rank, seed, spread, scale):
    connection = gated(n, dim, rank, seed, spread)
    generator = torch.Generator().manual_seed(seed + 1)
    x = scale * torch.randn(2, 3, n, dim, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        matrices, gates = connection.matrices(x), connection.gates(x)
    assert torch.equal(matrices["res"], torch.eye(n, dtype=torch.float64).expand(2, 3, n, n))  # exactly I
    assert bool((gates["read"] > 0).all() and (gates["read"] < 1).all())
    assert bool((gates["write"] > 0).all() and (gates["write"] < 2).all())
    assert bool((matrices["pre"] > 0).all() and (matrices["pre"] < 1 / n).all())
    assert torch.equal(matrices["post"], gates["write"])
    # the streams are never mixed: the update is p_s F(h) on every stream, the same F(h)
    block = branch(dim, seed + 2).double()
    with torch.no_grad():
        update = connection(x, block) - x
    direction = update / gates["write"].unsqueeze(-1)
    torch.testing.assert_close(direction, direction[..., :1, :].expand_as(direction), rtol=1e-9, atol=1e-9 * scale)


def test_gradcheck_of_the_connection_with_a_branch_and_of_the_head():
    torch.manual_seed(0)
    connection = gated(3, 4, 2, seed=5, spread=0.5)
    block = branch(4, seed=6).double()
    names = [name for name, _ in connection.named_parameters()]
    block_names = [name for name, _ in block.named_parameters()]
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)

    def sublayer(x, *params):
        ours, theirs = params[: len(names)], params[len(names):]
        run = lambda h: torch.func.functional_call(block, dict(zip(block_names, theirs)), (h,))  # noqa: E731
        return torch.func.functional_call(connection, dict(zip(names, ours)), (x, run))

    params = [p.detach().clone().requires_grad_() for p in (*connection.parameters(), *block.parameters())]
    assert torch.autograd.gradcheck(sublayer, (x, *params))
    head = randomized(s2hc.GatedHead(4, 3, rank=2).double(), 7, 0.5)
    head_names = [name for name, _ in head.named_parameters()]
    head_params = [p.detach().clone().requires_grad_() for p in head.parameters()]
    read = lambda x, *p: torch.func.functional_call(head, dict(zip(head_names, p)), (x,))  # noqa: E731
    assert torch.autograd.gradcheck(read, (x, *head_params))


# ------------------------------------------------------------------------------------------ refusals


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


def _reshaped(state, key, shape):
    return {**state, key: torch.zeros(shape)}


def test_missing_extra_and_misshapen_tensors_are_named(tf):
    config = hf_config(tf)
    state = hf_connection(tf, config).state_dict()
    cases = [
        (_without(state, "input_mix_weight_up.weight"),
         "Qwen4-Exp connection state: tensor 'input_mix_weight_up.weight' is missing; expected shape (24, 5)"),
        ({**state, "bias": torch.zeros(3)}, "Qwen4-Exp connection state: unexpected tensor(s) {'bias': (3,)}"),
        (_reshaped(state, "input_mix_weight_down.weight", (6, 24)),
         "Qwen4-Exp connection state: tensor 'input_mix_weight_down.weight' has shape (6, 24), expected (5, 24) "
         "(hc_count n=3, hidden_size C=8, hc_lowrank r=5)"),
        (_reshaped(state, "hc_norm.weight", (8,)),
         "tensor 'hc_norm.weight' has shape (8,), expected (24,)"),
        (_reshaped(state, "block_inject_weight.weight", (24, 3)),
         "tensor 'block_inject_weight.weight' has shape (24, 3), expected (3, 24)"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError) as error:
            tf.conv.connection_from_hf(config, bad)
        assert message in str(error.value) and len(str(error.value).splitlines()) == 1
    head_state = hf_head(tf, config).state_dict()
    with pytest.raises(ValueError, match=r"^Qwen4-Exp head state: tensor 'hc_norm.weight' has shape \(3,\)"):
        tf.conv.head_from_hf(config, _reshaped(head_state, "hc_norm.weight", (3,)))
    ours = tf.conv.connection_from_hf(config, state).state_dict()
    with pytest.raises(ValueError, match=r"^s2hc gated residual state: tensor 'read_up' is missing"):
        tf.conv.connection_state_to_hf(_without(ours, "read_up"), DIM, N, RANK)


@pytest.mark.parametrize("setting,value,message", [
    ("n", 4, "the connection has n_streams=3, but the Qwen4-Exp config's hc_count is 4"),
    ("dim", 16, "the connection has dim=8, but the Qwen4-Exp config's hidden_size is 16"),
    ("rank", 6, "the connection has rank=5, but the Qwen4-Exp config's hc_lowrank is 6"),
    ("eps", 1e-5, "the connection has eps=1e-06, but the Qwen4-Exp config's rms_norm_eps is 1e-05"),
])
def test_a_module_whose_settings_differ_from_the_config_is_refused(tf, setting, value, message):
    sizes = {"n": N, "dim": DIM, "rank": RANK, "eps": 1e-6, setting: value}
    other = hf_config(tf, **sizes)
    connection, head = s2hc.GatedResidual(DIM, N, rank=RANK), s2hc.GatedHead(DIM, N, rank=RANK)
    with pytest.raises(ValueError) as error:
        tf.conv.connection_to_hf(connection, other)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        tf.conv.head_to_hf(head, other)
    assert str(error.value) == message.replace("connection", "head")
    expected = set(hf_connection(tf, hf_config(tf)).state_dict())
    assert set(tf.conv.connection_to_hf(connection, hf_config(tf))) == expected


def test_the_wrong_kind_of_module_is_refused_in_one_line(tf):
    config = hf_config(tf)
    cases = [
        (lambda: tf.conv.connection_to_hf(s2hc.GatedHead(DIM, N, rank=RANK), config),
         "connection must be an s2hc.GatedResidual, got GatedHead (a head: convert it with head_to_hf)"),
        (lambda: tf.conv.connection_to_hf(s2hc.HyperConnection(DIM, N)),
         "connection must be an s2hc.GatedResidual, got HyperConnection"),
        (lambda: tf.conv.connection_to_hf(torch.nn.Linear(2, 2)),
         "connection must be an s2hc.GatedResidual, got Linear"),
        (lambda: tf.conv.head_to_hf(s2hc.GatedResidual(DIM, N, rank=RANK)),
         "head must be an s2hc.GatedHead, got GatedResidual (a connection: convert it with connection_to_hf)"),
        (lambda: tf.conv.head_to_hf(s2hc.HyperHead(DIM, N)), "head must be an s2hc.GatedHead, got HyperHead"),
        (lambda: tf.conv.connection_from_hf(config, hf_head(tf, config)),
         "Qwen4-Exp connection state: tensor 'block_inject_weight.weight' is missing: these are a head (use_combine="
         "False, the model's hyper_connection_mixer)'s tensors; convert them with head_from_hf"),
        (lambda: tf.conv.head_from_hf(config, hf_connection(tf, config)),
         "Qwen4-Exp head state: tensor 'block_inject_weight.weight' is unexpected: these are a connection "
         "(use_combine=True, a decoder layer's *_hyper_connection)'s tensors; convert them with connection_from_hf"),
        (lambda: tf.conv.connection_state_to_hf(s2hc.GatedHead(DIM, N, rank=RANK), DIM, N, RANK),
         "s2hc gated residual state: tensor 'write' is missing: these are an s2hc.GatedHead's tensors"),
        (lambda: tf.conv.connection_from_hf(config, [1, 2]), "Qwen4-Exp connection state must be a mapping of names to "
                                                     "tensors or a module, got list"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as error:
            call()
        assert message in str(error.value) and len(str(error.value).splitlines()) == 1, str(error.value)


@pytest.mark.parametrize("config,message", [
    ({"hc_count": 3, "hidden_size": 8, "rms_norm_eps": 1e-6}, "the Qwen4-Exp config has no 'hc_lowrank'"),
    ({"hc_count": 1, "hc_lowrank": 2, "hidden_size": 8, "rms_norm_eps": 1e-6},
     "hc_count must be an integer in [2, 64], got 1"),
    ({"hc_count": 3, "hc_lowrank": 0, "hidden_size": 8, "rms_norm_eps": 1e-6},
     "hc_lowrank must be an integer >= 1, got 0"),
    ({"hc_count": 3, "hc_lowrank": 2, "hidden_size": 8, "rms_norm_eps": -1.0}, "rms_norm_eps must be"),
    ({"text_config": {"hc_count": 3}}, "the Qwen4-Exp config has no 'hidden_size'"),
])
def test_a_bad_config_is_refused_by_name(tf, config, message):
    with pytest.raises(ValueError) as error:
        tf.conv.connection_from_hf(config, {})
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1
