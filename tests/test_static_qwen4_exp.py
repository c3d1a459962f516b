"""``s2hc diagnose --static`` of Qwen's gated residual: a ``qwen4_exp`` checkpoint in transformers' names, and an
s2hc export of ``family="gated-residual"`` (s2hc/hf/static.py).

The gated residual has no static part, so what is checked is what the reader says the weights are, per stream:
against an independent computation from the tensors as stored (sliced per stream here, not reshaped as the
reader does), for a tiny ``Qwen4ExpForCausalLM`` written by ``save_pretrained`` (single file and sharded), a
multimodal-prefixed checkpoint written by hand, and an s2hc export; that only the connections' tensors were read;
and the refusals.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import SMALL_MODEL, randomize_

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed")
pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp",
                    reason="this transformers has no qwen4_exp model")

from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402

from s2hc.cli import main  # noqa: E402
from s2hc.hf.export import from_s2hc  # noqa: E402
from s2hc.hf.static import STREAM_MEASURES, diagnose_static, read_static, static_matrices  # noqa: E402
from s2hc.models import ModelConfig, Transformer  # noqa: E402

N, DIM, RANK, LAYERS = 3, 16, 5, 2
HYPER = ("_hyper_connection.", "hyper_connection_mixer.")


def tiny_config(**changes) -> Qwen4ExpTextConfig:
    """A Qwen4ExpTextConfig small enough to build in a moment: hidden_size 16, 2 layers, 2 experts."""
    settings = dict(vocab_size=32, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=8,
                    shared_expert_intermediate_size=8, num_experts=2, num_experts_per_tok=1, hc_count=N,
                    hc_lowrank=RANK)
    return Qwen4ExpTextConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def qwen_model() -> Qwen4ExpForCausalLM:
    """The tiny model, its hyper-connections random (the norms' weights too), stream 1 of layer 0's attention
    connection written ten times as strongly as the others."""
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(tiny_config()).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in HYPER):
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        model.model.layers[0].attn_hyper_connection.block_inject_weight.weight[1] *= 10
    return model


@pytest.fixture(scope="module")
def saved(qwen_model, tmp_path_factory):
    """``(single, sharded)``: the model by save_pretrained, in one file and in several shards."""
    root = tmp_path_factory.mktemp("qwen4_exp")
    qwen_model.save_pretrained(root / "single")
    qwen_model.save_pretrained(root / "sharded", max_shard_size="4KB")
    return root / "single", root / "sharded"


def hyper_tensors(directory) -> dict[str, torch.Tensor]:
    """Every hyper-connection tensor of the checkpoint, read here with safetensors' own loader."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update({k: v for k, v in safetensors_torch.load_file(str(file)).items() if any(p in k for p in HYPER)})
    return tensors


def expected_measures(tensors: dict[str, torch.Tensor], name: str, n: int, dim: int, names: dict[str, str]):
    """The per-stream numbers of connection ``name`` from its tensors, stream by stream (``names``: the measure's
    tensor under the checkpoint's naming)."""
    get = {key: tensors[f"{name}.{tensor}"].double() for key, tensor in names.items() if f"{name}.{tensor}" in tensors}
    out = {}
    for key in STREAM_MEASURES:
        if key not in get:
            continue
        rows = []
        for s in range(n):
            block = slice(s * dim, (s + 1) * dim)
            if key == "norm_scale":
                rows.append((1 + get[key][block]).mean())
            elif key == "write_norm":
                rows.append(torch.linalg.vector_norm(get[key][s]))
            elif key == "read_up_norm":
                rows.append(torch.linalg.matrix_norm(get[key][block, :]))
            else:
                rows.append(torch.linalg.matrix_norm(get[key][:, block]))
        out[key] = torch.stack(rows)
    return out


QWEN_NAMES = {"norm_scale": "hc_norm.weight", "write_norm": "block_inject_weight.weight",
              "read_up_norm": "input_mix_weight_up.weight", "read_down_norm": "input_mix_weight_down.weight"}
S2HC_NAMES = {"norm_scale": "norm_weight", "write_norm": "write", "read_up_norm": "read_up",
              "read_down_norm": "read_down"}


def check_weights(result, tensors, names, n, dim, connections, head):
    weights = result["stream_weights"]
    assert weights["layers"] == connections == result["layers"]
    for key in STREAM_MEASURES:
        values = torch.tensor(weights["connections"][key]["values"], dtype=torch.float64)
        shares = torch.tensor(weights["connections"][key]["shares"], dtype=torch.float64)
        expected = torch.stack([expected_measures(tensors, name, n, dim, names)[key] for name in connections])
        torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(shares, expected / expected.sum(-1, keepdim=True), rtol=1e-12, atol=1e-12)
        across = weights["across_depth"][key]
        torch.testing.assert_close(torch.tensor(across["mean"], dtype=torch.float64), expected.mean(0))
        top = (expected / expected.sum(-1, keepdim=True)).max()
        assert across["max_share"]["share"] == pytest.approx(top.item(), rel=1e-12)
        if head is not None and key != "write_norm":
            want = expected_measures(tensors, head, n, dim, names)[key]
            torch.testing.assert_close(torch.tensor(weights["head"][key]["values"], dtype=torch.float64), want)
    if head is not None:
        assert "write_norm" not in weights["head"]


def test_a_qwen4_exp_checkpoint_reads_as_its_tensors_say(saved):
    single, _ = saved
    result = diagnose_static(single)
    assert (result["layout"], result["family"], result["n_streams"]) == ("qwen4_exp", "gated-residual", N)
    assert result["family_options"] == {"rank": RANK, "eps": 1e-6}
    connections = [f"model.layers.{i}.{s}_hyper_connection" for i in range(LAYERS) for s in ("attn", "mlp")]
    check_weights(result, hyper_tensors(single), QWEN_NAMES, N, DIM, connections, "model.hyper_connection_mixer")
    top = result["stream_weights"]["across_depth"]["write_norm"]["max_share"]
    assert (top["stream"], top["connection"]) == (1, "model.layers.0.attn_hyper_connection") and top["share"] > 0.7
    # every hyper-connection tensor was read, and nothing else
    checkpoint = read_static(single)
    assert set(checkpoint.tensors_read) == set(hyper_tensors(single))
    assert len(checkpoint.tensors_read) == 4 * 2 * LAYERS + 3
    assert result["head_weights"] is None


def test_the_zero_input_matrices_are_what_transformers_applies_at_zero_input(qwen_model, saved):
    matrices = static_matrices(read_static(saved[0]))
    depth = 2 * LAYERS
    assert torch.equal(matrices["res"], torch.eye(N, dtype=torch.float64).expand(depth, N, N))
    assert torch.equal(matrices["pre"], torch.full((depth, N), 0.5 / N, dtype=torch.float64))
    assert torch.equal(matrices["post"], torch.ones(depth, N, dtype=torch.float64))
    zero = torch.zeros(1, 1, N * DIM)
    with torch.no_grad():
        for layer in qwen_model.model.layers:
            for module in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
                h, hyper_input, injection = module(zero)
                assert torch.equal(injection, torch.ones(1, 1, N)) and not h.any()


def test_a_sharded_checkpoint_opens_only_the_shards_with_hyper_connection_tensors(saved, tmp_path):
    single, sharded = saved
    directory = tmp_path / "sharded"
    shutil.copytree(sharded, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    hyper_shards = {shard for name, shard in index["weight_map"].items() if any(p in name for p in HYPER)}
    others = set(index["weight_map"].values()) - hyper_shards
    assert others, "the shard size must leave shards without hyper-connection tensors"
    for shard in others:  # shards it must not open: unreadable
        (directory / shard).write_bytes(b"not a safetensors file")
    checkpoint = read_static(directory)
    assert {path.rsplit("/", 1)[-1] for path in checkpoint.files} == hyper_shards
    assert all(any(p in name for p in HYPER) for name in checkpoint.tensors_read)
    a, b = diagnose_static(directory), diagnose_static(single)
    assert a["stream_weights"] == b["stream_weights"]


def write_by_hand(directory, tensors: dict[str, torch.Tensor], config: dict | None):
    directory.mkdir()
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def multimodal(qwen_model) -> tuple[dict[str, torch.Tensor], dict]:
    """The tiny model's tensors under the multimodal model's prefix, and a Qwen4ExpConfig's config.json."""
    tensors = {name.replace("model.", "model.language_model.", 1): value.clone().contiguous()
               for name, value in qwen_model.state_dict().items() if name.startswith("model.")}
    config = Qwen4ExpConfig(text_config=tiny_config().to_dict()).to_dict()
    return tensors, config


def test_the_multimodal_prefix_and_config_are_read(qwen_model, tmp_path):
    tensors, config = multimodal(qwen_model)
    assert config["model_type"] == "qwen4_exp" and "hc_count" not in config
    directory = write_by_hand(tmp_path / "vl", tensors, config)
    result = diagnose_static(directory)
    prefix = "model.language_model."
    connections = [f"{prefix}layers.{i}.{s}_hyper_connection" for i in range(LAYERS) for s in ("attn", "mlp")]
    check_weights(result, tensors, QWEN_NAMES, N, DIM, connections, f"{prefix}hyper_connection_mixer")


@pytest.mark.parametrize("nested", [False, True])
def test_eps_comes_from_the_place_model_type_names_and_is_recorded(qwen_model, nested, tmp_path):
    """rms_norm_eps is read where the other settings are: under text_config for "qwen4_exp", at the top for
    "qwen4_exp_text". A value in the other place (a hand-merged config.json) is not read; the one used is what every
    connection and the head compute with and what the result records."""
    tensors, config = multimodal(qwen_model)
    text = {**config["text_config"], "rms_norm_eps": 1e-5}
    if nested:
        config = {**config, "text_config": text, "rms_norm_eps": 1e-2}  # the top-level value is not the text model's
    else:
        tensors = {name.replace("model.language_model.", "model.", 1): value for name, value in tensors.items()}
        config = {**text, "model_type": "qwen4_exp_text", "text_config": {**text, "rms_norm_eps": 1e-2}}
    directory = write_by_hand(tmp_path / "model", tensors, config)
    checkpoint = read_static(directory)
    assert {connection.eps for _, connection in checkpoint.connections} == {checkpoint.head.eps} == {1e-5}
    assert checkpoint.family_options == {"rank": RANK, "eps": 1e-5}
    assert diagnose_static(directory)["family_options"]["eps"] == 1e-5


def test_integer_tensors_are_one_line(qwen_model, tmp_path, capsys):
    tensors = {name: value.round().to(torch.int32) if any(part in name for part in HYPER) else value
               for name, value in qwen_model.state_dict().items()}
    directory = write_by_hand(tmp_path / "ints", tensors, tiny_config().to_dict())
    assert main(["diagnose", "--static", str(directory), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(str(directory)) in err and "has dtype int32" in err, err
    assert "floating point" in err and not (tmp_path / "out").exists()


def test_an_s2hc_gated_residual_export_reads_the_same_way(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, **SMALL_MODEL, family="gated-residual", n_streams=4,
                         family_options={"rank": 6}, lss_init=0.5)
    model = Transformer(config)
    randomize_(model, torch.Generator().manual_seed(0), 0.5)
    from_s2hc(model).save_pretrained(tmp_path / "export")
    result = diagnose_static(tmp_path / "export")
    assert (result["layout"], result["family"], result["family_options"]) == ("s2hc", "gated-residual", {"rank": 6})
    connections = [f"blocks.{i}.{s}_hc" for i in range(SMALL_MODEL["n_layers"]) for s in ("attn", "mlp")]
    check_weights(result, model.state_dict(), S2HC_NAMES, 4, SMALL_MODEL["dim"], connections, "stream_head")
    read = read_static(tmp_path / "export").tensors_read
    assert read and all("_hc." in name or ".stream_head." in name for name in read)


def test_the_command_reports_the_stream_weights_and_says_what_they_are(saved, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["diagnose", "--static", str(saved[0]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gated-residual (n = 3, qwen4_exp layout), 4 connections, zero input (no static part" in printed
    assert "Per-stream weight norms (not usage" in printed
    assert "write_norm stream 1" in printed and "model.layers.0.attn_hyper_connection" in printed
    saved_json = json.loads((out / "static.json").read_text())
    assert saved_json["stream_weights"]["layers"][0] == "model.layers.0.attn_hyper_connection"
    report = (out / "report.md").read_text()
    for text in ("## Per-stream weights (the gated residual)", "has no static part",
                 "every read gate is 0.5 and every write gate 1", "token-driven", "weight norms, not usage",
                 "### write_norm", "share of the sum over the n streams", "Largest share: stream 1 at "
                 "`model.layers.0.attn_hyper_connection`", "head (final read)", "## Across depth"):
        assert text in report, text


# ------------------------------------------------------------------------------------------ refusals


def _only_others(qwen_model, directory):
    tensors = {k: v.clone() for k, v in qwen_model.state_dict().items() if not any(p in k for p in HYPER)}
    return write_by_hand(directory, tensors, tiny_config().to_dict())


def _misshapen(qwen_model, directory):
    tensors = {k: v.clone() for k, v in qwen_model.state_dict().items()}
    tensors["model.layers.1.mlp_hyper_connection.input_mix_weight_down.weight"] = torch.zeros(RANK + 1, N * DIM)
    return write_by_hand(directory, tensors, tiny_config().to_dict())


def _config_without(setting):
    def make(qwen_model, directory):
        config = tiny_config().to_dict()
        del config[setting]
        return write_by_hand(directory, dict(qwen_model.state_dict()), config)
    return make


def _multimodal_without(qwen_model, directory):
    tensors, config = multimodal(qwen_model)
    del config["text_config"]["hc_count"]
    return write_by_hand(directory, tensors, config)


def _missing_tensor(qwen_model, directory):
    tensors = dict(qwen_model.state_dict())
    del tensors["model.layers.1.mlp_hyper_connection.block_inject_weight.weight"]
    return write_by_hand(directory, tensors, tiny_config().to_dict())


def _more_layers_in_config(qwen_model, directory):
    return write_by_hand(directory, dict(qwen_model.state_dict()), tiny_config(num_hidden_layers=3).to_dict())


def _no_config(qwen_model, directory):
    return write_by_hand(directory, dict(qwen_model.state_dict()), None)


def _no_head(qwen_model, directory):
    tensors = {k: v for k, v in qwen_model.state_dict().items() if "hyper_connection_mixer" not in k}
    return write_by_hand(directory, tensors, tiny_config().to_dict())


def _with_deepseek_tensors(qwen_model, directory):
    tensors = {**qwen_model.state_dict(), "model.layers.0.attn_hc.base": torch.zeros(15)}
    return write_by_hand(directory, tensors, tiny_config().to_dict())


@pytest.mark.parametrize("make,message", [
    (_with_deepseek_tensors, "mixes qwen4_exp hyper-connection tensors"),
    (_only_others, "is a qwen4_exp checkpoint (config.json's model_type 'qwen4_exp_text') but holds no "
                   "hyper-connection tensors"),
    (_misshapen, "tensor model.layers.1.mlp_hyper_connection.input_mix_weight_down.weight has shape (6, 48), "
                 "expected (5, 48) (config.json: hc_count=3, hidden_size=16, hc_lowrank=5)"),
    (_config_without("hc_lowrank"), "config.json has no hc_lowrank (model_type 'qwen4_exp_text')"),
    (_config_without("num_hidden_layers"), "config.json has no num_hidden_layers"),
    (_multimodal_without, "config.json has no text_config.hc_count (model_type 'qwen4_exp')"),
    (_missing_tensor, "tensor model.layers.1.mlp_hyper_connection.block_inject_weight.weight is missing "
                      "(expected shape (3, 48)"),
    (_more_layers_in_config, "the hyper-connection tensors of model.layers.2.attn_hyper_connection are missing "
                             "(config.json says num_hidden_layers=3)"),
    (_no_config, "has qwen4_exp hyper-connection tensors but no config.json beside them"),
    (_no_head, "the tensors of model.hyper_connection_mixer are missing"),
])
def test_bad_qwen4_exp_checkpoints_get_one_line_and_nothing_is_written(qwen_model, make, message, tmp_path, capsys):
    source, out = make(qwen_model, tmp_path / "source"), tmp_path / "out"
    capsys.readouterr()
    assert main(["diagnose", "--static", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()
