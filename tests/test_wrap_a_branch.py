"""README's "Wrap a branch": its small GPT, exactly as written there, trains with every family's string through
the one public entry point (:class:`s2hc.Connections`), and what ``Connections`` builds is each family's own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import s2hc
from s2hc.connection import forms

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_gpt() -> dict:
    """The namespace of README's block that defines ``GPT`` (run as written: it also trains one step of mhc)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    (block,) = [b for b in blocks if "class GPT(" in b]
    namespace: dict = {}
    exec(compile(block, "README.md (Wrap a branch)", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("family", s2hc.families())
def test_the_readme_gpt_trains_with_every_family(family):
    gpt = readme_gpt()["GPT"]
    torch.manual_seed(0)
    model = gpt(family, vocab=64, dim=32, layers=2, heads=2)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    connection_parameters = {name: p.detach().clone() for name, p in model.connections.named_parameters()}
    losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # one batch, four steps: it learns
    moved = [name for name, p in model.connections.named_parameters()
             if not torch.equal(p, connection_parameters[name])]
    assert bool(moved) == bool(connection_parameters)  # every family but the residual trains its connections


@pytest.mark.parametrize("family", s2hc.families())
def test_connections_build_what_the_family_builds(family):
    form = forms.get(family)
    connections = s2hc.Connections(16, 6, family)
    assert len(connections) == 6 and connections.n_streams == form.default_streams
    for sublayer, connection in enumerate(connections):
        assert connection.family == family and connection.layer_index == sublayer // 2
    assert (connections.head is not None) == (form.default_stream_reduce == "head")
    assert connections.pre_norms == form.pre_norms
    assert connections.final_norm == (not form.replaces_final_norm(connections.stream_reduce))
    h = torch.randn(2, 5, 16)
    x = connections.expand(h)
    for connection in connections:
        x = connection(x, torch.tanh)
    assert connections.reduce(x).shape == (2, 5, 16)


def test_connections_match_the_models_own_connections():
    """The same family through s2hc's Transformer and through Connections: the same modules, the same start."""
    from s2hc.models import Transformer, get_preset

    config = get_preset("tiny", n_layers=2, dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=32,
                        family="attn-res", family_options={"block_size": 2})
    model = Transformer(config)
    connections = s2hc.Connections(16, 4, "attn-res", block_size=2)
    built = [block.attn_hc for block in model.blocks] + [block.mlp_hc for block in model.blocks]
    ours = [connections[0], connections[2], connections[1], connections[3]]
    assert [(m.sublayer, m.block_size) for m in built] == [(m.sublayer, m.block_size) for m in ours]
    assert type(model.stream_head) is type(connections.head)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(family="mhcc"), r"^family must be one of \['residual'"),
        (dict(family="residual", n_streams=4), r"^n_streams must be 1 for family='residual', got 4"),
        (dict(family="attn-res", lss_init=0.6), r"^lss_init scales several streams; family='attn-res' has one"),
        (dict(family="mhc", stream_reduce="max"), r"^stream_reduce must be one of \['sum', 'mean', 'head'\]"),
        (dict(family="mhc", rotation="cayley"), r"^unknown family_options \['rotation'\] for family 'mhc'"),
        (dict(family="mhc", iterations=0), r"^family option 'iterations' of 'mhc' must be an integer >= 1, got 0$"),
        (dict(family="attn-res", block_size=9), r"block_size' of 'attn-res' must be an integer in \[1, 4\], got 9"),
        (dict(family="s2hc", n_sublayers=0), r"^n_sublayers must be an integer >= 1, got 0"),
    ],
)
def test_bad_settings_are_one_line_naming_them(kwargs, message):
    kwargs = {"n_sublayers": 4, **kwargs}
    with pytest.raises(ValueError, match=message) as raised:
        s2hc.Connections(16, **kwargs)
    assert "\n" not in str(raised.value)


def test_hyper_connection_names_the_entry_point_for_the_other_forms():
    for family in ("residual", "gated-residual", "attn-res", "wide-residual"):
        with pytest.raises(ValueError, match=r"for a HyperConnection, got .* s2hc\.Connections"):
            s2hc.HyperConnection(16, 4, family=family)


def test_compat_takes_the_residual_and_refuses_the_forms_of_their_own_in_one_line():
    from s2hc.compat import get_init_and_expand_reduce_stream_functions

    init, expand, reduce = get_init_and_expand_reduce_stream_functions(4, family="residual")
    branch = nn.Linear(8, 8)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(init(dim=8, branch=branch)(x), x + branch(x))
    for family in ("gated-residual", "attn-res", "wide-residual"):
        with pytest.raises(ValueError, match=rf"^family={family!r} cannot be expressed .* s2hc.Connections$"):
            get_init_and_expand_reduce_stream_functions(4, family=family)
