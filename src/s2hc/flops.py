"""Model FLOPs per token, counted analytically from a :class:`~s2hc.models.ModelConfig`, and the peak a run's
device reaches: what the study's MFU divides (docs/study.md, "Verdicts at equal cost").

:func:`model_flops` counts one forward pass per token of a sequence of ``seq_len`` tokens, in parts: the
attention projections, the attention scores (``QKᵀ`` and ``PV``), the MLP, the norms, the LM head, the connections
(every sublayer's, :func:`connection_flops`), the streams (expansion, learned scaling, the reduction or learned
head) and the embedding. Each part is split in two:

- ``matmul``: the products (``2·m·k·n`` FLOPs for an ``(m, k) @ (k, n)`` product), exactly those that
  ``torch.utils.flop_counter.FlopCounterMode`` counts on the model's default path (``mm``, ``addmm``, ``bmm`` and
  scaled dot-product attention; ``tests/test_flops.py`` checks the two agree exactly). The attention scores are
  counted dense, ``4·T·H·D`` per token and layer, as the kernels compute them and as PaLM's MFU counts them (the
  causal half is not subtracted, a sliding window not either).
- ``elementwise``: an approximate count of the rest, one FLOP per element and operation (a transcendental
  function counts one): norms, activations, softmax, RoPE, biases, the connections' gates, their constraint
  maps (Sinkhorn's rounds, softmaxes, tanh), the write ``H_res X + H_postᵀ F``. It also holds the small solvers
  torch counts no matmul for (the Cayley chart's solve for rotations of 5 streams or more, the matrix exponential
  of ``rotation="expm"``), as approximate multiply-add counts. FlopCounterMode counts none of it.

Training FLOPs are 3 × forward (the backward pass is twice the forward's products), the usual convention of
model FLOPs: recomputation (activation checkpointing, ``recompute``) is not counted, so MFU does not reward it.
The loss (cross-entropy over the vocabulary) is left out, as FlopCounterMode leaves it out of a forward.

:func:`connection_flops` counts one connection (the one around one sublayer) per token, by connection form
(:mod:`s2hc.connection.forms`), through :data:`CONNECTION_FORMS`: a function per form class (the residual, the
hyper-connection of every mixing family, the gated residual, AttnRes, whose count grows with the sources a sublayer
reads, and the wide residual), so that a new form is one more entry; a form without one is refused by name. The
hyper-connection's constraint maps are counted by mixer class through :data:`CONSTRAINT_MAPS`.

Peaks (:func:`peak_flops`): :data:`PEAK_FLOPS`, NVIDIA's dense bfloat16 tensor-core peaks of known GPUs (their
data sheets give the figure with 2:4 sparsity, twice the dense one), found by name in the device a run's platform
record names; on a CPU, what :func:`measure_matmul_peak` measured when the run started (a float32 matmul, median
of repetitions), written into that record.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import mixers
from .connection import forms
from .connection.forms.attn_res import AttnResForm, block_size_for
from .connection.forms.gated_residual import GatedResidualForm
from .connection.forms.hyper import HyperConnectionForm
from .connection.forms.residual import ResidualForm
from .connection.forms.wide_residual import WideResidualForm
from .connection.gated import GATED_RESIDUAL_OPTIONS
from .mixers.hc import HCMixer
from .mixers.identity import IdentityMixer
from .mixers.isometric import IsometricMixer
from .mixers.kromhc import KromHCMixer
from .mixers.mhc import MHCMixer
from .mixers.mhc_lite import MHCLiteMixer
from .mixers.orthogonal import OrthogonalMixer
from .mixers.s2hc import S2HCMixer

__all__ = [
    "CONNECTION_FORMS", "CONSTRAINT_MAPS", "FLOPS_VERSION", "PEAK_FLOPS", "connection_flops", "measure_matmul_peak",
    "model_flops", "peak_flops",
]  # fmt: skip

#: The version of :func:`model_flops`'s dict (a row of a study records it).
FLOPS_VERSION = 1
#: The connection's own keywords (s2hc.models.model_config.CONNECTION_OPTIONS) and HyperHead's ``hc_eps``: they
#: change no count.
_NO_COUNT_OPTIONS = ("eps", "transpose_res", "projection_init", "gate_init")

Count = dict[str, int]


def _count(matmul: float = 0, elementwise: float = 0) -> Count:
    return {"matmul": int(round(matmul)), "elementwise": int(round(elementwise))}


def _add(*counts: Count) -> Count:
    return {"matmul": sum(c["matmul"] for c in counts), "elementwise": sum(c["elementwise"] for c in counts)}


def _scale(count: Count, factor: int) -> Count:
    return {key: value * factor for key, value in count.items()}


# ------------------------------------------------------------------------------------------ constraint maps


def _rotation(m: int, rotation: str = "cayley") -> Count:
    """One per-token rotation in SO(m) from m(m−1)/2 inputs (:class:`s2hc.mixers.orthomaps.Rotation`)."""
    k = m * (m - 1) // 2
    gate = 4 * k + k  # γ · tanh(α d + b), and the skew matrix's lower triangle
    if m <= 1:
        return _count(0, gate)
    if rotation == "expm":  # torch's matrix exponential: a degree-18 Taylor/Padé form, ~8 m³ products (approximate)
        return _count(0, gate + 8 * 2 * m**3)
    square = 2 * m**3  # the chart computes A² (a product) at every size
    if m <= 4:  # the closed form: ‖A‖², the combination (and at m = 4 the Pfaffian and the dual)
        return _count(square, gate + 2 * m * m + 6 * m * m + (20 if m == 4 else 0))
    # a batched solve (I + A) Q = I − A: LU (2m³/3) and m triangular solves (2m³), approximate
    return _count(square, gate + 2 * m * m + 8 * m**3 // 3)


def _zero_sum_frame(n: int) -> Count:
    """``I + U_Z (M − I) U_Zᵀ`` (s2hc, isometric): a batched ``(n, m) @ (m, m)`` and an ``(n, m) @ (m, n)``."""
    m = n - 1
    return _count(2 * n * m * m + 2 * n * m * n, m * m + n * n)


def _identity_map(n: int, **options: Any) -> tuple[int, Count]:
    return 0, _count()


def _hc_map(n: int, alpha: float = 0.01, projection: str = "per-stream", **options: Any) -> tuple[int, Count]:
    return n * n, _count(0, 3 * n * n)  # B + α tanh(d)


def _mhc_map(n: int, iterations: int = 20, variant: str = "paper", **options: Any) -> tuple[int, Count]:
    logits = 2 * n * n
    if variant == "deepseek-v4":  # a softmax + ε, then 2 (t − 1) + 1 normalisations (sum, + ε, divide)
        rounds = 5 * n * n + (2 * (iterations - 1) + 1) * (2 * n * n + n)
    else:  # 2t log-domain normalisations (max, subtract, exp, sum, log, add, subtract), then exp
        rounds = 2 * iterations * (5 * n * n + 2 * n) + n * n
    return n * n, _count(0, logits + rounds)


def _permutation_mixture(p: int) -> Count:
    """``softmax(α d + b) @ P``: the logits and softmax of p! inputs, a ``(p!) @ (p!, p²)`` product."""
    k = math.factorial(p)
    return _count(2 * k * p * p, 2 * k + 4 * k)


def _mhc_lite_map(n: int, **options: Any) -> tuple[int, Count]:
    return math.factorial(n), _permutation_mixture(n)


def _kromhc_map(n: int, **options: Any) -> tuple[int, Count]:
    factors = KromHCMixer.permutation_sizes(n)  # one mixture per prime factor of n, as the class declares
    counts, size = [_permutation_mixture(p) for p in factors], factors[0] if factors else 1
    for p in factors[1:]:  # the Kronecker products: an outer product (elementwise), size² · p² entries
        counts.append(_count(0, (size * p) ** 2))
        size *= p
    return sum(math.factorial(p) for p in factors), _add(_count(), *counts)


def _s2hc_map(n: int, rotation: str = "cayley", **options: Any) -> tuple[int, Count]:
    m = n - 1
    spectrum = _count(0, 3 * m + m * m)  # tanh(α d + b), then U · diag(s)
    core = _count(2 * m**3)  # (U diag(s)) Vᵀ
    return m * m, _add(_rotation(m, rotation), _rotation(m, rotation), spectrum, core, _zero_sum_frame(n))


def _isometric_map(n: int, rotation: str = "cayley", **options: Any) -> tuple[int, Count]:
    m = n - 1
    core = _count(2 * m**3)  # U Vᵀ
    return m * (m - 1), _add(_rotation(m, rotation), _rotation(m, rotation), core, _zero_sum_frame(n))


def _orthogonal_map(n: int, rotation: str = "cayley", **options: Any) -> tuple[int, Count]:
    return n * (n - 1) // 2, _rotation(n, rotation)


#: Each mixing family's constraint map ``d_res (K) -> H_res (n × n)``, by its class:
#: ``(n, **family_options) -> (K, count)``.
CONSTRAINT_MAPS: dict[type[mixers.Mixer], Callable[..., tuple[int, Count]]] = {
    IdentityMixer: _identity_map,
    HCMixer: _hc_map,
    MHCMixer: _mhc_map,
    MHCLiteMixer: _mhc_lite_map,
    KromHCMixer: _kromhc_map,
    S2HCMixer: _s2hc_map,
    IsometricMixer: _isometric_map,
    OrthogonalMixer: _orthogonal_map,
}


def _constraint_map(family: str, n: int, **options: Any) -> tuple[int, Count]:
    return CONSTRAINT_MAPS[mixers.get(family)](n, **options)


# ------------------------------------------------------------------------------------------ connection forms


def _residual(family: str, dim: int, n_streams: int, sublayer: int, n_sublayers: int, **options: Any) -> Count:
    """``x + F(x)``: one add per channel."""
    return _count(0, dim)


def _hyper_connection(family: str, dim: int, n: int, sublayer: int, n_sublayers: int, **options: Any) -> Count:
    """:class:`s2hc.HyperConnection` of a mixing family: the coefficient path (RMSNorm over n·C, the projection
    ``nC × (2n + K)``, the gates, the constraint map), the read ``H_pre X`` (n·C), the mixing ``H_res X`` (n²·C)
    and the write ``H_res X + H_postᵀ F`` (2·n·C, elementwise). HC's ``projection="per-stream"``: each stream normed
    over C and projected by ``C × (2 + n)``."""
    K, constraint = _constraint_map(family, n, **options)
    width = n * dim
    if mixers.get(family).projects_per_stream(**options):  # HC's per-stream projection
        projection = _count(2 * n * dim * (2 + n), 4 * width)
    else:
        projection = _count(2 * width * (2 * n + K), 4 * width)  # RMSNorm over nC (square, sum, scale, weight)
    gates = _count(0, 3 * n + 4 * n)  # H_pre = σ(α d + b), H_post = 2σ(α d + b)
    apply = _count(2 * width + 2 * n * width, 2 * width)  # the read and the mixing (products), the write
    return _add(projection, gates, constraint, apply)


def _gated_read(dim: int, n: int, rank: int) -> Count:
    """:class:`s2hc.GatedHead`: every stream normed over C (times 1 + w), the read gates
    ``σ(W_up silu(W_down x̃ / n))`` (two rank-r products) and ``h = mean_s G_s ⊙ x̃_s``."""
    width = n * dim
    return _count(2 * width * rank * 2, 5 * width + 3 * rank + 2 * width + 2 * width)


def _gated_residual(family: str, dim: int, n: int, sublayer: int, n_sublayers: int,
                    rank: int = GATED_RESIDUAL_OPTIONS["rank"], **options: Any) -> Count:
    """:class:`s2hc.GatedResidual`: the gated read, the write gates ``2σ(W_w x̃ / n)`` (an ``nC × n`` product) and
    ``X + p F(h)ᵀ`` (2·n·C)."""
    width = n * dim
    return _add(_gated_read(dim, n, rank), _count(2 * width * n, 3 * n + 2 * width))


def _depth_read(dim: int, sources: int) -> Count:
    """One AttnRes softmax read over ``sources`` sources: per source its dot with the query (``2C``; a
    matrix-vector product, which FlopCounterMode does not count, so it is counted with the elementwise part), its
    mean square and scale (``3C`` + 2), the softmax (5 per source) and the weighted sum (``2C``)."""
    return _count(0, sources * (2 * dim + 3 * dim + 2 + 5 + 2 * dim))


def _sources(sublayer: int, block_size: int) -> int:
    """The sources AttnRes's ``sublayer`` reads: the embedding and one per block begun before it."""
    return 1 + math.ceil(sublayer / block_size)


def _attn_res(family: str, dim: int, n: int, sublayer: int, n_sublayers: int, variant: str = "block",
              block_size: int | None = None, **options: Any) -> Count:
    """:class:`~s2hc.connection.forms.AttnResConnection` at ``sublayer``: its softmax read over its sources, and the
    output added to the current block (or appended as a new one: no FLOP)."""
    size = block_size_for(variant, block_size, n_sublayers)
    return _add(_depth_read(dim, _sources(sublayer, size)), _count(0, dim if sublayer % size else 0))


def _wide_residual(family: str, dim: int, n: int, sublayer: int, n_sublayers: int, **options: Any) -> Count:
    """:class:`~s2hc.connection.forms.WideResidual`: the read ``nC -> C`` and the write ``C -> nC`` (products) and the
    add (``nC``)."""
    return _count(2 * n * dim * dim * 2, n * dim)


#: Each connection form, by its class: ``(family, dim, n_streams, sublayer, n_sublayers, **family_options) ->
#: {"matmul", "elementwise"}`` per token.
CONNECTION_FORMS: dict[type[forms.ConnectionForm], Callable[..., Count]] = {
    ResidualForm: _residual,
    HyperConnectionForm: _hyper_connection,
    GatedResidualForm: _gated_residual,
    AttnResForm: _attn_res,
    WideResidualForm: _wide_residual,
}


def connection_flops(family: str, dim: int, n_streams: int, *, sublayer: int = 0, n_sublayers: int = 1,
                     **family_options: Any) -> Count:
    """Forward FLOPs per token of one connection of ``family`` (around sublayer ``sublayer`` of ``n_sublayers``;
    only AttnRes's count depends on where) with streams of width ``dim``: ``{"matmul", "elementwise"}`` (see the
    module). ``family_options`` as a model's (the connection's own keywords, ``eps`` and the like, change nothing);
    ValueError for a family no form counts."""
    form = forms.get(family)
    if type(form) not in CONNECTION_FORMS:
        raise ValueError(f"no FLOP count for the connection form of {family!r} ({type(form).__name__}); counted: "
                         f"{[kind.__name__ for kind in CONNECTION_FORMS]}")
    options = {k: v for k, v in family_options.items() if k not in _NO_COUNT_OPTIONS}
    return CONNECTION_FORMS[type(form)](family, dim, n_streams, sublayer, n_sublayers, **options)


def projection_inputs(family: str, n_streams: int, **family_options: Any) -> int:
    """K, the constraint map's inputs per token of a mixing family (what :func:`connection_flops` counts with)."""
    options = {k: v for k, v in family_options.items() if k not in _NO_COUNT_OPTIONS}
    return _constraint_map(family, n_streams, **options)[0]


# ------------------------------------------------------------------------------------------------ the model


def _norm(config, dim: int) -> int:
    """An RMSNorm (square, sum, scale, weight) or a LayerNorm (mean, subtract, square, sum, scale, weight, bias)."""
    return (7 if config.norm == "layernorm" else 4) * dim


def model_flops(config, seq_len: int) -> dict[str, Any]:
    """Forward and training FLOPs per token of the model ``config`` (a :class:`~s2hc.models.ModelConfig`) on
    sequences of ``seq_len`` tokens (see the module): ``parts`` (each ``{"matmul", "elementwise"}``),
    ``forward_matmul_per_token``, ``forward_elementwise_per_token``, ``forward_per_token`` (their sum),
    ``train_per_token`` (3 × forward) and ``train_matmul_per_token``."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    C, L, T, V = config.dim, config.n_layers, seq_len, config.vocab_size
    H, Hkv, D, F = config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
    n, family, form = config.n_streams, config.family, forms.get(config.family)
    q_width, kv_width = H * D, Hkv * D
    projections = _count(2 * C * (q_width + 2 * kv_width) + 2 * q_width * C,
                         (q_width + 2 * kv_width) * config.qkv_bias + C * config.out_bias
                         + (3 * D * (H + Hkv) if config.pos == "rope" else 0)
                         + (4 * D * (H + Hkv) if config.qk_norm else 0))  # QK-norm: an RMSNorm per head
    scores = _count(4 * T * H * D, 5 * T * H)  # QKᵀ and PV, dense; scale, max, subtract, exp, sum and divide
    mlp_products = 3 if config.mlp in ("swiglu", "geglu") else 2
    activation = 3 * F if mlp_products == 3 else 2 * F  # silu / tanh-GELU and the gate's product
    mlp = _count(mlp_products * 2 * C * F, activation + (F * (mlp_products - 1) + C) * config.mlp_bias)
    norms_per_layer = 2 * form.pre_norms + 2 * config.post_norms
    head_reads = config.stream_reduce == "head"
    final_norm = 0 if form.replaces_final_norm(config.stream_reduce) else _norm(config, C)
    norms = _count(0, L * norms_per_layer * _norm(config, C) + final_norm)
    connection = _add(*(connection_flops(family, C, n, sublayer=j, n_sublayers=2 * L, **config.family_options)
                        for j in range(2 * L)))
    state = n  # tensors the last block hands on: n streams, or AttnRes's sources
    if isinstance(form, AttnResForm):
        options = config.family_options
        state = _sources(2 * L, block_size_for(options.get("variant", "block"), options.get("block_size"), 2 * L))
    if head_reads and isinstance(form, GatedResidualForm):
        reduce = _gated_read(C, n, config.family_options.get("rank", GATED_RESIDUAL_OPTIONS["rank"]))
    elif head_reads and isinstance(form, AttnResForm):  # the output query's read over every source
        reduce = _depth_read(C, state)
    elif head_reads:  # HyperHead: RMSNorm over nC, an nC × n product, σ, and the weighted sum
        reduce = _count(2 * n * C * n, 3 * n * C + 3 * n + 2 * n * C)
    else:
        reduce = _count(0, (state - 1) * C + (C if config.stream_reduce == "mean" and state > 1 else 0))
    streams = _add(reduce, _count(0, n * C if config.lss_init is not None else 0))
    embedding = _count(0, C * config.embed_scale + C * (config.pos == "learned"))
    parts = {
        "attention_projections": _scale(projections, L),
        "attention_scores": _scale(scores, L),
        "mlp": _scale(mlp, L),
        "norms": norms,
        "lm_head": _count(2 * C * V),
        "connections": connection,
        "streams": streams,
        "embedding": embedding,
    }
    total = _add(*parts.values())
    forward = total["matmul"] + total["elementwise"]
    return {
        "version": FLOPS_VERSION, "seq_len": T, "family": family, "n_streams": n, "parts": parts,
        "forward_matmul_per_token": total["matmul"], "forward_elementwise_per_token": total["elementwise"],
        "forward_per_token": forward, "train_per_token": 3 * forward, "train_matmul_per_token": 3 * total["matmul"],
    }


# ------------------------------------------------------------------------------------------------ the peaks

#: Dense bfloat16 tensor-core peaks, FLOP/s, of known GPUs, by a part of the name torch gives them (the first
#: that matches): NVIDIA's data sheets (H100 and H200: "Tensor Core GPU" data sheets, BF16 Tensor Core, SXM 1 979,
#: NVL 1 671, PCIe 1 513 TFLOPS with sparsity; A100: 312 dense). An SXM part's name carries no form factor
#: ("NVIDIA H100 80GB HBM3"), so the NVL and PCIe names come first.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
#: The key of a platform record that holds :func:`measure_matmul_peak`'s measurement.
MEASURED_PEAK = "matmul_peak"


def measure_matmul_peak(device: torch.device | str = "cpu", size: int = 512, repeats: int = 7) -> dict[str, Any]:
    """The FLOP/s of a float32 ``(size, size) @ (size, size)`` product on ``device`` with torch's current threads:
    the median of ``repeats`` timed products after two untimed ones (a few milliseconds on a CPU). The matrices are
    constants, so no random number is drawn (training's generators are left as they are). Returns
    ``{"flops_per_s", "dtype", "size", "repeats", "threads"}``."""
    device = torch.device(device)
    a = torch.full((size, size), 1.0 / size, dtype=torch.float32, device=device)
    out = torch.empty_like(a)
    times = []
    for index in range(repeats + 2):
        started = time.perf_counter()
        torch.mm(a, a, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"flops_per_s": float(f"{2 * size**3 / median:.4g}"), "dtype": "float32", "size": size,
            "repeats": repeats, "threads": torch.get_num_threads()}


def peak_flops(platform: Mapping[str, Any], precision: str) -> dict[str, Any]:
    """The peak FLOP/s that a run's MFU divides by, from its platform record (``device``: ``"cpu"`` or the GPU's
    name) and the precision it trained in (``"bfloat16"`` or ``"float32"``): ``{"flops_per_s", "source",
    "label"}``, or ``{"flops_per_s": None, "reason"}`` where there is no known one.

    A GPU's is :data:`PEAK_FLOPS`' (bfloat16; a run in float32 on a GPU has none: its tensor-core peak is another
    one); a CPU's the float32 matmul the run measured when it started (:data:`MEASURED_PEAK`)."""
    device = str(platform.get("device") or "")
    if device == "cpu":
        measured = platform.get(MEASURED_PEAK) or {}
        if not measured.get("flops_per_s"):
            return {"flops_per_s": None, "reason": "the run's platform record holds no measured CPU peak (the run "
                                                    "started before runs measured one)"}
        return {"flops_per_s": measured["flops_per_s"], "source": "measured",
                "label": f"CPU, measured float32 {measured.get('size')}² matmul, {measured.get('threads')} threads"}
    for name, flops in PEAK_FLOPS:
        if name.lower() in device.lower():
            if precision != "bfloat16":
                return {"flops_per_s": None, "reason": f"the peak table holds bfloat16 peaks; this run trained on "
                                                       f"{device} in {precision}"}
            return {"flops_per_s": flops, "source": "table", "label": f"{device}, bf16 dense peak {flops / 1e12:g}e12"}
    return {"flops_per_s": None, "reason": f"no known peak for device {device or '?'!r} (the table: "
                                           f"{', '.join(name for name, _ in PEAK_FLOPS)})"}
