"""configs/recipe-authors.yaml: the s²HC authors' code's four departures from the papers' text, as s2hc options
(docs/training.md, "The authors' code"), and nothing else."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from s2hc.config import TrainConfig, load_yaml_config
from s2hc.connection import HyperConnection
from s2hc.models import Transformer
from s2hc.train.optim import decayed_parameter_names

RECIPE = Path(__file__).resolve().parents[1] / "src" / "s2hc" / "configs" / "recipe-authors.yaml"


def recipe_config(**overrides) -> TrainConfig:
    return TrainConfig.from_dict({**load_yaml_config(RECIPE), **overrides})


def test_the_recipe_sets_the_four_points_and_leaves_the_rest_to_the_defaults():
    values = load_yaml_config(RECIPE)
    assert values == {
        "family": "s2hc", "n_streams": 4, "weight_decay_on": "all", "model_overrides": {"weight_init": "neox"},
        "family_options": {"projection_init": "normal", "transpose_res": True},
    }
    defaults = TrainConfig()
    config = recipe_config()
    assert (config.lr, config.beta1, config.beta2, config.grad_clip, config.min_lr_ratio) == (
        defaults.lr, defaults.beta1, defaults.beta2, defaults.grad_clip, defaults.min_lr_ratio)


def test_the_recipe_model_starts_as_the_authors_does():
    config = recipe_config()
    torch.manual_seed(0)
    model = Transformer(config.model_config())
    width, layers = model.config.dim, model.config.n_layers
    connections = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert connections and all(c.transpose_res for c in connections)
    projections = torch.cat([c.projection.detach().flatten() for c in connections])
    assert abs(projections.std().item() / math.sqrt(2 / (5 * width)) - 1) < 0.02  # their nn.Linear re-draw
    down = torch.cat([b.mlp.down_proj.weight.detach().flatten() for b in model.blocks])
    assert abs(down.std().item() * math.sqrt(width) * layers - 1) < 0.05  # 1 / (sqrt(C) · L)
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() / math.sqrt(2 / (5 * width)) - 1) < 0.05
    assert set(decayed_parameter_names(model, on=config.weight_decay_on)) == {n for n, _ in model.named_parameters()}


def test_the_spectrum_at_its_initial_bias_is_one_in_bfloat16():
    """docs/training.md, "Precision": tanh(4) rounds to exactly 1 in bfloat16, and keeps rounding to 1 down to a
    pre-activation of artanh(1 − 2⁻⁹) = 3.47 (the midpoint to the next bfloat16 below 1)."""
    import math

    assert torch.tanh(torch.tensor(4.0)).bfloat16().item() == 1.0
    edge = math.atanh(1 - 2**-9)
    assert round(edge, 2) == 3.47
    assert torch.tanh(torch.tensor(edge + 1e-3, dtype=torch.float64)).bfloat16().item() == 1.0
    assert torch.tanh(torch.tensor(edge - 1e-3, dtype=torch.float64)).bfloat16().item() < 1.0
