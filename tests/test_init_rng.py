"""Common random numbers (s2hc.init_rng): with ``init_rng="per_parameter"`` a parameter's initial value depends only
on (seed, its qualified name, its distribution), so two configurations that differ in one option share every
other parameter bit for bit; ``"sequential"`` keeps the global generator's order, where an option that draws one
more tensor shifts every later draw."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s2hc import families
from s2hc.connection import forms
from s2hc.init_rng import Draw, check_init_rng, parameter_seed
from s2hc.models import ModelConfig, Transformer, get_preset
from s2hc.rundir import load_checkpoint
from s2hc.train import TrainConfig, train
from tests.helpers import small_config

SMALL = dict(vocab_size=256, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
BASE = dict(family="s2hc", n_streams=4)
# One option changed against BASE each, and the parameters it may change (prefix + suffix of the name); every
# other parameter the two models both have must be equal.
OPTIONS = {
    "projection_init": (dict(family_options={"projection_init": "normal"}), ("projection",)),
    "lss_init": (dict(lss_init=0.6), ()),  # adds stream_scale.scale, changes nothing else
    "gate_init": (dict(family_options={"gate_init": "residual"}, stream_reduce="mean"), ("bias_pre", "bias_post")),
    "residual": (dict(family="residual", n_streams=1), ()),
    "mhc": (dict(family="mhc"), ()),
    "hc": (dict(family="hc", family_options={"projection_init": "normal"}), ("bias_pre", "bias_post")),  # tanh gates
    "gated-residual": (dict(family="gated-residual"), ("norm_weight",)),  # its norm weight starts at 0, not 1
    "head": (dict(stream_reduce="head"), ()),
}


def _state(init_rng="per_parameter", seed=0, global_seed=0, **changes) -> dict[str, torch.Tensor]:
    torch.manual_seed(global_seed)
    config = get_preset("tiny", **{**SMALL, **BASE, **changes})
    model = Transformer(config, init_rng=init_rng, init_seed=seed if init_rng == "per_parameter" else None)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _shared(a: dict, b: dict) -> list[str]:
    return [name for name in a if name in b and a[name].shape == b[name].shape]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_option_changes_only_its_own_parameters(option):
    changes, allowed = OPTIONS[option]
    base, other = _state(), _state(**changes)
    shared = _shared(base, other)
    differ = {name for name in shared if not torch.equal(base[name], other[name])}
    assert {name for name in differ if not name.endswith(allowed or ("\0",))} == set()
    assert {"embed.weight", "blocks.1.attn.q_proj.weight", "blocks.1.mlp.down_proj.weight"} <= set(shared)
    if option == "projection_init":
        assert differ == {name for name in shared if name.endswith("projection")} != set()


def test_the_sequential_draw_shifts_every_later_weight():
    """What per_parameter removes: under the global generator's order, a normal projection (drawn while the
    connections are built) changes the embedding, attention and MLP weights of the same seed."""
    base, other = _state("sequential"), _state("sequential", family_options={"projection_init": "normal"})
    moved = [name for name in _shared(base, other) if not torch.equal(base[name], other[name])
             and "projection" not in name]
    assert "embed.weight" in moved and any(".attn.q_proj." in name for name in moved)


@settings(max_examples=8, deadline=None)
@given(global_seed=st.integers(0, 2**31), option=st.sampled_from(list(OPTIONS)))
def test_per_parameter_values_do_not_depend_on_the_global_generator(global_seed, option):
    changes = OPTIONS[option][0]
    first, again = _state(global_seed=0, **changes), _state(global_seed=global_seed, **changes)
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_the_seed_and_the_name_decide_and_nothing_else():
    first, again, other = _state(seed=3), _state(seed=3), _state(seed=4)
    random = [name for name in first if name.endswith(("_proj.weight", "embed.weight"))]
    assert random and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in random)
    # two parameters of one shape and rule are drawn apart (their names differ)
    assert not torch.equal(first["blocks.0.attn.q_proj.weight"], first["blocks.0.attn.k_proj.weight"])
    assert parameter_seed(3, "a", "normal") != parameter_seed(3, "a", "uniform")


def test_without_a_seed_the_global_generator_decides_it():
    torch.manual_seed(5)
    a = Transformer(get_preset("tiny", **SMALL)).embed.weight.detach().clone()
    torch.manual_seed(5)
    b = Transformer(get_preset("tiny", **SMALL)).embed.weight.detach()
    torch.manual_seed(6)
    c = Transformer(get_preset("tiny", **SMALL)).embed.weight.detach()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_std_change_rescales_the_same_noise():
    """weight_init changes the std, not the draw: gpt2's and neox's weights are one noise at two scales."""
    gpt2, neox = _state(), _state(weight_init="neox")
    dim, layers = SMALL["dim"], SMALL["n_layers"]
    ratios = {"embed.weight": math.sqrt(2 / (5 * dim)) / 0.02,
              "blocks.1.mlp.down_proj.weight": (1 / (math.sqrt(dim) * layers)) / (0.02 / math.sqrt(2 * layers))}
    for name, ratio in ratios.items():
        torch.testing.assert_close(neox[name], gpt2[name] * ratio, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("changes, name, kind, scale, shift", [
    (dict(family_options={"projection_init": "normal"}), "blocks.0.attn_hc.projection", "normal",
     math.sqrt(2 / (5 * 32)), 0.0),
    (dict(lss_init=0.6), "stream_scale.scale", "uniform", math.sqrt(6 / (4 + 32)), 0.6),
    (dict(family="gated-residual"), "blocks.1.mlp_hc.read_down", "normal", 0.02, 0.0),
    ({}, "blocks.0.attn.q_proj.weight", "normal", 0.02, 0.0),
])
def test_per_parameter_draws_keep_each_rule(changes, name, kind, scale, shift):
    value = _state(**changes)[name]
    if kind == "normal":
        assert abs(value.mean().item() - shift) < 0.1 * scale
        assert value.std().item() == pytest.approx(scale, rel=0.1)
    else:
        assert shift - scale <= value.min().item() and value.max().item() <= shift + scale
        assert value.std().item() == pytest.approx(scale / math.sqrt(3), rel=0.1)


def test_a_draw_is_the_same_on_every_dtype_and_device_it_is_copied_to():
    draw, generator = Draw("normal", 0.5), lambda: torch.Generator().manual_seed(1)
    full = draw.fill_(torch.empty(4, 4), generator())
    half = draw.fill_(torch.empty(4, 4, dtype=torch.bfloat16), generator())
    assert torch.equal(half, full.to(torch.bfloat16))
    with pytest.raises(ValueError, match="kind must be one of"):
        Draw("gamma", 1.0)


@pytest.mark.parametrize("value", ["random", None, 3])
def test_an_unknown_init_rng_is_refused(value, tmp_path):
    with pytest.raises(ValueError, match=r"init_rng must be one of \['per_parameter', 'sequential'\]"):
        check_init_rng(value)
    with pytest.raises(ValueError, match="init_rng must be one of"):
        Transformer(get_preset("tiny", **SMALL), init_rng=value)
    with pytest.raises(ValueError, match="init_rng must be"):
        TrainConfig(init_rng=value)
    with pytest.raises(ValueError, match="init_seed must be an integer >= 0"):
        Transformer(get_preset("tiny", **SMALL), init_seed=-1)


def test_a_run_configured_before_the_field_resumes_sequential():
    from s2hc.config import completed_settings

    stored = TrainConfig().to_dict()
    del stored["init_rng"]
    assert completed_settings(stored)["init_rng"] == "sequential"
    assert TrainConfig().init_rng == "per_parameter"


# ---- through the harness ---------------------------------------------------------------------------------------


def _initial_weights(corpus_file, root, init_rng, **changes) -> dict[str, torch.Tensor]:
    """A run's weights after one step at a learning rate whose update is 0 in float32 (even for parameters at 0):
    its initial weights, as the harness drew them, in its checkpoint."""
    config = small_config(corpus_file, root, max_steps=1, warmup_steps=0, lr=1e-300, eval_every=0,
                          init_rng=init_rng, seed=7, **changes)
    train(config)
    checkpoint = load_checkpoint(config.out)
    rebuilt = Transformer(ModelConfig.from_dict(checkpoint.model_config), init_rng=init_rng, init_seed=7) \
        if init_rng == "per_parameter" else None
    if rebuilt is not None:  # the step left them as they were: what the model draws by itself
        assert all(torch.equal(value, checkpoint.model[name]) for name, value in rebuilt.state_dict().items())
    return checkpoint.model


@pytest.mark.parametrize("init_rng", ["per_parameter", "sequential"])
def test_two_runs_that_differ_in_one_option_share_every_other_initial_tensor(corpus_file, tmp_path, init_rng):
    zero = _initial_weights(corpus_file, tmp_path / "zero", init_rng)
    normal = _initial_weights(corpus_file, tmp_path / "normal", init_rng,
                              family_options={"projection_init": "normal"})
    others = [name for name in zero if not name.endswith("projection")]
    equal = {name for name in others if torch.equal(zero[name], normal[name])}
    assert not any(torch.equal(zero[n], normal[n]) for n in zero if n.endswith("projection"))
    if init_rng == "per_parameter":
        assert equal == set(others)
    else:  # the draw that per_parameter removes: the embedding, attention and MLP weights moved too
        assert "embed.weight" not in equal


@pytest.mark.parametrize("init_rng", ["per_parameter", "sequential"])
def test_a_model_builds_on_the_meta_device(init_rng):
    """As `s2hc params` and the Hugging Face loader build it: no values to draw, and no error."""
    with torch.device("meta"):
        model = Transformer(get_preset("tiny", **{**SMALL, **BASE}, lss_init=0.6,
                                       family_options={"projection_init": "normal"}), init_rng=init_rng)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("family", sorted(families()))
def test_every_family_draws_nothing_from_the_global_generator(family):
    """A family whose parameters start random must say so (``random_init``): otherwise its values would follow the
    global generator, and the family would not share its other weights with the rest."""
    form = forms.get(family)
    n = 1 if form.max_streams == 1 else 4
    options = {"projection_init": "normal"} if "projection_init" in form.allowed_options() else {}
    first = _state(global_seed=1, family=family, n_streams=n, family_options=options)
    again = _state(global_seed=2, family=family, n_streams=n, family_options=options)
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_a_committed_study_still_grows_and_a_per_parameter_grid_does_not_join_it(tmp_path):
    """The committed studies recorded their grids before `init_rng` existed: their configs now say `sequential`,
    which is what those grids drew, so they grow; the same grid under the new default is another study."""
    from s2hc.study.runner import prepare
    from s2hc.study.spec import load_spec

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "start"
    out.mkdir()
    shutil.copy(root / "docs" / "start" / "study.json", out / "study.json")
    spec = load_spec(root / "configs" / "study-start.yaml")
    assert spec.train["init_rng"] == "sequential"
    prepare(spec, out)  # grows: no error
    shutil.copy(root / "docs" / "start" / "study.json", out / "study.json")
    fresh = load_spec(root / "configs" / "study-start.yaml", ["init_rng=per_parameter"])
    with pytest.raises(ValueError, match="holds a study of another grid or training settings"):
        prepare(fresh, out)
