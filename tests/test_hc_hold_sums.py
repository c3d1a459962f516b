"""HC's ``hold_sums`` ablation and the common-mode gain that it removes (``diagnostics.measures.common_mode_gain``)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SMALL_MODEL, capture_of, randomize_
from hypothesis import given, settings
from hypothesis import strategies as st

from s2hc import HyperConnection, mixers
from s2hc.diagnostics import training_diagnostics
from s2hc.diagnostics.measures import common_mode_gain
from s2hc.diagnostics.summary import summarize

MODES = ("rows", "columns", "both")


def _reference(H: torch.Tensor, mode: str) -> torch.Tensor:
    """The Frobenius-nearest matrix with the held sums, written out in float64 from the sets' definitions."""
    H = H.double()
    n = H.shape[-1]
    one = torch.ones(n, 1, dtype=torch.float64)
    J = one @ one.T / n
    P = torch.eye(n, dtype=torch.float64) - J
    if mode == "rows":
        return H + (one - H @ one) @ one.T / n
    if mode == "columns":
        return H + one @ (one.T - one.T @ H) / n
    return P @ H @ P + J


def _mixers(n: int, seed: int) -> dict[str, mixers.Mixer]:
    """HC's mixer with each ``hold_sums``, sharing one set of random parameters (B and α off their start)."""
    generator = torch.Generator().manual_seed(seed)
    built = {mode: mixers.build("hc", n, hold_sums=mode) for mode in ("none", *MODES)}
    randomize_(built["none"], generator, 0.5)
    for mixer in built.values():
        mixer.load_state_dict(built["none"].state_dict())
    return built


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_the_held_sums_are_one_and_the_matrix_is_the_nearest_such(n, scale, seed):
    built = _mixers(n, seed)
    d = scale * torch.randn(5, n * n, generator=torch.Generator().manual_seed(seed + 1))
    free = built["none"](d)
    for mode in MODES:
        held = built[mode](d)
        assert held.dtype == torch.float32
        if mode in ("rows", "both"):
            torch.testing.assert_close(held.sum(-1), torch.ones(5, n), atol=2e-6, rtol=0)
        if mode in ("columns", "both"):
            torch.testing.assert_close(held.sum(-2), torch.ones(5, n), atol=2e-6, rtol=0)
        torch.testing.assert_close(held.double(), _reference(free, mode), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(common_mode_gain(held), torch.ones(5, dtype=torch.float64), atol=2e-6, rtol=0)
        # a projection: a matrix already in the set is left as it is
        torch.testing.assert_close(_reference(held, mode), held.double(), atol=2e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_through_the_held_sums(mode):
    mixer = mixers.build("hc", 3, hold_sums=mode).double()
    d = torch.randn(2, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mixer.mix, (d,))


@pytest.mark.parametrize("mode", MODES)
def test_held_sums_start_as_hc_itself(mode):
    """``I`` is in every set, so at initialisation (``H_res = I``) the connection is HC's, output for output."""
    torch.manual_seed(0)
    paper = HyperConnection(16, 4, family="hc", layer_index=1)
    torch.manual_seed(0)
    held = HyperConnection(16, 4, family="hc", layer_index=1, hold_sums=mode)
    x = torch.randn(2, 3, 4, 16)
    torch.testing.assert_close(held(x, torch.tanh), paper(x, torch.tanh), atol=0, rtol=0)
    assert f"hold_sums='{mode}'" in repr(held)


@pytest.mark.parametrize("value", ["row", 1, None, True])
def test_a_bad_hold_sums_is_refused_naming_the_choices(value):
    with pytest.raises(ValueError, match=r"hold_sums must be one of \['none', 'rows', 'columns', 'both'\]"):
        mixers.build("hc", 4, hold_sums=value)


# ------------------------------------------------------------------------------------------ the common mode


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_the_common_mode_gain_is_the_mean_row_sum_and_the_mean_column_sum(n, seed):
    H = torch.randn(3, 2, n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    gain = common_mode_gain(H)
    assert gain.shape == (3, 2)
    torch.testing.assert_close(gain, H.sum(-1).mean(-1))
    torch.testing.assert_close(gain, H.sum(-2).mean(-1))
    copies = torch.ones(n, 1, dtype=torch.float64)  # what H does to a feature every stream shares, on average
    torch.testing.assert_close(gain, (H @ copies).squeeze(-1).mean(-1))


def test_the_summary_and_the_training_record_carry_the_common_mode():
    H = torch.eye(3).repeat(2, 4, 1, 1) * 1.5  # two layers, four tokens, every matrix 1.5 I
    s = summarize(capture_of(H))
    assert s["common_mode_gain"]["mean"] == [1.5, 1.5] and s["row_sums"]["min"] == [1.5, 1.5]
    assert s["composite_common_mode_gain"]["mean"] == pytest.approx([1.5, 2.25])
    assert s["headline"]["common_mode_gain_max"] == 1.5
    assert s["headline"]["composite_common_mode_gain_at_depth"] == pytest.approx(2.25)

    from s2hc.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family="hc", n_streams=4, vocab_size=97, **SMALL_MODEL))
    randomize_(model, torch.Generator().manual_seed(1), 0.3)
    record = training_diagnostics(model, torch.randint(0, 97, (2, 8)), tokens=8)
    for key in ("common_mode_gain_mean", "row_sum_min", "row_sum_max", "column_sum_min", "column_sum_max",
                "composite_common_mode_gain_mean"):
        assert len(record[key]) == 4, key  # one per connection
    assert any(abs(g - 1) > 1e-3 for g in record["common_mode_gain_mean"])  # HC off its start: a gain
    assert all(lo <= g <= hi for lo, g, hi in zip(record["row_sum_min"], record["common_mode_gain_mean"],
                                                  record["row_sum_max"]))
    json.dumps(record, allow_nan=False)


def test_the_trajectory_follows_the_common_mode_over_the_interior_connections():
    from s2hc.study.measure import trajectory

    record = {"deviation_singular_values_mean": [[1.0], [0.9], [0.8]], "inert_layers": [0],
              "rotation_angle_mean": [0.0, 1.0, 2.0], "composite_forward_amax_max": [1.0, 1.0, 1.0],
              "stream_similarity_mean": [1.0, 1.0, 1.0, 1.0], "common_mode_gain_mean": [9.0, 1.2, 1.4],
              "composite_common_mode_gain_mean": [9.0, 10.8, 15.1]}
    found = trajectory([{"step": 25, "diagnostics": record}])
    assert found["common_mode_gain"] == [pytest.approx(1.3)]  # the inert first connection left out
    assert found["composite_common_mode_gain"] == [15.1]
    older = {k: v for k, v in record.items() if "common_mode" not in k}  # a run recorded before the measure
    assert "common_mode_gain" not in trajectory([{"step": 25, "diagnostics": older}])
