"""s2hc.compat in the scenarios of the hyper-connections package's own tests, and its other init arguments.

The package's ``tests/test_hyper_connections.py`` wraps a branch as its README shows (with ``num_fracs`` 1 and 4,
``disable`` on and off, plain and manifold-constrained), uses the three returned functions by hand, and wraps
a convolution whose output width differs from its input with ``channel_first=True`` and a
``residual_transform``. These tests run the same scenarios on ``s2hc.compat`` (smaller, and the
manifold-constrained import as ``family="mhc"``) and, where the package's semantics are numeric, compare with
the installed package: at initialisation ``family="hc"`` computes exactly what the package's ``HyperConnections``
computes, since both reduce to their static parts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from s2hc import compat

DIM, STREAMS, TOKENS = 32, 4, 8


def package():
    return pytest.importorskip("hyper_connections")


def ours(num_streams=STREAMS, **kwargs):
    return compat.get_init_and_expand_reduce_stream_functions(num_streams, **kwargs)


def theirs(num_streams=STREAMS, **kwargs):
    return package().get_init_and_expand_reduce_stream_functions(num_streams, **kwargs)


def folded(batch=2, *rest, streams=STREAMS, seed=0):
    """A folded residual ``(batch*streams, *rest)`` whose streams differ (not an expanded copy)."""
    return torch.randn(batch * streams, *rest, generator=torch.Generator().manual_seed(seed))


def perturb_(module: nn.Module, seed: int = 0, spread: float = 0.3) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(spread * torch.randn(p.shape, generator=generator))


def conv_branch(c_in=16, c_out=8):
    return nn.Sequential(nn.Conv2d(c_in, c_in, 3, padding=1), nn.SiLU(), nn.Conv2d(c_in, c_out, 3, padding=1))


def assert_every_parameter_has_a_gradient(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# 1. The package's README test: wrap a branch, expand, call, reduce.


@pytest.mark.parametrize("family", ["s2hc", "mhc"])  # the package's plain and manifold-constrained imports
@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("num_fracs", [1, 4])
def test_readme_usage(num_fracs, disable, family):
    branch = nn.Linear(DIM, DIM)
    residual = torch.randn(2, TOKENS, DIM)
    init, expand_stream, reduce_stream = ours(num_fracs=num_fracs, disable=disable, family=family)
    block = init(dim=DIM, branch=branch)
    out = reduce_stream(block(expand_stream(residual)))
    assert out.shape == (2, TOKENS, DIM) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert_every_parameter_has_a_gradient(block)


@pytest.mark.parametrize("num_fracs", [1, 4])
def test_readme_usage_disabled_matches_package(num_fracs):
    branch = nn.Linear(DIM, DIM)
    residual = torch.randn(2, TOKENS, DIM)
    results = []
    for get in (ours, theirs):
        init, expand_stream, reduce_stream = get(num_fracs=num_fracs, disable=True)
        results.append(reduce_stream(init(dim=DIM, branch=branch)(expand_stream(residual))))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], branch(residual) + residual)


def test_readme_usage_matches_package_at_init():
    branch = nn.Linear(DIM, DIM)
    residual = torch.randn(2, TOKENS, DIM)
    results = []
    for get, kwargs in ((ours, {"family": "hc"}), (theirs, {})):
        init, expand_stream, reduce_stream = get(**kwargs)
        results.append(reduce_stream(init(dim=DIM, branch=branch, layer_index=3)(expand_stream(residual))))
    torch.testing.assert_close(results[0], results[1])


# 2. The package's manual test: the connection without a branch, and its add_residual.


@pytest.mark.parametrize("layer_index", [0, 5])
def test_manual_usage_matches_package_at_init(layer_index):
    branch = nn.Linear(DIM, DIM)
    residual = folded(2, TOKENS, DIM)
    outputs = []
    for get, kwargs in ((ours, {"family": "hc"}), (theirs, {})):
        hyper_conn = get(**kwargs)[0](dim=DIM, layer_index=layer_index)
        branch_input, add_residual = hyper_conn(residual)
        assert branch_input.shape == (2, TOKENS, DIM)
        outputs.append(add_residual(branch(branch_input)))
        torch.testing.assert_close(hyper_conn.decorate_branch(branch)(residual), outputs[-1])
    torch.testing.assert_close(outputs[0], outputs[1])
    assert ours()[2](outputs[0]).shape == (2, TOKENS, DIM)


# 3. The package's residual-transform test: channel-first convolutions that change the width.


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("family", ["s2hc", "hc"])
def test_residual_transform_channel_first(disable, family):
    branch, residual_fn = conv_branch(16, 8), nn.Conv2d(16, 8, 1)
    x = torch.randn(2, 16, 6, 6)
    before = branch(x) + residual_fn(x)
    init, expand_stream, reduce_stream = ours(disable=disable, family=family)
    block = init(dim=16, branch=branch, channel_first=True, residual_transform=residual_fn)
    after = reduce_stream(block(expand_stream(x)))
    assert after.shape == before.shape == (2, 8, 6, 6)
    after.square().mean().backward()
    assert_every_parameter_has_a_gradient(block)


def test_residual_transform_at_init_is_the_transformed_residual_plus_the_branch():
    """``family="hc"`` at initialisation: stream j becomes ``residual_transform(x_j) + branch(x_r)``, r read."""
    branch, residual_fn = conv_branch(16, 8), nn.Conv2d(16, 8, 1)
    init = ours(family="hc")[0]
    block = init(dim=16, branch=branch, channel_first=True, residual_transform=residual_fn, layer_index=2)
    residual = folded(2, 16, 5, 5)
    streams = residual.unflatten(0, (2, STREAMS))
    expected = residual_fn(residual).unflatten(0, (2, STREAMS)) + branch(streams[:, 2]).unsqueeze(1)
    torch.testing.assert_close(block(residual), expected.flatten(0, 1))
    branch_input, add_residual = ours(family="hc")[0](
        dim=16, channel_first=True, residual_transform=residual_fn, layer_index=2
    )(residual)
    torch.testing.assert_close(add_residual(branch(branch_input)), expected.flatten(0, 1))


@pytest.mark.parametrize("channel_first", [False, True])
def test_disabled_residual_transform_matches_package(channel_first):
    """``disable=True``: the package's ``Residual``, ``branch(x) + residual_transform(x)`` (it used to be ignored)."""
    if channel_first:
        branch, residual_fn, x = conv_branch(16, 8), nn.Conv2d(16, 8, 1), torch.randn(2, 16, 5, 5)
    else:
        branch, residual_fn, x = nn.Linear(DIM, 16), nn.Linear(DIM, 16), torch.randn(2, TOKENS, DIM)
    kwargs = {"dim": x.shape[1 if channel_first else -1], "channel_first": channel_first}
    mine = ours(disable=True)[0](branch=branch, residual_transform=residual_fn, **kwargs)(x)
    package_out = theirs(disable=True)[0](branch=branch, residual_transform=residual_fn, **kwargs)(x)
    torch.testing.assert_close(mine, package_out)
    torch.testing.assert_close(mine, branch(x) + residual_fn(x))


def test_residual_transform_may_change_the_width_only():
    block = ours()[0](dim=16, branch=conv_branch(16, 8), channel_first=True, residual_transform=nn.Conv2d(16, 8, 2))
    with pytest.raises(ValueError, match="residual_transform may change the width only"):
        block(folded(2, 16, 5, 5))


# 4. The other arguments of the package's connections.


@pytest.mark.parametrize("layer_index", [0, 3])
def test_channel_first_matches_package_at_init(layer_index):
    """The width on axis 1. The package's 0.4.11 reads channel-first streams right but writes the branch output
    summed over the last axis (it splits fractions off the last axis before moving the width there), so the
    writes are compared with its channel-last computation on the same numbers."""
    conv = conv_branch(16, 16)
    residual = folded(2, 16, 5, 5)
    mine = ours(family="hc")[0](dim=16, branch=conv, channel_first=True, layer_index=layer_index)
    package_init = theirs()[0]
    branch_input, _ = package_init(dim=16, channel_first=True, layer_index=layer_index)(residual)
    torch.testing.assert_close(ours(family="hc")[0](dim=16, channel_first=True, layer_index=layer_index)(residual)[0],
                               branch_input)

    def channel_last_conv(h):
        return conv(h.movedim(-1, 1)).movedim(1, -1)

    package_block = package_init(dim=16, branch=channel_last_conv, layer_index=layer_index)
    torch.testing.assert_close(mine(residual), package_block(residual.movedim(1, -1)).movedim(-1, 1))


def test_dropout_is_on_the_new_streams_as_in_the_package():
    branch = nn.Linear(DIM, DIM)
    residual = folded(2, TOKENS, DIM)
    plain = ours(family="hc")[0](dim=DIM, branch=branch, layer_index=1)(residual)

    def check(mine, package_out):
        torch.testing.assert_close(mine, package_out)  # the same mask from the same seed
        kept = mine != 0
        assert 0.3 < kept.float().mean() < 0.7  # the whole new residual is dropped, not only the branch's part
        torch.testing.assert_close(mine[kept], 2 * plain[kept])

    outputs = []
    for get, kwargs in ((ours, {"family": "hc"}), (theirs, {})):
        block = get(**kwargs)[0](dim=DIM, branch=branch, dropout=0.5, layer_index=1)
        torch.manual_seed(7)
        outputs.append(block(residual))
    check(*outputs)
    torch.testing.assert_close(block.eval()(residual), plain)

    outputs = []
    for get, kwargs in ((ours, {"family": "hc"}), (theirs, {})):
        branch_input, add_residual = get(**kwargs)[0](dim=DIM, dropout=0.5, layer_index=1)(residual)
        torch.manual_seed(7)
        outputs.append(add_residual(branch(branch_input)))
    check(*outputs)


@pytest.mark.parametrize("channel_first", [False, True])
def test_num_input_views_matches_package_at_init(channel_first):
    """Each view is a read with its own ``H_pre``, stacked first: the branch gets ``(v, b, ..., d)``."""
    views = 3
    linear = nn.Linear(DIM, DIM)
    seen = []

    def branch(h):
        seen.append(h.shape)
        mixed = h[0] + 2 * h[1] - h[2]
        return linear(mixed.movedim(1, -1)).movedim(-1, 1) if channel_first else linear(mixed)

    shape = (DIM, 3, 3) if channel_first else (TOKENS, DIM)
    residual = folded(2, *shape)
    kwargs = {"dim": DIM, "branch": branch, "num_input_views": views, "layer_index": 2, "channel_first": channel_first}
    mine = ours(family="hc")[0](**kwargs)(residual)
    if not channel_first:  # the package puts the width before the batch for views with channel_first
        torch.testing.assert_close(mine, theirs()[0](**kwargs)(residual))
    assert seen[0] == (views, 2, *shape)
    read = residual.unflatten(0, (2, STREAMS))[:, 2]
    expected = residual.unflatten(0, (2, STREAMS)) + branch(torch.stack([read] * views)).unsqueeze(1)
    torch.testing.assert_close(mine, expected.flatten(0, 1))


@pytest.mark.parametrize("family", ["hc", "s2hc", "mhc"])
def test_num_input_views_views_learn_apart(family):
    block = ours(family=family)[0](dim=DIM, num_input_views=2)
    perturb_(block)
    branch_input, add_residual = block(folded(2, TOKENS, DIM))
    assert branch_input.shape == (2, 2, TOKENS, DIM)
    assert not torch.allclose(branch_input[0], branch_input[1])
    add_residual(branch_input.sum(0)).square().mean().backward()
    assert_every_parameter_has_a_gradient(block)


@pytest.mark.parametrize("with_branch", [True, False])
def test_add_branch_out_to_residual_false_returns_the_branch_output(with_branch):
    """As the package: the streams are read into the branch and its output is returned, not added to them."""
    linear = nn.Linear(DIM, DIM)

    def branch(h):
        return linear(h), "aux"

    residual = folded(2, TOKENS, DIM)
    outputs = []
    for get, kwargs in ((ours, {"family": "hc"}), (theirs, {})):
        init = get(**kwargs)[0]
        if with_branch:
            outputs.append(init(dim=DIM, branch=branch, layer_index=1, add_branch_out_to_residual=False)(residual))
        else:
            branch_input, add_residual = init(dim=DIM, layer_index=1, add_branch_out_to_residual=False)(residual)
            outputs.append(add_residual(branch(branch_input)))
    (mine, extra), (package_out, _) = outputs
    assert extra == "aux" and mine.shape == (2, TOKENS, DIM)
    torch.testing.assert_close(mine, package_out)
    torch.testing.assert_close(mine, linear(residual.unflatten(0, (2, STREAMS))[:, 1]))


@pytest.mark.parametrize("family", ["s2hc", "mhc", "hc"])
def test_add_branch_out_to_residual_false_has_no_unused_parameters(family):
    block = ours(family=family)[0](dim=DIM, branch=nn.Linear(DIM, DIM), add_branch_out_to_residual=False)
    assert block.hc is None  # no H_res and no writes, as the package creates no betas
    perturb_(block)
    block(folded(2, TOKENS, DIM)).square().mean().backward()
    assert_every_parameter_has_a_gradient(block)


def test_depth_residual_fn_matches_package_at_init():
    def gated(branch_written, mixed):
        return mixed + 0.5 * branch_written

    branch = nn.Linear(DIM, DIM)
    residual = folded(2, TOKENS, DIM)
    mine = ours(family="hc")[0](dim=DIM, branch=branch, depth_residual_fn=gated, layer_index=1)(residual)
    package_out = theirs()[0](dim=DIM, branch=branch, depth_residual_fn=gated, layer_index=1)(residual)
    torch.testing.assert_close(mine, package_out)


def test_stream_embed_matches_package():
    mine, package_expand = ours(dim=DIM, add_stream_embed=True)[1], theirs(dim=DIM, add_stream_embed=True)[1]
    assert mine.stream_embed.shape == (STREAMS, DIM)
    with torch.no_grad():
        mine.stream_embed.normal_()
    package_expand.load_state_dict(mine.state_dict())  # the same name and shape as the package's
    x = torch.randn(2, TOKENS, DIM)
    torch.testing.assert_close(mine(x), package_expand(x))
    assert isinstance(ours(dim=DIM, add_stream_embed=True, disable=True)[1], nn.Identity)


# 5. Frac-connections: the width split into fractions.


@pytest.mark.parametrize("streams, fracs", [(1, 4), (4, 2), (2, 4)])
@pytest.mark.parametrize("family", ["hc", "s2hc", "mhc", "kromhc"])
def test_fracs_are_slots_of_the_family(streams, fracs, family):
    init, expand_stream, reduce_stream = ours(streams, num_fracs=fracs, family=family)
    block = init(dim=DIM, branch=nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM)), layer_index=1)
    assert block.hc.n_streams == streams * fracs and block.hc.dim == DIM // fracs
    perturb_(block, spread=0.1)
    out = reduce_stream(block(expand_stream(torch.randn(2, TOKENS, DIM))))
    assert out.shape == (2, TOKENS, DIM) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert_every_parameter_has_a_gradient(block)


@pytest.mark.parametrize("streams, fracs, layer_index", [(1, 4, 0), (1, 2, 3), (4, 2, 1), (2, 4, 3)])
def test_fracs_start_as_the_plain_residual(streams, fracs, layer_index):
    """``family="hc"`` at init: each branch-input fraction reads its own fraction of stream ``layer_index % s``
    and each output fraction is added to the same fraction of every stream: ``x_j + F(x_r)``."""
    branch = nn.Linear(DIM, DIM)
    block = ours(streams, num_fracs=fracs, family="hc")[0](dim=DIM, branch=branch, layer_index=layer_index)
    residual = folded(2, TOKENS, DIM, streams=streams)
    unfolded = residual.unflatten(0, (2, streams))
    expected = unfolded + branch(unfolded[:, layer_index % streams]).unsqueeze(1)
    torch.testing.assert_close(block(residual), expected.flatten(0, 1))


@pytest.mark.parametrize("streams, fracs, views", [(1, 4, 1), (4, 2, 1), (2, 2, 3)])
def test_fracs_compute_their_equations(streams, fracs, views):
    """After training has moved the parameters: the reads, the slot mixing and the writes, one slot at a time."""
    block = ours(streams, num_fracs=fracs, family="s2hc")[0](dim=DIM, num_input_views=views, layer_index=1)
    perturb_(block)
    residual = folded(2, TOKENS, DIM, streams=streams)
    branch = nn.Linear(DIM, DIM)
    branch_input, add_residual = block(residual)
    new = add_residual(branch(branch_input if views == 1 else branch_input.sum(0)))

    c, n = DIM // fracs, streams * fracs
    x = residual.unflatten(0, (2, streams)).transpose(1, 2)  # (b, T, s, d)
    slots = torch.stack([x[..., i, j * c : (j + 1) * c] for j in range(fracs) for i in range(streams)], dim=-2)
    pre, post, res = block.hc.coefficients(slots)
    more_pre, more_post = block.gates(slots)
    pre = torch.cat([pre.unsqueeze(-2), more_pre], -2)  # rows (view, fraction)
    post = torch.cat([post.unsqueeze(-2), more_post], -2)  # rows: output fractions
    def read(row):
        return sum(pre[..., row, k, None] * slots[..., k, :] for k in range(n))

    reads = [torch.cat([read(v * fracs + j) for j in range(fracs)], -1) for v in range(views)]
    out = branch(reads[0] if views == 1 else sum(reads))
    for v in range(views):
        got = branch_input if views == 1 else branch_input[v]
        torch.testing.assert_close(got, reads[v])
    for i in range(streams):
        for j in range(fracs):
            slot = j * streams + i
            expected = sum(res[..., slot, k, None] * slots[..., k, :] for k in range(n))
            expected = expected + sum(post[..., f, slot, None] * out[..., f * c : (f + 1) * c] for f in range(fracs))
            got = new.unflatten(0, (2, streams))[:, i, :, j * c : (j + 1) * c]
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_fracs": 2},
        {"num_input_views": 2},
        {"num_fracs": 2, "channel_first": True},
        {"residual_transform": nn.Linear(DIM, DIM)},
        {"depth_residual_fn": torch.add},
    ],
)
def test_call_styles_agree_beyond_the_fast_path(kwargs):
    views = kwargs.get("num_input_views", 1)
    linear = nn.Linear(DIM, DIM)

    def branch(h):
        h = h.sum(0) if views > 1 else h
        return linear(h.movedim(1, -1)).movedim(-1, 1) if kwargs.get("channel_first") else linear(h)

    init = ours()[0]
    wrapped, bare = init(dim=DIM, branch=branch, layer_index=1, **kwargs), init(dim=DIM, layer_index=1, **kwargs)
    perturb_(bare)
    wrapped.load_state_dict(bare.state_dict(), strict=False)
    residual = folded(2, DIM, 3, 3) if kwargs.get("channel_first") else folded(2, TOKENS, DIM)
    expected = wrapped(residual)
    branch_input, add_residual = bare(residual)
    torch.testing.assert_close(add_residual(branch(branch_input)), expected)
    torch.testing.assert_close(bare.decorate_branch(branch)(residual), expected)


def test_everything_together():
    """Channel-first convolutions with 2 streams of 2 fractions, 2 input views, a width change and dropout."""
    conv = conv_branch(16, 8)

    def branch(views):
        return conv(views[0] - views[1])

    init, expand_stream, reduce_stream = ours(2, num_fracs=2, family="s2hc")
    block = init(
        dim=16,
        branch=branch,
        channel_first=True,
        residual_transform=nn.Conv2d(16, 8, 1),
        num_input_views=2,
        dropout=0.1,
    )
    out = reduce_stream(block(expand_stream(torch.randn(2, 16, 5, 5))))
    assert out.shape == (2, 8, 5, 5)
    out.square().mean().backward()
    assert_every_parameter_has_a_gradient(block)
