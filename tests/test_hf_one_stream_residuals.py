"""The one-stream residuals of production models against transformers' own modules (transformers 5.25):
Muse Spark's and Ergo's residual gates and Beam's depth-scaled add (s2hc's ``vp-residual``), ZAYA's residual
scaling (``affine-residual``); the converters' round trips and refusals (s2hc/hf/muse_spark.py, ergo.py, beam.py,
zaya.py).

Three levels: the connection alone on random weights and streams (float32 to float32 rounding, float64 to 1e-10
relative, bfloat16 bit for bit where the released code's precision is s2hc's); and each design's tiny random model
with every residual add computed by s2hc's connection instead of its own, whose logits (Muse Spark: the text
model's last hidden state, it has no LM head of its own) must not change. s2hc's Transformer cannot build the rest
of any of these models (docs/mixers.md, "Production designs": gated attention, NoPE layers, MoE routers, ZAYA's
CCA attention), so the model-level check keeps transformers' sublayers and swaps the connections. A design whose
module this transformers lacks is skipped (Ergo is new in 5.25).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_to_scale
from torch import nn

import s2hc
from s2hc.connection import forms

DIM = 12


def design(name: str) -> SimpleNamespace:
    """transformers' modeling and configuration modules of ``name`` and s2hc's converter; skips without them."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    modeling = pytest.importorskip(f"transformers.models.{name}.modeling_{name}",
                                   reason=f"this transformers has no {name} model")
    configuration = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
    converter = importlib.import_module(f"s2hc.hf.{name}")
    assert name == converter.MODEL_TYPE
    return SimpleNamespace(modeling=modeling, configuration=configuration, conv=converter)


def randomized(module: nn.Module, seed: int, spread: float = 1.0, shift: float = 0.0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(shift + spread * torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype))
    return module


def streams(dtype=torch.float32, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual ``(2, 5, C)`` and a branch output of another scale."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, DIM, generator=generator, dtype=torch.float64) * 2.0
    f = torch.randn(2, 5, DIM, generator=generator, dtype=torch.float64) * 0.7
    return x.to(dtype), f.to(dtype)


def ours(connection: nn.Module, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """s2hc's connection around a branch that returns ``f``: ``(B, T, C)`` in and out."""
    return connection(x.unsqueeze(-2), lambda h: f).squeeze(-2)


def check_levels(reference, connection: nn.Module, hf_module: nn.Module | None, exact_dtypes=(),
                 f64: float = 1e-10) -> None:
    """``reference(hf_module, x, f)`` against s2hc's ``connection`` in float32 (float32 rounding), float64 (``f64``:
    1e-10 where the reference runs in float64) and, bit for bit, in ``exact_dtypes``, with gradients in float64."""
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.float64, f64)):
        module = None if hf_module is None else hf_module.to(dtype)
        mine = connection.to(dtype)
        x, f = streams(dtype)
        assert_close_to_scale(ours(mine, x, f), reference(module, x, f), tolerance)
    for dtype in exact_dtypes:
        x, f = streams(dtype)
        assert torch.equal(ours(connection.float(), x, f), reference(None if hf_module is None else hf_module.float(),
                                                                   x, f))
    # gradients, float64: of the stream, the branch output and every parameter
    x, f = streams(torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    fs = [f.clone().requires_grad_() for _ in range(2)]
    hf64, mine = (None if hf_module is None else hf_module.double()), connection.double()
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (reference(hf64, xs[0], fs[0]) * cotangent).sum().backward()
    (ours(mine, xs[1], fs[1]) * cotangent).sum().backward()
    assert_close_to_scale(xs[1].grad, xs[0].grad, f64)
    assert_close_to_scale(fs[1].grad, fs[0].grad, f64)
    if hf_module is not None:
        hf_grads = {name: p.grad for name, p in hf64.named_parameters()}
        for hf_name, name in HF_NAMES_OF[type(hf_module).__name__].items():
            assert_close_to_scale(dict(mine.named_parameters())[name].grad, hf_grads[hf_name], f64)


HF_NAMES_OF: dict[str, dict[str, str]] = {}


# ------------------------------------------------------------------------------------------ Muse Spark


def muse_config(tf, **kwargs):
    settings = dict(vocab_size=64, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, intermediate_size=24, moe_intermediate_size=8,
                    moe_hidden_size=DIM, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    mlp_layer_types=["dense", "sparse"], bos_token_id=None, eos_token_id=None)
    return tf.configuration.MuseSparkTextConfig(**{**settings, **kwargs})


def test_muse_sparks_gate_is_the_vp_residuals_default():
    tf = design("muse_spark")
    config = muse_config(tf)
    hf = randomized(tf.modeling.MuseSparkResidualGate(config).float(), seed=1, spread=1.5)
    hf.gate.data[:3] = torch.tensor([4.0, -4.0, 0.0])  # w/τ = ±13: α's floor holds one channel up
    HF_NAMES_OF[type(hf).__name__] = tf.conv.HF_NAMES
    connection = tf.conv.connection_from_hf(config, hf, layer_index=1, sublayer=3)
    options = forms.options("vp-residual")
    assert {k: getattr(connection, a) for k, a in (("temperature", "temperature"), ("alpha_floor", "alpha_floor"),
                                                   ("init_std", "init_std"))} == {
        k: options[k] for k in ("temperature", "alpha_floor", "init_std")}
    assert connection.measures()["alpha_floor_hit"] > 0
    check_levels(lambda m, x, f: m(x, f), connection, hf, exact_dtypes=(torch.bfloat16,))


def test_a_muse_spark_model_with_s2hcs_gates_gives_the_same_hidden_states():
    tf = design("muse_spark")
    torch.manual_seed(0)
    model = tf.modeling.MuseSparkTextModel(muse_config(tf)).eval()
    randomized(model, seed=2, spread=0.3)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        gates = tf.conv.model_gates_from_hf(model.state_dict())
        assert set(gates) == {f"blocks.{i}.{slot}.gate" for i in range(2) for slot in ("attn_hc", "mlp_hc")}
        for index, layer in enumerate(model.layers):
            for slot, name in enumerate(tf.conv.LAYER_MODULES):
                gate = tf.conv.connection_from_hf(model.config, getattr(layer, name), index, 2 * index + slot)
                assert torch.equal(gate.gate, gates[f"blocks.{index}.{('attn_hc', 'mlp_hc')[slot]}.gate"])
                setattr(layer, name, _Swapped(gate, residual_first=True))
        actual = model(ids).last_hidden_state
    assert torch.equal(actual, expected)


class _Swapped(nn.Module):
    """A transformers residual module replaced by s2hc's connection (the branch's output already computed)."""

    def __init__(self, connection: nn.Module, residual_first: bool):
        super().__init__()
        self.connection, self.residual_first = connection, residual_first

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        residual, out = (a, b) if self.residual_first else (b, a)
        return ours(self.connection, residual, out)


# ------------------------------------------------------------------------------------------ Ergo


def ergo_config(tf, **kwargs):
    settings = dict(vocab_size=64, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, first_dense_intermediate_size=24, moe_intermediate_size=8,
                    shared_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    return tf.configuration.ErgoConfig(**{**settings, **kwargs})


def test_ergos_gate_is_the_vp_residual_without_temperature_or_floor():
    tf = design("ergo")
    config = ergo_config(tf)
    fresh = tf.modeling.ErgoResidualGate(config)
    assert torch.equal(tf.conv.connection_from_hf(config, fresh).gate, torch.zeros(DIM))  # β = 1/2 at the start
    hf = randomized(fresh, seed=4, spread=3.0)
    HF_NAMES_OF[type(hf).__name__] = tf.conv.HF_NAMES
    connection = tf.conv.connection_from_hf(config, hf)
    assert (connection.temperature, connection.alpha_kind, connection.alpha_floor) == (1.0, "softplus", 0.0)
    # Ergo computes its gates in float32 whatever its dtype (``self.weight.float()``), s2hc in float64 for float64
    # streams: there the two agree to float32's rounding of α and β, not to 1e-10
    check_levels(lambda m, x, f: m(f, x), connection, hf, f64=2e-6)
    x, f = streams(torch.bfloat16)  # Ergo leaves its float32 sum uncast (its stream is float32); s2hc writes x's dtype
    assert torch.equal(ours(connection.float(), x, f), hf.float()(f, x).to(torch.bfloat16))
    # the same function as Muse Spark's formula without its floor, to rounding
    clamped = s2hc.connection.VPResidual(DIM, temperature=1.0, alpha_floor=0.0)
    clamped.load_state_dict(connection.state_dict())
    x, f = streams(torch.float64)
    assert_close_to_scale(ours(clamped.double(), x, f), ours(connection.double(), x, f), 1e-12)


def test_an_ergo_model_with_s2hcs_gates_gives_the_same_logits():
    tf = design("ergo")
    model = randomized(tf.modeling.ErgoForCausalLM(ergo_config(tf)).eval(), seed=5, spread=0.3)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids).logits
        for index, layer in enumerate(model.model.layers):
            for slot, name in enumerate(tf.conv.LAYER_MODULES):
                gate = tf.conv.connection_from_hf(model.config, getattr(layer, name), index, 2 * index + slot)
                setattr(layer, name, _Swapped(gate, residual_first=False))
        actual = model(ids).logits
    assert torch.equal(actual, expected)


# ------------------------------------------------------------------------------------------ Beam


def beam_config(tf, **kwargs):
    settings = dict(vocab_size=64, hidden_size=DIM, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=4,
                    num_experts_per_tok=2, n_group=1, topk_group=1, sliding_window=4)
    return tf.configuration.BeamConfig(**{**settings, **kwargs})


@pytest.mark.parametrize("add_idx", [2, 3, 10, 105])
def test_beams_depth_scaled_add_is_the_depth_gated_vp_residual(add_idx):
    tf = design("beam")
    connection = tf.conv.connection_from_hf(beam_config(tf), add_idx)
    assert connection.sublayer == add_idx - 2 and list(connection.parameters()) == []
    assert tf.conv.connection_to_hf(connection) == {"residual_add_idx": add_idx}
    reference = lambda _, x, f: tf.modeling.depth_scaled_residual_add(f, x, add_idx)  # noqa: E731
    check_levels(reference, connection, None, exact_dtypes=(torch.bfloat16, torch.float16))


def test_a_beam_model_with_s2hcs_adds_gives_the_same_logits(monkeypatch):
    tf = design("beam")
    model = randomized(tf.modeling.BeamForCausalLM(beam_config(tf)).eval(), seed=7, spread=0.3)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(8))
    calls = []

    def s2hc_add(hidden_states, residual, residual_add_idx):
        calls.append(residual_add_idx)
        return ours(tf.conv.connection_from_hf(model.config, residual_add_idx), residual, hidden_states)

    with torch.no_grad():
        expected = model(ids).logits
        monkeypatch.setattr(tf.modeling, "depth_scaled_residual_add", s2hc_add)
        actual = model(ids).logits
    assert calls == list(range(2, 8)) and torch.equal(actual, expected)


# ------------------------------------------------------------------------------------------ ZAYA


def test_zayas_residual_scaling_is_the_affine_residual():
    tf = design("zaya")
    fresh = tf.modeling.ZayaResidualScaling(DIM)
    x, f = streams()
    assert torch.equal(ours(tf.conv.connection_from_hf({"hidden_size": DIM}, fresh), x, f), x + f)  # starts residual
    hf = randomized(fresh, seed=9, spread=0.5, shift=0.5)
    HF_NAMES_OF[type(hf).__name__] = tf.conv.HF_NAMES
    connection = tf.conv.connection_from_hf({"hidden_size": DIM}, hf)
    check_levels(lambda m, x, f: m(f, x), connection, hf)


def test_a_zaya_model_with_s2hcs_scalings_gives_the_same_logits():
    tf = design("zaya")
    config = tf.configuration.ZayaConfig(vocab_size=64, hidden_size=DIM * 2, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=None,
                                         bos_token_id=None, pad_token_id=None)
    model = randomized(tf.modeling.ZayaForCausalLM(config).eval(), seed=10, spread=0.2)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = model(ids).logits
        state = tf.conv.model_scalings_from_hf(model.state_dict())
        assert len(state) == 2 * 2 * 4
        for index, layer in enumerate(model.model.layers):
            for name in tf.conv.LAYER_MODULES:
                setattr(layer, name, _Swapped(tf.conv.connection_from_hf(config, getattr(layer, name), index),
                                              residual_first=False))
        actual = model(ids).logits
    assert torch.equal(actual, expected)


# ------------------------------------------------------------------------------------------ round trips, refusals


@pytest.mark.parametrize("name", ["muse_spark", "ergo", "zaya"])
def test_round_trips_are_exact_copies_and_load_into_transformers(name):
    tf = design(name)
    config = {"muse_spark": muse_config, "ergo": ergo_config}.get(name, lambda tf: {"hidden_size": DIM})(tf)
    build = {"muse_spark": lambda: tf.modeling.MuseSparkResidualGate(config),
             "ergo": lambda: tf.modeling.ErgoResidualGate(config),
             "zaya": lambda: tf.modeling.ZayaResidualScaling(DIM)}[name]
    hf = randomized(build(), seed=12)
    connection = tf.conv.connection_from_hf(config, hf)
    back = tf.conv.connection_to_hf(connection, config)
    assert set(back) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        assert torch.equal(back[key], value) and back[key].data_ptr() != value.data_ptr()
    fresh = build()
    fresh.load_state_dict(back)  # strict
    state = {k: v.double() for k, v in hf.state_dict().items()}
    mapped = tf.conv.connection_state_from_hf(state, DIM)
    assert all(v.dtype == torch.float64 for v in mapped.values())
    assert all(torch.equal(tf.conv.connection_state_to_hf(mapped, DIM)[k], v) for k, v in state.items())


def test_missing_extra_and_misshapen_tensors_are_named_in_one_line():
    from s2hc.hf import beam, ergo, muse_spark, zaya

    cases = [
        (lambda: muse_spark.connection_state_from_hf({}, 4),
         "Muse Spark residual gate state: tensor 'gate' is missing; expected shape (4,)"),
        (lambda: muse_spark.connection_state_from_hf({"gate": torch.zeros(5)}, 4),
         "Muse Spark residual gate state: tensor 'gate' has shape (5,), expected (4,) (hidden_size C=4)"),
        (lambda: ergo.connection_state_from_hf({"weight": torch.zeros(4), "bias": torch.zeros(4)}, 4),
         "Ergo residual gate state: unexpected tensor(s) {'bias': (4,)}"),
        (lambda: ergo.connection_state_from_hf({"gate": torch.zeros(4)}, 4),
         "Ergo residual gate state: tensor 'weight' is missing"),
        (lambda: zaya.connection_state_to_hf({"branch_scale": torch.zeros(4)}, 4),
         "s2hc affine-residual state: tensor 'branch_bias' is missing"),
        (lambda: beam.connection_from_hf({"hidden_size": 4}, 2, {"gate": torch.zeros(4)}),
         "Beam residual add state: unexpected tensor(s) {'gate': (4,)}"),
        (lambda: beam.connection_from_hf({"hidden_size": 4}, 1), "residual_add_idx must be an integer >= 2, got 1"),
        (lambda: muse_spark.connection_from_hf({"hidden_size": 4}, {"gate": torch.zeros(4)}),
         "the Muse Spark config has no 'residual_gate_temperature'"),
        (lambda: muse_spark.connection_to_hf(s2hc.connection.AffineResidual(4)),
         "connection must be an s2hc.connection.VPResidual, got AffineResidual"),
        (lambda: ergo.connection_to_hf(s2hc.connection.VPResidual(4)),
         "the connection has temperature=0.3, but Ergo computes temperature=1.0"),
        (lambda: beam.connection_to_hf(s2hc.connection.VPResidual(4)),
         "the connection has gate='learned', but Beam computes gate='depth'"),
        (lambda: zaya.connection_to_hf(s2hc.connection.AffineResidual(4), {"hidden_size": 8}),
         "the connection has dim=4, but the ZAYA config's hidden_size is 8"),
        (lambda: zaya.model_scalings_from_hf({"model.layers.0.post_mlp_residual_scale.residual_bias": torch.zeros(4)}),
         "ZAYA state: blocks.0.mlp_hc has ['residual_bias'] but not ['branch_bias', 'branch_scale', "
         "'residual_scale']"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as error:
            call()
        assert message in str(error.value) and len(str(error.value).splitlines()) == 1, str(error.value)


def test_every_converter_names_its_model_type():
    from s2hc.hf import beam, ergo, muse_spark, zaya

    assert [m.MODEL_TYPE for m in (muse_spark, ergo, beam, zaya)] == ["muse_spark", "ergo", "beam", "zaya"]
