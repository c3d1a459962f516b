"""Parity with Hugging Face transformers: every architecture of s2hc.hf.architectures gives the same logits.

Each architecture's transformers model is built offline from a small config (random weights, eager attention),
its weights are moved far from their initialisation so that every norm offset, bias and rotation matters,
and the converted s2hc model must reproduce its float32 logits to 1e-4. The cases are parametrised over the
registry: a new architecture fails here until ``hf_config`` has a small config of it. Llama is covered with and
without Llama 3's RoPE scaling and tied embeddings, Mistral and Gemma3 with windows shorter than the sequence;
the weight map is checked both ways (HF -> s2hc -> HF gives back every tensor).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from s2hc.hf import architectures  # noqa: E402
from s2hc.hf.convert import config_from_hf, load_hf_state_dict, to_hf_state_dict  # noqa: E402
from s2hc.models import PRESETS, ModelConfig, Transformer  # noqa: E402

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
# Llama 3's scaling over 32 original positions: of head_dim 16's 8 wavelengths (2π·10⁴^(j/8)) the first (6.3 < 32/4)
# is kept, the second (19.9) blended and the other six (> 32/1) stretched 4×, so every branch of it is compared.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10_000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)


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
    if arch == "llama":  # Llama 2 style: GQA, attention and MLP biases, untied
        return transformers.LlamaConfig(**SMALL, num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                                        rope_theta=10_000.0, tie_word_embeddings=False)
    if arch == "llama-rope-scaling":  # Llama 3.2 style
        return transformers.LlamaConfig(**SMALL, num_hidden_layers=2, rope_parameters=dict(LLAMA3_ROPE),
                                        tie_word_embeddings=False)
    if arch == "llama-tied":  # SmolLM2 / TinyLlama style: tied, and an attention width (4 · 32) other than dim
        return transformers.LlamaConfig(**{**SMALL, "head_dim": 32}, num_hidden_layers=2, rope_theta=50_000.0,
                                        tie_word_embeddings=True)
    if arch == "mistral":  # every layer slides, the window a third of the sequence
        return transformers.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=WINDOW, rope_theta=10_000.0,
                                          tie_word_embeddings=False)
    raise AssertionError(f"no small config of {arch!r}: add one to hf_config for the new architecture")


def case_of(architecture: architectures.Architecture) -> str:
    """The name of an architecture's case here: its model type (``gemma3`` for both of Gemma3's)."""
    return "gemma3" if "gemma3" in architecture.model_types else architecture.name


ARCHITECTURES = [case_of(a) for a in architectures.ARCHITECTURES]  # every registered architecture
VARIANTS = ["llama-rope-scaling", "llama-tied"]
CASES = ARCHITECTURES + VARIANTS


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


@pytest.mark.parametrize("arch", CASES)
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
    llama = config_from_hf(hf_config("llama"))
    assert (llama.qkv_bias, llama.out_bias, llama.mlp_bias, llama.qk_norm, llama.tie_embeddings) == (
        True, True, True, False, False,
    )  # fmt: skip
    assert llama.rope_scaling is None and llama.layer_types() == ["global"] * 2
    scaled = config_from_hf(hf_config("llama-rope-scaling"))
    assert scaled.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    tied = config_from_hf(hf_config("llama-tied"))
    assert (tied.tie_embeddings, tied.head_dim, tied.rope_theta, tied.n_kv_heads) == (True, 32, 50_000.0, 2)
    mistral = config_from_hf(hf_config("mistral"))
    assert mistral.layer_types() == ["local"] * 2 and mistral.sliding_window == WINDOW < SEQ
    assert config_from_hf({**hf_config("mistral").to_dict(), "sliding_window": None}).layer_types() == ["global"] * 2


def test_a_config_json_with_legacy_rope_scaling_reads_the_same():
    """Llama-3.2's config.json as published (rope_theta beside rope_scaling) gives the same ModelConfig."""
    legacy = {**hf_config("llama-rope-scaling").to_dict(), "rope_theta": 10_000.0,
              "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}
    del legacy["rope_parameters"]
    assert config_from_hf(legacy) == config_from_hf(hf_config("llama-rope-scaling"))


@pytest.mark.parametrize(("arch", "without"), [("gemma3", {"sliding_window": None}),
                                               ("mistral", {"sliding_window": None}),
                                               ("llama-rope-scaling", {"rope_scaling": None})])
def test_the_comparison_sees_the_sliding_window(arch, without):
    """Without its window (Gemma3, Mistral) or its RoPE scaling (Llama 3) the model differs from the reference by
    far more than the tolerance: the sequence is longer than the window and than the original positions."""
    reference, _ = build_pair(arch)
    model = Transformer(config_from_hf(hf_config(arch), **without)).eval()
    load_hf_state_dict(model, reference.state_dict())
    ids = tokens()
    with torch.no_grad():
        assert (model(ids) - reference(input_ids=ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", CASES)
def test_the_weight_map_round_trips(arch):
    """HF state dict -> s2hc model -> HF state dict gives back every parameter tensor, under its name."""
    reference, model = build_pair(arch)
    expected = dict(reference.named_parameters(remove_duplicate=False))  # tied heads under both names
    got = to_hf_state_dict(model)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    with pytest.raises(ValueError, match="needs a residual model"):
        to_hf_state_dict(build_pair(arch, family="s2hc", n_streams=2)[1])


def test_an_unknown_model_type_names_the_allowed_ones():
    with pytest.raises(ValueError, match="model_type must be one of") as error:
        config_from_hf({"model_type": "falcon"})
    assert all(repr(t) in str(error.value) for t in architectures.model_types()) and "'falcon'" in str(error.value)
    assert architectures.model_types() == list(architectures.REGISTRY)
    assert {"qwen3", "qwen2", "gemma3", "gemma3_text", "gpt2", "llama", "mistral"} == set(architectures.REGISTRY)
    assert architectures.get("gpt2").tokenizer == "gpt2" and architectures.get("llama").tokenizer is None
    for architecture in architectures.ARCHITECTURES:
        assert architecture.preset in PRESETS, architecture.name


def test_rope_scaling_is_validated_by_the_model_config():
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert ModelConfig(rope_scaling=scaling).rope_scaling == scaling
    for bad, key in (({**scaling, "rope_type": "yarn"}, "rope_type"), ({**scaling, "beta_fast": 32}, "beta_fast"),
                     ({k: v for k, v in scaling.items() if k != "factor"}, "factor"),
                     ({**scaling, "low_freq_factor": 4.0}, "low_freq_factor"),
                     ({**scaling, "original_max_position_embeddings": 0.5}, "original_max_position_embeddings")):
        with pytest.raises(ValueError, match=key):
            ModelConfig(rope_scaling=bad)
    with pytest.raises(ValueError, match="rope_scaling needs pos='rope'"):
        ModelConfig(rope_scaling=scaling, pos="learned")


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
        config_from_hf(transformers.FalconConfig())
    config = hf_config("llama")
    config.rope_parameters = {**LLAMA3_ROPE, "rope_type": "yarn"}
    with pytest.raises(ValueError, match=r"rope_type must be one of \['default', 'llama3'\].*'yarn'"):
        config_from_hf(config)
    config = hf_config("qwen3")
    config.rope_parameters = dict(LLAMA3_ROPE)
    with pytest.raises(ValueError, match="rope_type must be 'default'"):
        config_from_hf(config)
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**hf_config("mistral").to_dict(), "hidden_act": "gelu"})
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


@pytest.mark.parametrize("arch", CASES)
def test_s2hc_version_runs_forward_and_backward(arch):
    """The same architectures with four s²HC streams load the same weights and train."""
    _, model = build_pair(arch, family="s2hc", n_streams=4)
    model.train()
    ids = tokens(seq=SEQ + 1)
    logits = model(ids[:, :-1])
    assert logits.shape == (3, SEQ, VOCAB) and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert model.num_connection_params() > 0, "no hyper-connection parameters"
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the hyper-connections' zero-initialised projection receives gradient
    assert any(p.grad.abs().sum() > 0 for p in model.hyper_connection_parameters() if p.dim() == 2)


@pytest.mark.parametrize(("head_dim", "original", "theta"), [(16, 32, 1e4), (64, 8192, 5e5), (128, 8192, 5e5)])
def test_llama3_frequencies_are_those_of_transformers_to_the_bit(head_dim, original, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from s2hc.models.transformer import llama3_frequencies

    scaling = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=original)
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      rope_parameters=dict(rope_type="llama3", rope_theta=theta, **scaling))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert attention_factor == 1.0 and torch.equal(llama3_frequencies(plain, scaling), expected)


def test_no_module_outside_the_registry_asks_for_an_architecture_by_name():
    """Adding an architecture is one file in hf/architectures/ (and its preset): no other module compares a
    model_type with a name, or keys a mapping by one (as upcycle.py's _PRESET_OF and convert.py's if/elif did)."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "src" / "s2hc"
    names = set(architectures.model_types())

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for path in sorted(source.rglob("*.py")):
        if path.is_relative_to(source / "hf" / "architectures"):
            continue
        if path.is_relative_to(source / "torchtitan"):  # its keys name torchtitan's own models ("qwen3"), not HF's
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            compared = isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators])
            compared |= isinstance(node, ast.Compare) and any(
                isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in n.elts)
                for n in node.comparators)
            keyed = isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None)
            if compared or keyed:
                found.append(f"{path.relative_to(source)}:{node.lineno}")
    assert not found, found
