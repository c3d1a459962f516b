"""One weight-decay rule for every family (``weight_decay_on="matrices"``), and the s²HC authors' (``"all"``), by
parameter name; decay toward 1 of the connections' norm weights under ``"all"``, through a checkpoint too; the
run's record of what decayed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMALL_MODEL
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import s2hc
from s2hc.cli import main
from s2hc.connection import forms
from s2hc.models import Transformer, get_preset
from s2hc.rundir import load_model, read_metrics
from s2hc.train import TrainConfig, train
from s2hc.train.optim import decayed_parameter_names, make_optimizer, parameter_groups, weight_decay_record

MODEL = dict(vocab_size=256, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=32)

# (id, family, n_streams, family_options, other ModelConfig fields): every family, and every form that changes
# which parameters a model holds.
FORMS = [(name, name, 1 if forms.get(name).max_streams == 1 else 4, {}, {}) for name in s2hc.families()] + [
    ("hc-flat", "hc", 4, {"projection": "flat"}, {}),
    ("mhc-deepseek-v4-head", "mhc", 4, {"variant": "deepseek-v4"}, {"stream_reduce": "head"}),
    ("s2hc-untied", "s2hc", 4, {}, {"tie_embeddings": False}),
    ("s2hc-gemma-norms", "s2hc", 4, {}, {"norm_unit_offset": True, "qk_norm": True, "post_norms": True}),
    ("mhc-gpt2-like", "mhc", 3, {}, {"norm": "layernorm", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
                                     "pos": "learned", "mlp": "gelu"}),
    ("kromhc-6", "kromhc", 6, {}, {}),
    ("gated-residual-sum", "gated-residual", 3, {"rank": 4}, {"stream_reduce": "sum"}),
    ("mhc-lss", "mhc", 4, {}, {"lss_init": 0.6}),
]

# What decays under "matrices", stated by name independently of s2hc.train.optim: the model's weight matrices and
# embeddings, and the connections' projections (the gated residual's three, the wide residual's read and write);
# nothing else (AttnRes's queries and key-norm weights are not matrices).
PROJECTIONS = r"(projection|read_down|read_up|write|read)"
MATRICES = re.compile(r"(^(embed|pos_embed|lm_head)\.weight"
                      r"|\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight"
                      rf"|_hc\.{PROJECTIONS}|^stream_head\.{PROJECTIONS})$")
#: decay toward 1 under "all" (the connections' norms, the affine residual's scales), but the gated residual's (1 + w)
CONNECTION_NORMS = re.compile(r"_hc\.(norm_weight|branch_scale|residual_scale)$")


def model_of(family, n_streams, options, fields) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset("tiny", family=family, n_streams=n_streams, family_options=options,
                                  **{**MODEL, **fields}))


@pytest.fixture(params=FORMS, ids=[form[0] for form in FORMS])
def model(request) -> Transformer:
    return model_of(*request.param[1:])


def groups_by_name(groups) -> dict[str, dict]:
    out = {}
    for group in groups:
        assert len(group["names"]) == len(group["params"]) and group["params"]
        for name in group["names"]:
            assert name not in out, f"{name} in two groups"
            out[name] = group
    return out


def check_every_parameter_once(model, groups) -> dict[str, dict]:
    by_name = groups_by_name(groups)
    assert sorted(by_name) == sorted(name for name, _ in model.named_parameters())  # once each, a tied one too
    params = dict(model.named_parameters())
    for group in groups:
        assert all(p is params[name] for name, p in zip(group["names"], group["params"], strict=True))
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params()
    return by_name


def test_matrices_decay_and_nothing_else_whatever_the_family(model):
    groups = parameter_groups(model, 0.1)
    by_name = check_every_parameter_once(model, groups)
    decayed = {name for name, group in by_name.items() if group["weight_decay"] == 0.1}
    assert all(g["decay_toward"] == 0.0 and g["weight_decay"] in (0.0, 0.1) for g in groups)
    assert decayed == {name for name in by_name if MATRICES.search(name)}
    assert decayed_parameter_names(model) == [name for name, _ in model.named_parameters() if name in decayed]
    # each kind by name: connection biases, scales, γ, static matrices and norm weights stay; so do model norms
    kept = set(by_name) - decayed
    assert all(MATRICES.search(name) is None for name in kept)
    connection = {name for name in by_name if "_hc." in name or name.startswith(("stream_head.", "stream_scale."))}
    projections = {name for name in connection if re.search(rf"\.{PROJECTIONS}$", name)}
    assert projections <= decayed
    assert connection - projections <= kept
    assert all(name in kept for name in by_name if re.search(r"norm\.(weight|bias)$|_proj\.bias$", name))
    if model.form.projection_width(model.config.n_streams, **model.config.family_options) is not None:
        assert any(re.search(rf"_hc\.{PROJECTIONS}$", name) for name in decayed)


@pytest.mark.parametrize("family, options, static", [("mhc", {}, "mixer.bias"), ("hc", {}, "mixer.bias"),
                                                     ("hc", {"projection": "flat"}, "mixer.bias")])
def test_the_static_n_by_n_matrices_no_longer_decay(family, options, static):
    """The rule before (``p.dim() >= 2``) decayed mHC's (n, n) bias and HC's static matrix alone of all biases."""
    model = model_of(family, 4, options, {})
    by_name = groups_by_name(parameter_groups(model, 0.1))
    name = f"blocks.0.attn_hc.{static}"
    assert dict(model.named_parameters())[name].shape == (4, 4) and by_name[name]["weight_decay"] == 0.0


def test_all_decays_every_parameter_and_the_connection_norms_toward_one(model):
    groups = parameter_groups(model, 0.1, on="all")
    by_name = check_every_parameter_once(model, groups)
    assert all(group["weight_decay"] == 0.1 for group in groups)
    toward_one = {name for name, group in by_name.items() if group["decay_toward"] == 1.0}
    stored_offset = model.config.family == "gated-residual"  # Qwen's 1 + w: w decays toward 0
    assert toward_one == {name for name in by_name if CONNECTION_NORMS.search(name) and not stored_offset}
    assert all(by_name[name]["decay_toward"] == 0.0 for name in set(by_name) - toward_one)
    assert decayed_parameter_names(model, "all") == [name for name, _ in model.named_parameters()]
    if getattr(model.blocks[0].attn_hc, "norm_weight", None) is not None and not stored_offset:
        assert toward_one


def test_a_tied_head_is_the_embedding_and_counted_once():
    tied, untied = model_of("s2hc", 4, {}, {}), model_of("s2hc", 4, {}, {"tie_embeddings": False})
    assert "lm_head.weight" not in decayed_parameter_names(tied) and "embed.weight" in decayed_parameter_names(tied)
    assert {"embed.weight", "lm_head.weight"} <= set(decayed_parameter_names(untied))


def test_a_parameter_of_unknown_kind_is_refused_by_name():
    model = model_of("s2hc", 4, {}, {})
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3, 3)))
    with pytest.raises(ValueError, match=r"parameter 'extra' \(Transformer.extra\) is none of the kinds"):
        parameter_groups(model, 0.1)


def test_bad_rules_are_refused_in_one_line():
    model = model_of("s2hc", 4, {}, {})
    with pytest.raises(ValueError, match=r"^on must be one of \['matrices', 'all', '2d'\], got 'bias'$"):
        parameter_groups(model, 0.1, on="bias")
    with pytest.raises(ValueError, match=r"^on must be one of \['matrices', 'all', '2d'\], got 'bias'$"):
        make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), on="bias")
    with pytest.raises(ValueError, match=r"^weight_decay_on must be one of \['matrices', 'all', '2d'\], got 'bias'$"):
        TrainConfig(weight_decay_on="bias")
    assert TrainConfig().weight_decay_on == "matrices"


# ------------------------------------------------------------------------------------- the update itself

LR, WD = 0.25, 0.5  # lr · wd = 1/8: every product below is exact in float32


def zero_gradients(model) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # AdamW's update u is then exactly 0; only the decay moves a parameter


def set_start(model) -> None:
    with torch.no_grad():
        model.blocks[0].attn_hc.norm_weight.fill_(1.0)
        model.blocks[0].mlp_hc.norm_weight.fill_(3.0)
        model.blocks[0].attn.q_proj.weight.fill_(2.0)
        model.blocks[0].attn_hc.mixer.spectrum_bias.fill_(4.0)


def step_and_check(model, optimizer, on: str) -> None:
    """One step from :func:`set_start` with zero gradients: toward 1 by lr·wd·(p − 1), toward 0 by lr·wd·p."""
    set_start(model)
    zero_gradients(model)
    optimizer.step()
    block = model.blocks[0]
    assert torch.equal(block.attn_hc.norm_weight, torch.ones_like(block.attn_hc.norm_weight))  # at 1: stays
    expected_norm = 3.0 - LR * WD * (3.0 - 1.0) if on == "all" else 3.0
    assert torch.equal(block.mlp_hc.norm_weight, torch.full_like(block.mlp_hc.norm_weight, expected_norm))
    assert torch.equal(block.attn.q_proj.weight, torch.full_like(block.attn.q_proj.weight, 2.0 * (1 - LR * WD)))
    bias = 4.0 * (1 - LR * WD) if on == "all" else 4.0
    assert torch.equal(block.attn_hc.mixer.spectrum_bias, torch.full_like(block.attn_hc.mixer.spectrum_bias, bias))


@pytest.mark.parametrize("on", ["all", "matrices"])
def test_one_step_decays_each_parameter_toward_its_target(on):
    model = model_of("s2hc", 4, {}, {})
    step_and_check(model, make_optimizer(model, LR, WD, (0.9, 0.95), on=on), on)


def test_decay_toward_one_survives_load_state_dict_into_a_fresh_optimizer():
    model = model_of("s2hc", 4, {}, {})
    optimizer = make_optimizer(model, LR, WD, (0.9, 0.95), on="all")
    step_and_check(model, optimizer, "all")
    saved = optimizer.state_dict()
    assert [g["decay_toward"] for g in saved["param_groups"]] == [0.0, 1.0]  # recorded in the optimizer state

    fresh = model_of("s2hc", 4, {}, {})
    restored = make_optimizer(fresh, LR, WD, (0.9, 0.95), on="all")
    restored.load_state_dict(saved)
    step_and_check(fresh, restored, "all")

    for group in saved["param_groups"]:  # a file without the key (or with another) gets the rule's back
        group.pop("decay_toward")
        group["weight_decay"] = 0.0
    other = model_of("s2hc", 4, {}, {})
    again = make_optimizer(other, LR, WD, (0.9, 0.95), on="all")
    again.load_state_dict(saved)
    assert [(g["weight_decay"], g["decay_toward"]) for g in again.param_groups] == [(WD, 0.0), (WD, 1.0)]
    step_and_check(other, again, "all")


def test_decay_toward_one_survives_the_checkpointers_state_dict_round_trip():
    """The loop saves and restores through torch.distributed.checkpoint's full state dicts (train/checkpointer.py)."""
    model = model_of("s2hc", 4, {}, {})
    optimizer = make_optimizer(model, LR, WD, (0.9, 0.95), on="all")
    step_and_check(model, optimizer, "all")
    options = StateDictOptions(full_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)

    fresh = model_of("s2hc", 4, {}, {})
    restored = make_optimizer(fresh, LR, WD, (0.9, 0.95), on="all")
    set_state_dict(fresh, restored, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options)
    assert [g["decay_toward"] for g in restored.param_groups] == [0.0, 1.0]
    step_and_check(fresh, restored, "all")


# ----------------------------------------------------------------------------------------- the run's record


def test_the_record_names_every_parameter_by_pattern():
    model = model_of("mhc", 4, {}, {"tie_embeddings": False})
    record = weight_decay_record(model, 0.1, "matrices")
    assert record["on"] == "matrices" and record["rate"] == 0.1 and record["toward_one"] == []
    assert "blocks.*.attn_hc.projection" in record["decayed"] and "lm_head.weight" in record["decayed"]
    assert "blocks.*.attn_hc.mixer.bias" in record["not_decayed"]

    def expand(patterns):
        return {name for name, _ in model.named_parameters()
                if any(re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), name) for p in patterns)}

    assert expand(record["decayed"]) == set(decayed_parameter_names(model))
    assert expand(record["not_decayed"]) == {n for n, _ in model.named_parameters()} - expand(record["decayed"])
    everything = weight_decay_record(model, 0.1, "all")
    assert everything["not_decayed"] == [] and everything["toward_one"] == ["blocks.*.attn_hc.norm_weight",
                                                                           "blocks.*.mlp_hc.norm_weight"]


def test_train_with_the_authors_rule_records_what_decayed_once(corpus_file, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--family", "s2hc", "--set", "weight_decay_on=all",
            "--set", "model_overrides=" + json.dumps(SMALL_MODEL), "--data", str(corpus_file),
            "--cache-dir", str(tmp_path / "cache"), "--seq-len", "16", "--batch-size", "2", "--warmup-steps", "1",
            "--set", "eval_batches=1", "--checkpoint-every", "1", "--log-every", "1", "--no-progress",
            "--out", str(out)]
    assert main([*argv, "--max-steps", "2"]) == 0
    records = [r for r in read_metrics(out) if "weight_decay" in r]
    assert len(records) == 1 and records[0]["step"] == 0
    record = records[0]["weight_decay"]
    assert record["on"] == "all" and record["rate"] == 0.1 and record["not_decayed"] == []
    assert "blocks.*.attn_hc.norm_weight" in record["toward_one"] and "embed.weight" in record["decayed"]
    assert main([*argv, "--max-steps", "3", "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out) if "weight_decay" in r] == [0]  # not written again on resume
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]


def test_a_run_from_before_the_rule_resumes_under_matrices_and_records_it_then(tmp_path):
    """tests/fixtures/format2-run was configured before weight_decay_on existed: it reads as the default, and
    the record is written at the step the resumed run starts from."""
    fixture = Path(__file__).parent / "fixtures" / "format2-run"
    assert "weight_decay_on" not in (fixture / "config.yaml").read_text()
    run = tmp_path / "run"
    shutil.copytree(fixture, run)
    _, config = load_model(fixture)
    train(config.replace(out=str(run), max_steps=3, data="embedded"), resume=True)
    records = [r for r in read_metrics(run) if "weight_decay" in r]
    assert [r["step"] for r in records] == [2] and records[0]["weight_decay"]["on"] == "matrices"


def test_2d_rule_is_matrices_plus_the_two_dimensional_biases(model):
    """The rule before these (every parameter of two or more dimensions): the same set as "matrices" plus a
    connection's two-dimensional static matrices (mHC's (n, n) bias, HC's static matrix) and the learned stream
    scaling (n, C), and nothing else."""
    old = set(decayed_parameter_names(model, on="2d"))
    assert old == {name for name, p in model.named_parameters() if p.dim() >= 2}
    extra = old - set(decayed_parameter_names(model, on="matrices"))
    assert all(re.search(r"_hc\.mixer\.|^stream_scale\.scale$", name) for name in extra), extra
    assert set(decayed_parameter_names(model, on="matrices")) <= old
    assert ("stream_scale.scale" in extra) == (model.config.lss_init is not None)
    static = extra - {"stream_scale.scale"}
    # the only two-dimensional biases: mHC's (DeepSeek-V4.1's single-pass mHC's too) and HC's static matrix
    assert bool(static) == (model.config.family in ("mhc", "hc", "mhc-lagged")), extra
