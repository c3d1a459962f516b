"""The model configuration (a plain, YAML/JSON-serialisable dataclass) and the named presets.

>>> cfg = get_preset("tiny", family="s2hc", n_streams=4)
>>> (cfg.dim, cfg.n_layers, cfg.family, cfg.n_streams)
(128, 4, 's2hc', 4)
>>> ModelConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checks import MAX_LAYERS, check_int
from ..connection import forms
from ..connection.forms import HYPER_CONNECTION_OPTIONS, check_family

__all__ = ["ModelConfig", "PRESETS", "default_stream_reduce", "get_preset"]

NORMS = ("rmsnorm", "layernorm")
MLPS = ("swiglu", "geglu", "gelu")
POSITIONS = ("rope", "learned")
STREAM_REDUCTIONS = ("sum", "mean", "head")
# RoPE scalings the model computes (rope_type -> its keys besides rope_type); transformers' other types are refused.
ROPE_SCALINGS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# HyperConnection's own keywords (its RMSNorm epsilon; mixing with H_resᵀ; how its projection and its gates start),
# accepted beside the family's options.
CONNECTION_OPTIONS = HYPER_CONNECTION_OPTIONS
# How Transformer.init_weights draws the weights outside the connections (see ModelConfig's docstring).
WEIGHT_INITS = ("gpt2", "neox")


def default_stream_reduce(family: str) -> str:
    """What ``ModelConfig.stream_reduce=None`` resolves to for ``family`` (its form's ``default_stream_reduce``):
    ``"head"`` for the gated residual (Qwen's model ends with its gated read) and AttnRes (its output query),
    ``"sum"`` (the papers') for every other family."""
    return forms.get(family).default_stream_reduce


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(name: str, value: Any) -> float:
    """A positive finite number; numeric strings are accepted because YAML reads ``1e6`` as a string."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _fail(name, value, "a positive number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(name, value, "a positive number")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False")
    return value


def _check_choice(name: str, value: Any, choices) -> str:
    if value not in choices:
        raise _fail(name, value, f"one of {list(choices)}")
    return value


@dataclass
class ModelConfig:
    """A decoder-only transformer: shape, architecture features, and the residual family.

    Shapes: ``dim`` is the residual width C, attention uses ``n_heads`` query heads and ``n_kv_heads``
    key/value heads (grouped-query attention) of width ``head_dim`` (so the attention width
    ``n_heads · head_dim`` may differ from ``dim``, as in Qwen3 and Gemma3). ``None`` fields are resolved
    in ``__post_init__``: ``n_kv_heads = n_heads``, ``head_dim = dim // n_heads``, ``ffn_dim = 4 · dim``
    for ``mlp="gelu"`` and ``8 · dim / 3`` rounded up to a multiple of 64 for the gated MLPs,
    ``local_rope_theta = rope_theta``. Change ``dim`` through :func:`get_preset` or a new config (not
    :func:`dataclasses.replace` of a resolved one) to have them re-derived.

    Architecture features:
        norm / norm_eps: ``"rmsnorm"`` or ``"layernorm"`` (LayerNorm with bias, GPT-2).
        norm_unit_offset: Gemma's RMSNorm, whose weight ``w`` is stored zero-initialised and applied as
            ``1 + w`` (every RMSNorm of the model, the QK-norms included).
        mlp: ``"swiglu"`` ``down(silu(gate(x)) · up(x))``, ``"geglu"`` the same with tanh-approximated GELU
            (Gemma's ``gelu_pytorch_tanh``), ``"gelu"`` ``down(gelu_tanh(up(x)))`` (GPT-2's ``gelu_new``).
        qkv_bias / out_bias / mlp_bias: biases of the q, k, v projections (Qwen2.5), of the attention
            output projection, of the MLP projections (GPT-2 has all three).
        pos: ``"rope"`` (rotate-half convention, base ``rope_theta``) or ``"learned"`` absolute positions.
        rope_scaling: None (plain RoPE) or Llama 3's frequency scaling, ``{"rope_type": "llama3", "factor",
            "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` (as transformers'
            ``rope_parameters``): wavelengths longer than ``original / low_freq_factor`` are stretched by
            ``factor``, those shorter than ``original / high_freq_factor`` kept, those between blended. It
            applies to every layer's RoPE (local layers' too).
        max_seq_len: the longest input ``forward`` accepts (the learned position table's size).
        qk_norm: RMSNorm over ``head_dim`` of queries and keys, before RoPE (Qwen3, Gemma3).
        tie_embeddings: the LM head shares the token embedding's weight.
        embed_scale: multiply token embeddings by ``sqrt(dim)`` (Gemma).
        post_norms: Gemma's sandwich norms, a norm on the attention and on the MLP output, inside the branch.
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` instead
            of ``head_dim ** -0.5`` (Gemma3).
        sliding_window / sliding_window_pattern / local_rope_theta: with ``sliding_window = W``, layer
            ``i`` is global when ``(i + 1) % sliding_window_pattern == 0`` and local otherwise (Gemma3:
            pattern 6, five local layers to one global); pattern 0 means no global layer, every layer
            slides (Mistral). A local layer's query at position ``t`` sees the keys ``t - W < s <= t`` and uses
            RoPE base ``local_rope_theta``.
        weight_init: how ``Transformer.init_weights`` draws every weight outside the connections (C = ``dim``,
            L = ``n_layers``; biases 0 and norms the identity either way). ``"gpt2"`` (default): linear and
            embedding weights ~ N(0, init_std²), the residual output projections (``o_proj``, ``down_proj``)
            ~ N(0, (init_std / sqrt(2L))²). ``"neox"``, the s²HC authors' code (``litgpt/pretrain.py``,
            ``initialize_weights``; GPT-NeoX's small init and its ``wang_init``): linear and embedding weights,
            the untied LM head's included, ~ N(0, 2 / (5C)), ``o_proj`` and ``down_proj`` ~ N(0, (1 / (sqrt(C) · L))²).
            A model loaded from weights (upcycled, converted, ``--init-from``) does not depend on it.
        init_std: the std of ``weight_init="gpt2"`` (unused by ``"neox"``, whose stds follow from C and L).

    Residual family: ``family`` (a name from :func:`s2hc.families`), ``n_streams`` (1 for ``"residual"``)
    and ``family_options`` (the family's options, see :func:`s2hc.mixers.options`, plus the connection's own:
    ``eps``, ``transpose_res``, ``projection_init``, ``gate_init``), passed to every :class:`s2hc.HyperConnection`
    of the model; ``gate_init="residual"`` (a residual-equivalent start, :mod:`s2hc.connection.init`) needs
    ``stream_reduce="mean"``. ``family="gated-residual"`` is Qwen's gated residual (:class:`s2hc.GatedResidual`,
    options ``rank`` and ``eps`` only, ``n_streams >= 2``): as in transformers' ``qwen4_exp`` layer its branches
    have no pre-norm (the connection's read is normalised), and with its head the model has no final norm.

    ``stream_reduce``: how the streams become one before the final norm, ``"sum"`` (the papers') or ``"mean"``
    (the same up to the final norm's ε; upcycled models use it so that they compute exactly what their residual
    source computes, see :mod:`s2hc.models.widen`), or ``"head"``: the family's learned read, DeepSeek-V4's
    ``HyperHead`` (:class:`s2hc.HyperHead`, its ``hc_eps`` from ``family_options``, else 1e-6) for a mixing
    family, Qwen's gated read (:class:`s2hc.GatedHead`, which replaces the final norm) for ``"gated-residual"``.
    None (the default) resolves to ``"head"`` for ``"gated-residual"`` (Qwen's model) and ``"sum"`` otherwise.

    ``lss_init``: None (default: the embedding copied into every stream, as the papers and Qwen do) or a number
    ``λ₀``: learned stream scaling (LSS, brain-lab-research/hc-stream-collapse), each stream the embedding times a
    learned per-stream, per-channel scale ``λ ∈ R^{n×C}`` starting at ``λ₀`` plus Xavier-uniform noise (that code's
    default ``λ₀`` is 0.6; :class:`s2hc.connection.StreamScaling`). A multi-stream family only.
    """

    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 1024
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False
    mlp: str = "swiglu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    pos: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = False
    tie_embeddings: bool = True
    embed_scale: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int = 6
    local_rope_theta: float | None = None
    weight_init: str = "gpt2"
    init_std: float = 0.02
    family: str = forms.RESIDUAL.name
    n_streams: int = 1
    family_options: dict[str, Any] = field(default_factory=dict)
    stream_reduce: str | None = None
    lss_init: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_heads", "max_seq_len", "n_streams"):
            check_int(name, getattr(self, name))
        check_int("sliding_window_pattern", self.sliding_window_pattern, minimum=0)  # 0: no global layer
        check_int("n_layers", self.n_layers, maximum=MAX_LAYERS)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads must be a multiple of n_kv_heads, got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim must be a multiple of n_heads when head_dim is not given, "
                    f"got dim={self.dim}, n_heads={self.n_heads}"
                )
            self.head_dim = self.dim // self.n_heads
        check_int("head_dim", self.head_dim)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("mlp", self.mlp, MLPS)
        _check_choice("pos", self.pos, POSITIONS)
        if self.stream_reduce is None:
            self.stream_reduce = default_stream_reduce(self.family)
        _check_choice("stream_reduce", self.stream_reduce, STREAM_REDUCTIONS)
        _check_choice("weight_init", self.weight_init, WEIGHT_INITS)
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim if self.mlp == "gelu" else 64 * math.ceil(8 * self.dim / 3 / 64)
        check_int("ffn_dim", self.ffn_dim)
        for name in ("norm_eps", "rope_theta", "init_std"):
            setattr(self, name, _check_float(name, getattr(self, name)))
        for name in ("norm_unit_offset", "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tie_embeddings",
                     "embed_scale", "post_norms"):  # fmt: skip
            _check_bool(name, getattr(self, name))
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError(f"norm_unit_offset=True needs norm='rmsnorm', got norm={self.norm!r}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim must be even for pos='rope', got head_dim={self.head_dim}")
        if self.query_pre_attn_scalar is not None:
            self.query_pre_attn_scalar = _check_float("query_pre_attn_scalar", self.query_pre_attn_scalar)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window)
        if self.local_rope_theta is None:
            self.local_rope_theta = self.rope_theta
        self.local_rope_theta = _check_float("local_rope_theta", self.local_rope_theta)
        self._check_rope_scaling()
        self._check_mixer()

    def _check_rope_scaling(self) -> None:
        """``rope_scaling`` as a plain dict of numbers: one of :data:`ROPE_SCALINGS` with exactly its keys."""
        if self.rope_scaling is None:
            return
        if not isinstance(self.rope_scaling, Mapping):
            raise _fail("rope_scaling", self.rope_scaling, "None or a dict with rope_type 'llama3' and its keys")
        if self.pos != "rope":
            raise ValueError(f"rope_scaling needs pos='rope', got pos={self.pos!r}")
        scaling = dict(self.rope_scaling)
        rope_type = _check_choice("rope_scaling['rope_type']", scaling.get("rope_type"), tuple(ROPE_SCALINGS))
        keys = ROPE_SCALINGS[rope_type]
        unknown = sorted(str(k) for k in set(scaling) - {"rope_type", *keys})
        if unknown:
            raise ValueError(f"rope_scaling has unknown key(s) {unknown} for rope_type {rope_type!r}; "
                             f"allowed: {['rope_type', *keys]}")
        for key in keys:
            if key not in scaling:
                raise ValueError(f"rope_scaling[{key!r}] is missing; rope_type {rope_type!r} needs {list(keys)}")
        factors = {key: _check_float(f"rope_scaling[{key!r}]", scaling[key]) for key in keys[:3]}
        if factors["low_freq_factor"] >= factors["high_freq_factor"]:
            raise ValueError(f"rope_scaling['low_freq_factor'] must be below rope_scaling['high_freq_factor'], got "
                             f"{factors['low_freq_factor']} and {factors['high_freq_factor']}")
        original = check_int("rope_scaling['original_max_position_embeddings']", scaling[keys[3]])
        self.rope_scaling = {"rope_type": rope_type, **factors, keys[3]: original}

    def _check_mixer(self) -> None:
        check_family(self.family)
        if not isinstance(self.family_options, Mapping):
            raise _fail("family_options", self.family_options, "a dict of the family's options")
        self.family_options = dict(self.family_options)
        if self.lss_init is not None:
            self.lss_init = _check_float("lss_init", self.lss_init)
        forms.get(self.family).check_model(dim=self.dim, n_streams=self.n_streams, n_sublayers=2 * self.n_layers,
                                           stream_reduce=self.stream_reduce, lss_init=self.lss_init,
                                           options=self.family_options)

    # ---- derived -------------------------------------------------------------------------------------

    def is_local_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) uses sliding-window attention."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_pattern == 0 or (layer + 1) % self.sliding_window_pattern != 0

    def layer_types(self) -> list[str]:
        """``"local"`` or ``"global"`` for every layer, in order."""
        return ["local" if self.is_local_layer(i) else "global" for i in range(self.n_layers)]

    # ---- serialisation -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (YAML / JSON ready), resolved defaults included."""
        return copy.deepcopy(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a mapping such as :meth:`to_dict` wrote; ValueError naming unknown keys and the allowed ones."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a model config must be a mapping, got {type(d).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; allowed: {allowed}")
        return cls(**copy.deepcopy(dict(d)))


# Presets: plain dicts so they read like YAML configs. The CPU presets use the embedded BPE tokenizer's
# vocabulary (4096) and leave head_dim / ffn_dim derived where overriding dim should re-derive them.
_GPT2 = dict(
    vocab_size=50257, max_seq_len=1024, norm="layernorm", norm_eps=1e-5, mlp="gelu",
    qkv_bias=True, out_bias=True, mlp_bias=True, pos="learned", tie_embeddings=True,
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized (RMSNorm, SwiGLU, RoPE, tied); step times in s2hc/models/__init__.py.
    "tiny": dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, ffn_dim=384, max_seq_len=256),
    "small": dict(vocab_size=4096, dim=256, n_layers=6, n_heads=4, ffn_dim=768, max_seq_len=512),
    # The sHC paper's 0.12 B nanoGPT (124 M with tied embeddings) and its 0.36 B sibling.
    "gpt2-small": dict(_GPT2, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "gpt2-medium": dict(_GPT2, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # Qwen/Qwen3-0.6B's shapes; untied as in the s²HC paper (≈ 0.75 B instead of 0.6 B).
    "qwen3-0.6b": dict(
        vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
        max_seq_len=40960, norm_eps=1e-6, mlp="swiglu", rope_theta=1_000_000.0, qk_norm=True,
        tie_embeddings=False,
    ),
    # google/gemma-3-1b-pt: 26 layers, 5 local (window 512, base 10 k) : 1 global (base 1 M), tied.
    "gemma3-1b": dict(
        vocab_size=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
        max_seq_len=32768, norm_eps=1e-6, norm_unit_offset=True, mlp="geglu", rope_theta=1_000_000.0,
        qk_norm=True, tie_embeddings=True, embed_scale=True, post_norms=True, query_pre_attn_scalar=256.0,
        sliding_window=512, sliding_window_pattern=6, local_rope_theta=10_000.0,
    ),
    # Qwen/Qwen2.5-1.5B: q/k/v biases, tied.
    "qwen2.5-1.5b": dict(
        vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, ffn_dim=8960,
        max_seq_len=131072, norm_eps=1e-6, mlp="swiglu", rope_theta=1_000_000.0, qkv_bias=True,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.2-1B: GQA 32 : 8, Llama 3's RoPE scaling (factor 32 over 8 k original positions), tied.
    "llama3.2-1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
        max_seq_len=131072, norm_eps=1e-5, mlp="swiglu", rope_theta=500_000.0, tie_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # mistralai/Mistral-7B-v0.1: GQA 32 : 8, a 4096-token sliding window on every layer (pattern 0), untied.
    "mistral-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
        max_seq_len=32768, norm_eps=1e-5, mlp="swiglu", rope_theta=10_000.0, tie_embeddings=False,
        sliding_window=4096, sliding_window_pattern=0,
    ),
}  # fmt: skip


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` with ``overrides`` applied (e.g. ``family="s2hc", n_streams=4``).

    ValueError naming the allowed presets for an unknown ``name``, and the allowed keys for an unknown override.
    """
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {list(PRESETS)}, got {name!r}")
    return ModelConfig.from_dict({**copy.deepcopy(PRESETS[name]), **overrides})
