"""What a study directory records and what it refuses: the registered test and the training settings held against
the runs they were made for, the commit of every invocation, and one line (not a traceback) for a value the study
cannot read, in its config or in a hand-edited ``results.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from s2hc.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGISTERED = {
    "registered": "2026-12-04",
    "hypothesis": "the residual start lowers the loss",
    "contrasts": [["mhc:gate_init=residual", "mhc"]],
    "alternative": "less",
    "alpha": 0.05,
}
STUDY = {"train": {"model_overrides": {"stream_reduce": "mean"}, "max_steps": 2},
         "families": ["mhc", "mhc:gate_init=residual"], "seeds": 2, "preregistered": REGISTERED}


def _config(tmp_path: Path, study: dict, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(study))  # JSON is YAML
    return path


# ----------------------------------------------------------------------------- values the study cannot read


@pytest.mark.parametrize("key, value, message", [
    ("measure", ["validation loss"], "measure must be one of ['validation loss', 'smallest deviation σ (interior)'] "
                                     "(a string), got a list ['validation loss']"),
    ("measure", {"validation loss": 1}, "measure must be one of"),
    ("alternative", ["less"], "alternative must be one of ['less', 'greater', 'two-sided'] (a string), got a list"),
    ("secondary", {"holm": True}, "secondary must be one of ['holm', 'none'] (a string), got a mapping"),
    ("hypothesis", {"a": 1}, "hypothesis must be a string"),
    ("registered", [2026], "registered must be a date (2026-12-04) or a string, got a list"),
])
def test_a_registration_field_of_the_wrong_kind_is_one_line(key, value, message, tmp_path, capsys):
    config = _config(tmp_path, {**STUDY, "preregistered": {**REGISTERED, key: value}})
    assert main(["study", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(config) in err and f"preregistered: {message}" in err, err
    assert not (tmp_path / "out").exists()


def _edited(tmp_path: Path, edit) -> Path:
    results = json.loads((DOCS / "start" / "results.json").read_text())
    edit(results["rows"])
    out = tmp_path / "edited"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))  # NaN is written as NaN, as Python's json reads it
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[2].update(val_loss=math.nan), "rows[2] ('{}'): val_loss is NaN; it must be a finite number"),
    (lambda rows: rows[2].update(val_loss="3.1"), "rows[2] ('{}'): val_loss is '3.1' (a string); it must be a finite"),
    (lambda rows: rows[2].pop("curves"), "rows[2] ('{}'): curves is absent; it must be a mapping with 'train' and"),
    (lambda rows: rows[2]["curves"]["val"].__setitem__(1, [10, "x"]), "rows[2] ('{}'): curves.val[1] is [10, 'x']"),
    (lambda rows: rows[2].update(seed="0"), "rows[2] ('{}'): seed is '0' (a string); it must be an integer >= 0"),
    (lambda rows: rows[2]["timing"].pop("median_step_s"), "rows[2] ('{}'): timing.median_step_s is absent"),
    (lambda rows: rows[2].update(grad_norm={"max": 1}), "rows[2] ('{}'): grad_norm is {{'max': 1}} (a mapping)"),
    (lambda rows: rows.__setitem__(2, [1]), "rows[2] is [1] (a list), not a row"),
])
def test_report_only_over_a_hand_edited_row_is_one_line_naming_the_row_and_field(edit, message, tmp_path, capsys):
    out = _edited(tmp_path, edit)
    name = json.loads((DOCS / "start" / "results.json").read_text())["rows"][2]["name"]
    assert main(["study", "--report-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / "results.json") in err and message.format(name) in err, err
    assert not (out / "report.md").exists()
