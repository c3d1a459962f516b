"""s2hc.models: presets and their sizes, the config's validation and serialisation, causality, the sliding
window, training, and an initialisation that leaves the hyper-connections alone."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import yaml

import s2hc
from s2hc.connection import forms
from s2hc.models import PRESETS, ModelConfig, Transformer, get_preset
from s2hc.models.transformer import (
    Attention,
    AttentionInputs,
    KVCache,
    attention_inputs,
    rope_cos_sin,
    sliding_window_mask,
)
from s2hc.params import count_connection_params

# Each architecture at test size, keeping its features (GQA, QK-norm, biases, Gemma's norms,
# embedding scaling, window and local/global pattern, learned positions).
MINI = dict(vocab_size=64, dim=32, n_heads=4, max_seq_len=32)
ARCHITECTURES = {
    "tiny": get_preset("tiny", **MINI, n_layers=2, ffn_dim=64),
    "gpt2": get_preset("gpt2-small", **MINI, n_layers=2, ffn_dim=128),
    "qwen3": get_preset("qwen3-0.6b", **MINI, n_layers=2, n_kv_heads=2, head_dim=16, ffn_dim=64),
    "qwen2.5": get_preset("qwen2.5-1.5b", **MINI, n_layers=2, n_kv_heads=2, head_dim=8, ffn_dim=64),
    "gemma3": get_preset(
        "gemma3-1b", **MINI, n_layers=3, n_kv_heads=1, head_dim=16, ffn_dim=64, sliding_window=4,
        sliding_window_pattern=3, query_pre_attn_scalar=8.0,
    ),
}  # fmt: skip


def with_mixer(config: ModelConfig, mixer: str, n_streams: int, **options) -> ModelConfig:
    return ModelConfig.from_dict(
        {**config.to_dict(), "family": mixer, "n_streams": n_streams, "family_options": options}
    )


def ids(batch=2, seq=16, vocab=64, seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def perturb_(params, seed=0, spread=0.3) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_(spread * torch.randn(p.shape, generator=generator))


# ---- presets ---------------------------------------------------------------------------------------------

# Reference sizes: nanoGPT's GPT-2 (124,439,808 with positions, tied), GPT-2 medium (355 M), Qwen3-0.6B
# untied as in the s²HC paper (0.75 B), keras-hub's Gemma3 1B (999,885,952), Qwen2.5-1.5B's model card
# (1.54 B, 1.31 B without embeddings).
SIZES = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "qwen3-0.6b": 751_632_384,
    "gemma3-1b": 999_885_952,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama3.2-1b": 1_235_814_400,  # tied embeddings, as Llama-3.2-1B
    "mistral-7b": 7_241_732_096,  # Mistral-7B-v0.1
}


@pytest.mark.parametrize("name", list(SIZES))
def test_large_presets_have_the_published_sizes(name):
    with torch.device("meta"):
        model = Transformer(get_preset(name))
    assert model.num_params() == SIZES[name]
    assert model.num_connection_params() == 0 and model.hyper_connection_parameters() == []


def test_qwen25_without_embeddings_and_gemma_layer_pattern():
    with torch.device("meta"):
        qwen = Transformer(get_preset("qwen2.5-1.5b"))
    assert round(qwen.num_params(exclude_embeddings=True) / 1e9, 2) == 1.31
    gemma = get_preset("gemma3-1b")
    assert gemma.layer_types().count("global") == 4 and gemma.layer_types()[5] == "global"
    assert gemma.layer_types()[:5] == ["local"] * 5


def test_untied_qwen3_counts_its_lm_head():
    with torch.device("meta"):
        untied = Transformer(get_preset("qwen3-0.6b"))
        tied = Transformer(get_preset("qwen3-0.6b", tie_embeddings=True))
    assert untied.num_params() - tied.num_params() == 151936 * 1024
    assert tied.lm_head.weight is tied.embed.weight and untied.lm_head.weight is not untied.embed.weight


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_presets_build_and_run(name):
    model = Transformer(get_preset(name, family="s2hc", n_streams=4))
    logits = model(ids(seq=8, vocab=4096))
    assert logits.shape == (2, 8, 4096) and torch.isfinite(logits).all()


def test_hc_params_match_the_parameter_table():
    with torch.device("meta"):
        model = Transformer(get_preset("qwen3-0.6b", family="s2hc", n_streams=4))
        residual = Transformer(get_preset("qwen3-0.6b"))
    aux = model.num_connection_params()
    assert aux == sum(p.numel() for p in model.hyper_connection_parameters())
    assert aux == count_connection_params("s2hc", layers=28, dim=1024, n_streams=4)
    assert model.num_params() == residual.num_params() + aux


# ---- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_config_round_trips_through_json_and_yaml(name):
    config = get_preset(name, family="mhc", n_streams=4, family_options={"iterations": 10})
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


def test_yaml_exponent_strings_are_numbers():
    # PyYAML reads "1e6" (no dot) as a string
    config = ModelConfig.from_dict(yaml.safe_load("rope_theta: 1e6\nnorm_eps: 1e-5\n"))
    assert (config.rope_theta, config.norm_eps) == (1e6, 1e-5)


def test_defaults_are_resolved():
    config = ModelConfig(dim=96, n_heads=6, mlp="swiglu")
    assert (config.n_kv_heads, config.head_dim, config.ffn_dim) == (6, 16, 256)
    assert ModelConfig(dim=96, n_heads=6, mlp="gelu").ffn_dim == 384
    assert ModelConfig(rope_theta=5e5).local_rope_theta == 5e5


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dim=100, n_heads=3), r"dim must be a multiple of n_heads.*dim=100, n_heads=3"),
        (dict(n_heads=4, n_kv_heads=3), r"n_heads must be a multiple of n_kv_heads.*n_kv_heads=3"),
        (dict(family="nope"), r"family must be one of \[.*'residual'.*'s2hc'.*got 'nope'"),
        (dict(family="residual", n_streams=4), r"n_streams must be 1 for family='residual', got 4"),
        (
            dict(family="s2hc", n_streams=4, family_options={"iterations": 3}),
            r"unknown family_options \['iterations'\]",
        ),
        (dict(family_options={"eps": 1e-5}), r"family='residual' takes no family_options"),
        (dict(norm="batchnorm"), r"norm must be one of \['rmsnorm', 'layernorm'\], got 'batchnorm'"),
        (dict(mlp="relu"), r"mlp must be one of \['swiglu', 'geglu', 'gelu'\]"),
        (dict(pos="alibi"), r"pos must be one of \['rope', 'learned'\]"),
        (dict(vocab_size=0), r"vocab_size must be an integer >= 1, got 0"),
        (dict(n_layers=2.0), r"n_layers must be an integer in \[1, 10000\], got 2.0"),
        (dict(tie_embeddings="yes"), r"tie_embeddings must be True or False, got 'yes'"),
        (dict(rope_theta=-1.0), r"rope_theta must be a positive number, got -1.0"),
        (dict(norm_eps="tiny"), r"norm_eps must be a positive number, got 'tiny'"),
        (dict(head_dim=15), r"head_dim must be even for pos='rope', got head_dim=15"),
        (dict(norm="layernorm", norm_unit_offset=True), r"norm_unit_offset=True needs norm='rmsnorm'"),
        (dict(sliding_window=0), r"sliding_window must be an integer >= 1, got 0"),
    ],
)
def test_bad_config_values_name_field_value_and_allowed(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**changes)


def test_unknown_keys_and_presets():
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['hidden'\]; allowed: \['vocab_size'"):
        ModelConfig.from_dict({"hidden": 64})
    with pytest.raises(ValueError, match=r"preset must be one of \['tiny', 'small', 'gpt2-small'.*got 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['layers'\]"):
        get_preset("tiny", layers=3)
    with pytest.raises(ValueError, match="mapping"):
        ModelConfig.from_dict([("dim", 8)])


def test_presets_default_to_the_plain_residual():
    for name in PRESETS:
        config = get_preset(name)
        assert (config.family, config.n_streams, config.family_options) == ("residual", 1, {})


# ---- forward ---------------------------------------------------------------------------------------------


def test_bad_inputs():
    model = Transformer(ARCHITECTURES["tiny"])
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of shape \(batch, time\), got \(16,\)"):
        model(ids()[0])
    with pytest.raises(ValueError, match="integer tensor"):
        model(ids().float())
    with pytest.raises(ValueError, match="33 positions, more than max_seq_len=32"):
        model(ids(seq=33))
    with pytest.raises(ValueError, match="config must be a ModelConfig"):
        Transformer({"dim": 32})


@pytest.mark.parametrize("family, n", [("residual", 1), ("s2hc", 4)])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_causal_masking(arch, family, n):
    """Changing the token at position t changes no logit before t (and does change the ones from t on)."""
    model = Transformer(with_mixer(ARCHITECTURES[arch], family, n)).eval()
    perturb_([p for p in model.parameters()], spread=0.2)  # hyper-connections away from their identity-like init
    x = ids(seq=16)
    t = 9
    y = x.clone()
    y[:, t] = (x[:, t] + 1) % 64
    with torch.no_grad():
        before, after = model(x), model(y)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-5)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_local_attention_ignores_keys_outside_the_window(n_kv_heads):
    """A local layer's output at t depends on inputs t - W < s <= t only; a global layer's on all s <= t."""
    config = ModelConfig(dim=32, n_heads=4, n_kv_heads=n_kv_heads, sliding_window=4, qk_norm=True)
    torch.manual_seed(0)
    local, full = Attention(config, local=True), Attention(config, local=False)
    full.load_state_dict(local.state_dict())
    T, W, t = 12, 4, 10
    positions = torch.arange(T)
    rope = rope_cos_sin(positions, config.head_dim, config.local_rope_theta)
    mask = sliding_window_mask(positions, positions, W)
    x = torch.randn(2, T, 32)
    for s, inside in [(t - W, False), (t - W + 1, True), (0, False)]:
        y = x.clone()
        y[:, s] += 1.0
        with torch.no_grad():
            changed_local = (local(y, rope, mask)[:, t] - local(x, rope, mask)[:, t]).abs().max()
            changed_full = (full(y, rope)[:, t] - full(x, rope)[:, t]).abs().max()
        assert (changed_local > 1e-4) == inside, (s, changed_local)
        assert changed_full > 1e-4


@pytest.mark.parametrize("family, n", [("residual", 1), ("s2hc", 4)])
def test_model_with_one_local_layer_sees_only_its_window(family, n):
    base = ARCHITECTURES["gemma3"].to_dict() | dict(n_layers=1, sliding_window=4, family=family, n_streams=n)
    model = Transformer(ModelConfig.from_dict(base)).eval()
    assert model.config.layer_types() == ["local"]
    perturb_(model.parameters(), spread=0.2)
    x, t = ids(seq=16), 12
    with torch.no_grad():
        reference = model(x)[:, t]
        for s, inside in [(t - 4, False), (2, False), (t - 3, True)]:
            y = x.clone()
            y[:, s] = (x[:, s] + 1) % 64
            change = (model(y)[:, t] - reference).abs().max()
            assert (change > 1e-4) == inside, (s, change)


def test_global_layers_see_past_the_window():
    base = ARCHITECTURES["gemma3"].to_dict() | dict(n_layers=1, sliding_window=4, sliding_window_pattern=1)
    model = Transformer(ModelConfig.from_dict(base)).eval()
    assert model.config.layer_types() == ["global"]
    x, t = ids(seq=16), 12
    y = x.clone()
    y[:, 2] = (x[:, 2] + 1) % 64
    with torch.no_grad():
        assert (model(y)[:, t] - model(x)[:, t]).abs().max() > 1e-4


def recorded_attention_inputs(model: Transformer, *args, **kwargs) -> AttentionInputs:
    """The :class:`AttentionInputs` that ``model(*args, **kwargs)`` hands to ``run_blocks``."""
    seen = []
    run_blocks = model.run_blocks
    model.run_blocks = lambda x, inputs, cache=None: seen.append(inputs) or run_blocks(x, inputs, cache)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        del model.run_blocks
    (inputs,) = seen
    return inputs


def assert_same_inputs(a: AttentionInputs, b: AttentionInputs) -> None:
    """Same tensors, dtypes and None-ness (a None mask keeps SDPA's is_causal path) in every field."""
    for field in dataclasses.fields(AttentionInputs):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert (x is None) == (y is None), field.name
        if x is None:
            continue
        pairs = zip(x, y) if isinstance(x, tuple) else [(x, y)]  # rope: (cos, sin)
        for u, v in pairs:
            assert u.dtype == v.dtype and torch.equal(u, v), field.name


@pytest.mark.parametrize("window", [4, 16])  # inside the 12 positions (a local mask), and covering them (None)
def test_incremental_attention_inputs_on_an_empty_cache_are_the_full_forwards(window):
    config = ModelConfig.from_dict(ARCHITECTURES["gemma3"].to_dict() | dict(sliding_window=window))
    model = Transformer(config).eval()
    x = ids(seq=12)
    full = recorded_attention_inputs(model, x)
    assert full.global_mask is None and (full.local_mask is None) == (window >= 12)
    assert full.global_rope is not None and full.local_rope is not None
    for kwargs in [dict(cache=KVCache()), dict(attention_mask=torch.ones(2, 12, dtype=torch.long))]:
        assert_same_inputs(recorded_attention_inputs(model, x, **kwargs), full)
    assert_same_inputs(attention_inputs(config, torch.arange(12), past=0), full)
    rope, mask = full.for_layer(local=True)
    assert rope is full.local_rope and mask is full.local_mask
    rope, mask = full.for_layer(local=False)
    assert rope is full.global_rope and mask is None


def test_padded_attention_inputs_hide_padding_keys():
    model = Transformer(ARCHITECTURES["gemma3"]).eval()  # window 4
    B, T, pad, W = 2, 10, 3, 4
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :pad] = 0  # sequence 0 left-padded by 3
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KVCache()
    prompt = recorded_attention_inputs(model, ids(B, T), cache=cache, attention_mask=mask, position_ids=positions)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    window = sliding_window_mask(torch.arange(T), torch.arange(T), W)
    for got, allowed in [(prompt.global_mask, causal), (prompt.local_mask, window)]:
        assert got.shape == (B, 1, T, T) and got.dtype == torch.bool
        assert torch.equal(got[1, 0], allowed)  # nothing padded in sequence 1
        assert not got[0, 0, pad:, :pad].any()  # real tokens never see padding keys
        assert torch.equal(got[0, 0, pad:, pad:], allowed[pad:, pad:])
        assert torch.equal(got[0, 0, :pad], torch.eye(T, dtype=torch.bool)[:pad])  # padding sees itself only
    assert torch.equal(prompt.global_rope[0], rope_cos_sin(positions, 16, model.config.rope_theta)[0])

    step_mask = torch.cat((mask, torch.ones(B, 1, dtype=torch.long)), dim=1)
    step = recorded_attention_inputs(model, ids(B, 1), cache=cache, attention_mask=step_mask,
                                     position_ids=positions[:, -1:] + 1)  # fmt: skip
    assert step.global_mask.shape == (B, 1, 1, T + 1)
    assert torch.equal(step.global_mask[:, 0, 0], step_mask.bool())  # every real key, no padding one
    assert torch.equal(step.local_mask[:, 0, 0], step_mask.bool() & (torch.arange(T + 1) > T - W))


# ---- training and initialisation -----------------------------------------------------------------------


def train_losses(config: ModelConfig, steps: int = 12, lr: float = 3e-3) -> list[float]:
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = ids(batch=4, seq=17, vocab=config.vocab_size, seed=1)
    losses = []
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_every_architecture_trains(family):
    losses = train_losses(ARCHITECTURES[family])
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("family", [m for m in s2hc.families() if m != "residual"])
def test_every_mixing_family_trains(family):
    n = 1 if forms.get(family).max_streams == 1 else 4  # AttnRes holds depth sources, not streams
    losses = train_losses(with_mixer(ARCHITECTURES["tiny"], family, n))
    assert losses[-1] < 0.8 * losses[0], losses


def test_init_weights_leaves_hyper_connections_alone():
    model = Transformer(with_mixer(ARCHITECTURES["gemma3"], "s2hc", 4))
    for block in model.blocks:  # docs/design.md's initialisation: zero projection, α = 0.01
        assert torch.count_nonzero(block.attn_hc.projection) == 0
        assert block.mlp_hc.alpha_pre.item() == pytest.approx(0.01)
    perturb_(model.parameters(), spread=0.5)
    aux = {id(p) for p in model.hyper_connection_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.init_weights()
    for name, p in model.named_parameters():
        if id(p) in aux:
            assert torch.equal(p, before[name]), f"init_weights changed {name}"
        else:
            assert not torch.equal(p, before[name]), f"init_weights did not reset {name}"


@pytest.mark.parametrize("family,n", [("s2hc", 4), ("mhc", 3), ("hc", 4)])
def test_both_connections_of_a_block_start_on_stream_layer_mod_n(family, n):
    """As in the s²HC authors' code, both sublayers of block l get layer_index = l (not 2l and 2l + 1)."""
    config = with_mixer(ARCHITECTURES["tiny"], family, n)
    model = Transformer(ModelConfig.from_dict({**config.to_dict(), "n_layers": 6}))
    for layer, block in enumerate(model.blocks):
        for hc in (block.attn_hc, block.mlp_hc):
            assert hc.layer_index == layer
            assert hc.bias_pre.argmax().item() == layer % n
            assert hc.bias_pre[layer % n] > hc.bias_pre.sort().values[-2]  # the one favoured stream


def test_init_weights_statistics():
    config = get_preset("small", n_layers=8, tie_embeddings=False)
    model = Transformer(config)
    out_std = 0.02 / (2 * 8) ** 0.5
    o_proj = torch.cat([b.attn.o_proj.weight.flatten() for b in model.blocks])
    q_proj = torch.cat([b.attn.q_proj.weight.flatten() for b in model.blocks])
    assert abs(o_proj.std().item() - out_std) < 0.05 * out_std
    assert abs(q_proj.std().item() - 0.02) < 0.001
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.001
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(config.dim))
    gemma = Transformer(ARCHITECTURES["gemma3"])
    assert torch.count_nonzero(gemma.blocks[0].attn_post_norm.weight) == 0  # (1 + w) norms start at w = 0
    gpt2 = Transformer(ARCHITECTURES["gpt2"])
    assert torch.count_nonzero(gpt2.blocks[0].mlp.up_proj.bias) == 0


def test_bfloat16_forward_and_backward():
    model = Transformer(with_mixer(ARCHITECTURES["gemma3"], "s2hc", 4)).to(torch.bfloat16)
    logits = model(ids())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
