"""A decoder-only transformer whose every sublayer is wrapped by a :class:`s2hc.HyperConnection`.

Data flow (``n = config.n_streams``)::

    ids (B, T) -> embed (· sqrt(C) for Gemma) [+ learned positions] -> expand_streams [· LSS] -> (B, T, n, C)
      -> per layer: attention sublayer, then MLP sublayer, each  X <- hc(X, branch)
      -> reduce_streams (sum, mean or a learned head: ``stream_reduce``) (B, T, C) -> final norm -> LM head
      -> logits (B, T, vocab)

A branch is everything between the connection's read and write: the pre-norm, the sublayer and, with
``post_norms`` (Gemma3), the norm on its output. Qwen's gated residual (``family="gated-residual"``) reads
normalised streams, so its branches have no pre-norm, and its head (:class:`s2hc.GatedHead`) takes the final
norm's place, as in transformers' ``qwen4_exp``. With Attention Residuals (``family="attn-res"``) the state between
sublayers is the tuple of depth sources (:mod:`s2hc.connection.forms.attn_res`) and the head is its output query.
What each family changes here is declared by its form (:mod:`s2hc.connection.forms`), never asked by name. With
``family="residual"`` the model is the plain pre-norm architecture of GPT-2, Qwen2.5, Qwen3 or Gemma3
(``tests/test_hf_parity.py`` checks the last three against Hugging Face ``transformers`` logit for logit).

Incremental decoding: ``forward(ids, cache=KVCache())`` appends every layer's keys and values to the cache, so the
next call needs only the new tokens. Hyper-connections mix streams per token, so attention is the only part of
the model that looks at earlier positions and the cache is all the state decoding needs; cached logits equal
the uncached ones (``tests/test_hf_export.py``). ``attention_mask`` / ``position_ids`` support left-padded
batches.

>>> import torch
>>> from s2hc.models import Transformer, get_preset
>>> model = Transformer(get_preset("tiny", n_layers=1, family="s2hc", n_streams=2))
>>> model(torch.zeros(2, 8, dtype=torch.long)).shape
torch.Size([2, 8, 4096])
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..checks import check_int
from ..connection import ConnectionModule, StreamScaling, build_connection, forms
from ..init_rng import DEFAULT_INIT_RNG, Draw, check_init_rng, parameter_generator, random_seed, redraw
from .model_config import ModelConfig

__all__ = [
    "Attention", "AttentionInputs", "Block", "KVCache", "MLP", "RMSNorm", "Transformer", "apply_rope",
    "attention_inputs", "llama3_frequencies", "make_norm", "rope_cos_sin",
]  # fmt: skip


# ---- norms ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back to the input's dtype.

    With ``unit_offset`` (Gemma) the stored weight ``w`` starts at 0 and the scale applied is ``1 + w``.
    ``(..., dim) -> (..., dim)``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.dim, self.eps, self.unit_offset = dim, eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float()
        if self.unit_offset:
            weight = 1.0 + weight
        return F.rms_norm(x.float(), (self.dim,), weight, self.eps).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, unit_offset={self.unit_offset}"


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's norm (``config.norm``) over ``dim`` features (default ``config.dim``)."""
    dim = config.dim if dim is None else dim
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, eps=config.norm_eps, unit_offset=config.norm_unit_offset)


# ---- rotary position embedding ---------------------------------------------------------------------------


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles for integer ``positions`` ``(T,)``: each ``(T, head_dim)``, float32
    (``(B, T, head_dim)`` for per-sequence positions ``(B, T)``).

    Rotate-half convention (as Hugging Face Llama / Qwen / Gemma): frequency ``j`` of ``head_dim / 2``
    is ``theta ** (-2j / head_dim)`` and is used by features ``j`` and ``j + head_dim / 2``; ``scaling``
    (a checked ``ModelConfig.rope_scaling``) rescales those frequencies (:func:`llama3_frequencies`).
    Computed in float32 on every call, so casting the model to bfloat16 does not coarsen the angles.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling is not None:  # ModelConfig accepts only rope_type "llama3"
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3's RoPE scaling of the frequencies ``inv_freq`` ``(head_dim / 2,)`` (float32, same shape).

    With ``L = original_max_position_embeddings``: a frequency whose wavelength ``2π / f`` exceeds
    ``L / low_freq_factor`` (it never turned once in pretraining) is divided by ``factor``; one whose wavelength
    is below ``L / high_freq_factor`` is kept; between the two, ``(1 - s) · f / factor + s · f`` with
    ``s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``. The operations are
    those of transformers' ``llama3`` rope type, in its order, so the angles agree to the last bit.
    """
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    too_long = wavelength > original / low
    stretched = torch.where(too_long, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    between = ~(wavelength < original / high) & ~too_long
    return torch.where(between, blended, stretched)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``x`` ``(B, H, T, D)`` by ``cos``, ``sin`` ``(T, D)`` or ``(B, T, D)``; returns x's shape
    and dtype."""
    if cos.dim() == 3:  # per-sequence positions: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def sliding_window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean attention mask ``(Tq, Tk)``, True where query ``t`` may see key ``s``: ``t - window < s <= t``."""
    distance = q_positions[:, None] - k_positions[None, :]
    return (distance >= 0) & (distance < window)


# ---- what the attention layers of one forward call share -------------------------------------------------

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionInputs:
    """The RoPE tables and masks of one forward call, for global and for sliding-window (local) layers.

    ``*_rope``: ``(cos, sin)``, each ``(T, head_dim)`` or, for per-sequence positions, ``(B, T, head_dim)``,
    float32 (see :func:`rope_cos_sin`); None with learned positions, and ``local_rope`` None without a window.
    ``*_mask``: boolean ``(T, P + T)`` or, with padding, ``(B, 1, T, P + T)``, True where a query may attend
    to a key; None means plain causal attention over the ``T`` new positions alone, which lets SDPA take its
    ``is_causal`` path instead of reading a mask.
    """

    global_rope: Rope | None = None
    local_rope: Rope | None = None
    global_mask: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None

    def for_layer(self, local: bool) -> tuple[Rope | None, torch.Tensor | None]:
        """``(rope, mask)`` for a sliding-window layer (``local``) or a global one."""
        return (self.local_rope, self.local_mask) if local else (self.global_rope, self.global_mask)


def attention_inputs(
    config: ModelConfig,
    positions: torch.Tensor,
    *,
    past: int = 0,
    attention_mask: torch.Tensor | None = None,
) -> AttentionInputs:
    """The RoPE tables and masks for ``T`` new tokens at ``positions`` after ``past`` cached ones.

    ``positions``: the tokens' positions for RoPE, LongTensor ``(T,)`` or ``(B, T)`` (left-padded batches give
    ``cumsum(attention_mask) - 1``). The masks do not depend on them: the new tokens are keys (and queries)
    ``past .. past + T - 1`` of the ``past + T`` keys, in cache order. ``attention_mask``: ``(B, past + T)``,
    nonzero for real tokens, 0 for padding, or None for none.

    - ``past == 0`` and nothing padded (an all-ones ``attention_mask`` counts as none): the full-sequence case.
      Global masks are None (causal SDPA); local layers get a ``(T, T)`` sliding-window mask, or None too
      when the window covers all ``T`` positions.
    - Otherwise the queries see keys up to their own slot: masks ``(T, past + T)``, and with padding
      ``(B, 1, T, past + T)`` where padding keys are hidden and a padding query sees only itself (so that no
      row is empty, which would give NaN).

    >>> from s2hc.models import get_preset
    >>> config = get_preset("tiny", sliding_window=2)
    >>> full = attention_inputs(config, torch.arange(3))
    >>> full.global_mask is None, full.local_mask.int().tolist(), full.global_rope[0].shape
    (True, [[1, 0, 0], [1, 1, 0], [0, 1, 1]], torch.Size([3, 32]))
    >>> step = attention_inputs(config, torch.tensor([3]), past=3)  # one new token after three cached ones
    >>> step.global_mask.int().tolist(), step.local_mask.int().tolist()
    ([[1, 1, 1, 1]], [[0, 0, 1, 1]])
    """
    device, T = positions.device, positions.shape[-1]
    total = past + T
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if bool(attention_mask.all()):
            attention_mask = None  # nothing padded: plain causal attention
    windowed = config.sliding_window is not None
    inputs = AttentionInputs()
    if config.pos == "rope":
        inputs.global_rope = rope_cos_sin(positions, config.head_dim, config.rope_theta, config.rope_scaling)
        if windowed:
            inputs.local_rope = rope_cos_sin(positions, config.head_dim, config.local_rope_theta, config.rope_scaling)
    slots = torch.arange(past, total, device=device)  # where the new tokens sit among the keys
    if past == 0 and attention_mask is None:
        if windowed and config.sliding_window < T:  # otherwise the window covers everything: plain causal
            inputs.local_mask = sliding_window_mask(slots, slots, config.sliding_window)
        return inputs
    keys = torch.arange(total, device=device)
    inputs.global_mask = keys[None, :] <= slots[:, None]  # (T, P + T)
    if windowed:
        inputs.local_mask = sliding_window_mask(slots, keys, config.sliding_window)
    if attention_mask is not None:
        # padding keys are hidden; a padding query attends to itself only, so no row is empty (no NaN)
        keep = attention_mask[:, None, None, :]
        self_only = (keys[None, :] == slots[:, None])[None, None]
        inputs.global_mask = (inputs.global_mask[None, None] & keep) | self_only
        if inputs.local_mask is not None:
            inputs.local_mask = (inputs.local_mask[None, None] & keep) | self_only
    return inputs


# ---- KV cache --------------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of every attention layer, for incremental decoding with :meth:`Transformer.forward`.

    Each layer's keys and values are ``(B, H_kv, T_seen, head_dim)`` tensors (after QK-norm and RoPE) that
    grow by the new positions on every call. The interface, ``get_seq_length()`` and ``update(key, value,
    layer_idx) -> (keys, values)``, is the one of Hugging Face's ``DynamicCache``, which the model accepts too.
    Sliding-window layers keep every key as well (the mask hides those outside the window), so every layer
    sees the same positions.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions stored so far (0 for an empty cache)."""
        if layer_idx >= len(self.keys) or self.keys[layer_idx] is None:
            return 0
        return self.keys[layer_idx].shape[-2]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None):
        """Append ``key``, ``value`` ``(B, H_kv, T_new, D)`` to layer ``layer_idx``; returns all keys and values."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is not None:
            key = torch.cat((self.keys[layer_idx], key), dim=-2)
            value = torch.cat((self.values[layer_idx], value), dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def select(self, index: torch.Tensor) -> None:
        """Keep only the sequences ``index`` (LongTensor of batch positions), in that order."""
        self.keys = [None if k is None else k.index_select(0, index) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, index) for v in self.values]

    def __len__(self) -> int:
        return len(self.keys)


# ---- sublayers -------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query heads, optional QK-norm, RoPE and a sliding window.

    ``forward(x, rope, mask, cache, layer)``: ``x`` ``(B, T, C)``, or three of them, the inputs of the query, key
    and value projections; ``rope`` ``(cos, sin)`` each ``(T, head_dim)``
    (or ``(B, T, head_dim)``) or None (learned positions); ``mask`` a boolean ``(T, T_keys)`` or
    ``(B, 1, T, T_keys)`` (True = attend) or None for plain causal attention. With a ``cache`` (see
    :class:`KVCache`) the new keys and values are appended to its layer ``layer`` and the queries attend over
    all of them. Returns ``(B, T, C)``. Projection, QK-norm and RoPE (:meth:`project`) are separate from the
    attention itself (:meth:`attend`); the cache sits between them.
    """

    def __init__(self, config: ModelConfig, local: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.local = local
        self.window = config.sliding_window if local else None
        # None lets SDPA use its default, head_dim ** -0.5.
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        dim, q_width, kv_width = config.dim, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(dim, q_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(dim, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(dim, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, dim, bias=config.out_bias)
        if config.qk_norm:  # RMSNorm over head_dim whatever config.norm is, as Qwen3 and Gemma3 do
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor] | None):
        """Queries ``(B, H, T, D)`` and keys, values ``(B, H_kv, T, D)`` for ``x`` ``(B, T, C)``, normed and rotated;
        ``x`` may be three ``(B, T, C)`` inputs, one each for the query, key and value projections (Inkling-2's
        three-query AttnRes read)."""
        x_q, x_k, x_v = x if isinstance(x, tuple) else (x, x, x)
        B, T, _ = x_q.shape
        q = self.q_proj(x_q).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x_k).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x_v).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of ``q`` ``(B, H, Tq, D)`` over ``k``, ``v`` ``(B, H_kv, Tk, D)``: returns ``(B, H, Tq, D)``.

        ``mask`` None means causal with ``Tq == Tk``. Key/value heads are repeated for grouped-query
        attention (head ``h`` reads key/value head ``h // (H / H_kv)``), which every SDPA backend accepts.
        """
        if self.n_kv_heads != self.n_heads:
            repeats = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        cache=None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, T, _ = (x[0] if isinstance(x, tuple) else x).shape
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.update(k, v, layer)
            expected = T if mask is None else mask.shape[-1]
            if k.shape[-2] != expected:
                raise ValueError(
                    f"the cache returned {k.shape[-2]} keys for layer {layer} where {expected} were expected; s2hc "
                    "models need a cache that keeps every position (s2hc.models.transformer.KVCache or a dynamic cache)"
                )
        y = self.attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """The feed-forward sublayer ``(B, T, C) -> (B, T, C)``: SwiGLU, GeGLU (tanh GELU) or a GELU MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kind = config.mlp
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=config.mlp_bias) if self.gated else None
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=config.mlp_bias)

    @property
    def gated(self) -> bool:
        return self.kind in ("swiglu", "geglu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


#: The default of activation checkpointing: PyTorch's non-reentrant checkpoint, which takes inputs that need no
#: gradient, keyword arguments and nested tensors (the RoPE tables), and composes with ``torch.compile``.
checkpoint_block = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


class Block(nn.Module):
    """One layer: an attention sublayer and an MLP sublayer, each inside its own hyper-connection.

    ``forward(x, rope, mask, cache)``: streams ``x`` ``(B, T, n, C)`` -> ``(B, T, n, C)``. Both connections get
    ``layer_index = layer``, as in the s²HC authors' code (the block index for both sublayers), so both start
    favouring stream ``layer mod n``; the attention uses layer ``layer`` of ``cache``. With
    ``family="gated-residual"`` the connections are :class:`s2hc.GatedResidual` and the pre-norms None. Where the
    form hands the attention three inputs (``attention_inputs``: AttnRes's ``qkv_reads``) the attention's query,
    key and value projections read one each, through ``attn_norm``, ``attn_k_norm`` and ``attn_v_norm``.

    Activation checkpointing (:meth:`Transformer.set_activation_checkpointing`): with ``gradient_checkpointing``
    True, a forward in training mode with gradients enabled and no ``cache`` keeps only the block's input and
    runs the block again during the backward pass, through ``_gradient_checkpointing_func(function, *args)``
    (default :data:`checkpoint_block`). The names are the ones transformers' ``gradient_checkpointing_enable``
    sets on every module that has them. The checkpoint is inside ``forward``, so hooks on the block (FSDP2's
    all-gathers) run once, and a compiled block (``block.compile()``) compiles the checkpoint with it. Evaluation,
    ``torch.no_grad()`` and decoding with a cache (which a second run would append to twice) run as usual.

    ``ran_compiled``: whether the block's last call ran as a compiled graph (True) or eagerly (False; None before
    its first call). A compiled block (``block.compile()``) runs eagerly where dynamo gave up on it (its
    recompile limit reached); :class:`s2hc.train.compiling.CompileWatch` reads this to say so.
    """

    gradient_checkpointing: bool = False
    _gradient_checkpointing_func: Callable[..., Any] | None = None

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.local = layer, config.is_local_layer(layer)
        form, options = forms.get(config.family), dict(family=config.family, **config.family_options)
        pre_norms = form.pre_norms  # the gated residual's read is normalised already
        self.attn_norm = make_norm(config) if pre_norms else None
        # A form may hand the attention three inputs (AttnRes's qkv_reads: query, key and value), each its own norm.
        inputs = form.attention_inputs(config.family_options, local=self.local)
        if inputs not in (1, 3):
            raise ValueError(f"family {config.family!r} hands the attention {inputs} inputs; it takes 1 or 3 "
                             "(query, key and value)")
        self.attention_inputs = inputs
        self.attn_k_norm = make_norm(config) if pre_norms and inputs == 3 else None
        self.attn_v_norm = make_norm(config) if pre_norms and inputs == 3 else None
        self.attn = Attention(config, local=self.local)
        self.attn_post_norm = make_norm(config) if config.post_norms else None
        self.mlp_norm = make_norm(config) if pre_norms else None
        self.mlp = MLP(config)
        self.mlp_post_norm = make_norm(config) if config.post_norms else None
        sublayers = {"n_sublayers": 2 * config.n_layers}  # attention 2·layer, MLP 2·layer + 1 (AttnRes counts them)
        self.attn_hc = build_connection(config.dim, config.n_streams, layer_index=layer, sublayer=2 * layer,
                                        **sublayers, **options,
                                        **form.sublayer_options(config.family_options, 2 * layer, local=self.local))
        self.mlp_hc = build_connection(config.dim, config.n_streams, layer_index=layer, sublayer=2 * layer + 1,
                                       **sublayers, **options)
        self.ran_compiled: bool | None = None

    def attention_branch(self, h: torch.Tensor, rope=None, mask=None, cache=None) -> torch.Tensor:
        """Pre-norm (if any), attention, optional post-norm: ``(B, T, C) -> (B, T, C)``."""
        y = self.attn(h if self.attn_norm is None else self.attn_norm(h), rope, mask, cache, self.layer)
        return y if self.attn_post_norm is None else self.attn_post_norm(y)

    def qkv_attention_branch(self, h_q: torch.Tensor, h_k: torch.Tensor, h_v: torch.Tensor, rope=None, mask=None,
                             cache=None) -> torch.Tensor:
        """The attention of three inputs (query, key and value: AttnRes's ``qkv_reads``), each through its own
        pre-norm (Inkling-2's ``q/k/v_input_layernorm``): three ``(B, T, C)`` -> ``(B, T, C)``."""
        if self.attn_norm is not None:  # built with the other two
            h_q, h_k, h_v = self.attn_norm(h_q), self.attn_k_norm(h_k), self.attn_v_norm(h_v)
        y = self.attn((h_q, h_k, h_v), rope, mask, cache, self.layer)
        return y if self.attn_post_norm is None else self.attn_post_norm(y)

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm (if any), MLP, optional post-norm: ``(B, T, C) -> (B, T, C)``."""
        y = self.mlp(h if self.mlp_norm is None else self.mlp_norm(h))
        return y if self.mlp_post_norm is None else self.mlp_post_norm(y)

    def forward(self, x: torch.Tensor, rope=None, mask=None, cache=None) -> torch.Tensor:
        # True only in a graph dynamo traced (a side effect it replays after the graph, guarding on nothing)
        self.ran_compiled = torch.compiler.is_compiling()
        if self.gradient_checkpointing and cache is None and self.training and torch.is_grad_enabled():
            checkpoint = self._gradient_checkpointing_func or checkpoint_block
            if isinstance(x, tuple):  # AttnRes's sources, each an argument of its own: a reentrant checkpoint
                return checkpoint(self._forward_sources, rope, mask, *x)  # sees only tensors passed directly
            return checkpoint(self._forward, x, rope, mask)
        return self._forward(x, rope, mask, cache)

    def _forward_sources(self, rope, mask, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._forward(sources, rope, mask)

    def _forward(self, x: torch.Tensor, rope=None, mask=None, cache=None) -> torch.Tensor:
        """The block itself (what :meth:`forward` checkpoints): ``(B, T, n, C) -> (B, T, n, C)``."""
        attention = self.attention_branch if self.attention_inputs == 1 else self.qkv_attention_branch
        x = self.attn_hc(x, attention, rope, mask, cache)
        return self.mlp_hc(x, self.mlp_branch)


# ---- the model -------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Decoder-only language model built from a :class:`ModelConfig`.

    ``forward(input_ids)``: LongTensor ``(B, T)`` with ``T <= config.max_seq_len`` -> logits ``(B, T, vocab_size)``
    in the dtype of the parameters (or of autocast).

    Keyword-only, for decoding: ``cache`` (a :class:`KVCache`, or Hugging Face's ``DynamicCache``) holding the
    ``P`` positions seen so far: ``input_ids`` are positions ``P .. P + T - 1`` and the cache grows by them;
    ``attention_mask`` ``(B, P + T)``, 1 for real tokens and 0 for padding (keys at padding are never attended
    to); ``position_ids`` ``(B, T)``, each token's position for RoPE or the learned table (default
    ``P .. P + T - 1``; give ``cumsum(attention_mask) - 1`` for left-padded batches).

    Either way the RoPE tables and masks come from :func:`attention_inputs` and the blocks run in
    :meth:`run_blocks`, so subclasses that change the streams' layout reuse both.

    ``init_rng`` / ``init_seed``: where the random initial values come from (:mod:`s2hc.init_rng`).
    ``"per_parameter"`` (default): each parameter from a generator seeded by (``init_seed``, its qualified name,
    its distribution), ``init_seed`` one draw of torch's global generator when not given, so that models of two
    configurations built with one seed share every parameter they both have. ``"sequential"``: torch's global
    generator in module order (``init_seed`` unused).
    """

    def __init__(self, config: ModelConfig, *, init_rng: str = DEFAULT_INIT_RNG, init_seed: int | None = None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.init_rng = check_init_rng(init_rng)
        # The seed of every parameter's own generator (per parameter; one draw of the global one when not given).
        self.init_seed = None
        if init_rng == "per_parameter":
            self.init_seed = random_seed() if init_seed is None else check_int("init_seed", init_seed, minimum=0)
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embed = nn.Embedding(config.max_seq_len, config.dim) if config.pos == "learned" else None
        self.stream_scale = None
        if config.lss_init is not None:
            self.stream_scale = StreamScaling(config.dim, config.n_streams, init=config.lss_init)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.stream_head = None
        if config.stream_reduce == "head":  # the form's learned read: HyperHead, Qwen's gated read, AttnRes's query
            self.stream_head = self.form.build_head(config.dim, config.n_streams, norm_eps=config.norm_eps,
                                                    options=config.family_options)
        # Qwen's gated read is normalised (its own RMSNorm with 1 + w): the model has no final norm after it.
        self.norm = nn.Identity() if self.form.replaces_final_norm(config.stream_reduce) else make_norm(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if self.init_seed is not None:  # the connections', the head's and LSS's draws, each from its own generator
            redraw(self, self.init_seed)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every weight except the hyper-connections' and the :class:`s2hc.HyperHead`'s (they keep
        theirs, docs/design.md section 1), as ``config.weight_init`` says (C = ``dim``, L = ``n_layers``):

        - ``"gpt2"`` (default): linear and embedding weights ~ N(0, init_std²); the residual output projections
          (attention ``o_proj``, MLP ``down_proj``) ~ N(0, (init_std / sqrt(2L))²), as in GPT-2.
        - ``"neox"``, the s²HC authors' ``initialize_weights`` (``litgpt/pretrain.py``): linear and embedding
          weights (the untied LM head's too, an ``nn.Linear`` there) ~ N(0, 2 / (5C)); ``o_proj`` and
          ``down_proj`` ~ N(0, (1 / (sqrt(C) · L))²). ``init_std`` is not used.

        Either way biases are 0 and norms the identity (weight 1, or 0 for Gemma's ``1 + w`` RMSNorm; LayerNorm
        bias 0). The random weights come from ``init_rng`` (:mod:`s2hc.init_rng`): each from its own
        generator (``"per_parameter"``, the same values on every call) or from torch's global one in module order
        (``"sequential"``).
        """
        for name, draw in self._weight_draws().items():
            generator = None if self.init_seed is None else parameter_generator(self.init_seed, name, draw.kind)
            draw.fill_(self.get_parameter(name), generator)
        linears = [self.lm_head] if not self.config.tie_embeddings else []
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, attn.o_proj, mlp.down_proj]
            for norm in (block.attn_norm, block.attn_k_norm, block.attn_v_norm, block.attn_post_norm,
                         block.mlp_norm, block.mlp_post_norm, attn.q_norm, attn.k_norm):  # fmt: skip
                if norm is not None:
                    norm.reset_parameters()
        for linear in linears:
            if linear is not None and linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if not isinstance(self.norm, nn.Identity):
            self.norm.reset_parameters()

    def _weight_draws(self) -> dict[str, Draw]:
        """The random weights :meth:`init_weights` draws, by qualified name, in the order the sequential draw takes
        them (embeddings, then block by block q, k, v, gate, up, o, down, then an untied LM head)."""
        std, out_std = self._weight_stds()
        draws = {"embed.weight": Draw("normal", std)}
        if self.pos_embed is not None:
            draws["pos_embed.weight"] = Draw("normal", std)
        for index, block in enumerate(self.blocks):
            branches = {"attn": block.attn, "mlp": block.mlp}
            for branch, proj, sigma in (("attn", "q_proj", std), ("attn", "k_proj", std), ("attn", "v_proj", std),
                                        ("mlp", "gate_proj", std), ("mlp", "up_proj", std),
                                        ("attn", "o_proj", out_std), ("mlp", "down_proj", out_std)):
                if getattr(branches[branch], proj) is not None:
                    draws[f"blocks.{index}.{branch}.{proj}.weight"] = Draw("normal", sigma)
        if not self.config.tie_embeddings:
            draws["lm_head.weight"] = Draw("normal", std)
        return draws

    def _weight_stds(self) -> tuple[float, float]:
        """``(std, out_std)`` of :meth:`init_weights`: every linear and embedding weight, and the residual output
        projections."""
        config = self.config
        if config.weight_init == "neox":
            return math.sqrt(2.0 / (5.0 * config.dim)), 1.0 / (math.sqrt(config.dim) * config.n_layers)
        return config.init_std, config.init_std / math.sqrt(2 * config.n_layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (shared ones counted once), hyper-connections included.

        ``exclude_embeddings`` leaves out the token and learned-position embedding tables, and with them
        a tied LM head; an untied LM head still counts.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.weight.numel()
            if self.pos_embed is not None:
                total -= self.pos_embed.weight.numel()
        return total

    def set_activation_checkpointing(
        self,
        enabled: bool = True,
        *,
        every_n_layers: int = 1,
        checkpoint_fn: Callable[..., Any] | None = None,
    ) -> None:
        """Checkpoint whole blocks (``enabled``) or stop (``enabled=False``): a checkpointed block keeps only its
        input streams ``(B, T, n, C)`` for the backward pass and runs again there, trading one more forward of
        each block for the activations inside it (attention, MLP, the connections' matrices). Only forwards in
        training mode with gradients enabled and no cache are checkpointed (see :class:`Block`); the values and
        gradients are those of the plain model.

        ``every_n_layers``: checkpoint blocks ``0, k, 2k, ...`` only (default every block). ``checkpoint_fn``:
        called as ``checkpoint_fn(function, *args)`` in place of :data:`checkpoint_block` (non-reentrant
        ``torch.utils.checkpoint.checkpoint``), e.g. one with other keyword arguments.
        transformers' ``gradient_checkpointing_enable()`` on :class:`s2hc.hf.S2HCForCausalLM` lands here.
        """
        every_n_layers = check_int("every_n_layers", every_n_layers)
        if checkpoint_fn is not None and not callable(checkpoint_fn):
            raise ValueError(f"checkpoint_fn must be callable or None, got {type(checkpoint_fn).__name__}")
        for index, block in enumerate(self.blocks):
            block.gradient_checkpointing = bool(enabled) and index % every_n_layers == 0
            block._gradient_checkpointing_func = checkpoint_fn

    @property
    def activation_checkpointing(self) -> bool:
        """Whether any block is checkpointed (:meth:`set_activation_checkpointing`)."""
        return any(block.gradient_checkpointing for block in self.blocks)

    def num_connection_params(self) -> int:
        """Number of parameters of the connections (:class:`s2hc.HyperConnection` or :class:`s2hc.GatedResidual`),
        the learned head and the stream scaling (0 for ``family="residual"``). The parameters themselves:
        :meth:`hyper_connection_parameters`.
        """
        return sum(p.numel() for p in self.hyper_connection_parameters())

    def num_hc_params(self) -> int:
        """Deprecated name of :meth:`num_connection_params` ("hc" alone names the HC family)."""
        warnings.warn("Transformer.num_hc_params() is deprecated; use num_connection_params()", DeprecationWarning,
                      stacklevel=2)
        return self.num_connection_params()

    def hyper_connection_parameters(self) -> list[nn.Parameter]:
        """The parameters of every connection, of the learned head and of the stream scaling (empty for
        ``family="residual"``), e.g. for an optimiser group of their own; :meth:`init_weights` never touches
        them."""
        return [p for module in self.modules() if isinstance(module, ConnectionModule) for p in module.parameters()]

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor of shape (batch, time), got {shape}")
        if cache is not None or attention_mask is not None or position_ids is not None:
            return self._forward_incremental(input_ids, cache, attention_mask, position_ids)
        T = input_ids.shape[1]
        if self.config.max_seq_len < T:
            raise ValueError(f"input_ids has {T} positions, more than max_seq_len={self.config.max_seq_len}")
        positions = torch.arange(T, device=input_ids.device)
        h = self._embed(input_ids, positions)
        x = self.run_blocks(self.expand_streams(h), attention_inputs(self.config, positions))
        return self.lm_head(self.norm(self.reduce_streams(x)))

    @property
    def form(self) -> forms.ConnectionForm:
        """The connection form of the model's family (:mod:`s2hc.connection.forms`)."""
        return forms.get(self.config.family)

    def expand_streams(self, h: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(B, T, C)`` -> streams ``(B, T, n, C)``: n copies, times the learned stream scaling when
        ``lss_init`` is set (the form's :meth:`~s2hc.connection.forms.ConnectionForm.expand`: AttnRes's state is
        the tuple ``(h,)``)."""
        x = self.form.expand(h, self.config.n_streams)
        return x if self.stream_scale is None else self.stream_scale(x)

    def reduce_streams(self, x: torch.Tensor) -> torch.Tensor:
        """Streams ``(B, T, n, C)`` -> ``(B, T, C)``: their sum, their mean with ``stream_reduce="mean"``, or
        the learned head's read with ``stream_reduce="head"`` (:class:`s2hc.HyperHead`'s weighted sum,
        :class:`s2hc.GatedHead`'s gated read, or AttnRes's output query over its sources)."""
        if self.stream_head is not None:
            return self.stream_head(x)
        return self.form.reduce(x, mean=self.config.stream_reduce == "mean")

    def run_blocks(self, x: torch.Tensor, inputs: AttentionInputs, cache=None) -> torch.Tensor:
        """Every block in order on streams ``x`` ``(B, T, n, C)`` (or the layout the blocks' connections take,
        e.g. the benchmark peer's ``(B · n, T, C)``), each layer with its ``(rope, mask)`` from ``inputs``
        (:func:`attention_inputs`) and, when decoding, appending its keys and values to ``cache``; returns
        ``x``'s shape.
        """
        # Each block is called as a module, so blocks compiled in place (block.compile()) run compiled.
        for block in self.blocks:
            x = block(x, *inputs.for_layer(block.local), cache)
        return x

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (scaled for Gemma) plus learned positions ``(T,)`` or ``(B, T)``: ``(B, T, C)``."""
        h = self.embed(input_ids)
        if self.config.embed_scale:  # scale rounded to the embedding's dtype, as Gemma does
            # a 0-dim CPU tensor: the kernel reads it as a scalar; made on the GPU it would be a blocking copy (a sync)
            h = h * torch.tensor(self.config.dim**0.5, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed(positions)
        return h

    def _forward_incremental(self, input_ids, cache, attention_mask, position_ids) -> torch.Tensor:
        """``forward`` with a cache, a padding mask or explicit positions (see the class docstring)."""
        config, device = self.config, input_ids.device
        B, T = input_ids.shape
        past = 0 if cache is None else int(cache.get_seq_length())
        total = past + T
        if total > config.max_seq_len:
            raise ValueError(
                f"{past} cached + {T} new positions = {total}, more than max_seq_len={config.max_seq_len}"
            )
        if attention_mask is not None and attention_mask.shape != (B, total):
            raise ValueError(
                f"attention_mask must have shape (batch, cached + new positions) = {(B, total)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            positions = torch.arange(past, total, device=device)
        else:
            if tuple(position_ids.shape) not in ((B, T), (1, T), (T,)):
                raise ValueError(
                    f"position_ids must have shape (batch, time) = {(B, T)}, got {tuple(position_ids.shape)}"
                )
            positions = position_ids.to(device=device, dtype=torch.long)
            if positions.dim() == 2 and positions.shape[0] == 1:
                positions = positions[0]
        h = self._embed(input_ids, positions)
        inputs = attention_inputs(config, positions, past=past, attention_mask=attention_mask)
        x = self.run_blocks(self.expand_streams(h), inputs, cache)
        return self.lm_head(self.norm(self.reduce_streams(x)))

    def extra_repr(self) -> str:
        c = self.config
        return f"family={c.family!r}, n_streams={c.n_streams}, params={self.num_params() / 1e6:.2f}M"
