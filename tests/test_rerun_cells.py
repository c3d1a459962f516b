"""scripts/rerun_cells.py names one cell of every committed study, and each cell is a configuration of its study's
config whose run is a committed row: the final rerun round cannot skip a study or fail on a stale name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
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


def test_a_control_trains_the_cell_with_the_code_of_its_commit(tmp_path, monkeypatch):
    """``--control STUDY --at COMMIT``: the cell is trained by COMMIT's own code (its ``src/`` and ``configs/``,
    the run config its ``s2hc study --print-commands`` writes) and recorded as a control beside its committed row.
    A clone of this checkout stands in for the repository, the smoke study's first s²HC run for the cell."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs a git checkout")
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(repo)], check=True)
    head, tree = (subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True,
                                 text=True, check=True).stdout.strip() for rev in ("HEAD", "HEAD:src"))
    row = {"name": "s2hc-n4-seed0", "label": "s2hc n=4", "seed": 0, "val_loss": 9.0, "steps": 40,
           "platform": [{"cpu": "Test CPU", "threads": 1}]}
    committed = {"rows": [row], "environment": {"commit": "c0ffee0"}}
    (repo / "docs" / "smoke").mkdir(parents=True)
    (repo / "docs" / "smoke" / "results.json").write_text(json.dumps(committed))
    script = _script()
    monkeypatch.setattr(script, "ROOT", repo)
    monkeypatch.setattr(script, "CELLS", {"smoke": ("configs/study-smoke.yaml", "s2hc n=4", 0)})
    cell = script.control("smoke", "HEAD", tmp_path / "out")
    run_dir = tmp_path / "out" / f"smoke-{head}" / "runs" / "s2hc-n4-seed0"
    assert script._steps(run_dir) == 40
    assert cell["rerun"] == round(script._final(run_dir)[0], 6) and cell["difference"] == round(cell["rerun"] - 9.0, 6)
    assert (cell["round"], cell["commit"], cell["code"], cell["committed_at"]) == ("control", head, tree, "c0ffee0")
    assert cell["committed_platform"] == row["platform"][0] and cell["platform"]["threads"] == 1
    with pytest.raises(SystemExit, match="--at: 'no-such-commit' is not a commit"):
        script.control("smoke", "no-such-commit", tmp_path / "out")
