"""``s2hc diagnose --static`` of the one-stream residuals of production models (Muse Spark, Ergo, ZAYA, Beam): a
tiny random checkpoint saved by transformers is read from safetensors and config.json alone, its learned maps
measured by the s2hc connection that computes each, and a damaged one refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_one_stream_residuals import beam_config, design, ergo_config, muse_config, randomized

from s2hc.cli import main


def _save(name: str, tmp_path):
    """A tiny random model of design ``name`` saved by transformers: ``(directory, model, converter)``."""
    tf = design(name)
    torch.manual_seed(0)
    if name == "muse_spark":
        model = tf.modeling.MuseSparkTextModel(muse_config(tf))
    elif name == "ergo":
        model = tf.modeling.ErgoForCausalLM(ergo_config(tf))
    elif name == "beam":
        model = tf.modeling.BeamForCausalLM(beam_config(tf))
    else:
        model = tf.modeling.ZayaForCausalLM(tf.configuration.ZayaConfig(
            vocab_size=64, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            eos_token_id=None, bos_token_id=None, pad_token_id=None))
    randomized(model, seed=1, spread=0.5)
    directory = tmp_path / name
    model.save_pretrained(directory)
    return directory, model, tf.conv


@pytest.mark.parametrize("name", ["muse_spark", "ergo", "zaya", "beam"])
def test_diagnose_static_reads_a_one_stream_checkpoint_and_measures_its_maps(name, tmp_path, capsys):
    directory, model, conv = _save(name, tmp_path)
    out = tmp_path / "out"
    assert main(["diagnose", "--static", str(directory), "--out", str(out)]) == 0
    assert "no residual matrix" in capsys.readouterr().out
    result = json.loads((out / "static.json").read_text())
    layers = model.config.get_text_config().num_hidden_layers
    connections = result["learned_maps"]["connections"]
    assert len(connections) == 2 * layers and "## Learned maps" in (out / "report.md").read_text()
    if name == "beam":  # a fixed add: β = 1/√i at residual_add_idx i
        assert connections[0]["beta_mean"] == pytest.approx(1 / 2**0.5) and result["tensors_read"] == 0
        return
    layer = (model.model if hasattr(model, "model") else model).layers[1]
    expected = conv.connection_from_hf(model.config, getattr(layer, conv.LAYER_MODULES[1]), 1).measures()
    assert connections[3] == pytest.approx({"name": connections[3]["name"], **expected})


def test_a_damaged_one_stream_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    directory, _, _ = _save("ergo", tmp_path)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    del tensors["layers.1.post_ffn_residual.scale"]  # the released layout, which save_pretrained writes
    save_file(tensors, weights, metadata={"format": "pt"})
    capsys.readouterr()  # transformers' own output while saving
    assert main(["diagnose", "--static", str(directory), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "layer 1's post_ffn_residual has no ['scale']" in error[0]
