"""``s2hc.params`` and the ``s2hc params`` command: counts from real modules, the paper's figures, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import s2hc
from s2hc import cli
from s2hc.connection import forms
from s2hc.params import count_connection_params, human, param_table

PAPER = dict(layers=28, dim=1024, n_streams=7)  # the s²HC paper's 1.3 B-class shape, n = 7
PAPER_ARGV = ["params", "--layers", "28", "--dim", "1024", "--streams", "7", "--json"]


# ----------------------------------------------------------------------------------- independent formula


def mixer_extra(family: str, n: int) -> int:
    """Parameters of the family itself (its α, b, γ), read off the family's code.

    mhc: one α and an n × n bias. s2hc (m = n − 1): two rotations, each α, γ and k = m(m−1)/2 biases,
    plus the spectrum's α and m biases: 2(k + 2) + 1 + m = m² + 5. mhc-lite: one α and n! biases.
    """
    m = n - 1
    return {"mhc": n * n + 1, "s2hc": m * m + 5, "mhc-lite": math.factorial(n) + 1}[family]


def num_inputs(family: str, n: int) -> int:
    return {"mhc": n * n, "s2hc": (n - 1) ** 2, "mhc-lite": math.factorial(n)}[family]


def formula(family: str, *, layers: int, dim: int, n_streams: int, sublayers_per_layer: int = 2) -> int:
    """``layers·sub·(nC(2n+K) + nC + extra)``: projection W, RMSNorm weight, then the small scalars.

    extra = the connection's α_pre, α_post, b_pre (n), b_post (n) — 2n + 2 — plus :func:`mixer_extra`;
    so mhc: n² + 2n + 3 and s2hc: (n−1)² + 2n + 7.
    """
    n, c, k = n_streams, dim, num_inputs(family, n_streams)
    extra = 2 * n + 2 + mixer_extra(family, n)
    return layers * sublayers_per_layer * (n * c * (2 * n + k) + n * c + extra)


def test_extra_terms_spelled_out():
    # The closed forms quoted in the docstring, at n = 7: mhc 49 + 14 + 3, s2hc 36 + 14 + 7.
    assert 2 * 7 + 2 + mixer_extra("mhc", 7) == 66
    assert 2 * 7 + 2 + mixer_extra("s2hc", 7) == 57


@pytest.mark.parametrize("family", ["mhc", "s2hc", "mhc-lite"])
@given(
    layers=st.integers(1, 3),
    dim=st.integers(1, 24),
    n_streams=st.integers(2, 5),
    sublayers_per_layer=st.integers(1, 3),
)
def test_formula_matches_modules_really_built_on_cpu(family, layers, dim, n_streams, sublayers_per_layer):
    # Real allocation: every connection built on the CPU, as a model would, and its parameters counted.
    sublayers = layers * sublayers_per_layer
    options = {"allow_large": True} if family == "mhc-lite" else {}
    with torch.device("cpu"):
        built = [
            s2hc.HyperConnection(dim, n_streams, family=family, layer_index=i, **options) for i in range(sublayers)
        ]
    assert all(p.device.type == "cpu" and not p.is_meta for hc in built for p in hc.parameters())
    real = sum(p.numel() for hc in built for p in hc.parameters())
    shape = dict(layers=layers, dim=dim, n_streams=n_streams, sublayers_per_layer=sublayers_per_layer)
    assert real == formula(family, **shape)
    assert count_connection_params(family, **shape) == real  # the meta count equals real allocation


@pytest.mark.parametrize("family", ["mhc", "s2hc", "mhc-lite"])
def test_counts_equal_formula_at_paper_shape(family):
    assert count_connection_params(family, **PAPER) == formula(family, **PAPER)


def test_paper_shape_mhc_lite_is_counted_without_allocating():
    # ~2 B parameters (8 GB in float32): only countable because nothing is allocated.
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (row,) = param_table(["mhc-lite"], **PAPER, sublayers_per_layer=2)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB: far below 8 GB
    assert row["K"] == 5040
    assert row["hc_params"] == formula("mhc-lite", **PAPER)


# ------------------------------------------------------------------------------------ the paper's figures


def check_paper_rows(rows: list[dict]) -> None:
    by_name = {row["family"]: row for row in rows}
    assert set(by_name) == set(s2hc.families())
    assert 25e6 <= by_name["mhc"]["hc_params"] <= 27e6  # paper: ≈ 26 M
    assert 19.5e6 <= by_name["s2hc"]["hc_params"] <= 21e6  # paper: ≈ 20 M
    assert 1.9e9 <= by_name["mhc-lite"]["hc_params"] <= 2.1e9  # paper: ≈ 2 B
    assert by_name["residual"]["hc_params"] == 0
    assert by_name["mhc"]["vs_mhc"] == 1.0
    for row in rows:
        assert row["sublayers"] == 56 and row["layers"] == 28 and row["dim"] == 1024
        assert row["n_streams"] == (1 if forms.get(row["family"]).max_streams == 1 else 7)
        assert row["per_sublayer"] * 56 == row["hc_params"]


def test_paper_figures_via_main(capsys):
    assert cli.main(PAPER_ARGV) == 0
    rows = json.loads(capsys.readouterr().out)
    check_paper_rows(rows)
    assert rows == json.loads(json.dumps(param_table(None, **PAPER, sublayers_per_layer=2)))


def test_paper_figures_via_python_m_s2hc():
    result = subprocess.run(
        [sys.executable, "-m", "s2hc", *PAPER_ARGV], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    check_paper_rows(json.loads(result.stdout))


def test_console_script_points_at_cli_main():
    (script,) = entry_points(group="console_scripts", name="s2hc")
    assert script.load() is cli.main


# ------------------------------------------------------------------------------------------ table output


def test_table_lists_every_family(capsys):
    assert cli.main(["params", "--layers", "28", "--dim", "1024", "--streams", "7"]) == 0
    out = capsys.readouterr().out
    assert ("| family | K | per sublayer | total | vs mHC | head | with head | vs mHC with head | "
            "connection FLOPs / token (fwd) |") in out  # not the model's
    for name in s2hc.families():
        assert f"| {name} |" in out
    assert "25.7 M (25,693,808)" in out  # human and exact
    assert "2.03 B" in out


def test_mixers_subset_without_mhc_has_no_ratio(capsys):
    assert cli.main(["params", "--families", "s2hc, residual", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["family"] for row in rows] == ["s2hc", "residual"]
    assert all(row["vs_mhc"] is None for row in rows)
    assert rows[0]["n_streams"] == 4 and rows[0]["layers"] == 28 and rows[0]["dim"] == 1024  # defaults


def test_residual_counts_zero_with_one_stream():
    assert count_connection_params("residual", layers=28, dim=1024, n_streams=7) == 0
    (row,) = param_table(["residual"], layers=2, dim=8, n_streams=4)
    assert row["n_streams"] == 1 and row["K"] == 0 and row["hc_params"] == 0


@pytest.mark.parametrize(
    ("count", "text"), [(0, "0"), (999, "999"), (107_536, "108 K"), (25_693_808, "25.7 M"), (999_999, "1 M"),
                        (2_029_400_632, "2.03 B")]
)
def test_human_numbers(count, text):
    assert human(count) == text


# -------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--layers", "0"], ["--layers", "0", ">= 1"]),
        (["--dim", "0"], ["--dim", "0", ">= 1"]),
        (["--dim", "-3"], ["--dim", "-3", ">= 1"]),
        (["--streams", "0"], ["--streams", "0", ">= 1"]),
        (["--streams", "two"], ["--streams", "two", ">= 1"]),
        (["--sublayers-per-layer", "0"], ["--sublayers-per-layer", "0", ">= 1"]),
        (["--families", "mhc,nope"], ["--families", "nope", "must be one of", "s2hc"]),
        (["--families", ","], ["--families", "allowed"]),
    ],
)
def test_bad_input_exits_2_naming_the_argument(capsys, argv, needles):
    assert cli.main(["params", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = [line for line in captured.err.splitlines() if line.startswith("s2hc params: error: ")]
    for needle in needles:
        assert needle in line


@pytest.mark.parametrize(("argv", "needles"), [
    (["--families", "wide-residual", "--streams", "1"], ["wide-residual", "n_streams must be at least 2"]),
    (["--families", "attn-res:block_size=100", "--layers", "2"], ["'block_size' of 'attn-res'", "[1, 4], got 100"]),
    (["--families", "mhc:alpha=.nan"], ["'alpha' of 'mhc' must be a finite number"]),
])
def test_params_refuses_what_train_refuses(capsys, argv, needles):
    """A model `s2hc train` would refuse is not priced either: the same checks (the config's, the model's)."""
    assert cli.main(["params", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("s2hc params: error: ") and "as `s2hc train` refuses it" in line
    for needle in needles:
        assert needle in line


def test_the_default_table_leaves_out_what_train_refuses_and_says_so(capsys):
    assert cli.main(["params", "--streams", "1", "--layers", "2", "--dim", "32", "--json"]) == 0
    captured = capsys.readouterr()
    listed = {row["family"] for row in json.loads(captured.out)}
    assert "wide-residual" not in listed and "mhc" in listed
    assert "left out, as `s2hc train` refuses them here: " in captured.err
    assert "wide-residual (n_streams" in captured.err


def test_bad_input_through_python_m_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "s2hc", "params", "--families", "bogus"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "s2hc params: error: argument --families must be one of" in result.stderr and "got 'bogus'" in result.stderr


def test_missing_subcommand_exits_2(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(family="nope", layers=1, dim=1, n_streams=2), "family must be one of"),
        (dict(family="mhc", layers=0, dim=1, n_streams=2), r"layers must be an integer in \[1, 10000\], got 0"),
        (dict(family="mhc", layers=1, dim=0, n_streams=2), "dim must be an integer >= 1, got 0"),
        (dict(family="mhc", layers=1, dim=1, n_streams=0), "n_streams must be an integer >= 1, got 0"),
        (dict(family="mhc", layers=1, dim=1, n_streams=2, sublayers_per_layer=0), "sublayers_per_layer"),
    ],
)
def test_library_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        count_connection_params(**kwargs)


def test_the_gated_residuals_head_is_counted_as_a_trained_model_counts_it():
    """``with head`` is what a model of the family counts as its connection parameters (a study row's
    ``hc_params``): the connections and the learned read its default ``stream_reduce`` builds."""
    from s2hc.models import Transformer, get_preset
    from s2hc.params import param_table

    rows = {row["family"]: row for row in param_table(["mhc", "gated-residual", "attn-res"], layers=2, dim=32,
                                                         n_streams=4)}
    for family, row in rows.items():
        model = Transformer(get_preset("tiny", family=family, n_streams=1 if family == "attn-res" else 4,
                                       n_layers=2, dim=32, n_heads=4, ffn_dim=64, vocab_size=64))
        assert row["with_head"] == model.num_connection_params(), family
    assert rows["gated-residual"]["head_params"] > 0 and rows["mhc"]["head_params"] == 0
    assert rows["gated-residual"]["vs_mhc_with_head"] > rows["gated-residual"]["vs_mhc"]
