"""Kimi-K3's Block AttnRes (``family="attn-res"``, block_size 24 sublayers, ``eps=rms_norm_eps``) against an
independent reference.

nemo-automodel is not a dependency, so the reference here is written from the released equations of
nemo-automodel 0.7.0 (``models/kimi_k3/model.py``: ``KimiDecoderLayer._forward_attn_residual`` and the text
model's output read; ``situ.py``: ``_attn_res_core``), not from s2hc's code: block entries ``S`` and a partial sum
``P`` per layer, a layer with an empty ``S`` taking ``P`` itself, ``P`` joining ``S`` every ``attn_res_block_size``
layers and restarting at the attention's output, and each read
``softmax_j((V_j / rms(V_j)) · (g ⊙ p)) · V`` over ``V = [*S, P]`` in float32 (here in the test's dtype). A
26-layer stack with blocks of 12 layers (three blocks, the last partial) and fixed random branches is compared in
float32 and float64, with state dicts in K3's names converted by :mod:`s2hc.hf.kimi_k3`; round trips are exact.
"""

from __future__ import annotations

import pytest
import torch

from s2hc.connection import forms
from s2hc.hf import kimi_k3
from s2hc.models import Transformer, get_preset

DIM, LAYERS, BLOCK, EPS = 16, 26, 12, 1e-5
CONFIG = {"hidden_size": DIM, "num_hidden_layers": LAYERS, "attn_res_block_size": BLOCK, "rms_norm_eps": EPS}


def k3_state(seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A K3 state dict's attention-residual tensors: projections N(0, 1), norm weights around 1."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for module in [f"model.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attention_res", "mlp_res")] + [
            "model.output_attn_res"]:
        state[f"{module}_proj.weight"] = torch.randn(1, DIM, generator=generator, dtype=dtype)
        state[f"{module}_norm.weight"] = 1 + 0.3 * torch.randn(DIM, generator=generator, dtype=dtype)
    return state


def k3_read(prefix_sum, block_residual, proj, norm, eps=EPS):
    """``_attn_res_core``: the entries and the prefix stacked, RMS-normalised keys scored against norm ⊙ proj."""
    values = torch.cat((block_residual, prefix_sum.unsqueeze(1)), dim=1)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    probabilities = (keys * (norm * proj[0])).sum(-1).softmax(-1)
    return (probabilities.unsqueeze(-1) * values).sum(dim=1)


def k3_model(embedding, state, attention, mlp):
    """The decoder stack and the output read as K3 runs them, on ``(tokens, C)`` rows."""
    prefix_sum, block_residual = embedding, embedding.new_zeros(embedding.shape[0], 0, DIM)
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        hidden = prefix_sum
        if block_residual.shape[1] > 0:
            hidden = k3_read(prefix_sum, block_residual, state[layer + "self_attention_res_proj.weight"],
                             state[layer + "self_attention_res_norm.weight"])
        if i % BLOCK == 0:
            block_residual = torch.cat((block_residual, prefix_sum.unsqueeze(1)), dim=1)
            prefix_sum = None
        out = attention[i](hidden)
        prefix_sum = out if prefix_sum is None else prefix_sum + out
        h = k3_read(prefix_sum, block_residual, state[layer + "mlp_res_proj.weight"],
                    state[layer + "mlp_res_norm.weight"])
        prefix_sum = prefix_sum + mlp[i](h)
    assert block_residual.shape[1] == -(-LAYERS // BLOCK)
    return k3_read(prefix_sum, block_residual, state["model.output_attn_res_proj.weight"],
                   state["model.output_attn_res_norm.weight"])


def branches(dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)

    def branch():
        weight = torch.randn(DIM, DIM, generator=generator, dtype=dtype) / DIM ** 0.5
        return lambda h: torch.tanh(h @ weight)

    return [branch() for _ in range(LAYERS)], [branch() for _ in range(LAYERS)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float64, 1e-12)])
def test_the_connections_compute_k3s_block_attn_res(dtype, tol):
    state = k3_state(dtype=dtype)
    attention, mlp = branches(dtype)
    embedding = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(2), dtype=dtype)
    expected = k3_model(embedding.reshape(-1, DIM), state, attention, mlp).view(2, 7, DIM)
    ours = kimi_k3.model_connections_from_hf(state, CONFIG)
    sources = (embedding,)
    for i in range(LAYERS):
        layer = {k.removeprefix(f"model.layers.{i}."): v for k, v in state.items() if f".layers.{i}." in k}
        attn_hc = kimi_k3.connection_from_hf(CONFIG, layer, i, "attention", dtype)
        mlp_hc = kimi_k3.connection_from_hf(CONFIG, layer, i, "mlp", dtype)
        assert torch.equal(attn_hc.query, ours[f"blocks.{i}.attn_hc.query"])
        sources = mlp_hc(attn_hc(sources, attention[i]), mlp[i])
    head = kimi_k3.head_from_hf(CONFIG, {k.removeprefix("model."): v for k, v in state.items()}, dtype)
    torch.testing.assert_close(head(sources), expected, atol=tol, rtol=tol)


def test_round_trips_are_exact_and_the_transformer_holds_it():
    state = k3_state(dtype=torch.bfloat16)  # K3 keeps them in the model's dtype: kept through a round trip
    ours = kimi_k3.model_connections_from_hf(state, CONFIG)
    back = kimi_k3.model_connections_to_hf(ours, CONFIG)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    options = kimi_k3.family_options(CONFIG)
    assert options == {"variant": "block", "block_size": 2 * BLOCK, "eps": EPS, "key_norm": "weighted",
                       "values": "raw", "scaled_logits": False, "read_first": True}
    model = Transformer(get_preset("tiny", family="attn-res", n_layers=LAYERS, family_options=options,
                                   vocab_size=64, dim=DIM, n_heads=2, ffn_dim=32, max_seq_len=16))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "_hc." in k or "stream_head" in k]
    again = kimi_k3.model_connections_to_hf(model.state_dict(), CONFIG)
    assert all(torch.equal(again[k], state[k].float()) for k in state)
    for i in range(LAYERS):
        layer = {k.removeprefix(f"model.layers.{i}."): v for k, v in state.items() if f".layers.{i}." in k}
        for kind in ("attention", "mlp"):
            connection = kimi_k3.connection_from_hf(CONFIG, layer, i, kind)
            assert all(torch.equal(v.float(), layer[k].float())
                       for k, v in kimi_k3.connection_to_hf(connection, CONFIG).items())


def test_the_released_depth_is_eight_block_entries_and_bad_inputs_are_named():
    released = {**CONFIG, "num_hidden_layers": 93}
    options = kimi_k3.family_options(released)
    # 93 layers in blocks of 12: S holds the embedding and 7 blocks (8 entries), the output reads them and P
    assert forms.get("attn-res").state_size(1, 2 * 93, options) == 9
    assert forms.attn_res.block_size_for("block", None, 2 * 93) == options["block_size"]
    with pytest.raises(ValueError, match=r"attn_res_block_size=None \(a plain residual\)"):
        kimi_k3.family_options({**CONFIG, "attn_res_block_size": None})
    with pytest.raises(ValueError, match=r"tensor 'mlp_res_proj.weight' has shape \(16,\), expected \(1, 16\)"):
        kimi_k3.connection_state_from_hf({"mlp_res_proj.weight": torch.zeros(DIM),
                                          "mlp_res_norm.weight": torch.ones(DIM)}, DIM, "mlp_res")
    with pytest.raises(ValueError, match=r"tensor 'stream_head.query' is missing"):
        kimi_k3.model_connections_from_hf({k: v for k, v in k3_state().items() if "output" not in k}, CONFIG)
    with pytest.raises(ValueError, match=r"has block_size=2, but Kimi-K3 computes block_size=24"):
        kimi_k3.connection_to_hf(forms.AttnResConnection(DIM, sublayer=3, block_size=2, eps=EPS), CONFIG)
    with pytest.raises(ValueError, match=r"has key_norm='unweighted', but Kimi-K3 computes key_norm='weighted'"):
        kimi_k3.connection_to_hf(forms.AttnResConnection(DIM, sublayer=3, block_size=24, key_norm="unweighted"))
