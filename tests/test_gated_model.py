"""Qwen's gated residual inside s2hc's model (``family="gated-residual"``: no branch pre-norm, its head in the final
norm's place), learned stream scaling (``lss_init``, as brain-lab-research/hc-stream-collapse starts it), and the
refusals of both. The connection's own parity with transformers is tests/test_hf_qwen4_exp.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SMALL_MODEL, small_config
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import s2hc
from s2hc.cli import main
from s2hc.connection import StreamScaling, build_connection, set_connection_options
from s2hc.diagnostics import collect
from s2hc.models import ModelConfig, Transformer, get_preset
from s2hc.params import count_connection_params
from s2hc.rundir import read_config

MODEL = dict(vocab_size=256, **SMALL_MODEL, max_seq_len=32)


def gated_model(**changes) -> Transformer:
    torch.manual_seed(0)
    fields = {"family": "gated-residual", "n_streams": 3, "family_options": {"rank": 4}, **MODEL, **changes}
    return Transformer(get_preset("tiny", **fields)).eval()


def keep(seen: dict, key: str):
    """A forward pre-hook that keeps its module's first input under ``key`` (and changes nothing)."""
    def hook(module, args):
        seen.setdefault(key, args[0])
    return hook


def test_the_gated_model_is_qwens_layout():
    model = gated_model()
    assert model.config.stream_reduce == "head"  # None resolves to Qwen's model: its gated read ends it
    assert isinstance(model.stream_head, s2hc.GatedHead) and isinstance(model.norm, nn.Identity)
    for block in model.blocks:
        assert block.attn_norm is None and block.mlp_norm is None  # the read is normalised already
        assert isinstance(block.attn_hc, s2hc.GatedResidual) and isinstance(block.mlp_hc, s2hc.GatedResidual)
        assert block.attn_hc.rank == 4 and block.attn_hc.n_streams == 3
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256) and torch.isfinite(logits).all()


def test_the_branch_gets_the_gated_read_and_the_head_ends_the_model():
    """What the attention and the LM head are given, recorded by hooks, against the modules' own read."""
    model = gated_model()
    seen = {}
    model.blocks[0].attn.register_forward_pre_hook(keep(seen, "attn"))
    model.blocks[0].attn_hc.register_forward_pre_hook(keep(seen, "streams"))
    model.lm_head.register_forward_pre_hook(keep(seen, "head_in"))
    model.blocks[-1].mlp_hc.register_forward_hook(lambda m, args, out: seen.update(final=out))
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 8)))
        connection = model.blocks[0].attn_hc
        normed = connection.normed(seen["streams"])
        expected = connection.gated_read(normed, connection.read_gates(normed))
        torch.testing.assert_close(seen["attn"], expected, rtol=0, atol=0)
        torch.testing.assert_close(seen["head_in"], model.stream_head(seen["final"]), rtol=0, atol=0)


def test_a_summed_read_out_is_a_named_departure_with_the_final_norm():
    model = gated_model(stream_reduce="sum")
    assert model.stream_head is None and not isinstance(model.norm, nn.Identity)


def test_the_connection_parameters_are_counted_by_the_formula():
    """2nCr + n²C + nC per sublayer (read down and up, write, norm), and the head's 2nCr + nC once."""
    model = gated_model()
    n, C, r, L = 3, MODEL["dim"], 4, MODEL["n_layers"]
    per_sublayer = 2 * n * C * r + n * n * C + n * C
    assert count_connection_params("gated-residual", layers=L, dim=C, n_streams=n, rank=r) == 2 * L * per_sublayer
    assert model.num_connection_params() == 2 * L * per_sublayer + 2 * n * C * r + n * C
    assert count_connection_params("gated-residual", layers=1, dim=1024, n_streams=4, sublayers_per_layer=1) == (
        2 * 4 * 1024 * 320 + 16 * 1024 + 4 * 1024)  # transformers' default rank 320


def test_the_diagnostics_read_the_gated_connections():
    model = gated_model()
    capture = collect(model, torch.randint(0, 256, (2, 8)), tokens=12)
    L = 2 * MODEL["n_layers"]
    assert capture.families == ["gated-residual"] * L
    torch.testing.assert_close(capture.res, torch.eye(3).expand(L, 12, 3, 3), rtol=0, atol=0)
    assert ((capture.pre > 0) & (capture.pre < 1 / 3)).all() and ((capture.post > 0) & (capture.post < 2)).all()
    assert capture.summary()["depth"] == L


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_streams": 1}, r"^n_streams must be at least 2 for family='gated-residual', got 1$"),
    ({"family_options": {"gate_init": "residual"}},
     r"^unknown family_options \['gate_init'\] for family 'gated-residual'; allowed: \['eps', 'rank'\]$"),
    ({"family_options": {"transpose_res": True}}, r"unknown family_options \['transpose_res'\]"),
    ({"stream_reduce": "median"}, r"^stream_reduce must be one of \['sum', 'mean', 'head'\], got 'median'$"),
])  # fmt: skip
def test_bad_gated_configs_are_refused_in_one_line(changes, message):
    fields = {"family": "gated-residual", "n_streams": 3, **MODEL, **changes}
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", **fields)


def test_bad_gated_modules_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^rank must be an integer >= 1, got 0$"):
        s2hc.GatedResidual(8, 2, rank=0)
    with pytest.raises(ValueError, match=r"^n_streams must be at least 2 for family='gated-residual'"):
        s2hc.GatedHead(8, 1)
    with pytest.raises(ValueError, match=r"HyperConnection, got .gated-residual. .*s2hc.Connections"):
        s2hc.HyperConnection(8, 2, family="gated-residual")
    with pytest.raises(ValueError, match=r"^unknown option\(s\) \['gate_init'\] for family 'gated-residual'; "
                                         r"allowed: \['eps', 'rank'\]$"):
        build_connection(8, 2, family="gated-residual", gate_init="residual")
    with pytest.raises(ValueError, match=r"^x must have n_streams=2 and dim=8"):
        s2hc.GatedResidual(8, 2, rank=2)(torch.zeros(1, 1, 3, 8), nn.Identity())
    with pytest.raises(ValueError, match=r"^family 'gated-residual' has one way to compute: connection options "
                                         r"\['recompute'\] do not apply to it$"):
        set_connection_options(gated_model(), recompute=True)


# ---- learned stream scaling ----------------------------------------------------------------------------


def hc_stream_collapse_lss(n_streams: int, dim: int, init: float) -> torch.Tensor:
    """brain-lab-research/hc-stream-collapse's ``StreamExpandLSS`` start, written from its description: an (n, C)
    tensor, torch's Xavier-uniform, plus ``lss_init``."""
    lss = torch.empty(n_streams, dim)
    nn.init.xavier_uniform_(lss)
    return lss + init


@given(st.integers(2, 8), st.integers(1, 96), st.sampled_from([0.6, 1.0]), st.integers(0, 2**16))
def test_lss_starts_where_hc_stream_collapse_starts(n, dim, init, seed):
    torch.manual_seed(seed)
    expected = hc_stream_collapse_lss(n, dim, init)
    torch.manual_seed(seed)
    scale = StreamScaling(dim, n, init=init).scale.detach()
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    bound = math.sqrt(6 / (n + dim))  # Xavier-uniform on (fan_out, fan_in) = (n, C)
    assert ((scale - init).abs() <= bound + 1e-7).all()


def test_lss_scales_the_copied_embedding_before_the_first_layer():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family="mhc", n_streams=4, lss_init=0.6, **MODEL)).eval()
    assert model.config.lss_init == 0.6 and model.stream_scale.scale.shape == (4, MODEL["dim"])
    seen = {}
    model.blocks[0].attn_hc.register_forward_pre_hook(keep(seen, "x"))
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        model(ids)
        expected = model.embed(ids).unsqueeze(-2) * model.stream_scale.scale
    torch.testing.assert_close(seen["x"], expected, rtol=0, atol=0)
    assert model.stream_scale.scale in set(model.hyper_connection_parameters())
    # the streams differ at the input, so the first connection's H_res is no longer called inert
    assert 0 not in collect(model, ids, tokens=8).inert


@pytest.mark.parametrize(("changes", "message"), [
    ({"family": "residual", "lss_init": 0.6}, r"^lss_init scales several streams; family='residual' has one"),
    ({"family": "mhc", "n_streams": 4, "lss_init": -1.0}, r"^lss_init must be a positive number, got -1.0$"),
    ({"family": "mhc", "n_streams": 4, "lss_init": "big"}, r"^lss_init must be a positive number, got 'big'$"),
])  # fmt: skip
def test_bad_lss_is_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**MODEL, **changes})


# ---- the commands -------------------------------------------------------------------------------------


def test_s2hc_train_trains_the_gated_residual(corpus_file, tmp_path):
    config = small_config(corpus_file, tmp_path, family="gated-residual", n_streams=3, max_steps=2)
    args = ["train", "--preset", "tiny", "--family", "gated-residual", "--streams", "3",
            "--family-option", "rank=4", "--set", "model_overrides=" + json.dumps(config.model_overrides),
            "--data", config.data, "--cache-dir", config.cache_dir, "--seq-len", str(config.seq_len),
            "--batch-size", "2", "--max-steps", "2", "--warmup-steps", "1", "--set", "eval_batches=1",
            "--no-progress", "--out", config.out]  # fmt: skip
    assert main(args) == 0
    saved = read_config(config.out)
    assert saved["family"] == "gated-residual" and saved["family_options"] == {"rank": 4}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(math.isfinite(line.get("loss", math.nan)) for line in lines)


def test_s2hc_params_counts_a_family_with_its_options(capsys):
    assert main(["params", "--families", "mhc,gated-residual:rank=16", "--layers", "4", "--dim", "128", "--json"]) == 0
    rows = {row["label"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["gated-residual:rank=16"]["per_sublayer"] == 2 * 4 * 128 * 16 + 16 * 128 + 4 * 128
    assert rows["mhc"]["hc_params"] == count_connection_params("mhc", layers=4, dim=128, n_streams=4)
    for families, message in (("mhc:foo", "option 'foo' of 'mhc' expects KEY=VALUE"),
                              ("hyper-connections:mhc", "argument --families must be one of"),
                              (",", "no family named in ','")):
        assert main(["params", "--families", families]) == 2
        assert message in capsys.readouterr().err


def test_diagnose_reports_what_the_gated_residual_reads_and_writes_and_no_residual_matrix(tmp_path):
    """Its H_res is the identity it never leaves: the report gives its reads, writes and stream usage, and no H_res
    number (no sums, norms, guarantees or composites of a matrix it does not have)."""
    from helpers import random_model

    from s2hc.diagnostics import diagnose_model

    model = random_model("gated-residual", 3, vocab_size=64)
    path = diagnose_model(model, torch.randint(0, 64, (2, 16)), tmp_path / "diag", tokens=20)
    report = path.read_text()
    assert "no residual matrix" in report and "Σ H_pre mean (read)" in report and "## Stream usage" in report
    assert "H_res can change" not in report and "column-sum" not in report and "Guarantees" not in report
    assert not (tmp_path / "diag" / "mixing.png").exists() and not (tmp_path / "diag" / "column_sums.png").exists()
