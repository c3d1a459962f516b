"""What a study directory records and what it refuses: the registered test and the training settings held against
the runs they were made for, the commit of every invocation, and one line (not a traceback) for a value the study
cannot read, in its config or in a hand-edited ``results.json``."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from s2hc.cli import main
from s2hc.study import parse_spec, runner
from s2hc.study.report import build_report

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


# ----------------------------------------------------------------------------------------------- provenance


def _git(directory: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _checkout(root: Path, files: dict[str, str]) -> Path:
    """A git checkout at ``root`` holding ``files``, committed."""
    root.mkdir(parents=True)
    _git(root, "init", "-q")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "initial")
    return root


SMALL = {"families": ["residual", "mhc"], "train": {"max_steps": 2}, "seeds": 1}


def _invocations(out: Path) -> list[dict]:
    return json.loads((out / "study.json").read_text())["invocations"]


def test_every_invocation_records_the_commit_of_s2hc_s_own_checkout(tmp_path, monkeypatch):
    package = _checkout(tmp_path / "checkout", {"src/s2hc/__init__.py": "", "src/s2hc/study.py": "x = 1\n"})
    monkeypatch.setattr(runner, "_package_dir", lambda: package / "src" / "s2hc")
    monkeypatch.delenv(runner.COMMIT_ENV, raising=False)
    spec, out = parse_spec(SMALL), tmp_path / "out"
    runner.prepare(spec, out, code=runner.provenance())
    (package / "src" / "s2hc" / "study.py").write_text("x = 2\n")  # the sources differ from the commit now
    runner.prepare(spec, out, code=runner.provenance(), action="print-commands")
    head = _git(package, "rev-parse", "--short", "HEAD")
    first, second = _invocations(out)
    assert (first["commit"], first["dirty"], first["commit_source"]) == (head, False, "s2hc's checkout")
    assert (second["commit"], second["dirty"], second["action"]) == (head, True, "print-commands")
    assert first["at"] and first["s2hc"]


def test_an_installed_snapshot_records_the_commit_it_is_given_or_the_config_s_checkout(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "s2hc"  # not a checkout: no commit of its own
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    monkeypatch.setattr(runner, "_package_dir", lambda: installed)
    monkeypatch.delenv(runner.COMMIT_ENV, raising=False)
    configs = _checkout(tmp_path / "configs", {"study.yaml": json.dumps(SMALL)})
    code = runner.provenance(configs / "study.yaml")
    assert code == {"commit": _git(configs, "rev-parse", "--short", "HEAD"), "dirty": False,
                    "commit_source": "the config's checkout"}
    monkeypatch.setenv(runner.COMMIT_ENV, "abc1234")  # what the snapshot was built from: it comes first
    monkeypatch.setenv(runner.DIRTY_ENV, "0")
    assert runner.provenance(configs / "study.yaml") == {"commit": "abc1234", "dirty": False,
                                                         "commit_source": "S2HC_COMMIT"}
    monkeypatch.delenv(runner.COMMIT_ENV)
    assert runner.provenance(tmp_path / "elsewhere.yaml")["commit"] is None  # nothing says: unknown, said so
    # a snapshot inside an unrelated checkout (a virtual environment in a repository) is not that checkout's code
    venv_checkout = _checkout(tmp_path / "repo", {"README": "x"})
    inside = venv_checkout / ".venv" / "s2hc"
    inside.mkdir(parents=True)
    (inside / "__init__.py").write_text("")
    monkeypatch.setattr(runner, "_package_dir", lambda: inside)
    assert runner.provenance()["commit"] is None


def test_results_and_report_say_where_the_commit_came_from():
    env = runner._environment(1.0, 1, {"commit": "abc1234", "dirty": None, "commit_source": "S2HC_COMMIT"})
    assert (env["commit"], env["dirty"], env["commit_source"]) == ("abc1234", None, "S2HC_COMMIT")
    results = json.loads((DOCS / "start" / "results.json").read_text())
    results["environment"].update(env, invocations=[{"commit": "abc1234", "dirty": False}, {"commit": None}])
    text = build_report(results, {}, None)
    assert "s2hc 0" in text and "(commit `abc1234` (as S2HC_COMMIT gave it: an installed snapshot), clean or not " \
                                "unknown)" in text
    assert ("- Invocations in this directory (study.json lists them): 2, commit `abc1234` (1×); commit unknown: s2hc "
            "did not run from a git checkout (1×).") in text
