"""FSDP2 under a bfloat16 parameter policy keeps what must stay float32 (docs/distributed.md, "Mixed precision"): in
s2hc's harness (:func:`s2hc.train.distributed.wrap`, one Gloo process) every connection computes its coefficients in
float32 from float32 parameters, and the streams it receives are float32 and equal, bit for bit, to those of the
unsharded model under autocast alone, where the branch is the only bfloat16 part (docs/design.md section 1.6)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from s2hc.connection import ConnectionModule
from s2hc.connection.precision import connection_modules
from s2hc.models import ModelConfig, Transformer
from s2hc.train import distributed

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16, family="s2hc", n_streams=4,
                     lss_init=0.6, stream_reduce="head")


@pytest.fixture()
def group():
    """A one-process Gloo group, as ``s2hc train --parallel fsdp`` makes without torchrun."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


def _connections(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, ConnectionModule)}


@torch.no_grad()
def _reference() -> Transformer:
    """The model whose every branch parameter is a bfloat16 value (so that FSDP's cast of it to bfloat16 is exact)
    and whose connection parameters are not (so that a cast of them would show)."""
    torch.manual_seed(0)
    model = Transformer(CONFIG, init_seed=0)
    connection = {id(p) for module in _connections(model).values() for p in module.parameters()}
    for parameter in model.parameters():
        if id(parameter) in connection:
            parameter.add_(torch.randn_like(parameter) * 0.05)
        else:
            parameter.copy_(parameter.to(torch.bfloat16))
    return model


def _record(model: torch.nn.Module) -> dict[str, list]:
    """Hooks on every connection module: the streams it receives, its parameters' dtypes during its forward, and
    the dtypes of the coefficients it computes."""
    seen: dict[str, list] = {"streams": [], "parameters": [], "coefficients": []}
    for name, module in _connections(model).items():
        def pre_hook(module, args, name=name):
            seen["streams"].append((name, args[0].detach().clone()))
            seen["parameters"].append((name, {p.dtype for p in module.parameters()}))

        module.register_forward_pre_hook(pre_hook)
        if hasattr(module, "_coefficients_on"):
            def coefficients(x, path, module=module, name=name, method=module._coefficients_on):
                out = method(x, path)
                seen["coefficients"].append((name, {t.dtype for t in out}))
                return out

            module._coefficients_on = coefficients
    return seen


def _step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    logits.float().logsumexp(-1).mean().backward()
    return logits


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_bf16_fsdp_keeps_the_connections_and_the_streams_float32(group):
    reference = _reference()
    model = copy.deepcopy(reference)
    wrapped = distributed.wrap(model, distributed.Context(parallel="fsdp"), compile_blocks=False,
                               amp_dtype=torch.bfloat16)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got, expected = _record(wrapped), _record(reference)
    got_logits, expected_logits = _step(wrapped, ids), _step(reference, ids)

    # each connection module is a float32 unit of its own, the blocks' branches bfloat16
    assert len(connection_modules(model)) == 2 * CONFIG.n_layers + 2  # two per block, the stream scaling, the head
    assert {dtype for _, dtypes in got["parameters"] for dtype in dtypes} == {torch.float32}
    assert got["coefficients"] and {d for _, dtypes in got["coefficients"] for d in dtypes} == {torch.float32}
    assert model.blocks[0].attn.q_proj.weight.dtype == torch.float32  # sharded: stored float32 ...
    assert model.blocks[0].attn.q_proj.weight.grad is not None
    # ... the streams every connection receives: float32, and exactly the unsharded autocast model's
    assert [name for name, _ in got["streams"]] == [name for name, _ in expected["streams"]]
    assert len(got["streams"]) == 2 * CONFIG.n_layers + 2
    for (name, x), (_, y) in zip(got["streams"], expected["streams"]):
        assert x.dtype == torch.float32, name
        assert torch.equal(x, y), name
    assert torch.equal(got_logits, expected_logits)
    expected_parameters = dict(reference.named_parameters())
    for prefix, module in _connections(model).items():  # the connections' gradients too, reduced in float32
        for name, parameter in module.named_parameters():
            assert parameter.grad.dtype == torch.float32
            assert torch.equal(_full(parameter.grad), expected_parameters[f"{prefix}.{name}"].grad), (prefix, name)


@torch.no_grad()
def test_the_comparison_sees_connection_parameters_rounded_to_bf16(group):
    """The check above could fail: the same model with only its connections' parameters rounded to bfloat16 (what
    FSDP's one bf16 policy did to them) receives other streams from the first block on."""
    reference = _reference()
    rounded = copy.deepcopy(reference)
    for module in _connections(rounded).values():
        for parameter in module.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got, expected = _record(rounded), _record(reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded(ids)
        reference(ids)
    differs = [name for (name, x), (_, y) in zip(got["streams"], expected["streams"]) if not torch.equal(x, y)]
    assert "blocks.0.mlp_hc" in differs and len(differs) >= 2 * CONFIG.n_layers
