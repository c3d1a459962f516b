"""AttnRes's three-query read in s2hc's own model (``qkv_reads``, Inkling-2's full-attention layers): each global
layer's attention reads three weighted sums over its sources, one each for the inputs of its query, key and value
projections, each through its own pre-norm; local layers and the MLPs read one.

Checked against the attention written out by hand (separate norms, projections, causal softmax), against the
one-query model when the three reads are made equal, the FLOP count by hand, and ``s2hc.Connections``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from s2hc import Connections
from s2hc.flops import model_flops
from s2hc.models import Transformer, get_preset

INKLING2 = dict(block_size=2, key_norm="unweighted", values="normed", scaled_logits=True, read_first=False)


def tiny(qkv_reads: bool, **overrides) -> Transformer:
    torch.manual_seed(0)
    config = get_preset("tiny", family="attn-res", family_options={**INKLING2, "qkv_reads": qkv_reads},
                        vocab_size=64, dim=32, n_heads=2, ffn_dim=48, max_seq_len=16, **overrides)
    return Transformer(config).double()


def randomise_(model: torch.nn.Module, seed: int = 1) -> None:
    """Random queries and norm weights (they start at zero and one, where the three reads coincide)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.5 + (0 if "query" in name else 1))


def test_the_attention_reads_its_query_key_and_value_inputs_apart():
    model = tiny(True)
    randomise_(model)
    block = model.blocks[1]
    assert block.attn_hc.num_queries == 3 and block.mlp_hc.num_queries == 1
    generator = torch.Generator().manual_seed(2)
    h_q, h_k, h_v = (torch.randn(2, 7, 32, generator=generator, dtype=torch.float64) for _ in range(3))
    got = block.qkv_attention_branch(h_q, h_k, h_v)  # no RoPE table: the projections and the softmax alone

    def rms(x, norm):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * norm.weight

    attn = block.attn
    q = F.linear(rms(h_q, block.attn_norm), attn.q_proj.weight).view(2, 7, 2, 16).transpose(1, 2)
    k = F.linear(rms(h_k, block.attn_k_norm), attn.k_proj.weight).view(2, 7, -1, 16).transpose(1, 2)
    v = F.linear(rms(h_v, block.attn_v_norm), attn.v_proj.weight).view(2, 7, -1, 16).transpose(1, 2)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = F.linear((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 32), attn.o_proj.weight)
    # s2hc's RMSNorm computes in float32 whatever the dtype: float32 rounding (a swapped input is off by O(1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_three_equal_reads_are_the_one_query_model():
    three, one = tiny(True), tiny(False)
    randomise_(one)
    state = dict(one.state_dict())
    for i, block in enumerate(three.blocks):
        if block.attention_inputs == 3:
            for name in ("attn_k_norm", "attn_v_norm"):
                state[f"blocks.{i}.{name}.weight"] = state[f"blocks.{i}.attn_norm.weight"]
            if block.attn_hc.query is not None:
                state[f"blocks.{i}.attn_hc.query"] = state[f"blocks.{i}.attn_hc.query"].expand(3, -1).clone()
    three.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(three(ids), one(ids), rtol=1e-10, atol=1e-10)
    randomise_(three, seed=4)  # three different reads: another function, and every part of it learns
    logits = three(ids)
    assert not torch.allclose(logits, one(ids))
    logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in three.named_parameters()
               if "attn_hc" in n or "attn_k_norm" in n or "attn_v_norm" in n)


def test_local_layers_and_mlps_read_one_query():
    model = tiny(True, n_layers=4, sliding_window=4, sliding_window_pattern=2)  # layers 1 and 3 global
    assert [block.attn_hc.num_queries for block in model.blocks] == [1, 3, 1, 3]
    assert [block.attn_k_norm is None for block in model.blocks] == [True, False, True, False]
    assert all(block.mlp_hc.num_queries == 1 for block in model.blocks)
    assert model.stream_head.num_queries == 1


def test_its_flops_count_two_more_reads_and_norms_per_global_layer():
    options = {**INKLING2, "block_size": 2}
    config = get_preset("tiny", family="attn-res", family_options={**options, "qkv_reads": True})
    base = get_preset("tiny", family="attn-res", family_options={**options, "qkv_reads": False})
    C, L, T = config.dim, config.n_layers, 256
    three, one = model_flops(config, T)["parts"], model_flops(base, T)["parts"]
    assert three["norms"]["elementwise"] - one["norms"]["elementwise"] == L * 2 * 4 * C  # two RMSNorms a layer
    sources = [1 + math.ceil(2 * layer / 2) for layer in range(1, L)]  # layer 0's attention reads nothing
    per_query = 4 * C + 5 + 1  # dot, softmax, weighted sum and the logit's scale, per source
    assert three["connections"]["elementwise"] - one["connections"]["elementwise"] == sum(
        2 * s * per_query for s in sources)
    assert three["attention_projections"] == one["attention_projections"]


def test_connections_hand_each_layers_first_branch_three_inputs():
    connections = Connections(16, 4, "attn-res", block_size=2, qkv_reads=True)
    assert [c.num_queries for c in connections] == [3, 1, 3, 1]
    calls = []

    def branch(*inputs):
        calls.append(len(inputs))
        return sum(inputs)

    x = connections.expand(torch.randn(2, 3, 16))
    for i in range(4):
        x = connections(x, i, branch)
    assert calls == [3, 1, 3, 1] and connections.reduce(x).shape == (2, 3, 16)
    with pytest.raises(ValueError, match=r"qkv_reads.*must be"):
        Connections(16, 4, "attn-res", qkv_reads="yes")


def test_it_compiles_and_checkpoints_as_the_one_query_read_does():
    """Every block compiled (dynamo traces the three-input branch; a backend that runs the traced graphs) and
    activation checkpointing give the eager model's logits and gradients."""
    from s2hc.train import compiling

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))

    def step(model):
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = tiny(True).float()
    randomise_(eager)
    expected, grads = step(eager)
    checkpointed = tiny(True).float()
    checkpointed.load_state_dict(eager.state_dict())
    checkpointed.set_activation_checkpointing(True)
    compiled = tiny(True).float()
    compiled.load_state_dict(eager.state_dict())
    compiling.compile_blocks(compiled.blocks, backend=lambda graph, inputs: graph.forward)
    for model in (checkpointed, compiled):
        logits, got = step(model)
        torch.testing.assert_close(logits, expected)
        assert got.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(got[name], grads[name], msg=name)
    assert all(block.ran_compiled for block in compiled.blocks)


def test_it_exports_through_transformers_and_its_queries_stay_with_adamw(tmp_path):
    """The three-query model reloads through transformers with its logits; the (3, C) queries are neither decayed
    nor given to Muon (a matrix by shape, but not a branch's weight), the extra norms likewise."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from s2hc.hf.export import from_s2hc
    from s2hc.train.optim import decayed_parameter_names, optimizer_of_parameters

    model = tiny(True).float().eval()
    randomise_(model)
    from_s2hc(model).save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids))
    routes, decayed = optimizer_of_parameters(model, "muon"), set(decayed_parameter_names(model))
    extra = [name for name in routes if name.endswith("attn_hc.query") or "attn_k_norm" in name
             or "attn_v_norm" in name]
    assert extra and all(routes[name] == "adamw" and name not in decayed for name in extra)
    assert routes["blocks.1.attn.q_proj.weight"] == "muon"


def test_s2hc_params_counts_what_the_model_holds():
    """``s2hc params`` (its counts) builds the three-query reads where the model does: the same parameters, and
    the FLOP count of the model's connections."""
    from s2hc.params import param_table

    model = tiny(True)
    (row,) = param_table([("attn-res", model.config.family_options)], layers=model.config.n_layers,
                         dim=model.config.dim, n_streams=1)
    assert row["with_head"] == model.num_connection_params()
    assert row["flops_per_token"] == sum(model_flops(model.config, 16)["parts"]["connections"].values())
