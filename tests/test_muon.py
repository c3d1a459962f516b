"""``optimizer: muon``: torch's Muon for the blocks' attention and MLP matrices, AdamW for everything else, by
parameter name; the weight-decay rule in both; the schedule in both; checkpoints, exact resume and the refusal of
the other optimizer's state; one and two processes (DDP, FSDP2); every family steps with it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_MODEL, cli_args, crash_after_checkpoint

import s2hc
from s2hc.cli import main
from s2hc.config import BEFORE_FIELD, OPTIMIZERS, WEIGHT_DECAY_RULES, completed_settings
from s2hc.models import Transformer, get_preset
from s2hc.rundir import load_checkpoint, load_model, read_metrics
from s2hc.train import TrainConfig, train
from s2hc.train import loop as training_loop
from s2hc.train.optim import (
    MuonWithAdamW,
    decay_targets,
    make_optimizer,
    optimizer_of_parameters,
    optimizer_parts,
)

MODEL = dict(vocab_size=256, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=32)

# The hidden matrices Muon updates, written out by hand for the two blocks: the attention's four projections and
# the gated MLP's three. Nothing else, whatever the family.
ATTENTION = ["blocks.0.attn.q_proj.weight", "blocks.0.attn.k_proj.weight", "blocks.0.attn.v_proj.weight",
             "blocks.0.attn.o_proj.weight", "blocks.1.attn.q_proj.weight", "blocks.1.attn.k_proj.weight",
             "blocks.1.attn.v_proj.weight", "blocks.1.attn.o_proj.weight"]
GATED_MLP = ["blocks.0.mlp.gate_proj.weight", "blocks.0.mlp.up_proj.weight", "blocks.0.mlp.down_proj.weight",
             "blocks.1.mlp.gate_proj.weight", "blocks.1.mlp.up_proj.weight", "blocks.1.mlp.down_proj.weight"]
PLAIN_MLP = ["blocks.0.mlp.up_proj.weight", "blocks.0.mlp.down_proj.weight",
             "blocks.1.mlp.up_proj.weight", "blocks.1.mlp.down_proj.weight"]

# (id, family, n_streams, family_options, other ModelConfig fields, Muon's parameters, AdamW parameters that must
# be there by name: the embedding, the head, a connection's projection, bias, scale and static matrix, norms).
FORMS = [
    ("residual", "residual", 1, {}, {}, ATTENTION + GATED_MLP,
     ["embed.weight", "norm.weight", "blocks.0.attn_norm.weight", "blocks.1.mlp_norm.weight"]),
    ("mhc-4", "mhc", 4, {}, {}, ATTENTION + GATED_MLP,
     ["embed.weight", "blocks.0.attn_hc.projection", "blocks.0.attn_hc.bias_pre", "blocks.0.attn_hc.alpha_post",
      "blocks.0.attn_hc.norm_weight", "blocks.1.mlp_hc.mixer.bias", "blocks.1.mlp_hc.mixer.alpha"]),
    ("s2hc-4", "s2hc", 4, {}, {}, ATTENTION + GATED_MLP,
     ["embed.weight", "blocks.0.attn_hc.projection", "blocks.0.attn_hc.bias_post", "blocks.1.mlp_hc.norm_weight"]),
    ("s2hc-4-untied", "s2hc", 4, {}, {"tie_embeddings": False}, ATTENTION + GATED_MLP,
     ["embed.weight", "lm_head.weight", "blocks.0.attn_hc.projection"]),
    ("gated-residual-4", "gated-residual", 4, {}, {}, ATTENTION + GATED_MLP,
     ["embed.weight", "blocks.0.attn_hc.read_down", "blocks.0.attn_hc.read_up", "blocks.0.attn_hc.write",
      "stream_head.read_down", "stream_head.read_up"]),
    ("mhc-3-gpt2-like", "mhc", 3, {}, {"norm": "layernorm", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
                                       "pos": "learned", "mlp": "gelu"}, ATTENTION + PLAIN_MLP,
     ["embed.weight", "pos_embed.weight", "blocks.0.attn.q_proj.bias", "blocks.0.attn.o_proj.bias",
      "blocks.1.mlp.down_proj.bias", "blocks.0.attn_norm.bias", "blocks.0.attn_hc.mixer.bias"]),
    ("mhc-4-lss", "mhc", 4, {}, {"lss_init": 0.6}, ATTENTION + GATED_MLP, ["stream_scale.scale"]),
]


def model_of(family, n_streams, options=None, fields=None) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset("tiny", family=family, n_streams=n_streams, family_options=options or {},
                                  **{**MODEL, **(fields or {})}))


def connection_parameter(name: str) -> bool:
    return "_hc." in name or name.startswith(("stream_head.", "stream_scale."))


@pytest.mark.parametrize("form", FORMS, ids=[form[0] for form in FORMS])
def test_muon_gets_the_branch_matrices_and_adamw_everything_else(form):
    _, family, n, options, fields, muon, adamw_named = form
    model = model_of(family, n, options, fields)
    names = [name for name, _ in model.named_parameters()]
    routes = optimizer_of_parameters(model, "muon")
    assert list(routes) == names  # every parameter once, a tied head as the embedding
    assert sorted(name for name, route in routes.items() if route == "muon") == sorted(muon)
    assert set(adamw_named) <= {name for name, route in routes.items() if route == "adamw"}
    assert all(routes[name] == "adamw" for name in names if connection_parameter(name) or name.endswith(".bias"))
    assert set(optimizer_of_parameters(model, "adamw").values()) == {"adamw"}

    optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), optimizer="muon")
    adamw, muon_part = optimizer_parts(optimizer)
    assert isinstance(optimizer, MuonWithAdamW) and isinstance(muon_part, torch.optim.Muon)
    params = dict(model.named_parameters())
    owned = {id(p): part for part in (adamw, muon_part) for g in part.param_groups for p in g["params"]}
    assert len(owned) == sum(len(g["params"]) for g in optimizer.param_groups) == len(params)  # each once
    assert all(owned[id(params[name])] is (muon_part if routes[name] == "muon" else adamw) for name in names)
    assert all(g["adjust_lr_fn"] == "match_rms_adamw" and g["momentum"] == 0.95 and g["nesterov"]
               for g in muon_part.param_groups)


@pytest.mark.parametrize("on", WEIGHT_DECAY_RULES)
def test_each_optimizer_applies_the_weight_decay_rule_to_its_own_parameters(on):
    model = model_of("mhc", 4)
    targets = decay_targets(model, on)
    optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), on=on, optimizer="muon")
    names = {id(p): name for name, p in model.named_parameters()}
    for part in optimizer_parts(optimizer):
        for group in part.param_groups:
            for p in group["params"]:
                target = targets[names[id(p)]]
                assert group["weight_decay"] == (0.0 if target is None else 0.1), names[id(p)]
                assert group["decay_toward"] == (target or 0.0), names[id(p)]
    muon_names = [names[id(p)] for g in optimizer.muon.param_groups for p in g["params"]]
    assert all(targets[name] == 0.0 for name in muon_names)  # the branches' matrices decay toward 0 under every rule
    if on == "all":  # the connections' norm weights decay toward 1, in AdamW
        assert any(g["decay_toward"] == 1.0 for g in optimizer.adamw.param_groups)


def test_a_branch_weight_that_is_not_a_matrix_is_refused_not_routed():
    model = model_of("s2hc", 4)
    model.blocks[0].attn.q_proj.weight = torch.nn.Parameter(torch.zeros(4, 4, 2))
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.q_proj\.weight' \(Linear\.weight, shape \(4, 4, 2\)\).*"
                                         r"not a matrix"):
        optimizer_of_parameters(model, "muon")
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adamw', 'muon'\], got 'sgd'"):
        make_optimizer(model_of("residual", 1), 1e-3, 0.1, (0.9, 0.95), optimizer="sgd")


def test_the_combined_state_round_trips_and_refuses_adamws_alone():
    model = model_of("s2hc", 4)
    optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), optimizer="muon")
    x = torch.randint(0, MODEL["vocab_size"], (2, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert set(state) == {"adamw", "muon"} and len(optimizer.state) == len(list(model.parameters()))
    fresh = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), optimizer="muon")
    fresh.load_state_dict(state)
    q = model.blocks[0].attn.q_proj.weight
    assert torch.equal(fresh.state[q]["momentum_buffer"], optimizer.state[q]["momentum_buffer"])
    adamw_state = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95)).state_dict()
    with pytest.raises(ValueError, match=r"written by optimizer 'adamw' cannot continue under 'muon'"):
        fresh.load_state_dict(adamw_state)


@pytest.mark.parametrize("family", s2hc.families())
def test_every_family_steps_with_muon(family):
    model = model_of(family, TrainConfig(family=family).n_streams)  # the family's default streams
    optimizer = make_optimizer(model, 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    routes = optimizer_of_parameters(model, "muon")
    x = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        assert math.isfinite(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = dict(model.named_parameters())
    muon = [name for name, route in routes.items() if route == "muon"]
    assert muon and all(not torch.equal(after[name], before[name]) for name in muon)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert all("momentum_buffer" in optimizer.state[after[name]] for name in muon)
    assert all("exp_avg" in optimizer.state[after[name]] for name, route in routes.items() if route == "adamw")


# ------------------------------------------------------------------------------------------- the config


def test_the_optimizer_setting_and_its_refusal(small, capsys):
    assert TrainConfig().optimizer == "adamw" == BEFORE_FIELD["optimizer"] and OPTIMIZERS == ("adamw", "muon")
    old = TrainConfig().to_dict()
    del old["optimizer"]  # a run configured before the field: AdamW updated every parameter
    assert completed_settings(old)["optimizer"] == "adamw"
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adamw', 'muon'\], got 'sgd'"):
        TrainConfig(optimizer="sgd")
    assert main(["train", *cli_args(small), "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "optimizer must be one of ['adamw', 'muon'], got 'sgd'" in err
    assert not Path(small.out).exists() or not list(Path(small.out).iterdir())


# ------------------------------------------------------------------------------------------- training


@pytest.fixture()
def small(corpus_file, tmp_path) -> TrainConfig:
    return TrainConfig(
        preset="tiny", family="s2hc", n_streams=4, model_overrides=dict(SMALL_MODEL),
        data=str(corpus_file), cache_dir=str(tmp_path / "cache"), seq_len=32, batch_size=4,
        max_steps=8, warmup_steps=2, lr=1e-2, eval_every=4, eval_batches=2, checkpoint_every=2,
        log_every=1, progress=False, out=str(tmp_path / "run"), optimizer="muon",
    )


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def test_train_with_muon_from_the_command_line(small):
    assert main(["train", *cli_args(small), "--optimizer", "muon"]) == 0
    curve = [loss for _, loss in losses(small.out)]
    assert len(curve) == 8 and all(math.isfinite(loss) for loss in curve)
    val = [r["val_loss"] for r in read_metrics(small.out) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]  # the same validation batches: it learns
    (record,) = [r["optimizer"] for r in read_metrics(small.out) if "optimizer" in r]
    assert record["name"] == "muon" and record["adjust_lr_fn"] == "match_rms_adamw"
    assert record["muon"] == ["blocks.*.attn.q_proj.weight", "blocks.*.attn.k_proj.weight",
                              "blocks.*.attn.v_proj.weight", "blocks.*.attn.o_proj.weight",
                              "blocks.*.mlp.gate_proj.weight", "blocks.*.mlp.up_proj.weight",
                              "blocks.*.mlp.down_proj.weight"]
    assert "embed.weight" in record["adamw"] and "blocks.*.attn_hc.projection" in record["adamw"]
    saved = load_checkpoint(small.out)
    assert saved.config["optimizer"] == "muon"
    state = saved.optimizer["state"]
    assert set(state["blocks.0.attn.q_proj.weight"]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state["blocks.0.attn_hc.projection"])
    assert {g.get("adjust_lr_fn") for g in saved.optimizer["param_groups"]} == {None, "match_rms_adamw"}


def test_the_schedule_drives_both_optimizers(small, monkeypatch):
    seen: dict[str, list[list[float]]] = {"adamw": [], "muon": []}
    real = training_loop.make_optimizer

    def recording(*args, **kwargs):
        optimizer = real(*args, **kwargs)
        for name, part in zip(("adamw", "muon"), optimizer_parts(optimizer), strict=True):
            part.register_step_pre_hook(
                lambda o, a, k, name=name: seen[name].append([g["lr"] for g in o.param_groups]))
        return optimizer

    monkeypatch.setattr(training_loop, "make_optimizer", recording)
    config = small.replace(max_steps=6, warmup_steps=2, eval_every=0, checkpoint_every=0)
    train(config)
    expected = [training_loop.learning_rate(step, peak=config.lr, warmup_steps=2, max_steps=6,
                                            min_ratio=config.min_lr_ratio) for step in range(6)]
    for name in ("adamw", "muon"):
        assert [set(lrs) for lrs in seen[name]] == [{lr} for lr in expected], name
    assert [r["lr"] for r in read_metrics(config.out) if "lr" in r] == pytest.approx(expected)


def test_resume_with_muon_is_exact(small, tmp_path):
    reference = small.replace(out=str(tmp_path / "reference"))
    train(reference)
    interrupted = small.replace(out=str(tmp_path / "interrupted"))
    crash_after_checkpoint(interrupted, 4)
    assert load_checkpoint(interrupted.out).step == 4
    train(interrupted, resume=True)
    assert losses(interrupted.out) == losses(reference.out)
    (a, _), (b, _) = load_model(interrupted.out), load_model(reference.out)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    state_a, state_b = (load_checkpoint(out).optimizer["state"] for out in (interrupted.out, reference.out))
    assert all(torch.equal(state_a[n][k], state_b[n][k]) for n in state_b for k in state_b[n])


def test_a_resume_under_the_other_optimizer_is_refused(small, capsys, monkeypatch):
    adamw = small.replace(optimizer="adamw", max_steps=2)
    train(adamw)
    capsys.readouterr()
    assert main(["train", *cli_args(adamw), "--resume", "--optimizer", "muon", "--max-steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trained with optimizer 'adamw', not 'muon'" in err
    # the checkpoint's own guard, behind the configuration's: a Muon run does not load AdamW's state either
    monkeypatch.setattr(training_loop, "_check_resumable", lambda *args: None)
    with pytest.raises(ValueError, match=r"trained with optimizer 'adamw', not 'muon'"):
        train(adamw.replace(optimizer="muon", max_steps=4), resume=True)
    assert load_checkpoint(adamw.out).step == 2


# ------------------------------------------------------------------------------------- several processes

# Muon orthogonalises its momentum in bfloat16 (torch's Newton–Schulz), so the ulps by which two processes' averaged
# gradients differ from one process's sum round to other bfloat16 values: measured ‖θ₂ − θ₁‖ / ‖θ₁‖ = 1.0e-4 (DDP)
# and 1.3e-4 (FSDP2) after 6 steps, losses equal to 1e-6. Orthogonalising each half of a matrix apart (what a
# per-shard Muon would do) moves θ by 5.4e-3.
PARAM_RTOL = 1e-3
LOSS_RTOL = 1e-5

distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def dist_args(corpus_file, cache, out, *, batch_size, max_steps=6, extra=()):
    return [
        "train", "--preset", "tiny", "--family", "s2hc", "--streams", "4",
        "--set", "model_overrides=" + json.dumps(SMALL_MODEL), "--data", str(corpus_file), "--cache-dir", str(cache),
        "--seq-len", "32", "--batch-size", str(batch_size), "--max-steps", str(max_steps), "--warmup-steps", "2",
        "--lr", "3e-3", "--set", "min_lr_ratio=1.0", "--eval-every", "0", "--set", "eval_batches=2",
        "--checkpoint-every", "2", "--log-every", "1", "--no-progress", "--optimizer", "muon", "--out", str(out),
        *extra,
    ]


def run_s2hc(argv, nproc=None):
    command = [sys.executable, "-m", "s2hc", *argv] + ([] if nproc is None else ["--nproc", str(nproc)])
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=300)


def param_difference(a, b) -> float:
    (ma, _), (mb, _) = load_model(a), load_model(b)
    va, vb = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (ma, mb))
    return ((va - vb).norm() / vb.norm()).item()


@distributed
def test_two_processes_with_muon_reach_the_parameters_of_one_and_resume_on_one(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    single = tmp_path / "single"
    assert (result := run_s2hc(dist_args(corpus_file, cache, single, batch_size=4))).returncode == 0, result.stderr
    curve = [loss for _, loss in losses(single)]
    for parallel in ("ddp", "fsdp"):
        out = tmp_path / parallel
        result = run_s2hc(dist_args(corpus_file, cache, out, batch_size=2, extra=["--parallel", parallel]), nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (out / "checkpoint.dcp" / "extra.pt").is_file()
        assert param_difference(out, single) <= PARAM_RTOL, parallel
        torch.testing.assert_close([loss for _, loss in losses(out)], curve, rtol=LOSS_RTOL, atol=0)
    # DDP's sharded checkpoint at step 4, resumed by one process: the Muon momentum and AdamW moments come back
    out = tmp_path / "resumed"
    start = run_s2hc(dist_args(corpus_file, cache, out, batch_size=2, max_steps=4), nproc=2)
    assert start.returncode == 0, start.stderr[-3000:]
    resumed = run_s2hc(dist_args(corpus_file, cache, out, batch_size=4, extra=["--resume"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_checkpoint(out).step == 6
    torch.testing.assert_close([loss for _, loss in losses(out)], curve, rtol=LOSS_RTOL, atol=0)
    assert param_difference(out, single) <= PARAM_RTOL
