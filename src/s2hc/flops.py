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

:func:`connection_flops` counts one connection (the one around one sublayer) per token as its connection form counts
itself (:meth:`s2hc.connection.forms.ConnectionForm.flops`; AttnRes's count grows with the sources a sublayer reads),
the hyper-connections' constraint maps as their mixing family does (:meth:`s2hc.mixers.Mixer.flops`), and the learned
final read and the state the last block hands on as the form says (``head_flops``, ``state_size``); a form or a
family that does not count itself is refused, naming it.

Peaks (:func:`peak_flops`): :data:`PEAK_FLOPS`, NVIDIA's dense bfloat16 tensor-core peaks of known GPUs (their
data sheets give the figure with 2:4 sparsity, twice the dense one), found by name in the device a run's platform
record names; on a CPU, what :func:`measure_matmul_peak` measured when the run started (a float32 matmul, median
of repetitions), written into that record.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from .connection import forms
from .counts import Count, add, count, scale

__all__ = ["FLOPS_VERSION", "PEAK_FLOPS", "connection_flops", "measure_matmul_peak", "model_flops", "peak_flops"]

#: The version of :func:`model_flops`'s dict (a row of a study records it).
FLOPS_VERSION = 1
#: The connection's own keywords (:data:`s2hc.connection.forms.HYPER_CONNECTION_OPTIONS`): they change no count.
_NO_COUNT_OPTIONS = forms.HYPER_CONNECTION_OPTIONS


def _counted_options(family_options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in family_options.items() if k not in _NO_COUNT_OPTIONS}


def connection_flops(family: str, dim: int, n_streams: int, *, sublayer: int = 0, n_sublayers: int = 1,
                     **family_options: Any) -> Count:
    """Forward FLOPs per token of one connection of ``family`` (around sublayer ``sublayer`` of ``n_sublayers``;
    only AttnRes's count depends on where) with streams of width ``dim``: ``{"matmul", "elementwise"}`` (see the
    module), as the family's form counts it (:meth:`~s2hc.connection.forms.ConnectionForm.flops`). ``family_options``
    as a model's (the connection's own keywords, ``eps`` and the like, change nothing); ValueError naming a form or
    a mixing family that does not count itself."""
    return forms.get(family).flops(dim, n_streams, sublayer=sublayer, n_sublayers=n_sublayers,
                                   **_counted_options(family_options))


def projection_inputs(family: str, n_streams: int, **family_options: Any) -> int:
    """K, the constraint map's inputs per token of a mixing family (what :func:`connection_flops` counts with)."""
    return forms.get(family).mixer.flops(n_streams, **_counted_options(family_options))[0]


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
    projections = count(2 * C * (q_width + 2 * kv_width) + 2 * q_width * C,
                         (q_width + 2 * kv_width) * config.qkv_bias + C * config.out_bias
                         + (3 * D * (H + Hkv) if config.pos == "rope" else 0)
                         + (4 * D * (H + Hkv) if config.qk_norm else 0))  # QK-norm: an RMSNorm per head
    scores = count(4 * T * H * D, 5 * T * H)  # QKᵀ and PV, dense; scale, max, subtract, exp, sum and divide
    mlp_products = 3 if config.mlp in ("swiglu", "geglu") else 2
    activation = 3 * F if mlp_products == 3 else 2 * F  # silu / tanh-GELU and the gate's product
    mlp = count(mlp_products * 2 * C * F, activation + (F * (mlp_products - 1) + C) * config.mlp_bias)
    # A layer's attention may take several inputs (AttnRes's qkv_reads), each read by a query and normed.
    inputs = [form.attention_inputs(config.family_options, local=config.is_local_layer(i)) for i in range(L)]
    norms_per_layer = 2 * form.pre_norms + 2 * config.post_norms
    final_norm = 0 if form.replaces_final_norm(config.stream_reduce) else _norm(config, C)
    extra_norms = form.pre_norms * sum(k - 1 for k in inputs)
    norms = count(0, (L * norms_per_layer + extra_norms) * _norm(config, C) + final_norm)
    connection = add(*(connection_flops(family, C, n, sublayer=j, n_sublayers=2 * L, **config.family_options,
                                        **form.sublayer_options(config.family_options, j,
                                                                local=config.is_local_layer(j // 2)))
                       for j in range(2 * L)))
    options = _counted_options(config.family_options)
    state = form.state_size(n, 2 * L, options)  # tensors the last block hands on: n streams, or AttnRes's sources
    if config.stream_reduce == "head":  # the form's learned read
        reduce = form.head_flops(C, n, n_sublayers=2 * L, options=options)
    else:
        reduce = count(0, (state - 1) * C + (C if config.stream_reduce == "mean" and state > 1 else 0))
    streams = add(reduce, count(0, n * C if config.lss_init is not None else 0))
    embedding = count(0, C * config.embed_scale + C * (config.pos == "learned"))
    parts = {
        "attention_projections": scale(projections, L),
        "attention_scores": scale(scores, L),
        "mlp": scale(mlp, L),
        "norms": norms,
        "lm_head": count(2 * C * V),
        "connections": connection,
        "streams": streams,
        "embedding": embedding,
    }
    total = add(*parts.values())
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
