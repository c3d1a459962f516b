"""s2hc.diagnostics.diagnose_model: the report of a model one holds (an s2hc Transformer or a hand-written module
of s2hc connections), written by the code that writes `s2hc diagnose`'s for a run."""

import json

import pytest
import torch
from helpers import SMALL_MODEL
from torch import nn

import s2hc
from s2hc.data.shards import stored_cache_dir
from s2hc.devices import autocast_dtype
from s2hc.diagnostics import collect, diagnose_checkpoint, diagnose_model, plots
from s2hc.diagnostics import report as report_module
from s2hc.models import Transformer, get_preset
from s2hc.rundir import load_model

VOCAB = 50


class Stack(nn.Module):
    """A hand-written model: an embedding, one branch per family each inside its connection, the streams
    summed into a linear head. ``forward(input_ids)``."""

    def __init__(self, families=("s2hc", "s2hc", "s2hc"), n=4, dim=16):
        super().__init__()
        self.n = n
        self.embed, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB)
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in families)
        self.connections = nn.ModuleList(s2hc.connection.build_connection(dim, n, family, layer_index=i)
                                         for i, family in enumerate(families))

    def forward(self, input_ids):
        x = s2hc.expand_streams(self.embed(input_ids), self.n)
        for connection, branch in zip(self.connections, self.branches):
            x = connection(x, branch)
        return self.head(s2hc.reduce_streams(x))


def moved(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with every parameter moved off its initialisation, so the matrices are not near the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture
def no_matplotlib(monkeypatch):
    """As without the plot extra: write_figures draws nothing and the report says what to install."""
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)


def ids(batch=3, time=12, seed=1):
    return torch.randint(0, VOCAB, (batch, time), generator=torch.Generator().manual_seed(seed))


def test_a_hand_written_model_gets_the_measurements_collect_gives(tmp_path, no_matplotlib):
    model, tokens = moved(Stack()), ids()
    report = diagnose_model(model, tokens, tmp_path / "out", tokens=20, seed=3)
    assert report == tmp_path / "out" / "report.md"
    written = json.loads((tmp_path / "out" / "diagnostics.json").read_text())
    expected = collect(model, tokens, tokens=20, seed=3).summary()  # the same sample, measured apart
    assert written["kind"] == "model" and written["model"] == "Stack" and written["family"] == "s2hc"
    assert written["s2hc_transformer"] is False and written["input_shape"] == [3, 12] and written["seed"] == 3
    assert written["layers"] == ["connections.0", "connections.1", "connections.2"] and written["tokens"] == 20
    for key in ("row_sum_error", "col_sum_error", "spectral_norm", "identity_distance"):
        assert written[key]["max"] == pytest.approx(expected[key]["max"], rel=1e-12, abs=0)
    assert written["headline"]["identity_distance_mean"] > 0.05  # moved: the matrices are not the identity
    assert all(check["holds"] for check in written["guarantees"]) and written["guarantees"]  # s²HC's claims
    text = report.read_text()
    assert text.startswith("# s2hc diagnostics: `Stack`\n")
    assert "Family `s2hc`, n = 4 streams (3 connections). Measured on 20 token positions" in text
    assert "s2hc does not know how this model's streams enter and leave" in text
    assert "pip install 's2hc[plot]'" in text and not list((tmp_path / "out").glob("*.png"))


def test_a_run_and_its_model_get_the_same_report(tiny_checkpoint, corpus_file, tmp_path, no_matplotlib):
    """diagnose_checkpoint and diagnose_model measure and write through one path: on the same tokens their
    reports differ only in the title and the paragraph saying what was measured."""
    found = diagnose_checkpoint(tiny_checkpoint, data=str(corpus_file), tokens=48, out=tmp_path / "run", seq_len=16,
                                batch_size=2, device="cpu")
    model, config = load_model(tiny_checkpoint)
    windows = report_module._validation_ids(str(corpus_file), config, stored_cache_dir(config.cache_dir), 48, 16, 2)
    report = diagnose_model(model, windows, tmp_path / "model", tokens=48, batch_size=2,
                            autocast_dtype=autocast_dtype(config.dtype, torch.device("cpu")))
    run_text, model_text = (tmp_path / "run" / "report.md").read_text(), report.read_text()
    assert run_text.startswith("# s2hc diagnose: ") and model_text.startswith("# s2hc diagnostics: `Transformer`")
    assert run_text.split("\n", 3)[3] == model_text.split("\n", 3)[3]
    written = json.loads((tmp_path / "model" / "diagnostics.json").read_text())
    assert written["s2hc_transformer"] is True and written["n_layers"] == SMALL_MODEL["n_layers"]
    assert written["inert_layers"] == found["inert_layers"] == [0, 3]  # the first and last, as for the run
    for key in ("col_sum_error", "composite_spectral_norm", "read_share", "stream_similarity"):
        assert written[key] == json.loads((tmp_path / "run" / "diagnostics.json").read_text())[key]


def test_the_figures_are_written_and_linked(tmp_path):
    pytest.importorskip("matplotlib", reason="the figures need the plot extra")
    report = diagnose_model(moved(Stack(("mhc", "mhc"))), ids(), tmp_path, tokens=16)
    text = report.read_text()
    assert "pip install" not in text
    linked = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert {"amax_gain.png", "column_sums.png", "mixing.png", "stream_usage.png"} <= set(linked)
    assert all((tmp_path / name).stat().st_size > 0 for name in linked)


def test_connections_of_several_families(tmp_path, no_matplotlib):
    report = diagnose_model(Stack(("s2hc", "mhc", "hc")), ids(), tmp_path, tokens=None)
    written = json.loads((tmp_path / "diagnostics.json").read_text())
    assert written["family"] is None and written["families"] == ["s2hc", "mhc", "hc"] and written["tokens"] == 36
    assert "guarantees" not in written
    text = report.read_text()
    assert "Families `s2hc`, `mhc`, `hc`, n = 4 streams (3 connections)" in text
    assert "there is no one family's guarantees to check" in text


def test_a_transformer_keeps_its_mode_and_its_output(tmp_path, no_matplotlib):
    model = Transformer(get_preset("tiny", vocab_size=VOCAB, family="kromhc", n_streams=4, **SMALL_MODEL)).train()
    before = model.eval()(ids()).detach()
    model.train()
    diagnose_model(model, ids(), tmp_path)
    assert model.training and torch.equal(model.eval()(ids()), before)


class Fails(Stack):
    def forward(self, input_ids):
        raise RuntimeError("the user's forward failed")


BAD_CALLS = {
    "float ids": (lambda: (Stack(), torch.randn(2, 8)), {}, "input_ids must be a 2-D integer tensor"),
    "1-D ids": (lambda: (Stack(), torch.arange(8)), {}, "input_ids must be a 2-D integer tensor"),
    "3-D ids": (lambda: (Stack(), torch.zeros(1, 2, 8, dtype=torch.long)), {}, "input_ids must be a 2-D"),
    "a list": (lambda: (Stack(), [[1, 2, 3]]), {}, "input_ids must be a 2-D integer tensor"),
    "no tokens": (lambda: (Stack(), torch.zeros(0, 8, dtype=torch.long)), {}, "input_ids must be a 2-D"),
    "bool ids": (lambda: (Stack(), torch.ones(2, 8, dtype=torch.bool)), {}, "input_ids must be a 2-D integer"),
    "ids beyond the vocabulary": (
        lambda: (Transformer(get_preset("tiny", vocab_size=VOCAB, family="s2hc", n_streams=4, **SMALL_MODEL)),
                 torch.full((1, 4), VOCAB)), {}, f"input_ids must lie in [0, {VOCAB})"),
    "no connection": (lambda: (nn.Linear(4, 4), ids()), {}, "model (Linear) has no hyper-connection that mixes"),
    "residual connections": (lambda: (Stack(("residual",), n=1), ids()), {}, "model (Stack) has no hyper-connection"),
    "not a module": (lambda: ("my model", ids()), {}, "model must be a torch.nn.Module"),
    "tokens 0": (lambda: (Stack(), ids()), {"tokens": 0}, "tokens must be an integer >= 1"),
    "batch_size 0": (lambda: (Stack(), ids()), {"batch_size": 0}, "batch_size must be an integer >= 1"),
    "negative seed": (lambda: (Stack(), ids()), {"seed": -1}, "seed must be an integer >= 0"),
    "autocast by name": (lambda: (Stack(), ids()), {"autocast_dtype": "bfloat16"}, "autocast_dtype must be"),
    "empty name": (lambda: (Stack(), ids()), {"name": " "}, "name must not be empty"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_one_line_naming_the_argument(case, tmp_path):
    make, options, message = BAD_CALLS[case]
    model, input_ids = make()
    with pytest.raises(ValueError) as raised:
        diagnose_model(model, input_ids, tmp_path / "out", **options)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_an_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(ValueError, match=r"^out '.*taken' is a file, not a directory"):
        diagnose_model(Stack(), ids(), tmp_path / "taken")


def test_a_failing_forward_leaves_no_output_behind(tmp_path):
    with pytest.raises(RuntimeError, match="the user's forward failed"):
        diagnose_model(Fails(), ids(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
