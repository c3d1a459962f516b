"""Every value checked by type and range before anything runs: TrainConfig's fields and family options, the
argument checks of ``s2hc.checks``, and what ``HyperConnection`` accepts as input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import s2hc
from s2hc.checks import MAX_STREAMS, check_bool, check_float, check_int, check_str, check_streams
from s2hc.config import MAX_LR, TrainConfig, parse_assignment

# ------------------------------------------------------------------------------------------ s2hc.checks


@pytest.mark.parametrize(
    ("value", "kwargs", "expected"),
    [
        (0.5, {}, 0.5),
        (3, {}, 3.0),
        ("1e-3", {}, 1e-3),  # YAML 1.1 reads 1e-3 as a string
        (np.float32(0.25), {"minimum": 0.0}, 0.25),
        (0.0, {"minimum": 0.0, "maximum": 1.0}, 0.0),
        (1.0, {"minimum": 0.0, "maximum": 1.0}, 1.0),
    ],
)
def test_check_float_accepts_finite_numbers_in_range(value, kwargs, expected):
    assert check_float("x", value, **kwargs) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "kwargs", "allowed"),
    [
        (math.nan, {}, "a finite number"),
        (math.inf, {}, "a finite number"),
        (-math.inf, {"minimum": 0.0}, ">= 0"),
        ("abc", {}, "a finite number"),
        (True, {}, "a finite number"),
        (None, {}, "a finite number"),
        ([1.0], {}, "a finite number"),
        (0.0, {"positive": True}, "> 0"),
        (-1.0, {"minimum": 0.0}, ">= 0"),
        (1.0, {"minimum": 0.0, "maximum": 1.0, "open_maximum": True}, "in [0, 1)"),
        (2.0, {"maximum": 1.0, "positive": True}, "in (0, 1]"),
    ],
)
def test_check_float_refuses_naming_the_value_and_the_range(value, kwargs, allowed):
    with pytest.raises(ValueError, match=r"^x must be a finite number") as error:
        check_float("x", value, **kwargs)
    assert allowed in str(error.value) and repr(value) in str(error.value)


def test_check_int_bool_str_and_streams():
    assert check_int("n", 3, maximum=5) == 3
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 5\], got 6"):
        check_int("n", 6, maximum=5)
    with pytest.raises(ValueError, match="n must be an integer >= 1, got True"):
        check_int("n", True)
    assert check_bool("b", False) is False
    for bad in ("maybe", "yes", 1, None):
        with pytest.raises(ValueError, match="b must be true or false"):
            check_bool("b", bad)
    assert check_str("s", "x") == "x"
    with pytest.raises(ValueError, match="s must be a string, got int 5"):
        check_str("s", 5)
    with pytest.raises(ValueError, match="s must not be empty"):
        check_str("s", "  ")
    assert check_streams("n", MAX_STREAMS) == MAX_STREAMS
    with pytest.raises(ValueError, match=f"n must be at most {MAX_STREAMS}.*got 100000"):
        check_streams("n", 100_000)


# ------------------------------------------------------------------------------------------ TrainConfig

BAD_CONFIGS = [  # (--set KEY=VALUE as the user types it, what the error says)
    ("lr=.inf", "lr must be a finite number in (0, 1], got inf"),
    ("lr=inf", "lr must be a finite number in (0, 1], got 'inf'"),
    ("lr=.nan", "lr must be a finite number"),
    ("lr=1e38", "lr must be a finite number in (0, 1]"),
    ("lr=0", "lr must be a finite number in (0, 1]"),
    ("lr=abc", "lr must be a finite number"),
    ("grad_clip=abc", "grad_clip must be a finite number >= 0, got 'abc'"),
    ("grad_clip=.nan", "grad_clip must be a finite number >= 0, got nan"),
    ("grad_clip=-1", "grad_clip must be a finite number >= 0"),
    ("min_lr_ratio=abc", "min_lr_ratio must be a finite number in [0, 1]"),
    ("min_lr_ratio=1.5", "min_lr_ratio must be a finite number in [0, 1]"),
    ("weight_decay=abc", "weight_decay must be a finite number >= 0"),
    ("weight_decay=.inf", "weight_decay must be a finite number >= 0"),
    ("beta1=abc", "beta1 must be a finite number in [0, 1)"),
    ("beta1=1.0", "beta1 must be a finite number in [0, 1)"),
    ("beta2=-0.1", "beta2 must be a finite number in [0, 1)"),
    ("data=5", "data must be a string, got int 5"),
    ("tokenizer=[a]", "tokenizer must be a string"),
    ("out=[1,2]", "out must be a string, got list [1, 2]"),
    ("out=''", "out must not be empty"),
    ("cache_dir=''", "cache_dir must not be empty"),
    ("compile=maybe", "compile must be true or false, got 'maybe'"),
    ("progress=1", "progress must be true or false, got 1"),
    ("seq_len=0", "seq_len must be an integer >= 1"),
    ("batch_size=2.5", "batch_size must be an integer >= 1"),
    ("max_steps=abc", "max_steps must be an integer >= 1"),
    ("eval_every=-1", "eval_every must be an integer >= 0"),
    ("seed=100000000000000000000000", "seed must be an integer in [0, 4294967295]"),
    ("n_streams=100000", "n_streams must be at most 64"),
    ("device=gpu", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ("dtype=float16", "dtype must be one of"),
    ("parallel=maybe", "parallel must be one of"),
    ("preset=huge", "preset must be one of"),
    ("family=nope", "family must be one of"),
    ("connection={fused: 2}", "connection.fused must be true or false"),
    ("connection={kernels: cuda}", "connection.kernels must be one of"),
    ("connection=5", "connection must be a mapping"),
    ("model_overrides=[1]", "model_overrides must be a mapping"),
    ("model_overrides={dim: x}", "dim must be an integer >= 1"),
    ("family_options=5", "family_options must be a mapping"),
]


@pytest.mark.parametrize(("assignment", "message"), BAD_CONFIGS, ids=[a for a, _ in BAD_CONFIGS])
def test_every_config_value_is_checked_by_type_and_range(assignment, message):
    key, value = parse_assignment(assignment)
    values = {"family": "s2hc", key: value} if key == "n_streams" else {key: value}
    with pytest.raises(ValueError) as error:
        TrainConfig(**values)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


BAD_FAMILY_OPTIONS = [  # (family, n, options, message)
    ("mhc", 4, {"alpha": math.nan}, "family option 'alpha' of 'mhc' must be a finite number, got nan"),
    ("mhc", 4, {"alpha": math.inf}, "family option 'alpha' of 'mhc' must be a finite number"),
    ("mhc", 4, {"alpha": "abc"}, "family option 'alpha' of 'mhc' must be a finite number"),
    ("mhc", 4, {"iterations": 2.5}, "family option 'iterations' of 'mhc' must be an integer >= 1"),
    ("mhc", 4, {"iterations": 0}, "family option 'iterations' of 'mhc' must be an integer >= 1"),
    ("s2hc", 4, {"rotation": "foo"}, "rotation must be one of"),
    ("s2hc", 4, {"exact_identity_init": "yes"}, "family option 'exact_identity_init' of 's2hc' must be true or false"),
    ("s2hc", 4, {"eps": 0}, "family option 'eps' of 's2hc' must be a finite number > 0"),
    ("s2hc", 4, {"transpose_res": 1}, "family option 'transpose_res' of 's2hc' must be true or false"),
    ("s2hc", 4, {"bogus": 1}, "unknown family_options ['bogus']"),
    ("mhc-lite", 4, {"allow_large": "maybe"}, "must be true or false"),
    ("mhc-lite", 4, {"off_identity_bias": math.nan}, "must be a finite number"),
    ("mhc-lite", 7, {}, "allow_large=True"),  # the family's own limit, before any data is read
    ("mhc-lite", 9, {"allow_large": True}, "s2hc stops at mixtures of 8 streams"),  # a run builds its n! table
    ("kromhc", 13, {"allow_large": True}, "s2hc stops at mixtures of 8 streams"),
    ("hc", 4, {"projection": "diagonal"}, "projection"),
]


@pytest.mark.parametrize(("family", "n", "options", "message"), BAD_FAMILY_OPTIONS)
def test_family_options_are_checked_by_the_type_the_family_declares(family, n, options, message):
    with pytest.raises(ValueError) as error:
        TrainConfig(family=family, n_streams=n, family_options=options)
    assert message in str(error.value)


def test_good_values_pass_and_numeric_strings_become_floats():
    config = TrainConfig(lr="1e-3", family="mhc", family_options={"alpha": "1e-2", "iterations": 5})
    assert config.lr == 1e-3 and isinstance(config.lr, float)
    assert config.family_options == {"alpha": 0.01, "iterations": 5}
    assert TrainConfig(lr=MAX_LR, beta1=0.0, grad_clip=0, min_lr_ratio=1).lr == 1.0
    kromhc = TrainConfig(family="kromhc", family_options={"off_identity_bias": "n-independent"})
    assert kromhc.family_options == {"off_identity_bias": "n-independent"}
    assert TrainConfig(device="cuda:1").device == "cuda:1"  # a GPU run's config still loads on a CPU machine
    # the round trip a checkpoint makes
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_config_validation_builds_nothing_real():
    # mhc-lite at n = 8 with allow_large: validation builds its 40 320-permutation table on meta only.
    config = TrainConfig(family="mhc-lite", n_streams=8, family_options={"allow_large": True})
    assert config.n_streams == 8


# ----------------------------------------------------------------------------------- HyperConnection input


def branch(h):
    return torch.tanh(h)


@pytest.mark.parametrize("family", ["residual", "s2hc", "mhc", "hc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_connection_follows_the_inputs_floating_dtype(family, dtype, fused):
    n = 1 if family == "residual" else 4
    hc = s2hc.connection.build_connection(8, n, family)  # float32 parameters
    hc.set_options(fused=fused)
    x = torch.randn(2, 3, n, 8).to(dtype)
    out = hc(x, branch)
    assert out.dtype == dtype and out.shape == x.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_connection_refuses_integer_input_naming_x_and_its_dtype(dtype):
    hc = s2hc.HyperConnection(8, 4)
    with pytest.raises(TypeError, match=rf"x must be a floating-point tensor .*got dtype {dtype}"):
        hc(torch.zeros(2, 3, 4, 8, dtype=dtype), branch)


def test_connection_refuses_numpy_input_and_a_branch_returning_a_tuple():
    hc = s2hc.HyperConnection(8, 4)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor .*numpy.ndarray \(convert it with torch.from_numpy"):
        hc(np.zeros((2, 3, 4, 8), dtype=np.float32), branch)
    with pytest.raises(TypeError, match=r"branch must return a tensor .*got tuple \(return only the hidden states\)"):
        hc(torch.randn(2, 3, 4, 8), lambda h: (h, None))
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        s2hc.expand_streams(np.zeros((2, 3, 8)), 4)


def test_a_branch_of_another_dtype_gets_a_note_saying_where_h_came_from():
    hc = s2hc.HyperConnection(8, 4)
    mlp = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))  # float32 parameters
    with pytest.raises(RuntimeError) as error:
        hc(torch.randn(2, 3, 4, 8, dtype=torch.float64), mlp)
    notes = getattr(error.value, "__notes__", [])
    if hasattr(error.value, "add_note"):  # Python >= 3.11
        assert any("h of dtype torch.float64" in note for note in notes)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the way nn.Linear users mix dtypes
        assert hc(torch.randn(2, 3, 4, 8), mlp).dtype == torch.float32


def test_a_huge_stream_count_is_refused_before_anything_is_allocated():
    for build in (lambda: s2hc.HyperConnection(64, 100_000), lambda: s2hc.expand_streams(torch.zeros(1, 1, 2), 10**5)):
        with pytest.raises(ValueError, match=f"n_streams must be at most {MAX_STREAMS}"):
            build()
    assert s2hc.HyperConnection(4, MAX_STREAMS, family="identity").n_streams == MAX_STREAMS
