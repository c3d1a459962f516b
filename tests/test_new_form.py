"""A connection form is one module plus one registry line (docs/design.md, "Adding a connection form"): a form
defined here, registered and nothing else, trains, counts its FLOPs, diagnoses and benches; and nothing outside the
declaring packages asks a form, connection or head by its class."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import small_config
from torch import nn

import s2hc
from s2hc.connection import Connection, forms
from s2hc.connection.forms import CoefficientProbe, ConnectionForm
from s2hc.counts import add, count

SRC = Path(s2hc.__file__).parent
NAME = "mean-read"


class MeanRead(Connection):
    """Reads the streams' mean, writes the branch output to every stream with a learned gain: ``(B, T, n, C)``."""

    family = NAME

    def __init__(self, dim: int, n_streams: int, layer_index: int = 0):
        super().__init__()
        self.dim, self.n_streams, self.layer_index = dim, n_streams, layer_index
        self.gain = nn.Parameter(torch.ones(n_streams))

    def matrices(self, x: torch.Tensor, fused: bool | None = None) -> dict[str, torch.Tensor]:
        n, lead = self.n_streams, x.shape[:2]
        return {"pre": torch.full((*lead, n), 1 / n), "post": self.gain.detach().float().expand(*lead, n),
                "res": torch.eye(n).expand(*lead, n, n)}

    def forward(self, x: torch.Tensor, branch, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = branch(x.mean(dim=-2), *args, **kwargs)
        return x + self.gain.to(x.dtype)[:, None] * out.unsqueeze(-2)


class MeanReadForm(ConnectionForm):
    name = NAME
    summary = "the streams' mean read, a learned write gain per stream"
    min_streams = 2
    coefficient_paths = (True,)

    def build(self, dim, n_streams, layer_index=0, *, sublayer=0, n_sublayers=1, **options):
        self.check_options(options, "option(s)")
        return MeanRead(dim, n_streams, layer_index)

    def flops(self, dim, n_streams, *, sublayer, n_sublayers, **options):
        return add(count(0, n_streams * dim), count(0, 2 * n_streams * dim))  # the mean; the gained write

    def coefficient_probe(self, dim, n_streams, generator):
        module = MeanRead(dim, n_streams)
        return CoefficientProbe(module, lambda x, fused: module.gain.sum() * x.sum())


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(forms.REGISTRY, NAME, MeanReadForm())
    return NAME


def test_a_form_defined_outside_the_package_trains_counts_diagnoses_and_benches(registered, corpus_file, tmp_path):
    from s2hc.bench.measure import Variant, benchmark_coefficients, benchmark_steps
    from s2hc.bench.settings import BenchSettings
    from s2hc.diagnostics import diagnose_checkpoint
    from s2hc.flops import model_flops
    from s2hc.models import Transformer
    from s2hc.train import train

    assert registered in s2hc.families()
    config = small_config(corpus_file, tmp_path, family=registered, n_streams=2, max_steps=2)
    result = train(config)
    assert result.step == 2 and result.val_loss is not None
    gains = [m.gain for m in Transformer(config.model_config()).modules() if isinstance(m, MeanRead)]
    assert len(gains) == 2 * config.model_config().n_layers

    flops = model_flops(config.model_config(), config.seq_len)
    assert flops["parts"]["connections"]["elementwise"] == 2 * config.model_config().n_layers * 3 * 2 * 32

    diagnosed = diagnose_checkpoint(result.out, out=tmp_path / "diagnose")
    written = json.loads((tmp_path / "diagnose" / "diagnostics.json").read_text())
    assert diagnosed["family"] == written["family"] == registered and len(written["layers"]) == 4
    assert (tmp_path / "diagnose" / "report.md").exists()

    settings = BenchSettings(preset="tiny", overrides={"n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 2,
                                                       "ffn_dim": 64, "vocab_size": 64}, n_streams=2, batch_size=1,
                             seq_len=8, repeats=1, steps=1, warmup=0, memory=False)
    rows = benchmark_steps(settings, [Variant(registered, 2)])
    assert [row["family"] for row in rows] == ["residual", registered]
    coefficient_rows = benchmark_coefficients([registered], n_streams=2, dim=16, tokens=8, repeats=1)
    assert [(row["family"], row["fused"]) for row in coefficient_rows] == [(registered, True)]


# ---------------------------------------------------- nobody outside the declaring packages asks a class

#: Where the forms, their modules and the mixing families are declared: the only places that may ask one's class.
DECLARING = ("connection/forms/", "mixers/")
#: The base classes every module of a form is, which anyone may ask: what a module is, never which form.
BASES = {"ConnectionModule", "Connection", "StreamHead", "ConnectionForm", "Mixer", "Module"}


def _declared_classes() -> set[str]:
    """Every class the forms define (their forms, connections and heads) and the hyper-connection's own modules,
    but the bases. (A mixing family's inner modules, a Sinkhorn or a rotation, are its mathematics, not a form.)"""
    paths = [*(SRC / "connection" / "forms").glob("*.py"), SRC / "connection" / "module.py",
             SRC / "connection" / "streams.py"]
    names = {node.name for path in paths for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ClassDef)}
    return names - BASES


def _class_names(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Tuple):
        for item in node.elts:
            yield from _class_names(item)


def test_no_module_outside_the_declaring_packages_asks_a_form_connection_or_head_class():
    declared = _declared_classes()
    assert {"HyperConnection", "HyperHead", "GatedResidual", "GatedHead", "AttnResConnection", "AttnResHead",
            "WideResidual", "ResidualConnection", "HyperConnectionForm", "DepthAttention"} <= declared
    found = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(DECLARING):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                    "issubclass")
                    and len(node.args) == 2):
                asked = set(_class_names(node.args[1])) & declared
                found += [f"{relative}:{node.lineno} {name}" for name in sorted(asked)]
    assert found == []
