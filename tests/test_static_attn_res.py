"""``s2hc diagnose --static`` of Attention Residuals checkpoints (Inkling-2 saved by transformers, Kimi-K3 in its
released names): every read's bound is checked against the queries read back from the checkpoint by hand, and
against the weights the read gives sources built to reach it (the bound is attained, and never exceeded by random
sources); zero queries read uniformly; a damaged checkpoint is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_inkling2 import DIM, FULL, LAYERS, PER_BLOCK, hf_config, random_queries_  # noqa: E402
from test_kimi_k3 import CONFIG as K3_CONFIG  # noqa: E402
from test_kimi_k3 import k3_state  # noqa: E402
from transformers.models.inkling2.modeling_inkling2 import Inkling2TextModel  # noqa: E402

from s2hc.cli import main  # noqa: E402
from s2hc.connection.forms import AttnResConnection  # noqa: E402
from s2hc.hf import inkling2  # noqa: E402


def _diagnose(directory, tmp_path, capsys) -> dict:
    out = tmp_path / "out"
    assert main(["diagnose", "--static", str(directory), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "depth reads" in printed and "Report:" in printed
    assert (out / "report.md").read_text().count("\n| layers.") >= LAYERS
    return json.loads((out / "static.json").read_text())


def _inkling2(tmp_path, zero=False):
    torch.manual_seed(0)
    model = Inkling2TextModel(hf_config()).eval()
    if not zero:
        random_queries_(model)
    model.save_pretrained(tmp_path / "inkling2")
    return tmp_path / "inkling2", model


def test_inkling2s_reads_are_bounded_by_their_queries(tmp_path, capsys):
    directory, model = _inkling2(tmp_path)
    result = _diagnose(directory, tmp_path, capsys)
    assert result["layout"] == "inkling2" and result["family"] == "attn-res"
    assert result["family_options"]["block_size"] == 2 * PER_BLOCK
    reads = {entry["name"]: entry for entry in result["depth_reads"]["reads"]}
    assert not reads["layers.0.attention"]["reads"]  # layer 0's attention takes the embedding
    for i, layer in enumerate(model.layers):
        for kind, module in (("attention", layer.attention_input), ("mlp", layer.mlp_input)):
            if module is None:
                continue
            queries = module.query.detach().double().reshape(-1, DIM)
            names = [f"layers.{i}.{kind}.{q}" for q in "qkv"] if len(queries) == 3 else [f"layers.{i}.{kind}"]
            assert (len(queries) == 3) == (kind == "attention" and i in FULL)
            for name, query in zip(names, queries):
                # Inkling-2: unweighted keys, logits scaled by C^-1/2, so R = 2 ‖q‖ C^-1/2 √C = 2 ‖q‖
                assert reads[name]["logit_range"] == pytest.approx(2 * float(query.norm()), rel=1e-12)
                s = reads[name]["sources"]
                assert s == 1 + math.ceil((2 * i + (kind == "mlp")) / (2 * PER_BLOCK))
    out = reads["output"]
    assert out["sources"] == 1 + math.ceil(2 * LAYERS / (2 * PER_BLOCK))
    assert out["logit_range"] == pytest.approx(2 * float(model.final_input.query.detach().double().norm()), rel=1e-12)


def test_the_bound_is_reached_by_aligned_sources_and_never_passed_by_random_ones():
    torch.manual_seed(3)
    connection = AttnResConnection(DIM, sublayer=9, block_size=2, key_norm="weighted", scaled_logits=True,
                                   eps=1e-12).double()
    with torch.no_grad():
        connection.query.copy_(0.05 * torch.randn(DIM))
        connection.key_norm_weight.copy_(1 + 0.3 * torch.randn(DIM))
    s = connection.num_sources
    bound = connection.read_bounds(s)[0]
    u = (connection.query * connection.key_norm_weight).detach()
    aligned = (u[None, None], *(-u[None, None],) * (s - 1))  # one source along u, the others against it
    with torch.no_grad():
        weights = connection.depth_weights(aligned)[0, 0]
    assert float(weights[0]) == pytest.approx(bound["weight_max"], rel=1e-9)
    assert float(weights[1]) == pytest.approx((1 - bound["weight_max"]) / (s - 1), rel=1e-9)
    reversed_ = (-u[None, None], *(u[None, None],) * (s - 1))
    random = tuple(torch.randn(4, 64, DIM, dtype=torch.float64) for _ in range(s))
    with torch.no_grad():
        assert float(connection.depth_weights(reversed_)[0, 0, 0]) == pytest.approx(bound["weight_min"], rel=1e-9)
        weights = connection.depth_weights(random)
    assert float(weights.max()) <= bound["weight_max"] and float(weights.min()) >= bound["weight_min"]
    assert float(weights.max()) < 0.9 * bound["weight_max"] + 0.1 / s  # random sources stay well inside it


def test_zero_queries_read_uniformly(tmp_path, capsys):
    directory, _ = _inkling2(tmp_path, zero=True)
    result = _diagnose(directory, tmp_path, capsys)
    across = result["depth_reads"]["across_depth"]
    assert across["uniform"] == across["reads"] > 0
    for entry in result["depth_reads"]["reads"]:
        if entry["reads"]:
            assert entry["weight_max"] == entry["weight_min"] == pytest.approx(1 / entry["sources"])


def _k3(tmp_path, state=None, config=None):
    directory = tmp_path / "k3"
    directory.mkdir(parents=True)
    safetensors_torch.save_file(state or k3_state(), directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "kimi_k3", **K3_CONFIG}))
    return directory


def test_kimi_k3s_reads_are_bounded_by_their_weighted_queries(tmp_path, capsys):
    state = k3_state()
    result = _diagnose(_k3(tmp_path, state), tmp_path, capsys)
    assert result["layout"] == "kimi_k3" and result["family_options"]["block_size"] == 2 * K3_CONFIG[
        "attn_res_block_size"]
    reads = {entry["name"]: entry for entry in result["depth_reads"]["reads"]}
    dim = K3_CONFIG["hidden_size"]
    for name, module in (("layers.5.mlp", "model.layers.5.mlp_res"), ("output", "model.output_attn_res")):
        u = state[f"{module}_proj.weight"][0].double() * state[f"{module}_norm.weight"].double()
        assert reads[name]["logit_range"] == pytest.approx(2 * float(u.norm()) * math.sqrt(dim), rel=1e-12)
    assert reads["layers.0.attention"]["sources"] == 1 and reads["layers.0.attention"]["weight_max"] == 1


def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    state = k3_state()
    state["model.layers.3.mlp_res_norm.weight"] = torch.ones(DIM + 1)
    assert main(["diagnose", "--static", str(_k3(tmp_path, state))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "blocks.3.mlp_hc.key_norm_weight" in err
    state = k3_state()
    state["model.output_attn_res_proj.weight"][0, 0] = float("nan")
    assert main(["diagnose", "--static", str(_k3(tmp_path / "nan", state))]) == 2
    err = capsys.readouterr().err
    assert "model.output_attn_res_proj.weight" in err and "NaN" in err
    config = {"model_type": "inkling2", "hidden_size": 32}
    directory, _ = _inkling2(tmp_path)
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["diagnose", "--static", str(directory)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_inkling2s_released_names_map_as_transformers_renames_them():
    """transformers saves Inkling-2 in the released names (``attn_res.attn_queries.{i}`` is layer i + 1's attention):
    both namings give the same s2hc state."""
    torch.manual_seed(0)
    model = Inkling2TextModel(hf_config()).eval()
    random_queries_(model)
    ours = inkling2.model_connections_from_hf(model.state_dict(), hf_config())
    released = {f"attn_res.attn_queries.{i - 1}": model.layers[i].attention_input.query for i in range(1, LAYERS)}
    released.update({f"attn_res.mlp_queries.{i}": model.layers[i].mlp_input.query for i in range(LAYERS)})
    released["attn_res.output_query"] = model.final_input.query
    assert all(inkling2.is_connection_tensor(key) for key in released)
    assert not inkling2.is_connection_tensor("model.layers.3.self_attn.q_proj.weight")
    other = inkling2.model_connections_from_hf(released, hf_config())
    assert other.keys() == ours.keys() and all(torch.equal(other[k], ours[k]) for k in ours)
