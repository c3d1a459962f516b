"""Every family's guarantee (docs/design.md section 1), tested on random and large inputs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import family_sizes, randomize_
from hypothesis import given
from hypothesis import strategies as st

from s2hc import mixers
from s2hc.mixers.base import Guarantees

TOL = 1e-5

# The table of docs/design.md section 1, written out independently of the classes' own flags.
EXPECTED = {
    "identity": Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        orthogonal=True,
        closed_under_products=True,
    ),
    "hc": Guarantees(),
    "mhc": Guarantees(row_sums_one=True, nonnegative=True),
    "mhc-lite": Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        closed_under_products=True,
    ),
    "kromhc": Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        closed_under_products=True,
    ),
    "s2hc": Guarantees(
        row_sums_one=True, col_sums_one=True, spectral_norm_at_most_one=True, closed_under_products=True
    ),
    "orthogonal": Guarantees(spectral_norm_at_most_one=True, orthogonal=True, closed_under_products=True),
    "isometric": Guarantees(
        row_sums_one=True,
        col_sums_one=True,
        spectral_norm_at_most_one=True,
        orthogonal=True,
        closed_under_products=True,
    ),
    "ihc": Guarantees(  # Hy4's independent HC: H_res = I
        row_sums_one=True,
        col_sums_one=True,
        nonnegative=True,
        spectral_norm_at_most_one=True,
        orthogonal=True,
        closed_under_products=True,
    ),
}


def build(name: str, n: int, **options) -> mixers.Mixer:
    if name in ("mhc-lite", "kromhc") and n > mixers.MAX_PERMUTATION_STREAMS:
        options.setdefault("allow_large", True)
    return mixers.build(name, n, **options)


def sample(name: str, n: int, seed: int, scale: float, spread: float, batch: int = 16, **options):
    """A mixer with parameters moved by ``spread`` and its H_res for inputs of magnitude up to ``scale``."""
    g = torch.Generator().manual_seed(seed)
    mixer = build(name, n, **options)
    randomize_(mixer, g, spread)
    d = scale * (2 * torch.rand(batch, mixer.num_inputs, generator=g) - 1)
    return mixer, mixer(d)


def check_guarantees(h: torch.Tensor, g: Guarantees, norm_tol: float = TOL) -> None:
    n = h.shape[-1]
    ones = torch.ones(n, dtype=h.dtype)
    if g.row_sums_one:
        torch.testing.assert_close(h @ ones, ones.expand(h.shape[:-1]), atol=TOL, rtol=0)
    if g.col_sums_one:
        torch.testing.assert_close(ones @ h, ones.expand(h.shape[:-2] + (n,)), atol=TOL, rtol=0)
    if g.nonnegative:
        assert h.min().item() >= 0.0
    if g.spectral_norm_at_most_one:
        assert torch.linalg.matrix_norm(h.double(), ord=2).max().item() <= 1 + norm_tol
    if g.orthogonal:
        eye = torch.eye(n, dtype=h.dtype).expand_as(h)
        torch.testing.assert_close(h.transpose(-1, -2) @ h, eye, atol=TOL, rtol=0)


def test_registry_lists_the_table_in_order():
    assert list(mixers.REGISTRY) == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_declared_guarantees_match_the_design_table(name):
    assert mixers.get(name).guarantees == EXPECTED[name]


@pytest.mark.parametrize("name,n", family_sizes())
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 50.0), spread=st.floats(0.0, 3.0))
def test_guarantees_hold_for_random_and_large_inputs(name, n, seed, scale, spread):
    mixer, h = sample(name, n, seed, scale, spread)
    assert h.shape == (16, n, n) and h.dtype == torch.float32
    check_guarantees(h, EXPECTED[name])


@pytest.mark.parametrize("name,n", family_sizes())
@pytest.mark.parametrize("value", [50.0, -50.0])
def test_guarantees_hold_at_saturated_inputs(name, n, value):
    mixer = build(name, n)
    with torch.no_grad():  # large scales so that |α · d| is in the hundreds, not 0.5
        for p in mixer.parameters():
            if p.numel() == 1:
                p.fill_(5.0)
    check_guarantees(mixer(torch.full((3, mixer.num_inputs), value)), EXPECTED[name])


@pytest.mark.parametrize("name,n", family_sizes([f for f, g in EXPECTED.items() if g.closed_under_products]))
def test_product_of_64_matrices_keeps_the_guarantees(name, n):
    _, h = sample(name, n, seed=n, scale=50.0, spread=1.0, batch=64)
    product = torch.eye(n)
    for factor in h:
        product = factor @ product
    check_guarantees(product[None], EXPECTED[name], norm_tol=1e-4)


def test_unconstrained_hc_amplifies():
    _, h = sample("hc", 4, seed=0, scale=50.0, spread=1.0)
    assert torch.linalg.matrix_norm(h, ord=2).max() > 1.5


def test_orthogonal_does_not_preserve_the_mean():
    _, h = sample("orthogonal", 4, seed=0, scale=50.0, spread=1.0)
    assert ((torch.ones(4) @ h) - 1).abs().max() > 0.1


def test_s2hc_leaves_the_birkhoff_polytope():
    """Negative entries (rotations, flips) are what s²HC allows beyond doubly stochastic matrices."""
    _, h = sample("s2hc", 4, seed=0, scale=50.0, spread=1.0)
    assert h.min() < -0.1


@pytest.mark.parametrize("name,n", family_sizes())
def test_num_inputs_per_family(name, n):
    m, k = n - 1, (n - 1) * (n - 2) // 2
    factors = {2: [2], 3: [3], 4: [2, 2], 5: [5], 6: [2, 3], 8: [2, 2, 2], 12: [2, 2, 3]}[n]
    expected = {
        "identity": 0,
        "ihc": 0,
        "hc": n * n,
        "mhc": n * n,
        "mhc-lite": math.factorial(n),
        "kromhc": sum(math.factorial(p) for p in factors),
        "s2hc": m * m,
        "orthogonal": n * (n - 1) // 2,
        "isometric": 2 * k,
    }[name]
    assert build(name, n).num_inputs == expected


# ---------------------------------------------------------------------------------------------- inits


@pytest.mark.parametrize("name,n", family_sizes(["mhc", "mhc-lite", "kromhc", "s2hc", "isometric"]))
def test_near_identity_at_initialisation(name, n):
    # The permutation families with their papers' −8 start far from I at n ≥ 5 (tested exactly below);
    # the n-independent bias keeps every mixture within e⁻⁸ of I, so the bound holds at every n.
    options = {"off_identity_bias": "n-independent"} if name in ("mhc-lite", "kromhc") else {}
    mixer = build(name, n, **options)
    h = mixer(torch.zeros(1, mixer.num_inputs))[0]
    # mhc keeps the paper's −8 per off-diagonal entry, so at n = 8 the diagonal is 1 − 7e⁻⁸.
    tol = 2e-3 if not (name == "mhc" and n == 8) else 7 * math.exp(-8) * 1.01
    assert (h - torch.eye(n)).abs().max().item() <= tol


def paper_bias_diagonal(size: int) -> float:
    """Diagonal of a mix of all size! permutations with bias 0 on I and −8 on the others, at d = 0.

    Every weight off I is e⁻⁸ w_I; (size − 1)! − 1 of those permutations fix a given stream."""
    w_identity = 1.0 / (1.0 + (math.factorial(size) - 1) * math.exp(-8))
    return w_identity * (1.0 + (math.factorial(size - 1) - 1) * math.exp(-8))


@pytest.mark.parametrize("name,n", family_sizes(["mhc-lite", "kromhc"]))
def test_paper_off_identity_bias_is_the_default(name, n):
    """The mHC-lite and KromHC papers' (and code's) −8 on every non-identity permutation, whatever n is."""
    assert mixers.options(name)["off_identity_bias"] == -8.0
    mixer = build(name, n)
    mixtures = [mixer.mixture] if name == "mhc-lite" else list(mixer.factors)
    for mixture in mixtures:
        assert mixture.bias[0].item() == 0.0 and torch.all(mixture.bias[1:] == -8.0)
    h = mixer(torch.zeros(1, mixer.num_inputs))[0].double()
    sizes = [n] if name == "mhc-lite" else mixer.factor_sizes
    diagonal = math.prod(paper_bias_diagonal(p) for p in sizes)  # a Kronecker product's diagonal
    # TOL, not 1e-6: at n = 6 the float32 softmax over 720 terms rounds its normaliser by ~3e-6
    torch.testing.assert_close(h.diagonal(), torch.full((n,), diagonal, dtype=torch.float64), atol=TOL, rtol=0)


def test_paper_bias_starts_far_from_identity_at_large_n():
    """Why the n-independent option exists: with −8 per permutation, 6 % of mhc-lite's weight is off I at
    n = 5 and 93 % at n = 8; the n-independent bias keeps e⁻⁸/(1 + e⁻⁸) off I at every n."""
    assert 1 - paper_bias_diagonal(4) == pytest.approx(6.0e-3, rel=0.01)
    assert 1 - paper_bias_diagonal(8) > 0.8
    for n in (4, 6, 8):
        mixer = build("mhc-lite", n, off_identity_bias="n-independent")
        w = torch.softmax(mixer.mixture.bias.double(), dim=-1)
        assert 1 - w[0].item() == pytest.approx(math.exp(-8) / (1 + math.exp(-8)), rel=1e-6)


def test_n_independent_bias_values():
    from s2hc.mixers.mhc_lite import n_independent_off_identity_bias

    assert n_independent_off_identity_bias(2) == -8.0  # so KromHC's 2 × 2 factors are the same either way
    assert n_independent_off_identity_bias(4) == pytest.approx(-8 - math.log(23))  # −11.1
    kromhc = build("kromhc", 12, off_identity_bias="n-independent")
    assert [f.bias[1].item() for f in kromhc.factors] == pytest.approx([-8.0, -8.0, -8 - math.log(5)])
    assert build("mhc-lite", 3, off_identity_bias=-5).mixture.bias[1].item() == -5.0


@pytest.mark.parametrize("name", ["mhc-lite", "kromhc"])
@pytest.mark.parametrize("value", ["n_independent", None, True, float("nan"), float("-inf"), [-8.0]])
def test_bad_off_identity_bias_is_refused_naming_the_option(name, value):
    with pytest.raises(ValueError, match=r"off_identity_bias must be a finite number or 'n-independent', got"):
        mixers.build(name, 4, off_identity_bias=value)


@pytest.mark.parametrize("name", ["identity", "orthogonal", "isometric"])
def test_exactly_identity_at_initialisation(name):
    mixer = build(name, 4)
    assert torch.equal(mixer(torch.zeros(2, mixer.num_inputs)), torch.eye(4).expand(2, 4, 4))


@pytest.mark.parametrize("rotation", ["cayley", "expm"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_s2hc_exact_identity_init_is_exact_and_learns(n, rotation):
    mixer = build("s2hc", n, exact_identity_init=True, rotation=rotation)
    d = torch.zeros(2, mixer.num_inputs, requires_grad=True)
    h = mixer(d)
    assert torch.equal(h, torch.eye(n).expand(2, n, n))
    weights = torch.randn(2, n, n, generator=torch.Generator().manual_seed(n))
    (h * weights).sum().backward()
    assert d.grad.abs().sum() > 0
    assert mixer.spectrum_bias.grad.abs().min() > 0  # the spectrum is not frozen at its maximum
    if n > 2:
        assert mixer.rotation_u.bias.grad.abs().sum() > 0


def test_s2hc_default_init_is_near_not_exact_identity():
    h = build("s2hc", 4)(torch.zeros(1, 9))[0]
    deviation = (h - torch.eye(4)).abs().max().item()
    assert 0 < deviation < 2e-3
    # the deviation block is tanh(4) · I on the zero-sum subspace
    torch.testing.assert_close(h.diagonal().sum(), torch.tensor(1 + 3 * math.tanh(4.0)), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- mhc


def sinkhorn_reference(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Plain-domain Sinkhorn in float64 (columns, then rows), independent of the log-domain code."""
    p = logits.double().exp()
    for _ in range(iterations):
        p = p / p.sum(dim=-2, keepdim=True)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


@pytest.mark.parametrize("iterations", [1, 5, 20])
def test_mhc_matches_an_independent_sinkhorn_with_gradient(iterations):
    g = torch.Generator().manual_seed(iterations)
    mixer = build("mhc", 4, iterations=iterations).double()
    randomize_(mixer, g, 1.0)
    d = (3 * torch.randn(8, 16, generator=g, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(8, 4, 4, generator=g, dtype=torch.float64)
    ours = mixer(d)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), d)
    logits = mixer.alpha * d.unflatten(-1, (4, 4)) + mixer.bias
    ref = sinkhorn_reference(logits, iterations)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), d)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_mhc_column_error_grows_with_spread_and_shrinks_with_iterations():
    from s2hc.mixers.mhc import log_sinkhorn

    logits = torch.randn(512, 4, 4, generator=torch.Generator().manual_seed(0))

    def column_error(spread, iterations):
        h = log_sinkhorn(spread * logits, iterations)
        return ((torch.ones(4) @ h) - 1).abs().max().item()

    errors = [column_error(spread, 20) for spread in (1.0, 4.0, 16.0)]
    assert errors == sorted(errors) and errors[-1] > 0.1  # finite Sinkhorn drifts as logits spread
    assert column_error(1.0, 200) < 1e-5 < column_error(1.0, 3)


def test_mhc_runs_in_float32_for_bfloat16_inputs():
    h = build("mhc", 4)(torch.randn(5, 16).bfloat16())
    assert h.dtype == torch.float32


# --------------------------------------------------------------------------------- mhc-lite / kromhc


def test_mhc_lite_permutations_are_all_distinct_built_once_and_follow_the_module():
    mixer = build("mhc-lite", 4)
    perms = mixer.mixture.permutations
    assert perms.shape == (24, 16) and torch.equal(perms[0], torch.eye(4).flatten())
    assert len({tuple(p.tolist()) for p in perms}) == 24
    pointer = perms.data_ptr()
    mixer(torch.randn(3, 24))
    mixer(torch.randn(5, 24))
    assert mixer.mixture.permutations.data_ptr() == pointer
    assert mixer.double().mixture.permutations.dtype == torch.float64


def test_kromhc_power_of_two_is_the_official_two_by_two_form():
    mixer = build("kromhc", 4)
    g = torch.Generator().manual_seed(0)
    randomize_(mixer, g, 2.0)
    d = torch.randn(6, 4, generator=g)
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    factors = []
    for factor, d_i in zip(mixer.factors, d.split(2, dim=-1)):
        w = torch.softmax(factor.alpha * d_i + factor.bias, dim=-1)  # weight of (identity, swap)
        factors.append(w[:, :1, None] * torch.eye(2) + w[:, 1:, None] * swap)
    expected = torch.stack([torch.kron(a, b) for a, b in zip(*factors)])
    torch.testing.assert_close(mixer(d), expected)
    assert mixer.factor_sizes == [2, 2]


@pytest.mark.parametrize(
    "name,n,tokens", [("mhc-lite", 7, 16), ("kromhc", 7, 16), ("kromhc", 14, 8), ("mhc-lite", 8, 4)]
)
@pytest.mark.parametrize("spread,scale", [(0.0, 0.0), (0.3, 1.0), (1.0, 0.1), (3.0, 50.0)])
def test_large_permutation_mixtures_stay_exactly_doubly_stochastic(name, n, tokens, spread, scale):
    """5 040 or 40 320 softmax weights: a float32 normaliser rounds every row and column sum by up to 3e-5
    (1.7e-5 at initialisation, n = 7), so those mixtures accumulate in float64 and return float32."""
    mixer, h = sample(name, n, seed=n, scale=scale, spread=spread, batch=tokens)
    assert h.dtype == torch.float32
    check_guarantees(h, EXPECTED[name])
    h = h.double()
    assert (h.sum(dim=-1) - 1).abs().max().item() <= 1e-6 and (h.sum(dim=-2) - 1).abs().max().item() <= 1e-6


def test_kromhc_factor_sizes_for_any_n():
    assert build("kromhc", 12).factor_sizes == [2, 2, 3]
    assert build("kromhc", 5).factor_sizes == [5]


# ---------------------------------------------------------------------------------------------- s2hc


def test_helmert_basis_is_an_orthonormal_zero_sum_basis():
    from s2hc.mixers.orthomaps import helmert_basis

    for n in (2, 3, 4, 7):
        u = helmert_basis(n)
        torch.testing.assert_close(u.T @ u, torch.eye(n - 1, dtype=u.dtype))
        torch.testing.assert_close(u.sum(dim=0), torch.zeros(n - 1, dtype=u.dtype))
        torch.testing.assert_close(u @ u.T, torch.eye(n, dtype=u.dtype) - 1.0 / n)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6])
def test_cayley_equals_the_solver_definition(m):
    from s2hc.mixers.orthomaps import cayley, skew_from_vector

    g = torch.Generator().manual_seed(m)
    a = skew_from_vector(3 * torch.randn(64, m * (m - 1) // 2, generator=g, dtype=torch.float64), m)
    eye = torch.eye(m, dtype=torch.float64)
    torch.testing.assert_close(cayley(a), torch.linalg.solve(eye + a, eye - a))


@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0, 50.0, 500.0])
def test_cayley_is_orthogonal_to_float32_rounding_for_large_inputs(m, scale):
    """The closed forms stay orthogonal to ~1e-6 for entries up to 500 (m = 4's textbook form lost 2.8e-4
    there), fused equals unfused, the gradient is finite, and in float64 it is still the solver's Cayley."""
    from s2hc.mixers.orthomaps import cayley, skew_from_vector

    g = torch.Generator().manual_seed(m)
    k = m * (m - 1) // 2
    z = scale * (2 * torch.rand(2048, k, generator=g) - 1)
    if m == 4:  # also rank-2 inputs (Pf(A) ≈ 0), where the textbook form cancelled worst
        u, v = torch.randn(2, 512, 4, generator=g)
        wedge = scale * (u[:, :, None] * v[:, None, :] - v[:, :, None] * u[:, None, :])
        rows, cols = torch.triu_indices(4, 4, offset=1)
        z = torch.cat([z, wedge[:, rows, cols]], dim=0)
    z.requires_grad_()
    a = skew_from_vector(z, m)
    q, q_fused = cayley(a), cayley(a, fused=True)
    eye = torch.eye(m, dtype=torch.float64)
    for rotation in (q, q_fused):
        r = rotation.double()
        assert (r.transpose(-1, -2) @ r - eye).abs().max().item() <= 4e-6
    torch.testing.assert_close(q_fused, q, atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad((q * torch.randn(q.shape, generator=g)).sum(), z)
    assert torch.isfinite(grad).all()
    a64 = a.detach().double()
    torch.testing.assert_close(cayley(a64), torch.linalg.solve(eye + a64, eye - a64))


@pytest.mark.parametrize("name,n", [("s2hc", 2), ("s2hc", 4), ("s2hc", 5), ("isometric", 5), ("orthogonal", 4)])
def test_no_general_solver_where_a_closed_form_exists(name, n, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.linalg.solve called")

    monkeypatch.setattr(torch.linalg, "solve", refuse)
    mixer = build(name, n)
    mixer(torch.randn(4, mixer.num_inputs))


def test_expm_reaches_rotations_cayley_cannot():
    """A half-turn (eigenvalue −1) is exp of a finite skew matrix but Cayley of none."""
    from s2hc.mixers.orthomaps import cayley, matrix_exp_rotation

    half_turn = torch.tensor([[0.0, math.pi], [-math.pi, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(matrix_exp_rotation(half_turn), -torch.eye(2, dtype=torch.float64))
    assert (cayley(half_turn * 1e3) + torch.eye(2, dtype=torch.float64)).abs().max() > 1e-6

    mixer = build("s2hc", 3, rotation="expm")
    with torch.no_grad():
        mixer.rotation_u.gamma.fill_(math.pi)
        mixer.rotation_u.bias.fill_(30.0)  # tanh saturates to 1: a half-turn of U_core
    h = mixer(torch.zeros(1, 4))[0].double()
    torch.testing.assert_close(
        h, (2.0 / 3.0) * torch.ones(3, 3, dtype=torch.float64) - torch.eye(3, dtype=torch.float64), atol=1e-3, rtol=0
    )


@pytest.mark.parametrize("name", ["s2hc", "isometric", "orthogonal"])
def test_expm_option_keeps_the_guarantees(name):
    _, h = sample(name, 5, seed=3, scale=50.0, spread=2.0, rotation="expm")
    check_guarantees(h, EXPECTED[name])


def test_deviation_block_has_the_built_spectrum():
    """The singular values of U_Zᵀ H U_Z are |s|: the diagonal is what s²HC attenuates by."""
    from s2hc.mixers.orthomaps import helmert_basis

    g = torch.Generator().manual_seed(5)
    mixer = build("s2hc", 4)
    randomize_(mixer, g, 1.0)
    rotation_inputs = 20.0 * torch.randn(4, 6, generator=g)
    h = mixer(torch.cat([rotation_inputs, torch.zeros(4, 3)], dim=-1))  # spectrum inputs 0: s = tanh(b_s)
    s = torch.tanh(mixer.spectrum_bias.detach()).expand(4, 3)
    basis = helmert_basis(4, torch.float32)
    sv = torch.linalg.svdvals(basis.T @ h @ basis)
    torch.testing.assert_close(sv, s.abs().sort(dim=-1, descending=True).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,n", family_sizes())
def test_guarantees_survive_casting_the_mixer_to_bfloat16(name, n):
    g = torch.Generator().manual_seed(0)
    mixer = build(name, n)
    randomize_(mixer, g, 1.0)
    mixer = mixer.to(torch.bfloat16)
    h = mixer(torch.randn(8, mixer.num_inputs, generator=g).bfloat16() * 30)
    assert h.dtype == torch.float32
    check_guarantees(h, EXPECTED[name])


# ---------------------------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(
    "name,n,options",
    [(name, n, {}) for name in list(mixers.REGISTRY) for n in (2, 4)]
    + [("s2hc", 4, {"rotation": "expm"}), ("s2hc", 4, {"exact_identity_init": True}), ("s2hc", 6, {}),
       ("orthogonal", 5, {}), ("kromhc", 6, {}), ("mhc", 3, {"iterations": 7})],
)
def test_float64_gradcheck(name, n, options):
    g = torch.Generator().manual_seed(n)
    mixer = build(name, n, **options).double()
    randomize_(mixer, g, 0.5)
    if name == "s2hc" and options.get("exact_identity_init"):
        with torch.no_grad():
            mixer.spectrum_bias.fill_(0.3)  # away from the reflection's kink at z = 0
    d = torch.randn(3, mixer.num_inputs, generator=g, dtype=torch.float64, requires_grad=True)
    if mixer.num_inputs == 0:  # identity, isometric at n = 2: nothing to differentiate
        assert mixer(d).shape == (3, n, n)
        return
    assert torch.autograd.gradcheck(mixer, (d,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in list(mixers.REGISTRY) if n not in ("identity", "ihc")])  # no parameters
def test_float64_gradcheck_through_parameters(name):
    """The map is differentiable in its own parameters (α, b, γ, spectrum bias) too."""
    g = torch.Generator().manual_seed(1)
    mixer = build(name, 4).double()
    randomize_(mixer, g, 0.5)
    d = torch.randn(2, mixer.num_inputs, generator=g, dtype=torch.float64)
    names, values = zip(*[(k, v.detach().clone().requires_grad_()) for k, v in mixer.named_parameters()])

    def as_function(*values):
        return torch.func.functional_call(mixer, dict(zip(names, values)), (d,))

    assert torch.autograd.gradcheck(as_function, values, eps=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------- bad input


def test_unknown_family_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"family must be one of .*'s2hc'.*got 'nope'"):
        mixers.build("nope", 4)


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_bad_stream_count(n):
    with pytest.raises(ValueError, match=r"n_streams must be an integer >= 1"):
        mixers.build("s2hc", n)


def test_mhc_lite_refuses_large_n_unless_insisted():
    with pytest.raises(ValueError, match=r"n_streams=8 needs 40320 inputs.*allow_large=True.*<= 6"):
        mixers.build("mhc-lite", 8)
    assert mixers.build("mhc-lite", 7, allow_large=True).num_inputs == 5040
    with pytest.raises(ValueError, match=r"prime factor of n_streams=7"):
        mixers.build("kromhc", 7)


def test_unknown_option_and_bad_option_values():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['iterations'\] for family 's2hc'; allowed"):
        mixers.build("s2hc", 4, iterations=3)
    with pytest.raises(ValueError, match=r"rotation must be one of \['cayley', 'expm'\], got 'qr'"):
        mixers.build("s2hc", 4, rotation="qr")
    with pytest.raises(ValueError, match=r"iterations must be an integer in \[1, 10000\], got 0"):
        mixers.build("mhc", 4, iterations=0)


def test_wrong_input_width():
    with pytest.raises(ValueError, match=r"d_res must have last dimension K=9 .* got shape \(2, 8\)"):
        mixers.build("s2hc", 4)(torch.zeros(2, 8))


@pytest.mark.parametrize("name", list(mixers.REGISTRY))
@pytest.mark.parametrize("method", ["mix", "mix_fused", "__call__"])
def test_every_entry_point_checks_the_input_width(name, method):
    """A family's own ``mix`` and ``mix_fused``, not only the module's call, say what width they expected."""
    mixer = mixers.build(name, 4)
    wrong = torch.zeros(2, mixer.num_inputs + 1)
    with pytest.raises(ValueError) as error:
        getattr(mixer, method)(wrong)
    assert f"d_res must have last dimension K={mixer.num_inputs}" in str(error.value)
    assert f"got shape (2, {mixer.num_inputs + 1})" in str(error.value)
    with pytest.raises(TypeError, match=r"d_res must be a floating-point torch.Tensor .* got dtype torch.int64"):
        getattr(mixer, method)(torch.zeros(2, mixer.num_inputs, dtype=torch.long))
    with pytest.raises(TypeError, match=r"d_res must be a floating-point torch.Tensor .* got list"):
        getattr(mixer, method)([0.0] * mixer.num_inputs)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("mhc", {"alpha": "x"}, "alpha must be a finite number, got 'x'"),
    ("s2hc", {"alpha": float("inf")}, "alpha must be a finite number, got inf"),
    ("hc", {"alpha": None}, "alpha must be a finite number, got None"),
    ("s2hc", {"exact_identity_init": "no"}, "exact_identity_init must be true or false, got 'no'"),
    ("mhc-lite", {"allow_large": "yes"}, "allow_large must be true or false, got 'yes'"),
    ("kromhc", {"allow_large": 0}, "allow_large must be true or false, got 0"),
    ("orthogonal", {"rotation": {"chart": "cayley"}}, "rotation must be one of ['cayley', 'expm']"),
    ("isometric", {"rotation": None}, "rotation must be one of ['cayley', 'expm'], got None"),
])
def test_every_option_value_is_checked_by_the_family(name, options, message):
    with pytest.raises(ValueError) as error:
        mixers.build(name, 4, **options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_family_runs_on_the_meta_device():
    """Shapes without data: nothing to turn off on a device without autocast."""
    with torch.device("meta"):
        mixer = mixers.build("s2hc", 4)
        assert mixer(torch.zeros(3, mixer.num_inputs)).shape == (3, 4, 4)
