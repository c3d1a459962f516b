"""Inkling-2's Block AttnRes (``family="attn-res"`` with Inkling-2's conventions) against transformers'
``models/inkling2``.

The released ``Inkling2BlockAttentionResidual`` is compared in float32 with s2hc's read for one and three
queries and every source count of a tiny config; a whole ``Inkling2TextModel`` (8 layers, blocks of 3 layers, full
attention at layers 0, 2 and 5, random queries) is compared with the same layers' attention, convolutions and MoE
run as branches of s2hc's connections (converted by :mod:`s2hc.hf.inkling2`) and its head. The released read
casts to float32 whatever the model's dtype, so float64 is checked against a float64 transcription of its
equations. Round trips are exact; bad tensors are refused by name. s2hc's Transformer holds the three-query reads at its
global layers (``qkv_reads``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.inkling2.modeling_inkling2")

from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig  # noqa: E402
from transformers.models.inkling2.modeling_inkling2 import (  # noqa: E402
    Inkling2BlockAttentionResidual,
    Inkling2TextModel,
)

from s2hc.connection.forms import AttnResConnection  # noqa: E402
from s2hc.diagnostics.depth import depth_attention  # noqa: E402
from s2hc.hf import inkling2  # noqa: E402
from s2hc.models import Transformer, get_preset  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)
DIM, LAYERS, PER_BLOCK = 32, 8, 3
FULL = (0, 2, 5)


def hf_config(layer_types=None) -> Inkling2TextConfig:
    config = Inkling2TextConfig(
        vocab_size=64, unpadded_vocab_size=64, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
        sliding_window_size=4, rel_extent=8, d_rel=4, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_layers_per_attn_res_block=PER_BLOCK, eos_token_id=None,
        layer_types=layer_types or ["hybrid" if i in FULL else "hybrid_sliding" for i in range(LAYERS)],
    )
    config._attn_implementation = "eager"
    return config


def random_queries_(module: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("query"):
                p.copy_(torch.randn(p.shape, generator=generator))


def transcription(sources, query, eps=inkling2.KEY_NORM_EPS):
    """The released equations, written out: x_j = v_j / rms(v_j), α = softmax(q·x_j / √C), Σ α_j x_j per query."""
    x = torch.stack(sources, dim=-2)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    logits = torch.einsum("btsc,qc->btqs", x, query.reshape(-1, x.shape[-1])) / x.shape[-1] ** 0.5
    return torch.einsum("btqs,btsc->btqc", logits.softmax(-1), x).unbind(-2)


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("sublayer", range(1, 2 * LAYERS))
def test_the_read_is_inkling2s(sublayer, num_queries):
    config = hf_config()
    hf = Inkling2BlockAttentionResidual(config, num_queries=num_queries)
    random_queries_(hf, seed=sublayer)
    ours = AttnResConnection(DIM, sublayer=sublayer, block_size=2 * PER_BLOCK, num_queries=num_queries,
                             **{k: v for k, v in inkling2.FAMILY_OPTIONS.items() if k != "variant"})
    ours.load_state_dict(inkling2.connection_state_from_hf(hf, DIM, num_queries))
    generator = torch.Generator().manual_seed(100 + sublayer)
    sources = tuple(3 * torch.randn(2, 5, DIM, generator=generator) + i for i in range(ours.num_sources))
    theirs = hf(torch.stack(sources[:-1], dim=-2), sources[-1])
    got = []
    ours(sources, lambda *hs: got.extend(hs) or hs[0])
    assert len(got) == num_queries
    for mine, released in zip(got, theirs):
        torch.testing.assert_close(mine, released, **TOL)
    # float64: against the transcription (the released module computes in float32 whatever it is given)
    sources64 = tuple(s.double() for s in sources)
    got64 = []
    ours.double()(sources64, lambda *hs: got64.extend(hs) or hs[0])
    for mine, written in zip(got64, transcription(sources64, ours.query)):
        assert mine.dtype == torch.float64
        torch.testing.assert_close(mine, written, atol=1e-12, rtol=1e-12)


def test_a_model_computes_what_inkling2s_computes():
    config = hf_config()
    torch.manual_seed(0)
    model = Inkling2TextModel(config).eval()
    random_queries_(model)
    captured = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda mod, args, kwargs, i=i: captured.__setitem__(i, kwargs),
                                        with_kwargs=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).last_hidden_state
        sources = (model.embed_tokens(ids),)
        for i, layer in enumerate(model.layers):
            kw = {k: v for k, v in captured[i].items() if k not in ("block_states", "hidden_states")}
            common = dict(attention_mask=kw.pop("attention_mask"), relative_distance=kw.pop("relative_distance"),
                          conv_mask=kw.pop("conv_mask"), cache=None)
            kw.pop("cache", None)

            def attention(hq, hk=None, hv=None, layer=layer, common=common, kw=kw):
                if hk is None:
                    out = layer.self_attn(hidden_states=layer.input_layernorm(hq), **common, **kw)[0]
                else:
                    out = layer.self_attn(hidden_states=layer.q_input_layernorm(hq),
                                          key_hidden_states=layer.k_input_layernorm(hk),
                                          value_hidden_states=layer.v_input_layernorm(hv), **common, **kw)[0]
                return layer.post_attention_convolution(out, cache=None, conv_mask=common["conv_mask"], **kw)

            def mlp(h, layer=layer, common=common, kw=kw):
                out = layer.mlp(layer.post_attention_layernorm(h))
                return layer.post_mlp_convolution(out, cache=None, conv_mask=common["conv_mask"], **kw)

            attn_hc = inkling2.connection_from_hf(config, layer.attention_input, i, "attention")
            mlp_hc = inkling2.connection_from_hf(config, layer.mlp_input, i, "mlp")
            assert attn_hc.num_queries == (3 if i in FULL else 1) and attn_hc.reads == (i > 0)
            sources = mlp_hc(attn_hc(sources, attention), mlp)
        assert len(sources) == 1 + -(-LAYERS // PER_BLOCK)
        got = model.norm(inkling2.head_from_hf(config, model.final_input)(sources))
    torch.testing.assert_close(got, expected, **TOL)


def test_round_trips_are_exact_and_bad_tensors_are_named():
    config = hf_config()
    model = Inkling2TextModel(config)
    random_queries_(model)
    hf_state = {f"model.{k}": v for k, v in model.state_dict().items()}
    ours = inkling2.model_connections_from_hf(hf_state, config)
    assert ours["blocks.2.attn_hc.query"].shape == (3, DIM) and "blocks.0.attn_hc.query" not in ours
    back = inkling2.model_connections_to_hf(ours, config)
    assert back.keys() == {k for k in hf_state if k.endswith(".query")}
    for key, value in back.items():
        assert torch.equal(value, hf_state[key])
    for i, layer in enumerate(model.layers):
        for kind, module in (("attention", layer.attention_input), ("mlp", layer.mlp_input)):
            connection = inkling2.connection_from_hf(config, module, i, kind)
            state = inkling2.connection_to_hf(connection, config)
            assert state.keys() == ({} if module is None else module.state_dict()).keys()
            for key, value in state.items():
                assert torch.equal(value, module.state_dict()[key])
    head = inkling2.head_from_hf(config, model.final_input)
    assert torch.equal(inkling2.head_to_hf(head, config)["query"], model.final_input.query)
    with pytest.raises(ValueError, match=r"tensor 'query' has shape \(32,\), expected \(3, 32\)"):
        inkling2.connection_state_from_hf({"query": torch.zeros(DIM)}, DIM, 3)
    with pytest.raises(ValueError, match=r"tensor 'blocks.7.mlp_hc.query' is missing"):
        inkling2.model_connections_from_hf({k: v for k, v in hf_state.items() if "layers.7.mlp" not in k}, config)
    with pytest.raises(ValueError, match=r"has key_norm='weighted', but Inkling-2 computes key_norm='unweighted'"):
        inkling2.connection_to_hf(AttnResConnection(DIM, sublayer=3, block_size=6), config)
    with pytest.raises(ValueError, match=r"has num_queries=1, but Inkling-2 computes num_queries=3"):
        inkling2.connection_to_hf(AttnResConnection(DIM, sublayer=4, block_size=2 * PER_BLOCK, **{
            k: v for k, v in inkling2.FAMILY_OPTIONS.items() if k != "variant"}), config)


PATTERN = 4  # full attention at layers 3 and 7: s2hc's global layers with sliding_window_pattern=4


def patterned_model(options) -> Transformer:
    return Transformer(get_preset("tiny", family="attn-res", n_layers=LAYERS, family_options=options, vocab_size=64,
                                  dim=DIM, n_heads=2, ffn_dim=32, max_seq_len=16, sliding_window=4,
                                  sliding_window_pattern=PATTERN))


def test_s2hcs_transformer_holds_its_three_query_reads_at_its_global_layers():
    full = [i for i in range(LAYERS) if (i + 1) % PATTERN == 0]
    config = hf_config(["hybrid" if i in full else "hybrid_sliding" for i in range(LAYERS)])
    options = inkling2.family_options(config)
    assert options["block_size"] == 2 * PER_BLOCK and options["key_norm"] == "unweighted" and options["qkv_reads"]
    ours = patterned_model(options)
    assert [block.attn_hc.num_queries for block in ours.blocks] == [3 if i in full else 1 for i in range(LAYERS)]
    assert [block.attn_k_norm is not None for block in ours.blocks] == [i in full for i in range(LAYERS)]
    model = Inkling2TextModel(config)
    random_queries_(model)
    state = inkling2.model_connections_from_hf(model.state_dict(), config)
    missing, unexpected = ours.load_state_dict(state, strict=False)  # a query of another shape would raise
    assert not unexpected and not [k for k in missing if "_hc." in k or "stream_head" in k]
    assert ours.blocks[0].attn_hc.query is None and ours.blocks[0].attn_hc.key_norm_weight is None
    logits = ours(torch.randint(0, 64, (2, 5)))
    assert torch.isfinite(logits).all()
    back = inkling2.model_connections_to_hf(ours.state_dict(), config, prefix="")
    assert back.keys() == {k for k in model.state_dict() if k.endswith(".query")}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.items())
    everywhere = Transformer(get_preset("tiny", family="attn-res", n_layers=LAYERS, family_options=options,
                                        vocab_size=64, dim=DIM, n_heads=2, ffn_dim=32, max_seq_len=16))
    with pytest.raises(RuntimeError, match=r"blocks.0.attn_hc|size mismatch for blocks.1.attn_hc.query"):
        everywhere.load_state_dict(state, strict=False)  # every layer global: the sliding layers' shapes differ


def test_its_gradients_are_exact_and_the_diagnostics_read_it():
    conventions = {k: v for k, v in inkling2.FAMILY_OPTIONS.items() if k != "variant"}
    connection = AttnResConnection(6, sublayer=3, block_size=2, num_queries=3, **conventions).double()
    random_queries_(connection)
    generator = torch.Generator().manual_seed(3)
    sources = tuple(torch.randn(2, 3, 6, generator=generator, dtype=torch.float64, requires_grad=True)
                    for _ in range(connection.num_sources))

    query = connection.query.detach().clone().requires_grad_()

    def run(query, *sources):
        return torch.func.functional_call(connection, {"query": query}, (sources, lambda q, k, v: q * k.sin() + v))[-1]

    assert torch.autograd.gradcheck(run, (query, *sources))
    config = hf_config(["hybrid" if (i + 1) % PATTERN == 0 else "hybrid_sliding" for i in range(LAYERS)])
    model = patterned_model(inkling2.family_options(config))
    reads = depth_attention(model, torch.randint(0, 64, (2, 5)))["reads"]
    assert reads[0]["sources"] == 1 and reads[0]["embedding_weight"] == 1.0
    names = [read["name"] for read in reads]  # the three-query reads (layers 3 and 7) one row per query
    assert len(names) == 2 * LAYERS + 1 + 2 * 2 and names[6:9] == [f"blocks.3.attn_hc query {q}" for q in range(3)]
