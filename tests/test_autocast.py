"""Under bfloat16 autocast the residual streams stay in their own dtype: only the branch is rounded.

A plain residual model keeps ``x`` in float32 under autocast (``x + F(x)``, with ``F`` the one low-precision
term). A hyper-connection must do the same: the coefficients, the read ``H_pre X``, the mixing ``H_res X`` and
the write run in the streams' dtype, on every compute path, eager and compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import s2hc
from s2hc.models import Transformer, get_preset

FAMILIES = list(s2hc.mixers.REGISTRY)
PATHS = ["reference", "eager", "compiled"] + (["triton"] if importlib.util.find_spec("triton") else [])
C, N = 32, 4


def connection(family: str, path: str, seed: int = 0, **options) -> s2hc.HyperConnection:
    """A connection moved away from its initialisation (so H_res is not I), computing on ``path``."""
    torch.manual_seed(seed)
    hc = s2hc.HyperConnection(C, N, family=family, layer_index=1, fused=path != "reference",
                              kernels="triton" if path == "triton" else "torch", **options)
    with torch.no_grad():
        hc.projection.normal_(0, 0.05)
    return hc


def call(hc: s2hc.HyperConnection, path: str):
    """``hc`` itself, or compiled (fullgraph) for the compiled path."""
    if path == "compiled":
        torch._dynamo.reset()
        return torch.compile(hc, fullgraph=True, backend="inductor")
    return hc


def streams(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 8, N, C, generator=torch.Generator().manual_seed(seed))


def zero_branch(h: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(h)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("path", PATHS)
def test_identity_with_a_zero_branch_returns_the_streams_bit_for_bit(path):
    """The fault reproduced: the read/mix matmul once ran in bfloat16 and rounded X by ~2e-3."""
    hc = call(s2hc.HyperConnection(C, N, family="identity", fused=path != "reference",
                                   kernels="triton" if path == "triton" else "torch"), path)
    x = streams()
    with bf16_autocast():
        y = hc(x, zero_branch)
    assert y.dtype == torch.float32
    assert torch.equal(y, x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_mixes_in_float32_under_autocast(family, path):
    """With a zero branch the output is H_res X alone: the same under autocast as without it."""
    hc = call(connection(family, path), path)
    x = streams()
    expected = hc(x, zero_branch)
    with bf16_autocast():
        y = hc(x, zero_branch)
    assert y.dtype == torch.float32
    if path == "compiled":  # two compiled graphs (with and without autocast) may order sums differently
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(y, expected)


@pytest.mark.parametrize("path", ["reference", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_branch_is_the_only_rounding(family, path):
    """X'_autocast − X'_fp32 = H_postᵀ (F_autocast(h) − F_fp32(h)) with h = H_pre X: nothing else is rounded,
    exactly as x + F(x) in a residual model, where the difference is F_autocast(x) − F_fp32(x)."""
    torch.manual_seed(2)
    branch = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))
    hc = connection(family, path)
    x = streams()
    with torch.no_grad():
        pre, post, res = hc.coefficients(x)
        h = torch.einsum("btn,btnc->btc", pre, x)
        full = hc(x, branch)
        with bf16_autocast():
            low = hc(x, branch)
            branch_low = branch(h).float()
        expected = post.unsqueeze(-1) * (branch_low - branch(h)).unsqueeze(-2)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low - full, expected, rtol=0, atol=1e-5 * full.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_matrices_under_autocast_are_float32_and_keep_the_guarantees(family):
    hc = connection(family, "eager")
    x = streams()
    with bf16_autocast():
        pre, post, res = hc.coefficients(x)
    assert pre.dtype == post.dtype == res.dtype == torch.float32
    torch.testing.assert_close(res, hc.coefficients(x)[2], rtol=0, atol=0)
    flags = s2hc.mixers.get(family).guarantees
    if flags.col_sums_one:
        assert (res.sum(-2) - 1).abs().max() < 1e-6
    if flags.spectral_norm_at_most_one:
        assert torch.linalg.matrix_norm(res.double(), ord=2).max() < 1 + 1e-6


@pytest.mark.slow
def test_small_model_logits_under_autocast_are_as_close_as_residuals():
    """The whole model: the multi-stream families' logits under autocast are no further from float32 than
    the residual model's (the same branches, the same bfloat16 rounding of them)."""
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))

    def relative_error(family: str, n: int) -> float:
        torch.manual_seed(0)
        model = Transformer(get_preset("small", family=family, n_streams=n)).eval()
        with torch.no_grad():
            full = model(ids)
            with bf16_autocast():
                low = model(ids).float()
        return ((low - full).norm() / full.norm()).item()

    residual = relative_error("residual", 1)
    for family in ("s2hc", "mhc", "identity"):
        assert relative_error(family, 4) <= 1.25 * residual, family


@pytest.mark.parametrize("family", ["s2hc", "mhc-lite", "kromhc", "hc", "orthogonal", "isometric", "identity"])
def test_transposed_mixing_of_closed_families_keeps_their_guarantees(family):
    """These sets are closed under transposition: H_resᵀ has every property H_res has."""
    x = streams()
    plain, transposed = connection(family, "eager"), connection(family, "eager", transpose_res=True)
    res, res_t = plain.coefficients(x)[2], transposed.coefficients(x)[2]
    torch.testing.assert_close(res_t, res.mT, rtol=0, atol=0)
    from s2hc.diagnostics import guarantee_checks

    checks = guarantee_checks(family, res_t.flatten(0, 1).unsqueeze(0), transposed=True)
    assert all(c["holds"] for c in checks), checks
    y = transposed(x, zero_branch)
    torch.testing.assert_close(y, torch.einsum("btji,btjc->btic", res, x))


def test_transposed_mhc_swaps_which_sums_are_exact():
    """Sinkhorn ends on a row normalisation: rows are exact, columns approximate; transposed, the reverse."""
    x = streams()
    for transpose in (False, True):
        hc = connection("mhc", "eager", transpose_res=transpose)
        with torch.no_grad():
            hc.mixer.alpha.fill_(3.0)  # far from the identity, where Sinkhorn's columns lag
        res = hc.coefficients(x)[2]
        rows, cols = (res.sum(-1) - 1).abs().max(), (res.sum(-2) - 1).abs().max()
        exact, approximate = (cols, rows) if transpose else (rows, cols)
        assert exact < 1e-6 < approximate


def test_transpose_res_is_checked_and_configurable():
    with pytest.raises(ValueError, match="transpose_res must be True or False, got 'yes'"):
        s2hc.HyperConnection(C, N, family="s2hc", transpose_res="yes")
    with pytest.raises(ValueError, match=r"family='residual' takes no family_options, got \['transpose_res'\]"):
        s2hc.Connections(C, 2, "residual", transpose_res=True)
    config = get_preset("tiny", family="s2hc", n_streams=4, family_options={"transpose_res": True}, n_layers=1)
    model = Transformer(config)
    assert all(m.transpose_res for m in model.modules() if isinstance(m, s2hc.HyperConnection))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixer_alone_under_autocast_equals_float32(family):
    """The constraint map used on its own (``s2hc.mixers.build``) runs its products in float32 too."""
    mixer = s2hc.mixers.build(family, N)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    d = 5 * torch.randn(16, mixer.num_inputs, generator=g)
    expected = mixer(d)
    with bf16_autocast():
        h = mixer(d)
    assert h.dtype == torch.float32 and torch.equal(h, expected)
