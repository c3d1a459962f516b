"""s2hc.compat: a drop-in for ``hyper_connections.get_init_and_expand_reduce_stream_functions``."""

from __future__ import annotations

import re

import einops
import pytest
import torch
from torch import nn

from s2hc import compat

DIM, STREAMS = 16, 4


def factory(source: str):
    """``get_init_and_expand_reduce_stream_functions`` from ``"s2hc"`` (ours) or ``"hyper_connections"``."""
    if source == "hyper_connections":
        return pytest.importorskip("hyper_connections").get_init_and_expand_reduce_stream_functions
    return compat.get_init_and_expand_reduce_stream_functions


# A small transformer written the way hyper_connections' README and vit.py write one.


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        qkv = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (einops.rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv)
        attn = (q @ k.transpose(-1, -2) * self.scale).softmax(dim=-1)
        return self.to_out(einops.rearrange(attn @ v, "b h n d -> b n (h d)"))


class Transformer(nn.Module):
    def __init__(self, get_fns, dim=DIM, depth=2, num_residual_streams=STREAMS, **hc_kwargs):
        super().__init__()
        init_hyper_conn, self.expand_streams, self.reduce_streams = get_fns(num_residual_streams, **hc_kwargs)
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    init_hyper_conn(dim=dim, branch=Attention(dim), layer_index=2 * i),
                    init_hyper_conn(dim=dim, branch=FeedForward(dim, 2 * dim), layer_index=2 * i + 1),
                ]
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = self.expand_streams(x)
        for attn, ff in self.layers:
            x = attn(x)
            x = ff(x)
        return self.norm(self.reduce_streams(x))


def copy_branches(src: Transformer, dst: Transformer) -> None:
    for src_layer, dst_layer in zip(src.layers, dst.layers):
        for a, b in zip(src_layer, dst_layer):
            b.branch.load_state_dict(a.branch.state_dict())


def perturb_(module: nn.Module, seed: int = 0, spread: float = 0.3) -> None:
    """Move every parameter off its initialisation, so that no coefficient is trivially 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(spread * torch.randn(p.shape, generator=generator))


# 1. The same model trains with either import.


@pytest.mark.parametrize(
    "source, kwargs",
    [
        ("s2hc", {}),
        ("s2hc", {"family": "mhc"}),
        ("s2hc", {"family": "identity"}),
        ("s2hc", {"disable": True}),
        ("hyper_connections", {}),
        ("hyper_connections", {"disable": True}),
    ],
)
def test_transformer_forward_backward(source, kwargs):
    torch.manual_seed(0)
    model = Transformer(factory(source), **kwargs)
    x = torch.randn(2, 5, DIM)
    out = model(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    hc_grads = [p.grad for name, p in model.named_parameters() if name.startswith("layers.") and ".branch." not in name]
    if kwargs.get("disable"):
        assert hc_grads == []
    else:
        assert hc_grads and sum(g.abs().sum() for g in hc_grads) > 0


def test_expand_reduce_match_einops():
    init, expand, reduce = compat.get_init_and_expand_reduce_stream_functions(STREAMS)
    x = torch.randn(3, 5, DIM)
    torch.testing.assert_close(expand(x), einops.repeat(x, "b ... -> (b s) ...", s=STREAMS), rtol=0, atol=0)
    folded = torch.randn(3 * STREAMS, 5, DIM)
    torch.testing.assert_close(reduce(folded), einops.reduce(folded, "(b s) ... -> b ...", "sum", s=STREAMS))


# 2. Parity with hyper_connections 0.4.11 and between the calling conventions.


def test_model_matches_package_at_init():
    theirs = Transformer(factory("hyper_connections"))
    ours = Transformer(factory("s2hc"), family="hc")
    copy_branches(theirs, ours)
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("layer_index", [0, 1, 6])
def test_block_matches_package_at_init(layer_index):
    """Distinct streams: the branch reads stream layer_index % s, and its output is added to every stream."""
    hc_package = pytest.importorskip("hyper_connections")
    branch = nn.Linear(DIM, DIM)
    theirs = hc_package.get_init_and_expand_reduce_stream_functions(STREAMS)[0]
    ours = compat.get_init_and_expand_reduce_stream_functions(STREAMS, family="hc")[0]
    residual = torch.randn(2 * STREAMS, 5, DIM)
    expected = theirs(dim=DIM, branch=branch, layer_index=layer_index)(residual)
    torch.testing.assert_close(ours(dim=DIM, branch=branch, layer_index=layer_index)(residual), expected)
    streams = residual.unflatten(0, (2, STREAMS))
    read = streams[:, layer_index % STREAMS]
    torch.testing.assert_close(expected, (streams + branch(read).unsqueeze(1)).flatten(0, 1))


def test_disabled_matches_package_residual():
    theirs = Transformer(factory("hyper_connections"), disable=True)
    ours = Transformer(factory("s2hc"), disable=True)
    copy_branches(theirs, ours)
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ours(x), theirs(x))
    assert ours(x).shape == x.shape  # disabled: no streams, expand and reduce are the identity


@pytest.mark.parametrize("shape", [(2 * STREAMS, 5, DIM), (2 * STREAMS, 2, 3, DIM), (2 * STREAMS, DIM)])
@pytest.mark.parametrize("kwargs", [{}, {"family": "hc"}, {"disable": True}])
def test_call_styles_agree(shape, kwargs):
    torch.manual_seed(0)
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM, **kwargs)[0]
    branch = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
    wrapped, bare = init(branch=branch, layer_index=1), init(layer_index=1)
    perturb_(bare)
    wrapped.load_state_dict(bare.state_dict(), strict=False)  # same connection parameters, plus the branch
    residual = torch.randn(*shape) if not kwargs.get("disable") else torch.randn(2, *shape[1:])

    expected = wrapped(residual)
    branch_input, add_residual = bare(residual)
    assert branch_input.shape == (2, *shape[1:-1], DIM)
    torch.testing.assert_close(add_residual(branch(branch_input)), expected)
    torch.testing.assert_close(bare.decorate_branch(branch)(residual), expected)
    assert expected.shape == residual.shape


@pytest.mark.parametrize("kwargs", [{}, {"disable": True}])
def test_tuple_output_and_branch_arguments_pass_through(kwargs):
    torch.manual_seed(0)
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM, **kwargs)[0]
    linear = nn.Linear(DIM, DIM)
    aux = torch.tensor(3.0)

    def branch(h, scale, *, shift):
        return linear(h) * scale + shift, aux

    def plain(h):
        return linear(h) * 2.0 + 0.5

    residual = torch.randn(2 * STREAMS, 5, DIM)
    expected = init(branch=plain, layer_index=2)(residual)
    new_residual, extra = init(branch=branch, layer_index=2)(residual, 2.0, shift=0.5)
    assert extra is aux
    torch.testing.assert_close(new_residual, expected)

    branch_input, add_residual = init(layer_index=2)(residual)
    new_residual, extra = add_residual(branch(branch_input, 2.0, shift=0.5))
    assert extra is aux
    torch.testing.assert_close(new_residual, expected)
    new_residual, extra = init(layer_index=2).decorate_branch(branch)(residual, 2.0, shift=0.5)
    torch.testing.assert_close(new_residual, expected)


def test_dim_bound_by_factory_and_layer_index_defaults_to_zero():
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM, family="hc")[0]
    block = init(branch=nn.Linear(DIM, DIM))
    assert block.hc.dim == DIM and block.hc.layer_index == 0
    with pytest.raises(TypeError, match="dim"):
        compat.get_init_and_expand_reduce_stream_functions(STREAMS)[0](branch=nn.Identity())


# 3. Bad input.


@pytest.mark.parametrize("num_streams", [0, -1, 2.0, True])
def test_bad_num_streams(num_streams):
    with pytest.raises(ValueError, match="num_streams"):
        compat.get_init_and_expand_reduce_stream_functions(num_streams)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_fracs": 0}, "num_fracs"),
        ({"add_stream_embed": True}, "add_stream_embed"),  # needs dim
        ({"add_stream_embed": 1}, "add_stream_embed"),
        ({"family": "nope"}, "family"),
        ({"rotation": "cayley", "iterations": 3}, "iterations"),
        ({"sinkhorn_iters": 10}, "sinkhorn_iters.*iterations"),
    ],
)
def test_unsupported_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        compat.get_init_and_expand_reduce_stream_functions(STREAMS, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"tanh": False}, ValueError, "tanh=False is not supported"),
        ({"log_domain_sinkhorn": True}, ValueError, "log_domain_sinkhorn"),
        ({"num_dynamic_alpha_proposals": 2}, ValueError, "num_dynamic_alpha_proposals"),
        ({"residual_mix_constraint_fn": abs}, ValueError, "residual_mix_constraint_fn"),
        ({"forward_method_names": ("f",)}, ValueError, "forward_method_names"),
        ({"typo_option": 1}, TypeError, "typo_option"),
        ({"num_fracs": 3}, ValueError, "divisible by num_fracs=3"),
        ({"num_input_views": 0}, ValueError, "num_input_views"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"channel_first": "yes"}, ValueError, "channel_first"),
        ({"add_branch_out_to_residual": None}, ValueError, "add_branch_out_to_residual"),
    ],
)
def test_unsupported_init_arguments_are_refused_by_name(kwargs, error, name):
    """Nothing the package's init accepts is silently ignored by an enabled connection."""
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM)[0]
    with pytest.raises(error, match=name):
        init(branch=nn.Identity(), **kwargs)


def test_leading_dim_not_divisible_by_streams():
    init, _, reduce = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM)
    residual = torch.randn(2 * STREAMS + 1, 5, DIM)
    for call in (init(branch=nn.Identity()), init(), reduce):
        with pytest.raises(ValueError, match=f"leading dimension must be divisible by num_streams={STREAMS}"):
            call(residual)


def test_branch_changing_shape_is_refused():
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM)[0]
    with pytest.raises(ValueError, match="branch must return the shape"):
        init(branch=lambda h: h[..., :1, :])(torch.randn(2 * STREAMS, 2, 3, DIM))


# Every family option is checked at the factory, by the family's own checks: one line naming the option, its value
# and what is allowed, not an error at the first init() or the first forward.
BAD_FAMILY_OPTIONS = [
    ("mhc", {"iterations": "x"}, "iterations must be an integer in [1, 10000], got 'x'"),
    ("mhc", {"iterations": 0}, "iterations must be an integer in [1, 10000], got 0"),
    ("mhc", {"iterations": 2.5}, "iterations must be an integer"),
    ("mhc", {"variant": "v3"}, "variant must be one of ['paper', 'deepseek-v4'], got 'v3'"),
    ("mhc", {"alpha": "x"}, "alpha must be a finite number, got 'x'"),
    ("mhc", {"alpha": float("nan")}, "alpha must be a finite number, got nan"),
    ("mhc", {"hc_eps": 1e-6}, "hc_eps is DeepSeek-V4's constant and needs variant='deepseek-v4'"),
    ("mhc", {"variant": "deepseek-v4", "hc_eps": -1.0}, "hc_eps must be a finite number >= 0, got -1.0"),
    ("hc", {"projection": "dense"}, "projection must be one of"),
    ("s2hc", {"rotation": ["cayley"]}, "rotation must be one of ['cayley', 'expm'], got ['cayley']"),
    ("s2hc", {"exact_identity_init": "yes"}, "exact_identity_init must be true or false, got 'yes'"),
    ("mhc-lite", {"allow_large": 1}, "allow_large must be true or false, got 1"),
    ("kromhc", {"off_identity_bias": "x"}, "off_identity_bias must be a finite number or 'n-independent'"),
    ("orthogonal", {"alpha": True}, "alpha must be a finite number, got True"),
]


@pytest.mark.parametrize("family, options, message", BAD_FAMILY_OPTIONS)
def test_bad_family_option_values_are_refused_at_the_factory(family, options, message):
    with pytest.raises(ValueError) as error:
        compat.get_init_and_expand_reduce_stream_functions(STREAMS, family=family, **options)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_streams": 1000}, "num_streams must be at most 64"),
    ({"num_streams": STREAMS, "dim": "16"}, "dim must be an integer >= 1, got '16'"),
    ({"num_streams": STREAMS, "dim": 0}, "dim must be an integer >= 1, got 0"),
    ({"num_streams": STREAMS, "disable": "no"}, "disable must be true or false, got 'no'"),
])
def test_bad_factory_arguments_are_refused_at_the_factory(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compat.get_init_and_expand_reduce_stream_functions(**kwargs)


def test_a_good_option_string_and_sizes_still_build():
    """The factory's check builds the family on the meta device only: init builds it for real, at s·f slots."""
    init, _, _ = compat.get_init_and_expand_reduce_stream_functions(2, num_fracs=2, dim=DIM, family="mhc-lite")
    assert init(branch=nn.Identity()).hc.n_streams == 4
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM, family="mhc", iterations=3)[0]
    assert init(branch=nn.Identity()).hc.mixer.iterations == 3


# What a call is given is checked first: one line saying what was expected, with the shape received.
BAD_CALLS = [  # (what is called, its argument, error, message)
    ("expand", torch.tensor(1.0), ValueError, "x must have shape (batch, ..., dim), got shape ()"),
    ("expand", [1.0, 2.0], TypeError, "x must be a torch.Tensor of shape (batch, ..., dim), got list"),
    ("reduce", torch.tensor(1.0), ValueError, "residual must have shape (batch * streams, ..., dim), got shape ()"),
    ("reduce", [1.0], TypeError, "residual must be a torch.Tensor"),
    ("connection", torch.tensor(1.0), ValueError, "residual must have shape (batch * streams, ..., dim), got shape ()"),
    ("connection", torch.zeros(2 * STREAMS, 3, DIM - 1), ValueError,
     f"residual must have shape (batch * streams, ..., dim) with dim={DIM}, got shape (8, 3, {DIM - 1})"),
    ("connection", torch.zeros(2 * STREAMS, 3, DIM, dtype=torch.long), TypeError,
     "residual must be a floating-point tensor, got dtype torch.int64"),
    ("connection", torch.zeros(2 * STREAMS, 3, DIM, device="meta"), ValueError,
     "x is on device meta, the module's parameters on cpu"),
    ("split", torch.zeros(2 * STREAMS, 3, DIM + 1), ValueError, f"with dim={DIM}, got shape (8, 3, {DIM + 1})"),
]


@pytest.mark.parametrize("called, argument, error, message", BAD_CALLS)
def test_bad_call_arguments_are_one_line(called, argument, error, message):
    init, expand, reduce = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM)
    call = {"expand": expand, "reduce": reduce, "connection": init(branch=nn.Identity()), "split": init()}[called]
    with pytest.raises(error) as caught:
        call(argument)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argument", ["branch", "residual_transform", "depth_residual_fn"])
def test_a_branch_that_is_not_callable_is_refused_at_init(argument):
    init = compat.get_init_and_expand_reduce_stream_functions(STREAMS, dim=DIM)[0]
    with pytest.raises(TypeError, match=f"{argument} must be a callable"):
        init(**{argument: 3})
    with pytest.raises(TypeError, match="branch must be a callable"):
        init().decorate_branch("not a function")
