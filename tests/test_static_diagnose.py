"""``s2hc diagnose --static``: the matrices at d = 0 read from safetensors alone (s2hc/hf/static.py).

The references are independent of the reader: for s2hc's layout, the model's own connections on real streams
with every ``α`` set to zero (the token-driven term switched off, not the input); for DeepSeek-V4's layout,
transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` themselves. The files are made here: by
``save_pretrained`` (single and sharded) and by hand in DeepSeek-V4's two namings.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import SMALL_MODEL, randomize_

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from s2hc.cli import main  # noqa: E402
from s2hc.hf.export import from_s2hc  # noqa: E402
from s2hc.hf.static import diagnose_static, read_static, static_matrices  # noqa: E402
from s2hc.models import ModelConfig, Transformer  # noqa: E402
from s2hc.models.widen import upcycle_model  # noqa: E402

N = 4


def hyper_model(family: str, seed: int = 0, **options) -> Transformer:
    """A small model of ``family`` (n = 4, 2 layers) with every parameter far from its initialisation."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=64, **SMALL_MODEL, family=family, n_streams=N, family_options=options)
    model = Transformer(config)
    randomize_(model, torch.Generator().manual_seed(seed), 0.5)
    return model.eval()


def save(model: Transformer, directory, **kwargs):
    """An s2hc export's weights and config.json (what `s2hc export` writes), via save_pretrained."""
    from_s2hc(model).save_pretrained(directory, **kwargs)
    return directory


@torch.no_grad()
def bias_only_matrices(model: Transformer) -> torch.Tensor:
    """Each connection's H_res ``(L, n, n)`` on random streams with the α of every gate and mixer set to 0:
    what the token cannot move. Checks that it is the same for every token, returns the first."""
    x = torch.randn(3, 5, N, model.config.dim, dtype=torch.float64)
    out = []
    for block in model.double().blocks:
        for connection in (block.attn_hc, block.mlp_hc):
            for name, p in connection.named_parameters():
                if name.rsplit(".", 1)[-1] == "alpha" or name.endswith("_alpha") or name.startswith("alpha_"):
                    p.zero_()
            res = connection.coefficients(x)[2]
            # The same for every token, to float64 rounding: each token's matrix comes from identical numbers
            # through the same ops, but vectorised kernels (SIMD lanes, blocked sums, the CPU's instruction set)
            # may round the 15 tokens differently, by a few ulps per op (6.8e-21 seen on another machine, mhc
            # deepseek-v4). A token term left in would differ by ~1e-2; 1e-12 (about 5 000 ulps) lies between.
            assert (res - res[:1, :1]).abs().max() <= 1e-12  # only biases remain
            out.append(res[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("family,options", [
    ("s2hc", {}), ("mhc", {}), ("mhc-lite", {}), ("kromhc", {}), ("hc", {}), ("hc", {"projection": "per-stream"}),
    ("orthogonal", {}), ("s2hc", {"transpose_res": True}), ("s2hc", {"rotation": "expm"}),
    ("mhc", {"variant": "deepseek-v4"}),
])
def test_static_matrices_of_an_s2hc_export_are_what_the_model_applies_without_its_token_term(
        family, options, tmp_path):
    model = hyper_model(family, **options)
    result = diagnose_static(save(model, tmp_path / "export"))
    expected = bias_only_matrices(model)
    assert result["layout"] == "s2hc" and result["family"] == family and result["family_options"] == options
    assert result["layers"] == [f"blocks.{i}.{s}_hc" for i in range(2) for s in ("attn", "mlp")]
    assert torch.allclose(torch.tensor(result["matrices"]["res"], dtype=torch.float64), expected, atol=1e-6)
    read = read_static(tmp_path / "export").tensors_read
    assert read and not any(name.endswith(("projection", "norm_weight")) for name in read)
    if result.get("guarantees"):  # the family's claims hold at d = 0 too
        assert all(check["holds"] for check in result["guarantees"]), result["guarantees"]


def test_a_sharded_checkpoint_opens_only_the_shards_that_hold_hyper_connection_tensors(tmp_path):
    model = hyper_model("s2hc")
    directory = save(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    hc_shards = {shard for name, shard in index["weight_map"].items()
                 if "_hc." in name and not name.endswith(("projection", "norm_weight"))}
    for shard in set(shards) - hc_shards:  # shards it must not open (even those with only projections): unreadable
        (directory / shard).write_bytes(b"not a safetensors file")
    checkpoint = read_static(directory)
    assert {p.rsplit("/", 1)[-1] for p in checkpoint.files} == hc_shards
    single = read_static(save(model, tmp_path / "single"))
    for (_, a), (_, b) in zip(checkpoint.connections, single.connections):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_models_hyper_head_is_read_with_its_connections(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, **SMALL_MODEL, family="s2hc", n_streams=N, stream_reduce="head")
    model = Transformer(config)
    with torch.no_grad():
        model.stream_head.bias.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
    result = diagnose_static(save(model, tmp_path / "head"))
    expected = torch.sigmoid(torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.float64)) + 1e-6
    assert result["head_weights"] == pytest.approx(expected.tolist(), abs=1e-7)
    assert result["depth"] == 2 * SMALL_MODEL["n_layers"]


def test_an_upcycled_model_reads_as_the_upcycling_initialisation(tmp_path):
    torch.manual_seed(0)
    residual = Transformer(ModelConfig(vocab_size=64, **SMALL_MODEL))
    model = upcycle_model(residual, "s2hc", N)
    result = diagnose_static(save(model, tmp_path / "upcycled"))
    pre, post = (torch.tensor(result["matrices"][k], dtype=torch.float64) for k in ("pre", "post"))
    assert torch.allclose(pre, torch.full_like(pre, 1 / N), atol=1e-6)  # H_pre uniform, Σ = 1
    assert torch.allclose(post.sum(-1), torch.full((len(post),), float(N), dtype=torch.float64), atol=1e-5)
    assert result["headline"]["col_sum_error"] < 1e-6 and result["headline"]["row_sum_error"] < 1e-6


# ------------------------------------------------------------------------------------------ DeepSeek-V4

dv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def deepseek(layers: int = 3):
    """transformers' config, connections and head with seeded random parameters (test_deepseek_v4's builders)."""
    from test_deepseek_v4 import hf_config, hf_connection, hf_head

    config = hf_config(n=N, dim=8)
    connections = {(layer, sublayer): hf_connection(config, seed=2 * layer + (sublayer == "ffn"))
                   for layer in range(layers) for sublayer in ("attn", "ffn")}
    return config, connections, hf_head(config)


def write_deepseek(directory, config, connections, head, released_names: bool):
    """A DeepSeek-V4 checkpoint in transformers' names or in the released checkpoints' names, with one other
    tensor beside the hyper-connections, and its config.json."""
    tensors = {"model.embed_tokens.weight": torch.randn(32, 8)}
    for (layer, sublayer), module in connections.items():
        for param, value in module.state_dict().items():
            name = (f"layers.{layer}.hc_{sublayer}_{param}" if released_names
                    else f"model.layers.{layer}.{sublayer}_hc.{param}")
            tensors[name] = value.clone()
    for param, value in head.state_dict().items():
        tensors[f"hc_head_{param.removeprefix('hc_')}" if released_names else f"model.hc_head.{param}"] = value.clone()
    directory.mkdir()
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


@torch.no_grad()
def transformers_static(module, n: int, dim: int):
    """transformers' own (pre, post, res as applied = combᵀ) at d = 0: post and comb on zero streams; pre from a
    copy whose scale is 0, on streams that put stream s in channel s (collapsed = pre)."""
    post, comb, _ = module(torch.zeros(1, 1, n, dim))
    probe = copy.deepcopy(module)
    probe.scale.zero_()
    _, _, collapsed = probe(torch.eye(n, dim)[None, None])
    return collapsed[0, 0, :n], post[0, 0], comb[0, 0].T


@pytest.mark.parametrize("released_names", [False, True])
def test_deepseek_v4_checkpoints_read_as_transformers_computes_them(released_names, tmp_path):
    config, connections, head = deepseek()
    directory = write_deepseek(tmp_path / "dsv4", config, connections, head, released_names)
    checkpoint = read_static(directory)
    assert not any("embed" in name or name.endswith("fn") for name in checkpoint.tensors_read)
    assert (checkpoint.layout, checkpoint.family, checkpoint.n_streams) == ("deepseek-v4", "mhc", N)
    matrices = static_matrices(checkpoint)
    for index, module in enumerate(connections.values()):
        pre, post, res = transformers_static(module, N, config.hidden_size)
        torch.testing.assert_close(matrices["pre"][index].float(), pre, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(matrices["post"][index].float(), post, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(matrices["res"][index].float(), res, atol=1e-6, rtol=1e-6)
    no_scale = dv4.DeepseekV4HyperHead(config)
    no_scale.load_state_dict({**head.state_dict(), "hc_scale": torch.zeros(1)})
    with torch.no_grad():
        weights = no_scale(torch.eye(N, config.hidden_size)[None, None])[0, 0, :N]
    torch.testing.assert_close(matrices["head"].float(), weights, atol=1e-6, rtol=1e-6)
    result = diagnose_static(directory)
    assert result["head_weights"] == pytest.approx(weights.tolist(), abs=1e-6)
    assert result["layers"][:2] == ["layers.0.attn_hc", "layers.0.ffn_hc"]
    # DeepSeek's Sinkhorn ends on a column normalisation: columns exact, rows near 1 (at 7 iterations)
    assert result["headline"]["col_sum_error"] < 1e-3


# ------------------------------------------------------------------------------------------ the command


def test_diagnose_static_writes_the_report_and_json(tmp_path, capsys):
    config, connections, head = deepseek()
    directory = write_deepseek(tmp_path / "dsv4", config, connections, head, released_names=False)
    out = tmp_path / "out"
    assert main(["diagnose", "--static", str(directory), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mhc (n = 4, deepseek-v4 layout), 6 connections, biases alone (d = 0)" in printed
    saved = json.loads((out / "static.json").read_text())
    assert saved["depth"] == 6 and saved["kind"] == "static"
    report = (out / "report.md").read_text()
    assert "Hyper-head stream weights at d = 0" in report and "## Across depth" in report
    default = tmp_path / "cwd"
    default.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(default)
        assert main(["diagnose", "--static", str(directory / "model.safetensors")]) == 0
    assert (default / "runs" / "diagnose-static" / "model" / "report.md").is_file()


def _residual_export(directory):
    torch.manual_seed(0)
    return save(Transformer(ModelConfig(vocab_size=64, **SMALL_MODEL)), directory)


def _no_config(directory):
    save(hyper_model("s2hc"), directory)
    (directory / "config.json").unlink()
    return directory


def _misshapen(directory):
    config, connections, head = deepseek(layers=1)
    connections[(0, "ffn")].base = torch.nn.Parameter(torch.zeros(7))
    return write_deepseek(directory, config, connections, head, released_names=False)


def _not_safetensors(directory):
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"garbage")
    return directory


@pytest.mark.parametrize("make,message", [
    (_residual_export, "holds no hyper-connection tensors"),
    (_no_config, "no config.json with an 's2hc' entry"),
    (_misshapen, "layers.0.ffn_hc: DeepSeek-V4 connection state: tensor 'base' has shape (7,)"),
    (_not_safetensors, "model.safetensors' is not a readable safetensors file (damaged, truncated or another format)"),
    (lambda d: d / "missing", "does not exist"),
])
def test_bad_checkpoints_get_one_line_and_nothing_is_written(make, message, tmp_path, capsys):
    source, out = make(tmp_path / "source"), tmp_path / "out"
    capsys.readouterr()
    assert main(["diagnose", "--static", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


# A damaged file: one line naming the file and what is wrong with it, never what failed inside s2hc.


def _export(directory):
    return save(hyper_model("mhc"), directory)


def _edit_config(change):
    def make(directory):
        _export(directory)
        change(directory / "config.json")
        return directory
    return make


def _integer_tensors(directory):
    _export(directory)
    file = directory / "model.safetensors"
    tensors = safetensors_torch.load_file(str(file))
    tensors["model.blocks.0.attn_hc.bias_pre"] = tensors["model.blocks.0.attn_hc.bias_pre"].round().to(torch.int64)
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    return directory


def _truncated(directory):
    _export(directory)
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    return directory


def _sharded(change):
    def make(directory):
        save(hyper_model("s2hc"), directory, max_shard_size="20KB")
        index = directory / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        change(directory, data["weight_map"])
        index.write_text(json.dumps(data))
        return directory
    return make


def _missing_shard(directory, weight_map):
    shard = weight_map["model.blocks.0.attn_hc.bias_pre"]
    (directory / shard).unlink()


def _tensor_not_in_its_shard(directory, weight_map):
    weight_map["model.blocks.0.attn_hc.bias_pre"] = next(s for s in weight_map.values()
                                                   if s != weight_map["model.blocks.0.attn_hc.bias_pre"])


def _s2hc_entry(value):
    return _edit_config(lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "s2hc": value})))


DAMAGED = [  # (how the checkpoint is damaged, the file the line names, what it says is wrong)
    (_integer_tensors, "source",
     "tensor model.blocks.0.attn_hc.bias_pre has dtype int64; a checkpoint's hyper-connection tensors are floating"),
    (_truncated, "source/model.safetensors", "is not a readable safetensors file (damaged, truncated"),
    (_edit_config(lambda path: path.write_text("[1, 2]")), "source/config.json", "holds an array, not a JSON object"),
    (_edit_config(lambda path: path.write_text("{not json")), "source/config.json", "is not JSON (Expecting"),
    (_edit_config(lambda path: path.write_bytes(b"\xff\xfe{}")), "source/config.json", "is not UTF-8 text"),
    (_edit_config(lambda path: (path.unlink(), path.mkdir())), "source/config.json", "is a directory"),
    (_s2hc_entry([1]), "source", "config.json's 's2hc' entry is an array, not the object of model settings"),
    (_s2hc_entry({"family": "sinkhorn"}), "source",
     "config.json's 's2hc' entry is not a model s2hc builds: family must be one of"),
    (_s2hc_entry({"family": "mhc", "dim": "wide"}), "source",
     "config.json's 's2hc' entry is not a model s2hc builds: dim must be an integer >= 1, got 'wide'"),
    (_sharded(_missing_shard), "source/model.safetensors.index.json", "which is not in"),
    (_sharded(_tensor_not_in_its_shard), "source/model", "holds no tensor 'model.blocks.0.attn_hc.bias_pre', which"),
]


@pytest.mark.parametrize("make, named, fragment", DAMAGED)
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_defect(make, named, fragment, tmp_path, capsys):
    source, out = make(tmp_path / "source"), tmp_path / "out"
    capsys.readouterr()
    assert main(["diagnose", "--static", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"'{tmp_path / named}" in err and fragment in err, err
    assert not out.exists()


def test_static_refuses_the_other_modes_options(tmp_path, capsys):
    assert main(["diagnose", "--static", "--synthetic", str(tmp_path)]) == 2
    assert "--static and --synthetic exclude each other" in capsys.readouterr().err
    assert main(["diagnose", "--static", str(tmp_path), "--data", "embedded"]) == 2
    assert "--data do(es) not apply to --static" in capsys.readouterr().err
