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


def test_one_process_trains_through_torchtitan_train(tmp_path):
    """AttnRes, whose state is a tuple of sources, with torchtitan's selective activation checkpointing."""
    steps = _train("attn_res_tiny", tmp_path / "run", 1, "--training.steps", "3")
    assert sorted(steps) == [1, 2, 3]
    assert all(float(loss) == float(loss) for loss, _ in steps.values())


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
