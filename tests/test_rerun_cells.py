"""scripts/rerun_cells.py names one cell of every committed study, and each cell is a configuration of its study's
config whose run is a committed row: the final rerun round cannot skip a study or fail on a stale name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("rerun_cells", ROOT / "scripts" / "rerun_cells.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_committed_study_has_a_cell():
    committed = {path.parent.name for path in (ROOT / "docs").glob("*/results.json")}
    assert committed <= set(_script().CELLS), f"studies without a cell: {sorted(committed - set(_script().CELLS))}"


@pytest.mark.parametrize("study", sorted(_script().CELLS))
def test_each_cell_is_a_committed_row_of_its_study(study):
    """The cell's configuration and seed are a row of the committed results.json (rerun_cells.py finds the row by the
    run's name, which the runner derives from both); a study not committed yet is checked against its config."""
    config, label, seed = _script().CELLS[study]
    results = ROOT / "docs" / study / "results.json"
    if results.is_file():
        rows = json.loads(results.read_text())["rows"]
        assert any(row["label"] == label and row["seed"] == seed for row in rows), (label, seed)
        return
    from s2hc.study.spec import load_spec

    spec = load_spec(ROOT / config)
    assert any(c.label == label for c in spec.configurations), f"{config} has no configuration {label!r}"
    assert seed in spec.seeds, f"{config} does not train seed {seed}"
