"""s2hc.torchtitan (the torchtitan extra): every family in torchtitan's decoder, built on meta and initialised to
s2hc's own starting values; one process trained through ``torchrun -m torchtitan.train --module``; two Gloo
processes with FSDP2 and a DCP checkpoint whose resume reproduces the uninterrupted run's losses exactly.

The runs load torchtitan's CPU fixes from the test-only package ``tests/torchtitan_cpu`` (their ``--module``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s2hc.extras import is_available

if not (is_available("torchtitan") and is_available("triton")):
    pytest.skip("needs the torchtitan extra (pip install 's2hc[torchtitan]')", allow_module_level=True)

import s2hc  # noqa: E402
from s2hc.init_rng import redraw  # noqa: E402
from s2hc.torchtitan.config_registry import config  # noqa: E402

TESTS = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)")


def _fresh(model_config) -> s2hc.Connections:
    """s2hc's own connections of the model, as s2hc initialises them (per-parameter draws from init_seed)."""
    fresh = s2hc.Connections(model_config.dim, 2 * len(model_config.layers), model_config.family,
                             n_streams=model_config.n_streams, stream_reduce=model_config.stream_reduce,
                             lss_init=model_config.lss_init, norm_eps=model_config.norm.eps,
                             **model_config.options())
    redraw(fresh, model_config.init_seed)
    return fresh


def _states(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_equal_states(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    got, expected = _states(got), _states(expected)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


def _built(family: str, **model):
    trainer = config(family, "tiny", **model)
    model_config = trainer.model_spec.model
    with torch.device("meta"):
        built = model_config.build()
    built.verify_module_protocol()
    built.to_empty(device="cpu")
    for state in _states(built).values():  # what to_empty leaves is arbitrary: make it visibly wrong
        state.data.fill_(float("nan"))
    with torch.no_grad():
        built.init_weights()
    return model_config, built


@pytest.mark.parametrize("family", s2hc.families())
def test_every_family_builds_on_meta_starts_at_s2hcs_values_and_trains(family):
    model_config, model = _built(family)
    fresh = _fresh(model_config)
    for i, key in enumerate(model.layers):
        _assert_equal_states(model.layers[key].attention_connection, fresh[2 * i])
        _assert_equal_states(model.layers[key].feed_forward_connection, fresh[2 * i + 1])
    for name in ("scale", "head"):
        assert (getattr(model.streams, name) is None) == (getattr(fresh, name) is None)
        if getattr(fresh, name) is not None:
            _assert_equal_states(getattr(model.streams, name), getattr(fresh, name))
    assert all(torch.isfinite(state).all() for state in _states(model).values())

    ids = torch.randint(0, model_config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[1] < losses[0]


def test_random_starts_follow_init_seed_and_options_reach_the_family():
    """projection_init=normal draws the projections per parameter from init_seed, as s2hc's own models do."""
    model_config, model = _built("s2hc", family_options="{projection_init: normal}", init_seed=3)
    fresh = _fresh(model_config)
    _assert_equal_states(model.layers["1"].feed_forward_connection, fresh[3])
    assert model.layers["1"].feed_forward_connection.projection.std() > 0
    _, other = _built("s2hc", family_options="{projection_init: normal}", init_seed=4)
    assert not torch.equal(other.layers["0"].attention_connection.projection,
                           model.layers["0"].attention_connection.projection)


def test_a_bad_name_or_parallelism_is_refused_by_name():
    from s2hc.torchtitan import config_registry

    with pytest.raises(AttributeError, match="FAMILY"):
        config_registry.nope_tiny  # noqa: B018
    assert config_registry.mhc_n2_tiny().model_spec.model.n_streams == 2
    with pytest.raises(ValueError):
        config("no-such-family", "tiny")


def _randomised(model_config):
    """A torchtitan model of ``model_config`` built as the trainer builds it, every parameter then moved off its
    starting value (norm weights of one, zero biases and s2hc's starts would hide a tensor mapped to another)."""
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.init_weights()
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def _logits(model, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ids, model(ids)


def _with_qk_norm(model_config):
    """llama3's blocks with a QK-norm: ComplexRoPE reorders its weight with the query and key features."""
    from torchtitan.models.common.nn_modules import RMSNorm

    for layer in model_config.layers:
        head_dim = model_config.dim // layer.attention.n_heads
        layer.attention.qk_norm = RMSNorm.Config(normalized_shape=head_dim, eps=model_config.norm.eps)
    return model_config


def _qwen3_debugmodel():
    """torchtitan's qwen3 debugmodel (CosSinRoPE, QK-norm, head_dim 128 != dim / heads, tied) with s2hc."""
    from torchtitan.models.qwen3 import qwen3_configs

    from s2hc.torchtitan.model import causal_sdpa, s2hc_model_config

    return s2hc_model_config(causal_sdpa(qwen3_configs["debugmodel"](attn_backend="flex")), "s2hc",
                             architecture="qwen3")


CONVERTED = {
    "s2hc": lambda: config("s2hc", "tiny").model_spec.model,
    "mhc": lambda: config("mhc", "tiny").model_spec.model,
    "attn-res": lambda: config("attn-res", "tiny").model_spec.model,
    "residual": lambda: config("residual", "tiny").model_spec.model,
    "gated-residual-head": lambda: config("gated-residual", "tiny").model_spec.model,
    "s2hc-lss-head": lambda: config("s2hc", "tiny", lss_init=0.6, stream_reduce="head").model_spec.model,
    "s2hc-qk-norm": lambda: _with_qk_norm(config("s2hc", "tiny").model_spec.model),
    "qwen3-s2hc": _qwen3_debugmodel,
}


@pytest.mark.parametrize("case", CONVERTED)
def test_a_torchtitan_models_weights_give_s2hcs_transformer_the_same_logits(case):
    """torchtitan's own forward against s2hc's Transformer with the converted weights, float32."""
    from s2hc.torchtitan.convert import load_checkpoint

    model_config = CONVERTED[case]()
    titan = _randomised(model_config)
    ids, expected = _logits(titan, model_config.vocab_size)
    converted = load_checkpoint(titan.state_dict(), model_config).eval()
    with torch.no_grad():
        got = converted(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_missing_misshapen_or_foreign_tensor_is_named():
    from s2hc.torchtitan.convert import to_s2hc_state

    model_config = config("s2hc", "tiny").model_spec.model
    state = _randomised(model_config).state_dict()
    without = {k: v for k, v in state.items() if k != "layers.1.feed_forward_connection.projection"}
    with pytest.raises(ValueError, match=r"'layers\.1\.feed_forward_connection\.projection' is missing"):
        to_s2hc_state(without, model_config)
    misshapen = {**state, "layers.0.attention.qkv_linear.wk.weight": torch.zeros(32, 64)}
    with pytest.raises(ValueError, match=r"'layers\.0\.attention\.qkv_linear\.wk\.weight' has shape \(32, 64\)"):
        to_s2hc_state(misshapen, model_config)
    with pytest.raises(ValueError, match=r"'layers\.0\.moe\.router' is not part"):
        to_s2hc_state({**state, "layers.0.moe.router": torch.zeros(1)}, model_config)


ROOT = TESTS.parent
HF_PYTHON = ROOT / ".venv" / "bin" / "python"  # make test's environment, with the hf extra torchtitan's cannot hold
EXPORT = """
import sys, torch, s2hc.hf
from transformers import AutoModelForCausalLM
run, out, ids, logits = sys.argv[1:]
s2hc.hf.export(run, out)
model = AutoModelForCausalLM.from_pretrained(out).eval()
with torch.no_grad():
    torch.save(model(torch.load(ids)).logits, logits)
"""


def _has_transformers(python: Path) -> bool:
    return python.is_file() and subprocess.run([str(python), "-c", "import transformers, s2hc"],
                                               capture_output=True).returncode == 0


def test_a_converted_torchtitan_model_exports_to_transformers_with_the_same_logits(tmp_path):
    """torchtitan's logits against transformers' of ``s2hc export``'s directory, exported from the converted run
    in the environment with the hf extra (torchtitan's cannot hold transformers)."""
    if not _has_transformers(HF_PYTHON):
        pytest.skip(f"needs {HF_PYTHON} with the hf extra (make test builds it)")
    from s2hc.torchtitan.convert import convert

    trainer = config("s2hc", "tiny")
    titan = _randomised(trainer.model_spec.model)
    ids, expected = _logits(titan, trainer.model_spec.model.vocab_size)
    convert(titan.state_dict(), trainer, tmp_path / "run")
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run([str(HF_PYTHON), "-c", EXPORT, str(tmp_path / "run"), str(tmp_path / "hf"),
                           str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(name: str, dump: Path, nproc: int, *args: str) -> dict[int, tuple[str, str]]:
    """``torchrun -m torchtitan.train --module torchtitan_cpu --config name``: {step: (loss, grad_norm)} of rank 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [str(TORCHRUN), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{_port()}", "-m", "torchtitan.train", "--module", "torchtitan_cpu",
               "--config", name, "--dump_folder", str(dump), "--debug.seed", "0", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=dump.parent)
    log = ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, log[-4000:]
    steps = {}
    for line in log.splitlines():
        match = STEP.search(line)
        if match and "[rank1]" not in line:
            steps[int(match[1])] = (match[2], match[3])
    return steps


def test_one_process_trains_through_torchtitan_train_and_its_checkpoint_loads_into_s2hc(tmp_path):
    """AttnRes, whose state is a tuple of sources, with torchtitan's selective activation checkpointing; its DCP
    checkpoint (model, optimizer, scheduler, data loader) converted to an s2hc run gives the logits torchtitan's
    model gets from the same checkpoint through torch.distributed.checkpoint and its own load_state_dict."""
    import torch.distributed.checkpoint as dcp

    from s2hc.rundir import load_checkpoint as load_s2hc_checkpoint
    from s2hc.rundir import load_model
    from s2hc.torchtitan.convert import main as convert_main

    steps = _train("attn_res_tiny", tmp_path / "run", 1, "--training.steps", "3", "--checkpoint.enable",
                   "--checkpoint.interval", "3")
    assert sorted(steps) == [1, 2, 3]
    assert all(float(loss) == float(loss) for loss, _ in steps.values())

    directory = tmp_path / "run" / "checkpoint" / "step-3"
    trainer = config("attn-res", "tiny")
    titan = _randomised(trainer.model_spec.model)
    state = {name: torch.empty_like(value) for name, value in titan.state_dict().items()}
    dcp.load(state, checkpoint_id=str(directory))  # torchtitan's layout, read by torch itself
    titan.load_state_dict(state)  # torchtitan's hooks merge wq, wk, wv into its fused wqkv
    ids, expected = _logits(titan, trainer.model_spec.model.vocab_size)

    assert convert_main([str(directory), "--config", "attn_res_tiny", "--out", str(tmp_path / "s2hc-run")]) == 0
    model, run_config = load_model(tmp_path / "s2hc-run")
    with torch.no_grad():
        got = model.eval()(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert load_s2hc_checkpoint(tmp_path / "s2hc-run", with_model=False).step == 3
    assert run_config.tokenizer == "s2hc-bpe-4k" and run_config.family == "attn-res"


def test_two_gloo_processes_with_fsdp_checkpoint_and_an_exact_resume(tmp_path):
    fsdp = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.spmd_backend", "partial_dtensor",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]
    whole = _train("s2hc_tiny", tmp_path / "whole", 2, *fsdp)
    assert sorted(whole) == [1, 2, 3, 4]
    shards = sorted(p.name for p in (tmp_path / "whole" / "checkpoint" / "step-2").iterdir())
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = _train("s2hc_tiny", tmp_path / "resumed", 2, *fsdp)
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: whole[step] for step in (3, 4)}

    # the two ranks' shards, assembled in one process, as s2hc's Transformer: torchtitan's logits
    import torch.distributed.checkpoint as dcp

    from s2hc.torchtitan.convert import load_checkpoint

    trainer = config("s2hc", "tiny")
    titan = _randomised(trainer.model_spec.model)
    state = {name: torch.empty_like(value) for name, value in titan.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "whole" / "checkpoint" / "step-4"))
    titan.load_state_dict(state)
    ids, expected = _logits(titan, trainer.model_spec.model.vocab_size)
    model = load_checkpoint(tmp_path / "whole" / "checkpoint" / "step-4", trainer.model_spec.model).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
