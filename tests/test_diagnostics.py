"""``s2hc.diagnostics`` and ``s2hc diagnose``: each measurement against a hand-computed case, the synthetic
mode's findings, the collectors, the figures, the command (a real 2-step checkpoint), bad input, and the
training loop's ``diagnostics_every`` (records logged, exact resume kept)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from helpers import SMALL_MODEL, capture_of, crash_after_checkpoint, randomize_, small_config
from hypothesis import given
from hypothesis import strategies as st

from s2hc import HyperConnection, mixers
from s2hc.cli import main
from s2hc.diagnostics import (
    Recorder,
    amax_gain,
    collect,
    column_sums,
    composite_product,
    cumulative_column_sums,
    deviation_block,
    deviation_singular_values,
    diagnose_synthetic,
    gradient_norms,
    guarantee_checks,
    identity_distance,
    negative_share,
    row_col_sum_error,
    row_sums,
    spectral_norm,
    stream_similarity,
    summarize,
    synthetic_matrices,
    training_diagnostics,
)
from s2hc.diagnostics.synthetic import logit_scale_sweep, scaled_mixer
from s2hc.mixers.orthomaps import helmert_basis
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import train

MEASUREMENT_KEYS = {
    "row_sum_error", "col_sum_error", "spectral_norm", "deviation_singular_values", "identity_distance",
    "negative_share", "rotation_angle", "spectrum_slope", "inert_layers", "negative_tolerance",
    "forward_amax", "backward_amax", "column_sums", "composite_spectral_norm",
    "composite_forward_amax", "composite_backward_amax", "composite_col_sum_error", "cumulative_column_sums",
}
FIGURES = ("deviation_singular_values.png", "amax_gain.png", "column_sums.png", "mixing.png")


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def J(n: int) -> torch.Tensor:
    return torch.full((n, n), 1.0 / n, dtype=torch.float64)


def zero_sum_matrix(core: torch.Tensor) -> torch.Tensor:
    """``J + U_Z core U_Zᵀ``: the s²HC form, built independently of the mixer."""
    n = core.shape[-1] + 1
    basis = helmert_basis(n)
    return J(n) + basis @ core @ basis.T


def rotation2(theta: float) -> torch.Tensor:
    return t([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])


# ------------------------------------------------------------------------------- hand-computed measurements


def test_permutation_matrix():
    P = t([[0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]])  # a 4-cycle: P⁴ = I
    err = row_col_sum_error(P)
    assert err.row.item() == 0 and err.col.item() == 0
    assert spectral_norm(P).item() == pytest.approx(1.0, abs=1e-12)
    assert negative_share(P).item() == 0
    assert identity_distance(P).item() == pytest.approx(math.sqrt(8))  # four 1s moved off the diagonal
    gain = amax_gain(P)
    assert gain.forward.item() == 1 and gain.backward.item() == 1
    # a permutation maps the zero-sum subspace onto itself, isometrically
    assert deviation_singular_values(P) == pytest.approx(torch.ones(3, dtype=torch.float64), abs=1e-12)
    Ps = composite_product(P.expand(4, 4, 4))
    assert torch.allclose(Ps[1], P @ P) and torch.allclose(Ps[3], torch.eye(4, dtype=torch.float64))
    assert torch.equal(cumulative_column_sums(P.expand(4, 4, 4)), torch.ones(4, 4, dtype=torch.float64))


def test_rotation_of_the_deviations_keeps_the_mean():
    R = torch.eye(3, dtype=torch.float64)
    R[:2, :2] = rotation2(0.7)
    H = zero_sum_matrix(R)
    assert torch.allclose(deviation_block(H), R, atol=1e-12)  # the Helmert compression recovers the core
    err = row_col_sum_error(H)
    assert err.row.item() < 1e-12 and err.col.item() < 1e-12
    assert deviation_singular_values(H) == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)
    assert spectral_norm(H).item() == pytest.approx(1.0, abs=1e-12)
    assert negative_share(H).item() > 0  # a rotation subtracts streams: not doubly stochastic, still exact


def test_rotation_of_the_whole_space_does_not():
    R = rotation2(math.pi / 2)  # [[0, -1], [1, 0]]
    err = row_col_sum_error(R)
    assert err.row.item() == pytest.approx(2.0) and err.col.item() == pytest.approx(2.0)  # sums −1 and 1
    assert row_sums(R) == pytest.approx([-1.0, 1.0], abs=1e-12)
    assert column_sums(R) == pytest.approx([1.0, -1.0], abs=1e-12)
    assert spectral_norm(R).item() == pytest.approx(1.0)
    assert negative_share(R).item() == 0.25
    assert identity_distance(R).item() == pytest.approx(2.0)
    gain = amax_gain(R)
    assert gain.forward.item() == pytest.approx(1.0) and gain.backward.item() == pytest.approx(1.0)


def test_scaled_matrix_compounds_over_depth():
    c, L = 1.5, 6
    Hs = (c * torch.eye(4, dtype=torch.float64)).expand(L, 4, 4)
    err = row_col_sum_error(Hs[0])
    assert err.row.item() == pytest.approx(0.5) and err.col.item() == pytest.approx(0.5)
    assert spectral_norm(Hs[0]).item() == pytest.approx(c)
    assert deviation_singular_values(Hs[0]) == pytest.approx([c] * 3)
    P = composite_product(Hs)
    assert spectral_norm(P) == pytest.approx([c ** (k + 1) for k in range(L)])
    gain = amax_gain(P)
    assert gain.forward == pytest.approx([c ** (k + 1) for k in range(L)])
    assert gain.backward == pytest.approx([c ** (k + 1) for k in range(L)])
    assert cumulative_column_sums(Hs)[:, 0] == pytest.approx([c ** (k + 1) for k in range(L)])


def test_attenuating_spectrum_and_signed_gains():
    H = zero_sum_matrix(torch.diag(t([1.0, 0.5, 0.25])))
    assert deviation_singular_values(H) == pytest.approx([1.0, 0.5, 0.25], abs=1e-12)
    assert spectral_norm(H).item() == pytest.approx(1.0, abs=1e-12)  # the mean direction keeps 1
    # Amax takes the absolute value of each sum (mHC), not the sum of absolute values
    M = t([[2.0, -3.0], [1.0, 1.0]])  # row sums −1, 2; column sums 3, −2
    gain = amax_gain(M)
    assert gain.forward.item() == 2.0 and gain.backward.item() == 3.0
    assert negative_share(t([[1.0, -1e-9], [0.0, 1.0]]), tolerance=1e-6).item() == 0
    assert negative_share(t([[1.0, -1e-9], [0.0, 1.0]]), tolerance=0).item() == 0.25
    assert negative_share(t([[1.0, -1e-9], [0.0, 1.0]])).item() == 0  # the default 1e-3 ignores rounding


def test_composite_order_is_later_layers_on_the_left():
    A, B = t([[1.0, 2.0], [0.0, 1.0]]), t([[1.0, 0.0], [3.0, 1.0]])
    P = composite_product(torch.stack([A, B]))
    assert torch.equal(P[0], A) and torch.equal(P[1], B @ A) and not torch.equal(B @ A, A @ B)


def test_stream_similarity_of_known_streams():
    x = t([[1, 0], [0, 1], [-1, 0], [2, 2], [0, 0]])  # n = 5 streams of width 2, the last zero
    sim = stream_similarity(x)
    r = 1 / math.sqrt(2)
    expected = t([
        [1, 0, -1, r, 0],
        [0, 1, 0, r, 0],
        [-1, 0, 1, -r, 0],
        [r, r, -r, 1, 0],
        [0, 0, 0, 0, 0],
    ])
    assert torch.allclose(sim, expected, atol=1e-12)
    copies = torch.randn(3, 4, 8).unsqueeze(-2).expand(3, 4, 4, 8)  # (B, T, n, C): copies, as after the embedding
    assert torch.allclose(stream_similarity(copies), torch.ones(3, 4, 4, 4, dtype=torch.float64))


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match=r"H must be a tensor of square matrices"):
        spectral_norm(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"Hs must stack matrices over depth"):
        composite_product(torch.eye(3))
    with pytest.raises(ValueError, match=r"res must have shape \(layers, tokens, n, n\)"):
        summarize(capture_of(torch.eye(3).expand(2, 3, 3)))


# --------------------------------------------------------------------------------------- summaries, claims


def test_summary_matches_the_measurements_and_checks_the_claims():
    Hs = synthetic_matrices("s2hc", 4, layers=5, tokens=64, logit_scale=3.0)
    s = summarize(capture_of(Hs, family="s2hc"))
    assert set(s) >= MEASUREMENT_KEYS and s["depth"] == 5 and s["tokens"] == 64
    assert s["spectral_norm"]["max"] == pytest.approx(spectral_norm(Hs).amax(1).tolist())
    assert s["composite_backward_amax"]["max"][-1] == pytest.approx(
        amax_gain(composite_product(Hs)[-1]).backward.max().item()
    )
    sv = deviation_singular_values(Hs)
    assert torch.allclose(torch.tensor(s["deviation_singular_values"]["mean"], dtype=torch.float64), sv.mean(1))
    assert all(c["holds"] for c in s["guarantees"]) and len(s["guarantees"]) == 6  # 3 claims, single and composite
    json.dumps(s, allow_nan=False)  # plain JSON


def test_a_broken_claim_is_reported():
    Hs = (1.01 * torch.eye(3)).expand(2, 4, 3, 3)  # rows sum to 1.01: not what mhc claims
    checks = {c["property"]: c for c in guarantee_checks("mhc", Hs)}
    assert not checks["rows sum to 1"]["holds"] and checks["rows sum to 1"]["measured"] == pytest.approx(0.01, rel=1e-5)
    assert checks["non-negative (most negative entry)"]["holds"]


@given(seed=st.integers(0, 2**16), spread=st.sampled_from([0.5, 2.0, 5.0]),
       family=st.sampled_from(["s2hc", "mhc-lite", "kromhc", "isometric", "orthogonal"]))
def test_claims_hold_for_randomised_families(seed, spread, family):
    """Whatever the parameters, each family's measured matrices keep what it claims (composites included)."""
    g = torch.Generator().manual_seed(seed)
    module = mixers.build(family, 4)
    randomize_(module, g, spread)
    with torch.no_grad():
        Hs = module(3.0 * torch.randn(6, 16, module.num_inputs, generator=g))
    checks = guarantee_checks(family, Hs)
    assert checks and all(c["holds"] for c in checks), checks


# ------------------------------------------------------------------------------------------------ synthetic


def test_scaled_mixer_sets_every_scale():
    module = scaled_mixer("s2hc", 4, 2.5)
    scales = {name: p for name, p in module.named_parameters() if name.split(".")[-1].endswith("alpha")}
    assert set(scales) == {"rotation_u.alpha", "rotation_v.alpha", "spectrum_alpha"}
    assert all(torch.all(p == 2.5) for p in scales.values())
    with pytest.raises(ValueError, match="logit_scale"):
        scaled_mixer("mhc", 4, -1.0)


@pytest.mark.parametrize("scale", [0.5, 4.0, 16.0])
def test_synthetic_s2hc_is_exact_over_28_layers(scale):
    Hs = synthetic_matrices("s2hc", 4, layers=28, tokens=256, logit_scale=scale)
    P = composite_product(Hs)
    assert (spectral_norm(P) - 1).abs().max().item() < 1e-4
    assert (cumulative_column_sums(Hs) - 1).abs().max().item() < 1e-4
    assert (row_sums(P) - 1).abs().max().item() < 1e-4


def test_synthetic_mhc_drifts_with_the_logit_scale_and_compounds_over_depth():
    sweep = logit_scale_sweep(["mhc", "mhc-lite"], scales=[0.5, 2.0, 8.0], layers=28, tokens=256)
    mhc = sweep["mhc"]
    single = [row["col_sum_error"] for row in mhc]
    composite = [row["composite_col_sum_error"] for row in mhc]
    assert single[0] < single[1] < single[2] and single[0] > 1e-4  # finite Sinkhorn: columns drift
    # and at moderate spread it compounds over depth (at S ≳ 8 the products of row-stochastic matrices contract
    # towards rank one, so the composite stops growing while single layers keep drifting)
    assert composite[0] > 2 * single[0] and composite[1] > 2 * single[1]
    assert all(row["col_sum_error"] < 1e-5 and row["composite_col_sum_error"] < 1e-4 for row in sweep["mhc-lite"])
    Hs = synthetic_matrices("mhc", 4, layers=28, tokens=256, logit_scale=4.0)
    assert row_col_sum_error(Hs).row.max().item() < 1e-5  # rows stay exact (the last normalisation)
    depth_error = row_col_sum_error(composite_product(Hs)).col.amax(1)
    assert depth_error[-1] > 2 * depth_error[0]


def test_synthetic_hc_explodes():
    Hs = synthetic_matrices("hc", 4, layers=28, tokens=256, logit_scale=1.0)
    gain = amax_gain(composite_product(Hs))
    forward, backward = gain.forward.amax(1), gain.backward.amax(1)
    assert forward[-1] > 1e3 and backward[-1] > 1e3 and forward[-1] > 100 * forward[0]


def test_synthetic_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    synthetic_matrices("mhc", 4, layers=2, tokens=8, logit_scale=1.0, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    a = synthetic_matrices("mhc", 4, layers=2, tokens=8, logit_scale=1.0, seed=3)
    assert torch.equal(a, synthetic_matrices("mhc", 4, layers=2, tokens=8, logit_scale=1.0, seed=3))


def test_synthetic_report_json_and_figures(tmp_path):
    result = diagnose_synthetic(["mhc", "s2hc", "hc", "residual"], layers=6, tokens=64, logit_scale=4.0,
                                sweep=[1.0], out=tmp_path)
    data = json.loads((tmp_path / "diagnostics.json").read_text())
    assert data["kind"] == "synthetic" and data["families"] == ["mhc", "s2hc", "hc"]
    assert set(data) >= MEASUREMENT_KEYS
    assert set(data["col_sum_error"]) == {"mhc", "s2hc", "hc"}
    assert data["settings"]["sweep"] == [1.0, 4.0]
    assert [row["logit_scale"] for row in data["logit_scale_sweep"]["mhc"]] == [1.0, 4.0]
    for name in (*FIGURES, "logit_scale_sweep.png"):
        assert (tmp_path / name).stat().st_size > 5_000, name
        assert f"({name})" in (tmp_path / "report.md").read_text()
    assert result["headline"]["s2hc"]["composite_spectral_norm_at_depth"] == pytest.approx(1.0, abs=1e-4)


# ---------------------------------------------------------------------------------------------- collectors


def tiny_model(mixer: str = "s2hc", n: int = 4):
    from s2hc.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family=mixer, n_streams=n, vocab_size=97, **SMALL_MODEL))
    with torch.no_grad():  # move the connections off their initialisation, so there is something to see
        for hc in (m for m in model.modules() if isinstance(m, HyperConnection)):
            for p in hc.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_recorder_captures_exactly_the_matrices_and_changes_nothing():
    torch.manual_seed(0)
    hc = HyperConnection(16, n_streams=3, family="mhc")
    with torch.no_grad():
        hc.projection.normal_()
    x = torch.randn(2, 5, 3, 16)
    branch = torch.nn.Linear(16, 16)
    expected = hc(x, branch)
    positions = torch.tensor([0, 3, 9])
    with Recorder(hc, positions=positions) as recorder:
        got = hc(x, branch)
    assert torch.equal(got, expected)
    capture = recorder.capture()
    full = hc.matrices(x)
    assert torch.allclose(capture.res[0], full["res"].flatten(0, 1)[positions], atol=1e-6)
    assert torch.allclose(capture.pre[0], full["pre"].flatten(0, 1)[positions], atol=1e-6)
    assert torch.allclose(capture.similarity[0], stream_similarity(x.flatten(0, 1)[positions]))
    assert not hc._forward_pre_hooks and not hc._forward_hooks  # removed on exit


def test_collect_on_a_model():
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 16))
    reference = model(ids)
    state = torch.get_rng_state()
    capture = collect(model, ids, tokens=20, batch_size=2, seed=1)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(model(ids), reference)
    assert capture.names == ["blocks.0.attn_hc", "blocks.0.mlp_hc", "blocks.1.attn_hc", "blocks.1.mlp_hc"]
    assert capture.res.shape == (4, 20, 4, 4) and capture.pre.shape == (4, 20, 4)
    assert capture.similarity.shape == (5, 20, 4, 4)
    assert torch.allclose(capture.similarity[0], torch.ones(20, 4, 4, dtype=torch.float64))  # expanded copies
    assert capture.similarity[-1].min() < 0.999  # the streams differ by the end
    s = capture.summary()
    assert s["layers"] == capture.names and all(c["holds"] for c in s["guarantees"])
    assert len(s["stream_similarity"]["offdiagonal"]["mean"]) == 5
    with pytest.raises(ValueError, match="nothing to measure"):
        collect(tiny_model("residual", 1), ids)


def test_gradient_norms_per_layer():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 8))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    norms = gradient_norms(model)
    assert {"embed", "blocks.0", "blocks.1", "norm"} <= set(norms["layers"])
    assert set(norms["hyper_connections"]) == {
        "blocks.0.attn_hc",
        "blocks.0.mlp_hc",
        "blocks.1.attn_hc",
        "blocks.1.mlp_hc",
    }
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    assert math.sqrt(sum(v * v for v in norms["layers"].values())) == pytest.approx(total, rel=1e-5)
    block0 = [p.grad for name, p in model.named_parameters() if name.startswith("blocks.0.")]
    assert norms["layers"]["blocks.0"] == pytest.approx(
        torch.cat([g.flatten() for g in block0]).norm().item(), rel=1e-5
    )
    record = training_diagnostics(model, ids, norms, tokens=8)
    assert record["grad_norm"] is norms and len(record["col_sum_error_max"]) == 4
    json.dumps(record, allow_nan=False)


# ------------------------------------------------------------------------------- the command, on checkpoints


@pytest.fixture(scope="module")
def runs(corpus_file, tmp_path_factory) -> dict[str, Path]:
    """Two-step checkpoints: s2hc (n = 4) and residual, sharing one token cache."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for mixer in ("s2hc", "residual"):
        config = small_config(corpus_file, root, family=mixer, n_streams=None, out=str(root / mixer))
        train(config)
        out[mixer] = Path(config.out)
    return out


def test_diagnose_a_checkpoint(runs, corpus_file, tmp_path, capsys):
    out = tmp_path / "diag"
    assert main(["diagnose", str(runs["s2hc"]), "--data", str(corpus_file), "--tokens", "100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "s2hc (n = 4), 4 connections, 100 tokens" in printed and "report.md" in printed
    data = json.loads((out / "diagnostics.json").read_text())
    head = data["headline"]  # the second line: the interior connections' measures, as the headline has them
    assert (f"connections that can change the output: largest ‖H − I‖_F {head['identity_distance_mean']:.3g}, "
            f"rotation angle {head['rotation_angle_mean']:.3g}°") in printed
    assert data["kind"] == "checkpoint" and data["family"] == "s2hc" and data["tokens"] == 100
    assert MEASUREMENT_KEYS | {"stream_similarity", "h_pre", "h_post"} <= set(data)
    assert data["layers"] == ["blocks.0.attn_hc", "blocks.0.mlp_hc", "blocks.1.attn_hc", "blocks.1.mlp_hc"]
    assert (
        max(data["col_sum_error"]["max"]) < 1e-5
        and abs(data["headline"]["composite_spectral_norm_at_depth"] - 1) < 1e-5
    )
    assert all(c["holds"] for c in data["guarantees"])
    report = (out / "report.md").read_text()
    for name in (*FIGURES, "stream_similarity.png", "stream_usage.png"):
        assert (out / name).stat().st_size > 5_000, name
        assert f"({name})" in report
    assert "| 3 `blocks.1.mlp_hc` |" in report


def test_diagnose_defaults_to_the_embedded_validation_split(runs, capsys):
    assert main(["diagnose", str(runs["s2hc"] / "checkpoint.pt"), "--tokens", "32"]) == 0
    out = runs["s2hc"] / "diagnostics"  # beside the checkpoint file
    data = json.loads((out / "diagnostics.json").read_text())
    assert data["data"] == "embedded" and data["split"] == "val" and data["tokens"] == 32


def test_diagnose_a_residual_checkpoint_has_nothing_to_measure(runs, tmp_path, capsys):
    out = tmp_path / "diag"
    assert main(["diagnose", str(runs["residual"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "nothing to measure" in printed and "'residual'" in printed and "0 mixing streams" in printed
    data = json.loads((out / "diagnostics.json").read_text())
    assert data["nothing_to_measure"] is True and data["checked"]["mixing_connections"] == 0
    assert data["checked"]["connections"] == 4
    assert "Nothing to measure" in (out / "report.md").read_text()


@pytest.mark.parametrize("kind", ["missing", "corrupt", "foreign", "empty-dir"])
def test_bad_checkpoints_exit_2_with_one_line(kind, tmp_path, capsys):
    path = tmp_path / "x.pt"
    if kind == "corrupt":
        path.write_bytes(os.urandom(200))
    elif kind == "foreign":
        torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    elif kind == "empty-dir":
        path = tmp_path / "run"
        path.mkdir()
    assert main(["diagnose", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("s2hc diagnose: error: ")
    expected = {"missing": "does not exist", "corrupt": "is not an s2hc checkpoint",
                "foreign": "is not an s2hc checkpoint", "empty-dir": "holds no checkpoint"}[kind]
    assert expected in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "exactly one"),
        (["somewhere", "--synthetic"], "exactly one"),
        (["--synthetic", "--data", "x.txt"], "--data"),
        (["ckpt", "--logit-scale", "2"], "--logit-scale"),
        (["--synthetic", "--families", "sinkhorn"], "must be one of"),
        (["--synthetic", "--logit-scale", "-1"], "logit-scale"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(["diagnose", *argv]) == 2
    assert message in capsys.readouterr().err


def test_diagnose_synthetic_command(tmp_path, capsys):
    out = tmp_path / "syn"
    argv = ["diagnose", "--synthetic", "--families", "mhc,s2hc,hc", "--layers", "28", "--streams", "4",
            "--logit-scale", "4", "--tokens", "128", "--sweep", "0.5,8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| `s2hc` |" in printed and "logit scale S = 4" in printed
    data = json.loads((out / "diagnostics.json").read_text())
    assert data["depth"] == 28 and data["n_streams"] == 4 and data["tokens"] == 128
    assert abs(data["headline"]["s2hc"]["composite_spectral_norm_at_depth"] - 1) < 1e-4
    assert data["headline"]["mhc"]["col_sum_error"] > 1e-3
    assert data["headline"]["hc"]["composite_backward_amax"] > 1e6
    assert data["settings"]["sweep"] == [0.5, 4.0, 8.0]
    for name in (*FIGURES, "logit_scale_sweep.png"):
        assert (out / name).stat().st_size > 5_000


# ------------------------------------------------------------------------------------------------ training


def _losses(run_dir) -> list:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def _diagnostics(run_dir) -> list:
    return [(r["step"], r["diagnostics"]) for r in read_metrics(run_dir) if "diagnostics" in r]


def test_training_logs_diagnostics_and_resumes_exactly(corpus_file, tmp_path):
    config = small_config(corpus_file, tmp_path, max_steps=6, diagnostics_every=2, checkpoint_every=2, log_every=1,
                          eval_every=0, lr=3e-3)
    train(config)
    records = _diagnostics(config.out)
    assert [step for step, _ in records] == [2, 4, 6]
    first = records[0][1]
    assert first["layers"] == ["blocks.0.attn_hc", "blocks.0.mlp_hc", "blocks.1.attn_hc", "blocks.1.mlp_hc"]
    assert {"blocks.0", "blocks.1", "embed"} <= set(first["grad_norm"]["layers"])
    assert len(first["grad_norm"]["hyper_connections"]) == 4
    assert max(first["col_sum_error_max"]) < 1e-5 and len(first["stream_similarity_mean"]) == 5

    plain = config.replace(diagnostics_every=0, out=str(tmp_path / "plain"))
    train(plain)
    assert _losses(plain.out) == _losses(config.out)  # measuring changes nothing about training
    assert not _diagnostics(plain.out)

    interrupted = config.replace(out=str(tmp_path / "interrupted"))
    crash_after_checkpoint(interrupted, 4)
    assert load_checkpoint(interrupted.out).step == 4
    train(interrupted, resume=True)
    assert _losses(interrupted.out) == _losses(config.out)
    assert _diagnostics(interrupted.out) == records

    # and `s2hc diagnose` on that run draws its history
    assert main(["diagnose", config.out, "--data", str(corpus_file), "--tokens", "32"]) == 0
    assert (Path(config.out) / "diagnostics" / "training_history.png").stat().st_size > 5_000


