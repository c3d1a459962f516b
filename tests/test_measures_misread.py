"""Diagnostics that cannot be misread: the rotation angle, the spectrum slope and the negative share with
its tolerance on constructed matrices and against independent references; the connections whose ``H_res`` cannot
change the output, found from the model and checked by perturbing them, reported apart by ``summarize``; and the
study report built from rows written before these measures (a dash) and after (values)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from helpers import capture_of
from hypothesis import given, settings
from hypothesis import strategies as st

from s2hc import HyperConnection
from s2hc.diagnostics import (
    NEGATIVE_TOLERANCE,
    Recorder,
    collect,
    inert_connections,
    negative_share,
    rotation_angle,
    spectrum_slope,
    summarize,
    training_diagnostics,
)
from s2hc.mixers.orthomaps import helmert_basis
from s2hc.models import Transformer, get_preset
from s2hc.reports import DASH
from s2hc.study import report as study_report
from s2hc.study.measure import MIXING_VERSION, ROW_VERSION, compact_diagnostics

TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 64}


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def zero_sum_matrix(core: torch.Tensor) -> torch.Tensor:
    """``J + U_Z core U_Zᵀ``: the s²HC form (``core`` acts on the differences between streams), built here."""
    n = core.shape[-1] + 1
    basis = helmert_basis(n)
    return torch.full((n, n), 1.0 / n, dtype=torch.float64) + basis @ core @ basis.T


def plane_rotation(m: int, theta: float, i: int = 0, j: int = 1) -> torch.Tensor:
    R = torch.eye(m, dtype=torch.float64)
    R[i, i] = R[j, j] = math.cos(theta)
    R[i, j], R[j, i] = -math.sin(theta), math.sin(theta)
    return R


# ------------------------------------------------------------------------------- constructed matrices


@pytest.mark.parametrize("theta", [0.05, 0.7, 2.0, 3.0])
def test_a_rotation_in_a_plane_of_the_differences_gives_its_angle_and_no_slope(theta):
    H = zero_sum_matrix(plane_rotation(3, theta, 1, 2))
    assert rotation_angle(H).item() == pytest.approx(math.degrees(theta), abs=1e-9)
    assert spectrum_slope(H) == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)  # every singular value stays 1


def test_a_diagonal_shrink_has_no_angle_and_the_slope_of_its_spectrum():
    s = [0.9, 0.5, 0.1]
    H = zero_sum_matrix(torch.diag(t(s)))
    assert rotation_angle(H).item() == pytest.approx(0.0, abs=1e-9)
    assert spectrum_slope(H) == pytest.approx([1 - v * v for v in s], abs=1e-12)


def test_a_flip_is_180_degrees_and_the_identity_0():
    flip = zero_sum_matrix(torch.diag(t([1.0, 1.0, -1.0])))  # one difference reversed: a reflection
    assert rotation_angle(flip).item() == pytest.approx(180.0, abs=1e-9)
    swap = t([[0.0, 1.0], [1.0, 0.0]])  # two streams exchanged: x₁ − x₂ -> x₂ − x₁
    assert rotation_angle(swap).item() == pytest.approx(180.0, abs=1e-9)
    eye = torch.eye(4, dtype=torch.float64)
    assert rotation_angle(eye).item() == pytest.approx(0, abs=1e-9)
    assert spectrum_slope(eye) == pytest.approx([0.0] * 3, abs=1e-12)


def test_one_stream_has_no_difference_to_turn():
    H = torch.ones(5, 1, 1)
    assert torch.equal(rotation_angle(H), torch.zeros(5, dtype=torch.float64))
    assert spectrum_slope(H).shape == (5, 0)


def test_a_rotation_with_a_spectrum_is_seen_through_it():
    """The s²HC case: the angle is the rotation's whatever the spectrum; the σ of a rotation are all 1."""
    R = plane_rotation(3, 0.4)
    H = zero_sum_matrix(R @ torch.diag(t([0.999, 0.999, 0.999])))  # a saturated spectrum, tanh(4)-like
    assert rotation_angle(H).item() == pytest.approx(math.degrees(0.4), abs=1e-9)
    assert spectrum_slope(H) == pytest.approx([1 - 0.999**2] * 3, abs=1e-12)


def test_negative_entries_closer_to_zero_than_the_tolerance_are_not_counted():
    assert NEGATIVE_TOLERANCE == 1e-3
    noise = t([[1.0, -5e-4], [5e-4, 1.0]])
    assert negative_share(noise).item() == 0
    assert negative_share(noise, tolerance=0).item() == 0.25  # every x < 0, as before
    assert negative_share(t([[1.0, -2e-3], [2e-3, 1.0]])).item() == 0.25
    for bad in (-1e-3, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
            negative_share(noise, tolerance=bad)


def _orthogonal(seed: int, m: int, proper: bool) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((m, m)))
    q = q * np.sign(np.diag(r))
    if proper and np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 5), proper=st.booleans(),
       s=st.lists(st.floats(0.05, 1.0), min_size=5, max_size=5))
def test_the_angle_of_random_s2hc_like_matrices_is_that_of_their_rotations(seed, m, proper, s):
    """``H = J + U_Z U diag(s) Vᵀ U_Zᵀ``: the angle is max |arg λ| of ``U Vᵀ``'s eigenvalues (numpy, not the
    SVD the measure uses), for every spectrum s > 0; the slope is 1 − s² (sorted as σ)."""
    U, V = _orthogonal(seed, m, proper), _orthogonal(seed + 1, m, proper)
    spectrum = np.array(s[:m])
    H = zero_sum_matrix(torch.from_numpy(U @ np.diag(spectrum) @ V.T))
    expected = np.degrees(np.abs(np.angle(np.linalg.eigvals(U @ V.T))).max()) if m else 0.0
    assert rotation_angle(H).item() == pytest.approx(expected, abs=1e-6)
    if m == 3 and proper:  # a rotation of 3-space: θ = arccos((tr Q − 1) / 2), no eigenvalues at all
        trace = np.trace(U @ V.T)
        assert rotation_angle(H).item() == pytest.approx(np.degrees(np.arccos(np.clip((trace - 1) / 2, -1, 1))),
                                                         abs=1e-5)
    assert spectrum_slope(H).numpy() == pytest.approx(1 - np.sort(spectrum)[::-1] ** 2, abs=1e-10)


def test_the_slope_of_a_tanh_spectrum_is_tanhs_derivative():
    a = torch.tensor([4.0, 1.0, -0.3], dtype=torch.float64, requires_grad=True)
    torch.tanh(a).sum().backward()
    H = zero_sum_matrix(torch.diag(torch.tanh(a.detach())))
    slope = spectrum_slope(H)  # descending σ: |tanh| 0.9993, 0.76, 0.29
    assert slope == pytest.approx(a.grad[[0, 1, 2]].tolist(), rel=1e-10)
    assert slope[0].item() == pytest.approx(1.34e-3, rel=1e-2)  # the initial bias 4: saturated


# ------------------------------------------------------------------------------- summaries: inert apart


def _stack(*layers: torch.Tensor, tokens: int = 3) -> torch.Tensor:
    return torch.stack([H.expand(tokens, *H.shape) for H in layers])


def test_summarize_puts_the_inert_connections_apart():
    subtracting = zero_sum_matrix(plane_rotation(3, 1.2))  # three entries of −0.33, and rounding's −6e-17
    assert negative_share(subtracting).item() == 3 / 16
    eye = torch.eye(4, dtype=torch.float64)
    s = summarize(capture_of(_stack(subtracting, eye, zero_sum_matrix(torch.diag(t([0.5, 0.5, 0.5])))), inert=[0]))
    head = s["inert_layers"], s["headline"]
    assert head[0] == [0] and s["negative_tolerance"] == NEGATIVE_TOLERANCE
    assert head[1]["negative_share_mean"] == 0 and head[1]["negative_share_inert"] == 3 / 16
    assert head[1]["rotation_angle_mean"] == pytest.approx(0, abs=1e-9)
    assert head[1]["rotation_angle_inert"] == pytest.approx(math.degrees(1.2))
    assert head[1]["identity_distance_mean"] == pytest.approx(0.5 * math.sqrt(3))  # the shrink, not the rotation
    assert head[1]["spectrum_slope_mean"] == pytest.approx((0 + 3 * 0.75) / 6)  # mean over 2 layers × 3
    assert s["rotation_angle"]["mean"][0] == pytest.approx(math.degrees(1.2))  # still measured per layer
    everything = summarize(capture_of(_stack(subtracting, eye)))
    assert everything["inert_layers"] == [] and everything["headline"]["negative_share_mean"] == 3 / 16
    assert everything["headline"]["negative_share_inert"] is None
    json.dumps(s, allow_nan=False)


def test_a_model_whose_every_connection_is_inert_has_no_interior_values():
    s = summarize(capture_of(_stack(torch.eye(3), torch.eye(3)), inert=[1, 0, 1]))
    assert s["inert_layers"] == [0, 1]
    assert all(s["headline"][f"{name}_mean"] is None
               for name in ("identity_distance", "rotation_angle", "spectrum_slope", "negative_share"))
    assert s["headline"]["identity_distance_inert"] == 0
    with pytest.raises(ValueError, match=r"inert_layers must be indices of the 2 layers \(0 to 1\), got \[2\]"):
        summarize(capture_of(_stack(torch.eye(3), torch.eye(3)), inert=[2]))


# ------------------------------------------------------------------------------- the collector knows the model


def model(family: str = "s2hc", stream_reduce: str = "sum", n_layers: int = 2) -> Transformer:
    torch.manual_seed(0)
    built = Transformer(get_preset("tiny", family=family, n_streams=4, stream_reduce=stream_reduce,
                                   **{**TINY, "n_layers": n_layers}))
    with torch.no_grad():  # off the initialisation, so the matrices mix
        for hc in (m for m in built.modules() if isinstance(m, HyperConnection)):
            for p in hc.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return built


@pytest.mark.parametrize("family, stream_reduce, expected", [
    ("s2hc", "sum", [0, 3]), ("s2hc", "mean", [0, 3]), ("s2hc", "head", [0]), ("mhc", "sum", [0]),
    ("hc", "sum", []),
])
def test_the_collector_marks_the_connections_that_cannot_change_the_output(family, stream_reduce, expected):
    ids = torch.randint(0, 64, (2, 8))
    capture = collect(model(family, stream_reduce), ids, tokens=8)
    assert capture.inert == expected and capture.summary()["inert_layers"] == expected
    record = training_diagnostics(model(family, stream_reduce), ids, tokens=8)
    assert record["inert_layers"] == expected and len(record["rotation_angle_mean"]) == 4


def test_one_block_every_connection_inert_and_the_headline_says_none():
    capture = collect(model(n_layers=1), torch.randint(0, 64, (2, 8)), tokens=8)
    summary = capture.summary()
    assert summary["inert_layers"] == [0, 1] and summary["headline"]["negative_share_mean"] is None


def test_a_bare_connection_is_not_a_model_nothing_is_called_inert():
    hc = HyperConnection(8, n_streams=3, family="s2hc")
    with Recorder(hc) as recorder:
        hc(torch.randn(1, 3, 3, 8), torch.tanh)
    assert recorder.capture().inert == []
    assert inert_connections(["s2hc"], stream_reduce="sum") == [0]
    assert inert_connections(["mhc", "mhc"], [True, True], "sum") == [1]  # transposed: rows and columns swap
    with pytest.raises(ValueError, match="stream_reduce must be one of"):
        inert_connections(["s2hc"], stream_reduce="max")


def _perturbed_output(base: Transformer, connection: int, ids: torch.Tensor) -> float:
    """How far the logits move when only ``connection``'s H_res changes (its mixer's parameters), in float64."""
    other = copy.deepcopy(base)
    hcs = [m for m in other.modules() if isinstance(m, HyperConnection)]
    with torch.no_grad():
        for p in hcs[connection].mixer.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return (other(ids) - base(ids)).abs().max().item()


def test_the_inert_connections_h_res_really_cannot_change_the_output():
    """The claim itself, in float64: perturbing the mixer (so H_res) of an inert connection leaves the logits
    unchanged to rounding; perturbing an interior one moves them."""
    base = model(n_layers=2).double()
    ids = torch.randint(0, 64, (2, 8))
    moved = [_perturbed_output(base, i, ids) for i in range(4)]
    assert collect(base, ids).inert == [0, 3]
    assert moved[0] < 1e-10 and moved[3] < 1e-10 and min(moved[1], moved[2]) > 1e-4


# ------------------------------------------------------------------------------- the study report


def _row(name: str, version: int, diagnostics: dict | None) -> dict:
    return {"name": name, "label": "s2hc n=4", "family": "s2hc", "options": {}, "n_streams": 4, "seed": 0,
            "status": "finished", "diagnostics": diagnostics, "version": version}


def _version3_diagnostics() -> dict:
    capture = collect(model(), torch.randint(0, 64, (2, 8)), tokens=8)
    return compact_diagnostics(capture.summary())


def test_the_study_report_dashes_rows_written_before_the_measures():
    assert ROW_VERSION == MIXING_VERSION == 3
    old = json.loads(json.dumps(_version3_diagnostics()))
    for key in ("identity_distance_mean", "rotation_angle_mean", "spectrum_slope_mean", "negative_share_inert"):
        del old["headline"][key]  # what a version-1 row holds: none of them, and negative_share_mean meaning other
    old["headline"]["negative_share_mean"] = 0.375
    del old["inert_layers"]  # nor did it record which connections cannot change the output
    lines = study_report.diagnostics_table({"rows": [_row("s2hc-n4-seed0", 1, old)]})
    header, _, row = lines[:3]
    assert "rotation angle (°)" in header and "negative entries (cannot change the output)" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "s2hc n=4" and cells[2:4] == [DASH] * 2 and cells[5] == DASH and cells[7] == DASH
    assert cells[4] != DASH  # the smallest deviation σ was measured then too
    # ‖H − I‖_F and the most negative entry come from the per-layer statistics, over the connections the family
    # and the default stream_reduce ("sum") make interior: for s2hc all but the first and the last
    interior = [1, 2]
    assert cells[1] == f"{max(old['identity_distance']['mean'][i] for i in interior):.3g}"
    assert cells[6] == f"{min(old['min_entry']['min'][i] for i in interior):.3g}"
    text = "\n".join(lines)
    assert "Rows measured before version 3 (all 1 measured rows)" in text and "re-run the study" in text
    assert "the angle column shows what the σ column cannot" in text


def test_the_study_report_shows_the_measures_of_a_version_3_row():
    new = _version3_diagnostics()
    assert new["inert_layers"] == [0, 3] and len(new["rotation_angle"]["mean"]) == 4
    head = new["headline"]
    rows = [_row("s2hc-n4-seed0", 3, new), {**_row("s2hc-n4-seed1", 1, new), "seed": 1}]
    lines = study_report.diagnostics_table({"rows": rows})
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[1] == f"{head['identity_distance_mean']:.3g}" and cells[2] == f"{head['rotation_angle_mean']:.3g}"
    assert cells[3] == f"{head['spectrum_slope_mean']:.3g}" and cells[7] == f"{head['negative_share_inert']:.3g}"
    assert cells[6] == f"{min(new['min_entry']['min'][i] for i in (1, 2)):.3g}"  # the recorded inert layers left out
    assert "1 of 2 measured rows: `s2hc-n4-seed1`" in "\n".join(lines)
    assert not any("before version" in line for line in study_report.diagnostics_table({"rows": rows[:1]}))
