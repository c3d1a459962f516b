"""Parity with Hugging Face transformers: Qwen3, Qwen2 (Qwen2.5), Gemma3 and GPT-2 give the same logits.

Each architecture's transformers model is built offline from a small config (random weights, eager attention),
its weights are moved far from their initialisation so that every norm offset, bias and rotation matters,
and the converted s2hc model must reproduce its float32 logits to 1e-4.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from s2hc.hf.convert import config_from_hf, load_hf_state_dict  # noqa: E402
from s2hc.models import Transformer  # noqa: E402

TOLERANCE = 1e-4
VOCAB, SEQ, WINDOW = 256, 24, 8
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def hf_config(arch: str):
    if arch == "qwen3":
        return transformers.Qwen3Config(**SMALL, num_hidden_layers=3, rope_theta=10_000.0, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**SMALL, num_hidden_layers=2, rope_theta=50_000.0, tie_word_embeddings=True)
    if arch == "gemma3":
        # 7 layers with the real 5 local : 1 global pattern: global at layer 5, local at 0-4 and 6;
        # query_pre_attn_scalar differs from head_dim so the score scaling is checked too.
        return transformers.Gemma3TextConfig(
            **SMALL,
            num_hidden_layers=7,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            tie_word_embeddings=True,
        )
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=0, eos_token_id=0)
    raise AssertionError(arch)


ARCHITECTURES = ("qwen3", "qwen2", "gemma3", "gpt2")


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights far from any initialisation, with O(1) activations: matrices ~ N(0, 1/fan_in), embeddings
    ~ N(0, 1), vectors (norm weights, biases) ~ 0.3·N(0, 1) (plus 1 for a plain RMSNorm weight)."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):  # GPT-2's token and position tables
            p.copy_(noise)
        elif p.dim() == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif ("norm" in name or ".ln_" in name) and "Gemma" not in type(model).__name__ and name.endswith("weight"):
            p.copy_(1.0 + 0.3 * noise)
        else:
            p.copy_(0.3 * noise)


def build_pair(arch: str, seed: int = 0, **overrides):
    config = hf_config(arch)
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomise(reference, seed)
    model = Transformer(config_from_hf(config, **overrides)).eval()
    load_hf_state_dict(model, reference.state_dict())
    return reference, model


def tokens(seed: int = 1, batch: int = 3, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(arch):
    reference, model = build_pair(arch)
    ids = tokens()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(ids)
    assert got.shape == expected.shape == (3, SEQ, VOCAB)
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{arch}: max |logit difference| {diff:.3g}"


def test_config_from_hf_reads_each_feature():
    qwen3 = config_from_hf(hf_config("qwen3"))
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.tie_embeddings, qwen3.n_kv_heads, qwen3.head_dim) == (
        True, False, False, 2, 16,
    )  # fmt: skip
    qwen2 = config_from_hf(hf_config("qwen2"))
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.out_bias, qwen2.rope_theta) == (False, True, False, 50_000.0)
    gemma = config_from_hf(hf_config("gemma3"))
    assert gemma.layer_types() == ["local"] * 5 + ["global", "local"]
    assert (gemma.sliding_window, gemma.rope_theta, gemma.local_rope_theta) == (WINDOW, 1e6, 1e4)
    assert gemma.norm_unit_offset and gemma.embed_scale and gemma.post_norms and gemma.mlp == "geglu"
    assert gemma.query_pre_attn_scalar == 24


def test_the_comparison_sees_the_sliding_window():
    """Without its window the Gemma3 model differs from the reference by far more than the tolerance."""
    reference, _ = build_pair("gemma3")
    model = Transformer(config_from_hf(hf_config("gemma3"), sliding_window=None)).eval()
    load_hf_state_dict(model, reference.state_dict())
    ids = tokens()
    with torch.no_grad():
        assert (model(ids) - reference(input_ids=ids).logits).abs().max() > 1e-2


def test_unsupported_features_are_refused():
    config = hf_config("gemma3")
    config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        config_from_hf(config)
    config = hf_config("qwen2")
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf(config)
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf(transformers.GPT2Config(scale_attn_by_inverse_layer_idx=True))


def test_mismatched_state_dict_lists_missing_and_unexpected_keys():
    reference, model = build_pair("qwen3")
    state = dict(reference.state_dict())
    state.pop("model.layers.0.self_attn.q_norm.weight")
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.q_norm.weight'\].*self_attn.extra"):
        load_hf_state_dict(model, state)
    state = dict(reference.state_dict())
    state["model.embed_tokens.weight"] = torch.zeros(VOCAB + 1, 64)
    with pytest.raises(ValueError, match="embed.weight: shape"):
        load_hf_state_dict(model, state)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_s2hc_version_runs_forward_and_backward(arch):
    """The same architectures with four s²HC streams load the same weights and train."""
    _, model = build_pair(arch, family="s2hc", n_streams=4)
    model.train()
    ids = tokens(seq=SEQ + 1)
    logits = model(ids[:, :-1])
    assert logits.shape == (3, SEQ, VOCAB) and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert model.num_hc_params() > 0, "no hyper-connection parameters"
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the hyper-connections' zero-initialised projection receives gradient
    assert any(p.grad.abs().sum() > 0 for p in model.hyper_connection_parameters() if p.dim() == 2)
