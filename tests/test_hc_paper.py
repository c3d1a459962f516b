"""``hc`` in the HC paper's form (``projection="per-stream"``, the default) against an independent reference:
lucidrains' ``hyper-connections`` package (its dynamic HC, Algorithm 2 of arXiv 2409.19606), with every
static and dynamic weight moved away from its initialisation and copied across."""

from __future__ import annotations

import pytest
import torch

import s2hc

hyper_connections = pytest.importorskip("hyper_connections")
from hyper_connections.hyper_connections import HyperConnections  # noqa: E402

C, N = 16, 4


def pair(seed: int, layer_index: int = 1):
    """The package's connection with random weights, and ours holding the same weights."""
    g = torch.Generator().manual_seed(seed)
    theirs = HyperConnections(N, dim=C, layer_index=layer_index, tanh=True)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    # their RMSNorm has no epsilon (F.normalize clamps the norm at 1e-12); ours must be > 0: a negligible one
    ours = s2hc.HyperConnection(C, N, family="hc", layer_index=layer_index, eps=1e-30)
    with torch.no_grad():
        ours.norm_weight.copy_(theirs.norm.gamma + 1)  # their RMSNorm scales by (γ + 1)
        ours.projection[:, 0] = theirs.dynamic_alpha_fn[:, 0]  # read weight of each stream
        ours.projection[:, 1] = theirs.dynamic_beta_fn  # write weight
        ours.projection[:, 2:] = theirs.dynamic_alpha_fn[:, 1:]  # each stream's row of A_r
        ours.bias_pre.copy_(theirs.static_alpha[:, 0])
        ours.bias_post.copy_(theirs.static_beta)
        ours.mixer.bias.copy_(theirs.static_alpha[:, 1:].T)  # H_res = A_rᵀ
        ours.alpha_pre.fill_(theirs.dynamic_alpha_scale.item())  # the paper shares one s_α for A_m and A_r
        ours.mixer.alpha.fill_(theirs.dynamic_alpha_scale.item())
        ours.alpha_post.fill_(theirs.dynamic_beta_scale.item())
    return theirs, ours


def run_package(theirs: HyperConnections, x: torch.Tensor, branch) -> torch.Tensor:
    """Their width and depth connections on streams ``x`` ``(B, T, n, C)`` (the package folds streams into B)."""
    folded = x.permute(0, 2, 1, 3).flatten(0, 1)  # (B·n, T, C), stream-major within each batch item
    branch_input, residuals, extra = theirs.width_connection(folded)
    out = theirs.depth_connection(branch(branch_input), residuals, **extra)
    return out.unflatten(0, (x.shape[0], N)).permute(0, 2, 1, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_stream_hc_equals_the_package_with_random_weights(seed):
    theirs, ours = pair(seed)
    torch.manual_seed(seed)
    branch = torch.nn.Sequential(torch.nn.Linear(C, C), torch.nn.Tanh())
    x = torch.randn(2, 5, N, C, generator=torch.Generator().manual_seed(100 + seed))
    expected = run_package(theirs, x, branch)
    for fused in (True, False):
        ours.set_options(fused=fused)
        torch.testing.assert_close(ours(x, branch), expected, rtol=1e-5, atol=1e-5)


def test_gradients_match_the_package():
    theirs, ours = pair(3)
    branch = torch.nn.Linear(C, C)
    x = torch.randn(2, 3, N, C, generator=torch.Generator().manual_seed(7))
    (run_package(theirs, x, branch) ** 2).sum().backward()
    (ours(x, branch) ** 2).sum().backward()
    torch.testing.assert_close(ours.projection.grad[:, 1], theirs.dynamic_beta_fn.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.mixer.bias.grad, theirs.static_alpha.grad[:, 1:].T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.bias_post.grad, theirs.static_beta.grad, rtol=1e-4, atol=1e-5)


def test_projection_forms_and_their_parameter_shapes():
    paper = s2hc.HyperConnection(C, N, family="hc")
    flat = s2hc.HyperConnection(C, N, family="hc", projection="flat")
    assert paper.per_stream and not flat.per_stream
    assert paper.projection.shape == (C, 2 + N) and paper.norm_weight.shape == (C,)
    assert flat.projection.shape == (N * C, 2 * N + N * N) and flat.norm_weight.shape == (N * C,)
    x = torch.randn(2, 3, N, C)
    branch = torch.nn.Linear(C, C)
    torch.testing.assert_close(paper(x, branch), flat(x, branch))  # the same function at initialisation
    with pytest.raises(ValueError, match=r"projection must be one of \['per-stream', 'flat'\], got 'rows'"):
        s2hc.HyperConnection(C, N, family="hc", projection="rows")
    with pytest.raises(ValueError, match="unknown option"):
        s2hc.HyperConnection(C, N, family="mhc", projection="flat")
