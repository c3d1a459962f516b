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
    for field, value, match in (("pipeline_parallel_degree", 2, "not pipeline parallelism"),
                                ("context_parallel_degree", 2, "not context parallelism"),
                                ("tensor_parallel_degree", 2, "partial_dtensor, not 'spmd_types'")):
        trainer = config("s2hc", "tiny")
        setattr(trainer.parallelism, field, value)
        with pytest.raises(NotImplementedError, match=match):
            trainer.model_spec.model.update_from_config(config=trainer)


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


def _connection_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from s2hc.connection import ConnectionModule

    return {name: module for name, module in model.named_modules() if isinstance(module, ConnectionModule)}


@torch.no_grad()
def _bf16_reference(model_config):
    """torchtitan's model whose every branch parameter is a bfloat16 value (so FSDP's cast of it is exact) and whose
    connection parameters are not (so that a cast of them would show), in float32."""
    model = _randomised(model_config).train()
    connection = {id(p) for module in _connection_modules(model).values() for p in module.parameters()}
    generator = torch.Generator().manual_seed(2)
    for parameter in model.parameters():
        if id(parameter) in connection:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        else:
            parameter.copy_(parameter.to(torch.bfloat16))
    return model


def _record(model: torch.nn.Module) -> dict[str, list]:
    """Hooks on every connection module: the state it receives, its parameters' dtypes during its forward, and the
    dtypes of the coefficients it computes."""
    seen: dict[str, list] = {"streams": [], "parameters": [], "coefficients": []}
    for name, module in _connection_modules(model).items():
        def pre_hook(module, args, name=name):
            state = args[0][-1] if isinstance(args[0], tuple) else args[0]
            seen["streams"].append((name, state.detach().clone()))
            seen["parameters"].append((name, {p.dtype for p in module.parameters()}))

        module.register_forward_pre_hook(pre_hook)
        if hasattr(module, "_coefficients_on"):
            def coefficients(x, path, name=name, method=module._coefficients_on):
                out = method(x, path)
                seen["coefficients"].append((name, {t.dtype for t in out}))
                return out

            module._coefficients_on = coefficients
    return seen


def _bf16_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


@pytest.fixture()
def gloo(monkeypatch):
    """A one-process Gloo group and torchtitan's device type the CPU (it falls back to "cuda" without one)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


def test_torchtitans_bf16_fsdp_keeps_the_connections_and_the_streams_float32(gloo, tmp_path):
    """torchtitan's parallelize (s2hc's, then parallelize_llama's FSDP2 with MixedPrecisionPolicy(param_dtype=
    bfloat16), as the trainer applies it, on one Gloo process) against the unsharded float32 model whose branches
    (embedding, attention, MLP, their norms, final norm, LM head) are bfloat16 modules: every connection sees
    float32 parameters and makes float32 coefficients, the streams it receives are float32 and bit for bit the
    reference's, and so are the logits and the connections' float32 gradients. The same comparison with the
    connections' parameters rounded to bfloat16 differs from the first block on."""
    import copy

    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from s2hc.connection.precision import connection_modules

    trainer = config("s2hc", "tiny", lss_init=0.6, stream_reduce="head")
    model_config = trainer.model_spec.model
    reference = _bf16_reference(model_config)
    model = copy.deepcopy(reference)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    training = TrainingConfig()
    assert training.mixed_precision_param == "bfloat16"  # torchtitan's default, what its runs here used
    trainer.model_spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training,
                                      parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                                      compile_config=CompileConfig(), ac_config=None, dump_folder=str(tmp_path))
    # the reference: the branches' parameters bfloat16 by hand (not RoPE's complex table), the connections float32,
    # no FSDP
    branches = [reference.tok_embeddings, reference.norm, reference.lm_head]
    for layer in reference.layers.values():
        branches += [layer.attention, layer.feed_forward, layer.attention_norm, layer.ffn_norm]
        layer.compute_dtype = torch.bfloat16
    for parameter in (p for module in branches for p in module.parameters()):
        parameter.data = parameter.data.to(torch.bfloat16)
    reference.stream_dtype, reference.compute_dtype = torch.float32, torch.bfloat16
    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for module in _connection_modules(rounded).values():
            for parameter in module.parameters():
                parameter.copy_(parameter.to(torch.bfloat16))

    ids = torch.randint(0, model_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got, expected, off = _record(model), _record(reference), _record(rounded)
    got_logits, expected_logits = _bf16_step(model, ids), _bf16_step(reference, ids)
    _bf16_step(rounded, ids)

    assert len(connection_modules(model)) == 2 * len(model_config.layers) + 2  # two per block, the scaling, the head
    assert {dtype for _, dtypes in got["parameters"] for dtype in dtypes} == {torch.float32}
    assert got["coefficients"] and {d for _, dtypes in got["coefficients"] for d in dtypes} == {torch.float32}
    assert model.layers["0"].attention.wo.weight.dtype == torch.float32  # sharded: stored float32, computed bf16
    assert [name for name, _ in got["streams"]] == [name for name, _ in expected["streams"]]
    assert len(got["streams"]) == 2 * len(model_config.layers) + 2  # the scaling, every connection, the head
    for (name, x), (_, y) in zip(got["streams"], expected["streams"]):
        assert x.dtype == torch.float32, name
        assert torch.equal(x, y), name
    assert got_logits.dtype == torch.bfloat16 and torch.equal(got_logits, expected_logits)
    expected_parameters = dict(reference.named_parameters())
    for prefix, module in _connection_modules(model).items():  # their gradients too, reduced in float32
        for name, parameter in module.named_parameters():
            assert parameter.grad.dtype == torch.float32
            assert torch.equal(_full(parameter.grad), expected_parameters[f"{prefix}.{name}"].grad), (prefix, name)
    differs = [name for (name, x), (_, y) in zip(off["streams"], expected["streams"]) if not torch.equal(x, y)]
    assert "layers.0.feed_forward_connection" in differs and len(differs) >= 2 * len(model_config.layers)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


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


MUON_MATRICES = re.compile(r"layers\.\d+\.(attention\.(qkv_linear\.wqkv|wo)|feed_forward\.w[123])\.weight")


@pytest.mark.parametrize(("family", "size"), [("s2hc", "tiny"), ("attn-res", "tiny"), ("gated-residual", "tiny"),
                                              ("mhc", "qwen2_5_1_5b")])
def test_muon_takes_the_branches_matrices_and_adamw_the_rest_by_s2hcs_rule(family, size, tmp_path):
    """torchtitan's param groups of muon_optimizer, on the model as the trainer wraps it (activation checkpointing's
    wrapper in its names): DistMuon exactly the attention's and feed-forward's weight matrices, AdamW every other
    parameter (embedding, LM head, norms, Qwen2.5's q/k/v bias, every connection parameter); weight decay on the
    matrices, the embedding, the LM head and the connections' declared token-driven projections only."""
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer

    from s2hc.connection import ConnectionModule

    trainer = config(family, size, optimizer="muon")
    model_config, optimizer = trainer.model_spec.model, trainer.optimizer
    assert {group.optimizer_kwargs["lr"] for group in optimizer.param_groups} == {
        config(family, size).optimizer.param_groups[0].optimizer_kwargs["lr"]}
    with torch.device("meta"):
        model = model_config.build()
    trainer.activation_checkpoint.build(dump_folder=str(tmp_path)).apply(model)
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    groups, _ = OptimizersContainer._build_param_groups(model, optimizer.param_groups, {})
    got = {name: (optimizer_name, group["weight_decay"] > 0) for optimizer_name, kinds in groups.items()
           for group in kinds for name in group["param_names"]}
    names = {canonical_fqn(name) for name, _ in model.named_parameters()}
    assert set(got) == names and sum(len(g["params"]) for kinds in groups.values() for g in kinds) == len(names)
    projections = {canonical_fqn(f"{prefix}.{attribute}") for prefix, module in model.named_modules()
                   if isinstance(module, ConnectionModule) for attribute in module.projections}
    for name in names:
        muon = MUON_MATRICES.fullmatch(name) is not None
        decays = muon or name in ("tok_embeddings.weight", "lm_head.weight") or name in projections
        assert got[name] == ("DistMuon" if muon else "AdamW", decays), name
    assert {route for route, _ in got.values()} == {"DistMuon", "AdamW"}
    assert bool(projections) == (family != "attn-res")  # AttnRes's queries are no token-driven projection


PAPER_SHAPES = {"qwen3_0_6b": "qwen3-0.6b", "qwen2_5_1_5b": "qwen2.5-1.5b", "gemma3_1b": "gemma3-1b"}
SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "qk_norm", "norm_eps",
         "rope_theta")


@pytest.mark.parametrize("size", PAPER_SHAPES)
def test_the_paper_shapes_build_on_meta_for_every_family_by_name(size):
    """``--config FAMILY_SIZE`` for every family, built on meta: the shapes of s2hc's own preset of that model (the
    converter reads them back), Qwen2.5's q/k/v biases, and a parameter count that moves with the family."""
    from s2hc.models import get_preset
    from s2hc.torchtitan import config_registry
    from s2hc.torchtitan.convert import to_model_config

    preset = get_preset(PAPER_SHAPES[size])
    counts = {}
    for family in s2hc.families():
        trainer = getattr(config_registry, f"{family.replace('-', '_')}_{size}")()
        model_config = trainer.model_spec.model
        assert model_config.family == family and trainer.dataloader.dataset == "c4"
        with torch.device("meta"):
            model = model_config.build()
        model.verify_module_protocol()
        counts[family] = sum(p.numel() for p in model.parameters())
        if family in ("residual", "s2hc"):
            converted = to_model_config(model_config)
            assert {k: getattr(converted, k) for k in SHAPE} == {k: getattr(preset, k) for k in SHAPE}
            assert converted.qkv_bias == preset.qkv_bias and converted.tie_embeddings
    residual_config = to_model_config(getattr(config_registry, f"residual_{size}")().model_spec.model)
    with torch.device("meta"):
        residual = _transformer(residual_config)
    assert counts["residual"] == sum(p.numel() for p in residual.parameters())
    assert counts["s2hc"] > counts["residual"]


def _transformer(model_config):
    from s2hc.models import Transformer

    return Transformer(model_config, init_rng="sequential")


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


def test_tensor_parallelism_on_two_gloo_processes_trains_as_one_process(tmp_path):
    """TP 2 (torchtitan's llama3 plan for the branches, the connections replicated), with sequence parallelism and
    without, from one seed checkpoint: after 3 float32 steps every parameter equals the one-process run's (the
    connections' updates within 2 % of their size, the rest within 1 %; a connection gradient marked with the other
    placement moves them 11 % and 84 % away). torchtitan's default bfloat16 FSDP2 under TP runs too, its losses
    those of float32 to bfloat16's rounding."""
    from s2hc.torchtitan.convert import read_dcp_state

    _train("s2hc_tiny", tmp_path / "seed", 1, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
           "--parallelism.spmd_backend", "partial_dtensor")
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    common = ["--checkpoint.enable", "--training.steps", "3", "--parallelism.spmd_backend", "partial_dtensor"]
    tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    fp32 = ["--training.mixed_precision_param", "float32"]
    no_sp = ["--parallelism.no-enable-sequence-parallel"]
    runs = {"one": (1, fp32), "tp-sp": (2, tp + fp32), "tp": (2, tp + fp32 + no_sp), "tp-sp-bf16": (2, tp)}
    losses = {}
    for name, (nproc, args) in runs.items():
        (tmp_path / name / "checkpoint").mkdir(parents=True)
        shutil.copytree(seed, tmp_path / name / "checkpoint" / "step-0")
        losses[name] = _train("s2hc_tiny", tmp_path / name, nproc, *common, *args)
        assert sorted(losses[name]) == [1, 2, 3], name

    model_config = config("s2hc", "tiny").model_spec.model
    start = read_dcp_state(seed, model_config)
    states = {name: read_dcp_state(tmp_path / name / "checkpoint" / "step-3", model_config) for name in runs}

    def distance(name: str, part: str) -> float:
        keys = [key for key in start if part in key]
        moved = torch.cat([(states["one"][key] - start[key]).flatten() for key in keys]).norm()
        return (torch.cat([(states[name][key] - states["one"][key]).flatten() for key in keys]).norm() / moved).item()

    for name in ("tp-sp", "tp"):
        for step, (loss, grad_norm) in losses[name].items():  # as logged: 5 and 4 decimals
            assert loss == losses["one"][step][0], (name, step)
            assert abs(float(grad_norm) - float(losses["one"][step][1])) <= 2e-4, (name, step)
        assert distance(name, "connection") < 0.02, name
        assert distance(name, "layers.") < 0.01, name
    for step, (loss, _) in losses["tp-sp-bf16"].items():
        assert abs(float(loss) - float(losses["one"][step][0])) < 1e-3

