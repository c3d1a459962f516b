"""Stream usage in the diagnostics: each stream's share of what the connections read and write and of what the
output takes, the effective number of streams and the dominant stream (docs/diagnostics.md, "Stream usage").

Against an independent reference (plain Python loops over tokens and streams), the measures' properties
(hypothesis), a collapse built by hand, the families' models through ``collect(...).summary()`` (the gated
residual, a DeepSeek-V4 HyperHead, sum), ``s2hc diagnose`` of a tiny trained run (report section and figure) and
the study report's table."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from helpers import SMALL_MODEL, capture_of
from hypothesis import given
from hypothesis import strategies as st

from s2hc import GatedResidual, HyperConnection
from s2hc.cli import main
from s2hc.diagnostics import (
    Recorder,
    collect,
    dominant_stream,
    effective_streams,
    mean_shares,
    stream_norms,
    stream_shares,
    summarize,
)
from s2hc.diagnostics.collect import split_inert_connections
from s2hc.diagnostics.report import stream_usage_lines
from s2hc.diagnostics.summary import stream_usage
from s2hc.models import Transformer, get_preset
from s2hc.study.measure import compact_diagnostics
from s2hc.study.rows import stream_usage as row_stream_usage

# ------------------------------------------------------------------------------------------ the reference


def reference_shares(weights: np.ndarray) -> tuple[list[list[float]], list[float]]:
    """Per layer, the token mean of each token's shares |w_s| / Σ_t |w_t| (tokens with Σ = 0 left out), and the
    effective number exp(−Σ p log p) of those means: loops, no vector arithmetic."""
    L, N, n = weights.shape
    layer_shares, effective = [], []
    for layer in range(L):
        sums, count = [0.0] * n, 0
        for token in range(N):
            total = sum(abs(float(weights[layer, token, s])) for s in range(n))
            if total == 0:
                continue
            count += 1
            for s in range(n):
                sums[s] += abs(float(weights[layer, token, s])) / total
        shares = [v / count for v in sums] if count else [math.nan] * n
        layer_shares.append(shares)
        entropy = -sum(p * math.log(p) for p in shares if p > 0)
        effective.append(math.exp(entropy) if count else math.nan)
    return layer_shares, effective


@given(seed=st.integers(0, 10_000), layers=st.integers(1, 4), tokens=st.integers(1, 9), n=st.integers(1, 8),
       negative=st.booleans())
def test_shares_and_effective_streams_match_the_reference(seed, layers, tokens, n, negative):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(layers, tokens, n, generator=generator, dtype=torch.float64) ** 3
    if negative:  # HC's H_pre may be negative: |.| counts a subtracted stream as used
        weights = weights * torch.where(torch.rand(weights.shape, generator=generator) < 0.4, -1.0, 1.0)
    weights[0, 0] = 0.0  # a token that reads nothing is left out
    shares, effective = reference_shares(weights.numpy())
    found = stream_usage(pre=weights, post=2 * weights)
    for layer in range(layers):
        if math.isnan(effective[layer]):
            assert math.isnan(found["read_effective_streams"][layer])
            assert found["read_dominant_stream"][layer] == -1
            continue
        assert found["read_share"][layer] == pytest.approx(shares[layer], abs=1e-12)
        assert found["read_effective_streams"][layer] == pytest.approx(effective[layer], rel=1e-12)
        assert found["read_dominant_share"][layer] == pytest.approx(max(shares[layer]), abs=1e-12)
        assert shares[layer][found["read_dominant_stream"][layer]] == pytest.approx(max(shares[layer]), abs=1e-12)
    np.testing.assert_allclose(found["write_share"], found["read_share"], rtol=1e-15)  # a scale changes no share


@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), scale=st.floats(-1e3, 1e3).filter(lambda c: abs(c) > 1e-3))
def test_properties_of_the_shares(seed, n, scale):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(6, n, generator=generator, dtype=torch.float64)
    shares = stream_shares(w)
    assert torch.allclose(shares.sum(-1), torch.ones(6, dtype=torch.float64)) and bool((shares >= 0).all())
    assert torch.allclose(stream_shares(scale * w), shares, atol=1e-15)  # scaling H_pre changes nothing
    perm = torch.randperm(n, generator=generator)
    assert torch.allclose(stream_shares(w[:, perm]), shares[:, perm])  # permuting the streams permutes the shares
    effective = effective_streams(shares)
    assert bool((effective >= 1 - 1e-12).all()) and bool((effective <= n + 1e-12).all())
    assert torch.allclose(effective_streams(shares[:, perm]), effective)
    mean = mean_shares(shares[None])
    assert torch.allclose(mean, shares.mean(0, keepdim=True)) and math.isclose(mean.sum().item(), 1.0)
    # a layer's effective number is at least the mean of its tokens' (entropy is concave)
    assert effective_streams(mean)[0] >= effective.mean() - 1e-12
    dominant = dominant_stream(shares)
    assert torch.equal(dominant.share, shares.max(-1).values) and torch.equal(dominant.stream, shares.argmax(-1))


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_effective_streams_of_equal_shares_and_of_one_stream(n):
    assert effective_streams(torch.full((n,), 1.0 / n)).item() == pytest.approx(n, rel=1e-12)
    for s in range(n):
        one = torch.zeros(n)
        one[s] = 1.0
        assert effective_streams(one).item() == 1.0
        assert dominant_stream(one).stream.item() == s and dominant_stream(one).share.item() == 1.0
    assert math.isnan(effective_streams(torch.zeros(n)).item())  # nothing put on any stream: no shares


def test_rows_without_shares_and_bad_input():
    shares = stream_shares(torch.tensor([[0.0, 0.0], [1.0, 3.0], [math.inf, 1.0]]))
    assert torch.isnan(shares[0]).all() and torch.isnan(shares[2]).all()
    assert mean_shares(shares).tolist() == [0.25, 0.75]  # the rows without shares are left out
    assert torch.isnan(mean_shares(shares[[0]])).all()
    with pytest.raises(ValueError, match="shares must be non-negative"):
        effective_streams(torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match=r"w must be a tensor with the streams last"):
        stream_shares(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x must be a tensor of streams"):
        stream_norms(torch.ones(3))
    res = torch.eye(3).expand(2, 5, 3, 3)
    with pytest.raises(ValueError, match=r"post must have shape \(2, 5, 3\), got \(2, 5, 2\)"):
        summarize(capture_of(res, torch.ones(2, 5, 3), torch.ones(2, 5, 2)))
    with pytest.raises(ValueError, match=r"output must have shape \(5, 3\)"):
        summarize(capture_of(res, torch.ones(2, 5, 3), output=torch.ones(4, 3)))
    with pytest.raises(ValueError, match="output_read must be one of"):
        summarize(capture_of(res, torch.ones(2, 5, 3), output=torch.ones(5, 3), output_read="max"))
    with pytest.raises(ValueError, match=r"read_inert_layers must be indices of the 2 layers \(0 to 1\), got \[2\]"):
        summarize(capture_of(res, torch.ones(2, 5, 3), read_inert=[2]))


def test_a_collapse_built_by_hand():
    """One stream's H_pre dominating at every connection: dominant share ≈ 1, effective ≈ 1, and the report says so;
    equal weights beside it give n."""
    generator = torch.Generator().manual_seed(0)
    L, N, n = 6, 40, 4
    pre = 1e-3 * torch.rand(L, N, n, generator=generator, dtype=torch.float64)
    pre[..., 2] = 1.0 + torch.rand(L, N, generator=generator, dtype=torch.float64)
    post = torch.ones(L, N, n, dtype=torch.float64)
    output = torch.ones(N, n, dtype=torch.float64)
    output[:, 2] = 1e4
    s = summarize(capture_of(torch.eye(n).expand(L, N, n, n), pre, post, output=output, output_read="sum",
                             read_inert=[0], write_inert=[L - 1]))
    assert all(v > 0.998 for v in s["read_dominant_share"]) and s["read_dominant_stream"] == [2] * L
    assert all(1 <= v < 1.02 for v in s["read_effective_streams"])
    assert s["write_effective_streams"] == pytest.approx([n] * L) and s["output_effective_streams"] < 1.01
    head = s["headline"]
    assert head["read_effective_streams_mean"] < 1.02 and head["read_depth_dominant_share"] > 0.998
    assert head["write_effective_streams_mean"] == pytest.approx(n) and head["output_dominant_share"] > 0.999
    text = "\n".join(stream_usage_lines(s))
    assert "One stream dominates: stream 2 has " in text and "of the output" in text
    assert "| 0 `0` | 0.00, 0.00, 1.00, 0.00 |" in text and "| no |" in text


def test_static_matrices_get_shares_and_no_output():
    """As ``s2hc diagnose --static`` calls it: pre / post at d = 0, one "token", no streams."""
    generator = torch.Generator().manual_seed(1)
    pre, post = torch.rand(5, 1, 4, generator=generator), torch.rand(5, 1, 4, generator=generator)
    s = summarize(capture_of(torch.eye(4).expand(5, 1, 4, 4), pre, post))
    shares, effective = reference_shares(pre.numpy())
    np.testing.assert_allclose(s["read_share"], shares, rtol=1e-12)
    assert s["read_effective_streams"] == pytest.approx(effective)
    assert s["read_inert_layers"] == [] and s["write_inert_layers"] == []
    assert not any(key.startswith("output_") for key in s) and "output_effective_streams" not in s["headline"]
    assert "Output: not measured" in "\n".join(stream_usage_lines(s))
    assert "read_share" not in summarize(capture_of(torch.eye(4).expand(5, 1, 4, 4)))  # no weights, no usage


# ---------------------------------------------------------------------------------------------- on models


def small_model(family: str, **options) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family=family, n_streams=4, vocab_size=97, **SMALL_MODEL, **options))
    with torch.no_grad():  # off the initialisation, so the streams differ
        for p in model.hyper_connection_parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_hc_at_initialisation_reads_one_stream_per_connection():
    """HC's static read is one-hot (stream l // 2 at layer l here): one stream per connection, several over depth."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family="hc", n_streams=4, vocab_size=97, **SMALL_MODEL))
    s = collect(model, torch.randint(0, 97, (2, 8))).summary()
    assert s["read_effective_streams"] == [1.0] * 4 and s["read_dominant_stream"] == [0, 0, 1, 1]
    assert s["read_inert_layers"] == [0] and s["write_inert_layers"] == [3] and s["output_read"] == "sum"
    assert s["read_depth_share"] == pytest.approx([1 / 3, 2 / 3, 0, 0])  # connections 1, 2, 3 (0's split is idle)
    assert s["read_depth_effective_streams"] == pytest.approx(math.exp(-(math.log(1 / 3) + 2 * math.log(2 / 3)) / 3))


@pytest.mark.parametrize("family, options, output_read", [
    ("mhc", {"family_options": {"variant": "deepseek-v4"}, "stream_reduce": "head"}, "hyper-head"),
    ("gated-residual", {}, "gated-head"),
    ("s2hc", {"stream_reduce": "mean"}, "mean"),
])
@torch.no_grad()
def test_models_through_collect_and_summary(family, options, output_read):
    model = small_model(family, **options)
    ids = torch.randint(0, 97, (3, 16))
    reference = model(ids)
    capture = collect(model, ids, tokens=30, batch_size=2, seed=1, keep_streams=True)
    assert torch.equal(model(ids), reference)  # the head's hook only reads
    s = capture.summary()
    assert s["output_read"] == output_read and capture.output.shape == (30, 4)
    final = capture.streams[-1].double()  # (N, n, C): the last connection's output, the head's input
    head = model.stream_head
    if output_read == "hyper-head":
        w = head.weights(final[None])[0]
        assert torch.allclose((w[..., None] * final).sum(-2), head(final[None])[0].double(), atol=1e-6)
        taken = torch.stack([w[:, k].abs() * final[:, k].norm(dim=-1) for k in range(4)], dim=-1)
    elif output_read == "gated-head":
        normed = head.normed(final[None])
        parts = head.read_gates(normed)[0] * normed[0]
        assert torch.allclose(parts.mean(-2), head(final[None])[0].double(), atol=1e-6)
        taken = torch.stack([parts[:, k].norm(dim=-1) for k in range(4)], dim=-1)
    else:
        taken = torch.stack([final[:, k].norm(dim=-1) for k in range(4)], dim=-1)
    per_token = [[float(taken[t, k]) / float(taken[t].sum()) for k in range(4)] for t in range(30)]
    expected = [sum(row[k] for row in per_token) / 30 for k in range(4)]
    assert s["output_share"] == pytest.approx(expected, rel=1e-5)
    assert s["output_effective_streams"] == pytest.approx(math.exp(-sum(p * math.log(p) for p in expected)), rel=1e-5)
    assert s["read_inert_layers"] == [0] and s["write_inert_layers"] == ([3] if output_read == "mean" else [])
    if family == "gated-residual":  # pre is the gates' mean over channels / n, read_spread their spread
        modules = dict(model.named_modules())
        assert all(isinstance(modules[name], GatedResidual) for name in capture.names)
        gates = [modules[name].gates(x[None])["read"][0] / 4 for name, x in zip(capture.names, capture.streams)]
        shares, _ = reference_shares(torch.stack([g.mean(-1) for g in gates]).double().numpy())
        np.testing.assert_allclose(s["read_share"], shares, rtol=1e-5)
        np.testing.assert_allclose(s["read_spread"]["mean"], [g.std(-1, correction=0).mean(0).tolist() for g in gates],
                                   rtol=1e-4)
    else:
        assert "read_spread" not in s
    json.dumps(s, allow_nan=False)


def test_a_learned_stream_scaling_makes_the_first_read_count():
    """With lss_init the streams enter the first connection scaled apart, not as copies: its read split counts."""
    model = small_model("s2hc", lss_init=1.0)
    assert model.stream_scale is not None
    assert split_inert_connections(model, 4) == ([], [3])
    assert split_inert_connections(small_model("s2hc", stream_reduce="head"), 4) == ([0], [])
    assert split_inert_connections(torch.nn.Linear(2, 2), 4) == ([], [])


def test_a_module_that_is_not_a_transformer_gets_plain_norms():
    torch.manual_seed(0)
    hc = HyperConnection(8, n_streams=3, family="mhc")
    x = torch.randn(2, 5, 3, 8)
    with Recorder(hc) as recorder:
        y = hc(x, torch.tanh)
    capture = recorder.capture()
    assert capture.output_read == "unknown" and capture.read_inert == [] and capture.write_inert == []
    assert torch.allclose(capture.output, y.flatten(0, 1).double().norm(dim=-1))
    s = capture.summary()
    assert s["output_read"] == "unknown"
    assert "how this model reduces its streams is not known" in "\n".join(stream_usage_lines(s))


# ------------------------------------------------------------------------------------------ s2hc diagnose


def test_diagnose_reports_the_stream_usage(tiny_checkpoint, corpus_file, tmp_path):
    out = tmp_path / "diag"
    argv = ["diagnose", str(tiny_checkpoint), "--data", str(corpus_file), "--tokens", "64", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "diagnostics.json").read_text())
    for key in ("read_share", "write_share", "read_effective_streams", "write_effective_streams",
                "read_dominant_share", "write_dominant_stream", "output_share", "output_effective_streams"):
        assert key in data, key
    assert data["output_read"] == "sum" and data["read_inert_layers"] == [0] and data["write_inert_layers"] == [3]
    assert len(data["read_share"]) == 4 and all(len(row) == 4 for row in data["read_share"])
    for row in (*data["read_share"], *data["write_share"], data["output_share"]):
        assert math.isclose(sum(row), 1.0, rel_tol=1e-9)
    report = (out / "report.md").read_text()
    section = report[report.index("## Stream usage"):report.index("## Figures")]
    effective = data["read_effective_streams"][2]
    assert f"| 2 `blocks.1.attn_hc` | {', '.join(f'{v:.2f}' for v in data['read_share'][2])} | {effective:.2f} of 4 |" \
        in section
    head = data["headline"]
    assert f"read from {head['read_effective_streams_mean']:.2f} of 4 effective streams" in section
    assert "exp of the entropy" in section and "Reading:" in section
    assert (out / "stream_usage.png").stat().st_size > 5_000 and "(stream_usage.png)" in report


# ---------------------------------------------------------------------------------------------- the study


def _study_results() -> tuple[dict, dict[str, list[dict]]]:
    """A sweep's results (tests/test_study_designs.py) whose hc rows carry a real model's compact diagnostics."""
    from test_study_designs import _sweep_results

    results = _sweep_results()
    compact = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = small_model("hc")
        compact[seed] = compact_diagnostics(collect(model, torch.randint(0, 97, (2, 16)), tokens=24).summary())
    for row in results["rows"]:
        if row["family"] == "hc":
            row["diagnostics"] = copy.deepcopy(compact[row["seed"]])
    return results, compact


def _interior_effective(diagnostics: dict, prefix: str) -> float:
    inert = diagnostics[f"{prefix}_inert_layers"]
    values = [math.exp(-sum(p * math.log(p) for p in shares if p > 0))
              for i, shares in enumerate(diagnostics[f"{prefix}_share"]) if i not in inert]
    return sum(values) / len(values)


def test_the_study_report_has_a_stream_usage_table(tmp_path):
    results, compact = _study_results()
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["study", "--report-only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## Stream usage" in report
    read = sum(_interior_effective(compact[seed], "read") for seed in (0, 1)) / 2
    write = sum(_interior_effective(compact[seed], "write") for seed in (0, 1)) / 2
    output = sum(compact[seed]["output_effective_streams"] for seed in (0, 1)) / 2
    dominant = sum(compact[seed]["output_dominant_share"] for seed in (0, 1)) / 2
    for label in ("hc n=4 [n_layers=2]", "hc n=4 [n_layers=4]"):
        assert f"| {label} | 4 | {read:.2f} | {write:.2f} | {output:.2f} | {dominant:.3f} | 2 |" in report
    assert "| residual" not in report[report.index("## Stream usage"):report.index("## Figures")]
    assert row_stream_usage(results["rows"][0]) is None  # residual: no diagnostics


def test_rows_measured_before_the_stream_usage_have_no_such_section(tmp_path):
    results, _ = _study_results()
    for row in results["rows"]:
        if row["diagnostics"]:
            row["diagnostics"] = {k: v for k, v in row["diagnostics"].items()
                                  if not k.startswith(("read_", "write_", "output_"))}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["study", "--report-only", "--out", str(tmp_path)]) == 0
    assert "Stream usage" not in (tmp_path / "report.md").read_text()
