"""Every count bounded, every silently ignored or duplicated setting refused.

A count read from a file or a flag (Sinkhorn iterations, seeds, layers, the n! permutation table) has a documented
maximum checked where that value is validated, so a 1 KB edit cannot make a command run for ever or run out of
memory; a setting that would be ignored (``model_overrides.family``), a NaN tensor, a non-positive ``eps`` or a
study that trains one model twice are refused with one line naming the argument or file.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from helpers import SMALL_MODEL, capture_of

import s2hc
from s2hc import cli, mixers
from s2hc.compat import get_init_and_expand_reduce_stream_functions
from s2hc.config import TrainConfig
from s2hc.diagnostics.summary import summarize
from s2hc.mixers.mhc import MAX_ITERATIONS
from s2hc.mixers.mhc_lite import MAX_BUILT_PERMUTATION_SIZE
from s2hc.params import count_connection_params
from s2hc.study.spec import MAX_SEEDS, parse_spec

SMALL = "model_overrides={" + ", ".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "}"


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``(status, the last line of stderr)``, checking that stderr holds no traceback."""
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    return status, lines[-1] if lines else ""


def assert_refused(argv: list[str], capsys, *fragments: str) -> None:
    status, line = run_cli(argv, capsys)
    assert status == 2, line
    assert line.startswith(f"s2hc {argv[0]}: error: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


# ------------------------------------------------------------------------ 8: counts read from config.json


def write_deepseek_v4(directory, config: dict, bias: float = 0.0):
    """A 1 KB DeepSeek-V4 checkpoint: one layer's attn/ffn ``base`` and ``scale`` (n = 2), and ``config``."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    directory.mkdir()
    n = 2
    tensors = {}
    for sublayer in ("attn", "ffn"):
        tensors[f"layers.0.{sublayer}_hc.base"] = torch.full(((2 + n) * n,), bias)
        tensors[f"layers.0.{sublayer}_hc.scale"] = torch.full((3,), 0.01)
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("config", "fragments"), [
    ({"hc_sinkhorn_iters": 10**11}, ["hc_sinkhorn_iters must be an integer in [1, 10000], got 100000000000"]),
    ({"hc_sinkhorn_iters": "many"}, ["hc_sinkhorn_iters must be an integer"]),
    ({"hc_eps": -1}, ["hc_eps must be a finite number >= 0"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps must be a finite number > 0"]),
])
def test_static_diagnose_bounds_the_counts_of_config_json(config, fragments, tmp_path, capsys):
    source = write_deepseek_v4(tmp_path / "dsv4", config)
    assert_refused(["diagnose", "--static", str(source), "--out", str(tmp_path / "out")], capsys, *fragments)
    assert not (tmp_path / "out").exists()


def test_deepseek_v4_converter_bounds_the_sinkhorn_iterations():
    from s2hc.hf.deepseek_v4 import connection_options

    config = {"hidden_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 10**11, "hc_eps": 1e-6, "rms_norm_eps": 1e-6}
    with pytest.raises(ValueError, match=r"^hc_sinkhorn_iters must be an integer in \[1, 10000\]"):
        connection_options(config)
    assert connection_options({**config, "hc_sinkhorn_iters": MAX_ITERATIONS})["iterations"] == MAX_ITERATIONS


def test_static_diagnose_refuses_a_non_finite_tensor_naming_it(tmp_path, capsys):
    source = write_deepseek_v4(tmp_path / "dsv4", {}, bias=math.nan)
    assert_refused(["diagnose", "--static", str(source), "--out", str(tmp_path / "out")], capsys,
                   "layers.0.attn_hc.base", "non-finite")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- 9: the n! permutation table


@pytest.mark.parametrize("family", ["mhc-lite", "kromhc"])
def test_allow_large_does_not_lift_the_permutation_table_cap(family):
    n = 11  # prime: kromhc's only factor is 11 (11! x 121 entries, 19 GB); mhc-lite's table likewise
    with pytest.raises(ValueError, match=f"s2hc stops at mixtures of {MAX_BUILT_PERMUTATION_SIZE} streams"):
        TrainConfig(family=family, n_streams=n, family_options={"allow_large": True})
    with pytest.raises(ValueError, match=r"whatever allow_large says"):
        mixers.build(family, MAX_BUILT_PERMUTATION_SIZE + 1 if family == "mhc-lite" else 11, allow_large=True)


def test_the_permutation_cap_from_a_run_config(capsys):
    assert_refused(["train", "--family", "mhc-lite", "--streams", "12", "--family-option", "allow_large=true"],
                   capsys, "mhc-lite at n_streams=12", f"{MAX_BUILT_PERMUTATION_SIZE} streams")


def test_counting_still_reaches_twelve_streams_on_meta():
    # s2hc params builds nothing real: the larger (documented) counting limit stays.
    assert count_connection_params("mhc-lite", layers=1, dim=4, n_streams=12) > math.factorial(12)


# ------------------------------------------------------------------------ 10: seeds, iterations, layers


def study(tmp_path, **values) -> str:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 2}, "families": ["residual"], **values}))
    return str(path)


@pytest.mark.parametrize(("seeds", "fragment"), [
    (100_000_000_000, f"seeds must be an integer in [1, {MAX_SEEDS}], got 100000000000"),
    (list(range(MAX_SEEDS + 1)), f"seeds lists {MAX_SEEDS + 1} seeds; at most {MAX_SEEDS}"),
    ([0, 2**40], "seeds must be an integer in [0, 4294967295]"),
])
def test_study_seeds_are_bounded(seeds, fragment, tmp_path, capsys):
    assert_refused(["study", study(tmp_path, seeds=seeds), "--out", str(tmp_path / "out")], capsys, fragment)


def test_mhc_iterations_are_bounded(capsys):
    assert_refused(["train", "--family", "mhc", "--family-option", "iterations=100000000000"], capsys,
                   f"iterations must be an integer in [1, {MAX_ITERATIONS}], got 100000000000")
    with pytest.raises(ValueError, match=r"iterations must be an integer in \[1, 10000\]"):
        s2hc.HyperConnection(8, 4, family="mhc", iterations=10**11)


def test_layers_are_bounded(capsys):
    assert_refused(["params", "--layers", "1000000000000"], capsys, "layers must be an integer in [1, 10000]")
    assert_refused(["train", "--set", "model_overrides={n_layers: 1000000000000}"], capsys,
                   "n_layers must be an integer in [1, 10000]")


def test_compare_seeds_are_bounded(tmp_path, capsys):
    assert_refused(["compare", "--seeds", "100000000000", "--out", str(tmp_path / "cmp")], capsys,
                   f"--seeds must be an integer in [1, {MAX_SEEDS}], got 100000000000")
    assert not (tmp_path / "cmp").exists()


# ------------------------------------------------------------------ 11: model_overrides that would be ignored


@pytest.mark.parametrize("key", ["family", "n_streams", "family_options"])
def test_model_overrides_refuse_the_family_settings(key, capsys):
    value = {"family": "mhc", "n_streams": 2, "family_options": {"iterations": 5}}[key]
    with pytest.raises(ValueError, match=f"model_overrides.{key} .*top-level '{key}'"):
        TrainConfig(family="s2hc", model_overrides={key: value})
    assert_refused(["train", "--set", f"model_overrides={{{key}: {json.dumps(value)}}}"], capsys,
                   f"model_overrides.{key}", f"top-level '{key}'")


# -------------------------------------------------------------------- 13b: eps, NaN tensors, duplicate grid


@pytest.mark.parametrize("eps", [-1.0, 0.0, math.nan, math.inf, "x"])
def test_hyper_connection_checks_eps(eps):
    with pytest.raises(ValueError, match=r"^eps must be a finite number > 0"):
        s2hc.HyperConnection(8, 4, family="s2hc", eps=eps)


def test_a_study_grid_refuses_the_same_configuration_twice_after_defaults():
    values = {"train": {"max_steps": 2}, "families": ["s2hc", "s2hc:rotation=cayley"]}
    with pytest.raises(ValueError, match=r"'s2hc n=4' and 's2hc \(rotation=cayley\) n=4' are the same configuration"):
        parse_spec(values)
    values["families"] = ["mhc", "mhc:iterations=20,alpha=1e-2"]  # defaults, one of them a YAML 1.1 string
    with pytest.raises(ValueError, match=r"are the same configuration"):
        parse_spec(values)
    values["families"] = ["s2hc", "s2hc:rotation=expm"]
    assert len(parse_spec(values).configurations) == 2


# ---------------------------------------------------------- 21: what a branch returns, read/write, n = 1


def test_compat_refuses_a_branch_that_returns_no_tensor():
    init, expand, _ = get_init_and_expand_reduce_stream_functions(2)
    block = init(dim=8, branch=lambda h: None, layer_index=0)
    with pytest.raises(TypeError, match=r"branch must return a tensor .*got NoneType"):
        block(expand(torch.randn(2, 3, 8)))
    split = init(dim=8, layer_index=0)
    branch_input, add_residual = split(expand(torch.randn(2, 3, 8)))
    with pytest.raises(TypeError, match=r"branch must return a tensor .*got NoneType"):
        add_residual(None)
    disabled, _, _ = get_init_and_expand_reduce_stream_functions(1, disable=True)
    with pytest.raises(TypeError, match=r"branch must return a tensor .*got str"):
        disabled(dim=8, branch=lambda h: "out")(torch.randn(2, 3, 8))


def test_read_and_write_name_a_bad_argument():
    hc = s2hc.HyperConnection(8, 4, family="s2hc")
    x = torch.randn(2, 3, 4, 8)
    h = hc.matrices(x)
    with pytest.raises(ValueError, match=r"h must hold 'pre'"):
        s2hc.HyperConnection.read(x, {})
    with pytest.raises(ValueError, match=r"h\['pre'\] must have shape \(2, 3, 4\)"):
        s2hc.HyperConnection.read(x, {"pre": h["pre"][:, :, :2]})
    with pytest.raises(ValueError, match=r"branch_out must have shape \(2, 3, 8\) .*got \(2, 3, 5\)"):
        s2hc.HyperConnection.write(x, h, torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match=r"h must hold 'res' and 'post'"):
        s2hc.HyperConnection.write(x, {"pre": h["pre"]}, torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match=r"x must be a floating-point torch.Tensor"):
        s2hc.HyperConnection.read([1.0], h)
    assert s2hc.HyperConnection.write(x, h, hc.read(x, h)).shape == x.shape


def test_diagnostics_of_one_stream_of_a_mixing_family():
    res = torch.ones(2, 5, 1, 1)
    summary = summarize(capture_of(res, torch.ones(2, 5, 1), torch.ones(2, 5, 1), family="mhc"))
    assert summary["deviation_singular_values"]["p10"] == [[], []]
    assert summary["headline"]["smallest_deviation_singular_value_mean"] is None


# ------------------------------------------------------ the options of the new families, bounded by the model


@pytest.mark.parametrize(("value", "fragment"), [
    ("0", "family option 'rank' of 'gated-residual' must be an integer >= 1, got 0"),
    ("-3", "family option 'rank' of 'gated-residual' must be an integer >= 1, got -3"),
    ("1.5", "family option 'rank' of 'gated-residual' must be an integer >= 1, got 1.5"),
    ("abc", "family option 'rank' of 'gated-residual' must be an integer >= 1, got 'abc'"),
    ("1000000000", "family option 'rank' of 'gated-residual' must be an integer in [1, 320] (at most the n·C = "
                   "4·32 = 128 features the read gates see, or the default 320), got 1000000000"),
])
def test_the_gated_residuals_rank_is_bounded(value, fragment, tmp_path, capsys):
    assert_refused(["train", "--family", "gated-residual", "--streams", "4", "--family-option", f"rank={value}",
                    "--set", SMALL, "--out", str(tmp_path / "run")], capsys, fragment)
    assert not (tmp_path / "run").exists()


def test_the_rank_bound_follows_the_width():
    """Up to n·C, or transformers' default 320 where n·C is smaller; nothing is allocated for a refused rank."""
    assert s2hc.GatedResidual(16, 4, rank=64).rank == 64
    assert s2hc.GatedResidual(4, 2).rank == 320  # the default at any width
    assert s2hc.GatedResidual(128, 4, rank=512).rank == 512
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 512\] .* got 513"):
        s2hc.GatedResidual(128, 4, rank=513)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 320\] .* got 10000000000"):
        s2hc.GatedHead(8, 4, rank=10**10)
    with pytest.raises(ValueError, match=r"^rank must be an integer >= 1, got True$"):
        s2hc.GatedHead(8, 4, rank=True)
    with pytest.raises(ValueError, match=r"family option 'rank' of 'gated-residual' must be an integer in \[1, 320\]"):
        TrainConfig(family="gated-residual", n_streams=2, family_options={"rank": 321},
                    model_overrides=SMALL_MODEL).model_config()


def test_qwen4_exp_hc_lowrank_is_bounded():
    from s2hc.hf.qwen4_exp import connection_options

    config = {"hidden_size": 16, "hc_count": 2, "hc_lowrank": 10**9, "rms_norm_eps": 1e-6}
    with pytest.raises(ValueError, match=r"hc_lowrank must be an integer in \[1, 320\] .* got 1000000000"):
        connection_options(config)
    assert connection_options({**config, "hc_lowrank": 32})["rank"] == 32


@pytest.mark.parametrize(("value", "fragment"), [
    ("0", "family option 'block_size' of 'attn-res' must be an integer >= 1, got 0"),
    ("x", "family option 'block_size' of 'attn-res' must be an integer >= 1, got 'x'"),
    ("5", "family option 'block_size' of 'attn-res' must be an integer in [1, 4], got 5"),  # 2 layers: 4 sublayers
    ("1000000000000", "family option 'block_size' of 'attn-res' must be an integer in [1, 4], got 1000000000000"),
])
def test_attn_res_block_size_is_bounded_by_the_sublayers(value, fragment, tmp_path, capsys):
    assert_refused(["train", "--family", "attn-res", "--family-option", f"block_size={value}", "--set", SMALL,
                    "--out", str(tmp_path / "run")], capsys, fragment)


def test_the_wide_residual_takes_no_option(tmp_path, capsys):
    assert_refused(["train", "--family", "wide-residual", "--family-option", "rank=4", "--set", SMALL,
                    "--out", str(tmp_path / "run")], capsys, "family='wide-residual' takes no family_options")
