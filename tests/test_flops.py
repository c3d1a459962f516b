"""s2hc.flops: the analytic FLOP count against torch's FlopCounterMode on real forwards, per family and model
feature, and the peaks MFU divides by.

FlopCounterMode counts matrix products only (mm, addmm, bmm, scaled dot-product attention): the count's
``matmul`` part must equal it exactly (tolerance 0). The ``elementwise`` part is an approximate count
FlopCounterMode does not see; it is checked only to be there and small beside the products of a realistic
model (below 5 % of the forward at GPT-2 small's shapes)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import s2hc
from s2hc import HyperConnection
from s2hc.connection import forms
from s2hc.flops import (
    PEAK_FLOPS,
    connection_flops,
    measure_matmul_peak,
    model_flops,
    peak_flops,
    projection_inputs,
)
from s2hc.models import ModelConfig, Transformer, get_preset

B, T = 2, 8
TINY = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=T)

CASES = [
    ("residual", 1, {}, {}),
    ("identity", 4, {}, {}),
    ("hc", 4, {}, {}),  # per-stream projection
    ("hc", 4, {"projection": "flat"}, {}),
    ("mhc", 4, {}, {}),
    ("mhc", 4, {"variant": "deepseek-v4", "iterations": 5}, {}),
    ("mhc-lite", 3, {}, {}),
    ("kromhc", 4, {}, {}),
    ("kromhc", 6, {}, {}),  # a 2 x 2 and a 3 x 3 factor
    ("s2hc", 2, {}, {}),  # m = 1: no rotation
    ("s2hc", 4, {}, {}),
    ("s2hc", 5, {}, {}),  # m = 4: the closed form with the Pfaffian
    ("s2hc", 6, {}, {}),  # m = 5: a batched solve
    ("s2hc", 4, {"rotation": "expm"}, {}),
    ("orthogonal", 4, {}, {}),
    ("isometric", 4, {}, {}),
    ("gated-residual", 4, {"rank": 8}, {}),
    ("attn-res", 1, {}, {}),  # the default Block: one sublayer per block at this depth (Full)
    ("attn-res", 1, {"block_size": 3}, {}),  # a partial sum in every block but the last
    ("attn-res", 1, {}, {"stream_reduce": "sum"}),
    ("wide-residual", 3, {}, {}),
    ("wide-residual", 2, {}, {"stream_reduce": "head"}),
    ("s2hc", 4, {"transpose_res": True}, {"stream_reduce": "head"}),
    ("mhc", 4, {}, {"stream_reduce": "mean", "lss_init": 0.6}),
    ("mhc-lagged", 4, {"iterations": 5}, {}),  # DeepSeek-V4.1's single-pass mHC and its final collapse
    ("mhc-lagged", 3, {}, {"stream_reduce": "sum"}),
    ("residual", 1, {}, {"mlp": "gelu", "qkv_bias": True, "out_bias": True, "mlp_bias": True, "pos": "learned",
                         "norm": "layernorm", "tie_embeddings": False}),
    ("s2hc", 4, {}, {"n_kv_heads": 1, "qk_norm": True, "post_norms": True, "mlp": "geglu", "embed_scale": True}),
]


def counted(model: torch.nn.Module, x: torch.Tensor) -> int:
    """FlopCounterMode's total for one forward; SDPA's math backend, since the CPU's fused attention kernel is
    one FlopCounterMode has no formula for (it would count the scores as 0)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("family, n, options, extra", CASES,
                         ids=[f"{c[0]}-n{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_the_matmul_count_is_what_flop_counter_mode_counts(family, n, options, extra):
    config = ModelConfig(**TINY, family=family, n_streams=n, family_options=options, **extra)
    torch.manual_seed(0)
    model = Transformer(config)
    x = torch.randint(0, config.vocab_size, (B, T))
    flops = model_flops(config, T)
    assert counted(model, x) == flops["forward_matmul_per_token"] * B * T  # exactly
    assert flops["forward_elementwise_per_token"] > 0
    assert flops["forward_per_token"] == flops["forward_matmul_per_token"] + flops["forward_elementwise_per_token"]
    assert flops["train_per_token"] == 3 * flops["forward_per_token"]
    assert sum(p["matmul"] for p in flops["parts"].values()) == flops["forward_matmul_per_token"]


def test_the_parts_by_hand():
    """The tiny residual model's parts, written out: C = 16, L = 2, H = 2, D = 8, F = 32 (SwiGLU), V = 64, T = 8."""
    parts = model_flops(ModelConfig(**TINY), T)["parts"]
    assert parts["attention_projections"]["matmul"] == 2 * (2 * 16 * 16 * 4)  # q, k, v, o: 16 x 16 each
    assert parts["attention_scores"]["matmul"] == 2 * (4 * T * 2 * 8)  # QKᵀ and PV, dense
    assert parts["mlp"]["matmul"] == 2 * (3 * 2 * 16 * 32)  # gate, up, down
    assert parts["lm_head"]["matmul"] == 2 * 16 * 64
    assert parts["connections"] == {"matmul": 0, "elementwise": 2 * 2 * 16}  # x + F(x), C adds per sublayer


def test_one_connection_by_hand():
    """s²HC at n = 4, C = 16 (m = 3, K = 9): the projection 64 x 17, the read 4·16, the mixing 16·16, the
    constraint map's products (two Cayley squares, the core and the basis conjugation)."""
    m, n, C = 3, 4, 16
    count = connection_flops("s2hc", C, n)
    products = 2 * n * C * (2 * n + m * m) + 2 * n * C + 2 * n * n * C
    constraint = 2 * (2 * m**3) + 2 * m**3 + 2 * n * m * m + 2 * n * m * n
    assert count["matmul"] == products + constraint
    assert connection_flops("s2hc", C, n, eps=1e-5, projection_init="normal") == count  # the connection's own


@pytest.mark.parametrize("family, n, options", [("identity", 4, {}), ("hc", 3, {}), ("mhc", 4, {}),
                                                ("mhc-lite", 4, {}), ("kromhc", 6, {}), ("s2hc", 5, {}),
                                                ("orthogonal", 4, {}), ("isometric", 5, {})])
def test_the_constraint_maps_take_the_inputs_the_connection_projects(family, n, options):
    connection = HyperConnection(16, n, family=family, **({"projection": "flat"} if family == "hc" else {}), **options)
    assert 2 * n + projection_inputs(family, n, **options) == connection.projection.shape[-1]


def test_every_connection_form_counts_itself_and_others_are_refused():
    for family in s2hc.families():
        n = 1 if forms.get(family).max_streams == 1 else 4
        assert connection_flops(family, 16, n, sublayer=3, n_sublayers=8)["elementwise"] > 0
    with pytest.raises(ValueError, match=r"family must be one of \["):
        connection_flops("nope", 16, 4)

    class Lagged(forms.ConnectionForm):  # a form added without a count
        name = "lagged"

    forms.REGISTRY["lagged"] = Lagged()
    try:
        with pytest.raises(ValueError, match=r"no FLOP count for the connection form of 'lagged' \(Lagged\)"):
            connection_flops("lagged", 16, 4)
    finally:
        del forms.REGISTRY["lagged"]


def test_a_mixing_family_without_a_count_is_refused_by_name():
    class Unknown(s2hc.mixers.Mixer):
        name = "unknown"

    with pytest.raises(ValueError, match=r"no FLOP count for mixing family 'unknown' \(Unknown\): define Unknown\."):
        Unknown.flops(4)


def test_attn_res_reads_grow_with_its_sources():
    """Full at sublayer j reads j + 1 sources; Block of size 2 reads 1 + ⌈j / 2⌉, adding to the partial sum at odd j."""
    per_source = 7 * 16 + 7  # the dot and the weighted sum (2C each), the key's mean square and scale, the softmax
    full = [connection_flops("attn-res", 16, 1, sublayer=j, n_sublayers=8, variant="full") for j in range(8)]
    assert [c["elementwise"] for c in full] == [per_source * (j + 1) for j in range(8)]
    assert all(c["matmul"] == 0 for c in full)  # matrix-vector products, which FlopCounterMode does not count
    block = [connection_flops("attn-res", 16, 1, sublayer=j, n_sublayers=8, block_size=2) for j in range(4)]
    assert [c["elementwise"] for c in block] == [per_source * 1, per_source * 2 + 16, per_source * 2,
                                                 per_source * 3 + 16]  # odd sublayers add to the partial sum


def test_at_gpt2_small_the_products_dominate_and_the_connections_are_small():
    residual = model_flops(get_preset("gpt2-small"), 1024)
    s2hc = model_flops(get_preset("gpt2-small", family="s2hc", n_streams=4), 1024)
    for flops in (residual, s2hc):
        assert flops["forward_elementwise_per_token"] < 0.05 * flops["forward_per_token"]
    extra = s2hc["forward_per_token"] / residual["forward_per_token"] - 1
    assert 0 < extra < 0.05  # four streams cost a few per cent of the FLOPs
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        model_flops(get_preset("tiny"), 0)


# ---------------------------------------------------------------------------------------------- peaks


@pytest.mark.parametrize("device, expected", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
])
def test_the_peak_table_is_read_from_the_device_name(device, expected):
    peak = peak_flops({"device": device}, "bfloat16")
    assert peak["flops_per_s"] == expected and peak["source"] == "table" and device in peak["label"]
    assert any(name in device for name, _ in PEAK_FLOPS)


def test_an_unknown_peak_is_unavailable_with_its_reason():
    assert peak_flops({"device": "NVIDIA GeForce RTX 4090"}, "bfloat16") == {
        "flops_per_s": None, "reason": "no known peak for device 'NVIDIA GeForce RTX 4090' (the table: "
                                      "H200 NVL, H200, H100 NVL, H100 PCIe, H100, A100)"}
    assert "bfloat16 peaks; this run trained on NVIDIA H100 80GB HBM3 in float32" in peak_flops(
        {"device": "NVIDIA H100 80GB HBM3"}, "float32")["reason"]
    assert "holds no measured CPU peak" in peak_flops({"device": "cpu"}, "float32")["reason"]


def test_a_cpu_peak_is_measured_and_read_back():
    measured = measure_matmul_peak("cpu", size=64, repeats=3)
    assert measured["flops_per_s"] > 0 and measured["dtype"] == "float32" and measured["threads"] >= 1
    state = torch.random.get_rng_state()
    measure_matmul_peak("cpu", size=32, repeats=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # draws nothing
    peak = peak_flops({"device": "cpu", "matmul_peak": measured}, "float32")
    assert peak["flops_per_s"] == measured["flops_per_s"] and peak["source"] == "measured"
    assert peak["label"].startswith("CPU, measured float32 64² matmul")
