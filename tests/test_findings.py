"""The findings pages (docs/results.md, README.md's results) are rendered from the committed JSON: the committed pages
are what their templates give, a number edited by hand or typed into a template is caught, and the comparisons
they cite are computed (and adjusted) as the pages say. The renderer is the repository's tooling, scripts/findings.py
(Jinja2), not a module of the package."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import scipy.stats

from s2hc.study import stats
from s2hc.study.preregistered import evaluate as evaluate_registered

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from findings import PAGES, Number, Study, check_template, render, render_pages  # noqa: E402


def _copy_repository(tmp_path: Path) -> Path:
    """The docs, the templates and README.md: what render_pages reads."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_the_committed_pages_are_what_their_templates_render():
    for page, text in render_pages(ROOT).items():
        assert (ROOT / page).read_text() == text, f"{page} is stale: run python scripts/render_findings.py"


def test_a_number_edited_by_hand_is_caught(tmp_path):
    root = _copy_repository(tmp_path)
    page = root / "docs" / "results.md"
    text = page.read_text()
    edited = text.replace("Holm p 0.869", "Holm p 0.689", 1)
    assert edited != text
    page.write_text(edited)
    assert render_pages(root)["docs/results.md"] != edited
    render_pages(root, write=True)
    assert page.read_text() == text  # rendering again restores it


@pytest.mark.parametrize("line", ["s²HC ends 0.03 above mHC", "after 300 steps", "n = 4 streams", "a 95 % interval"])
def test_a_number_typed_into_the_prose_is_refused(line):
    with pytest.raises(ValueError, match=r"results:2: a number typed into the prose"):
        check_template(f"# Title\n{line}\n", "results")


@pytest.mark.parametrize("line", ["`--max-steps 300` in code", "[a link](docs/study-0.12b.md)",
                                  "s2hc, gpt2, bf16, H200", "seed 0 and seeds 1 and 2", "<!-- a comment 12 -->",
                                  "{{ num(4) }} streams", "{% set n = 4 %}", "{# 4 streams #}",
                                  '{% for seed in (0, 1) %}{% do claim(seed < 2, "two") %}{% endfor %}'])
def test_names_code_links_and_expressions_may_hold_digits(line):
    check_template(line + "\n", "results")


def _study(values: dict[str, dict[int, float]], baselines=("residual",)) -> Study:
    rows = [{"name": f"{label}-seed{seed}", "label": label, "family": label.split()[0], "options": {},
             "n_streams": 1 if label == "residual" else 4, "seed": seed, "status": "finished", "val_loss": value}
            for label, seeds in values.items() for seed, value in seeds.items()]
    return Study("toy", {"study": {"baselines": list(baselines), "train": {}, "seeds": [0, 1, 2]}, "rows": rows,
                         "environment": {}})


VALUES = {"residual": {0: 5.0, 1: 5.1, 2: 5.2}, "mhc n=4": {0: 5.3, 1: 5.12, 2: 5.25},
          "s2hc n=4": {0: 5.31, 1: 5.1, 2: 5.21}}


def test_a_planned_comparison_is_confirmatory_with_its_reports_holm():
    study = _study(VALUES)
    c = study.diff("s2hc n=4", "residual")
    differences = [VALUES["s2hc n=4"][s] - VALUES["residual"][s] for s in range(3)]
    t = scipy.stats.ttest_1samp(differences, 0.0)
    half = scipy.stats.t.ppf(0.975, 2) * scipy.stats.sem(differences)
    assert c.kind == "confirmatory" and c.mean == pytest.approx(sum(differences) / 3)
    assert (c.low, c.high) == pytest.approx((c.mean - half, c.mean + half))
    other = scipy.stats.ttest_1samp([VALUES["mhc n=4"][s] - VALUES["residual"][s] for s in range(3)], 0.0).pvalue
    assert c.holm == pytest.approx(stats.holm([other, t.pvalue])[1])  # the report's table: mhc, then s2hc
    assert str(c).startswith("+0.107 [") and "−" in str(c)  # a typographic minus


def test_exploratory_comparisons_are_adjusted_over_those_the_pages_cite():
    study = _study(VALUES)
    texts = {"a": '{{ toy.diff("s2hc n=4", "mhc n=4").cite() }}', "b": '{{ toy.diff("mhc n=4", "s2hc n=4").p_holm }}'}
    rendered = render(texts, {"toy": study})
    raw = [c.p for c in study.exploratory]
    assert len(raw) == 2 and "exploratory" in rendered["a"]
    assert rendered["b"] == f"{stats.holm(raw)[1]:.3f}"


def test_an_unknown_configuration_names_those_there_are():
    with pytest.raises(ValueError, match=r"t:1: .*has no configuration 'hc n=4'; it has \['residual'"):
        render({"t": '{{ toy.loss("hc n=4") }}'}, {"toy": _study(VALUES)})


def test_set_binds_a_name_and_leaves_no_line():
    text = '{% set gap = toy.diff("s2hc n=4", "residual") %}\nThe gap is {{ gap }}.\n'
    assert render({"t": text}, {"toy": _study(VALUES)})["t"].startswith("The gap is +0.107 [")


def test_a_line_of_statements_leaves_no_line_and_a_name_the_template_lacks_is_an_error():
    text = ('{% set costs = [] %}\n  {% for label in ("mhc n=4", "s2hc n=4") %}{% do costs.append(toy.loss(label)) '
            '%}{% endfor %}\nLowest {{ min(costs).f(2) }}.\n')
    assert render({"t": text}, {"toy": _study(VALUES)})["t"] == "Lowest 5.21.\n"
    with pytest.raises(ValueError, match=r"^t:2: The gap is \{\{ gap \}\}\.: UndefinedError: 'gap' is undefined"):
        render({"t": "First.\nThe gap is {{ gap }}.\n"}, {"toy": _study(VALUES)})
    with pytest.raises(ValueError, match=r"^t:1: "):
        render({"t": "{% for %}\n"}, {"toy": _study(VALUES)})


def test_a_claim_the_data_no_longer_make_stops_the_rendering_at_its_line():
    text = ('Residual ends lowest.\n{% do claim(toy.loss("residual") < toy.loss("s2hc n=4"), "residual lowest") %}\n'
            'mHC ends lowest.\n{% for label in ("mhc n=4", "s2hc n=4") %}\n'
            '{% do claim(toy.loss(label) < toy.loss("residual"), "mhc lowest") %}\n{% endfor %}\n')
    with pytest.raises(ValueError, match=r"^t:5: .*no longer say .*'mhc lowest'"):
        render({"t": text}, {"toy": _study(VALUES)})
    held = render({"t": text.split("mHC")[0]}, {"toy": _study(VALUES)})["t"]
    assert held == "Residual ends lowest.\n"  # a claim that holds leaves no line


def test_a_measure_of_one_seed_is_that_seeds_value():
    study = _study(VALUES)
    for row in study.results["rows"]:
        row["grad_norm"] = {"max": 2 * row["val_loss"]}
    assert float(study.measure("mhc n=4", "grad_max", seed=1)) == 2 * VALUES["mhc n=4"][1]
    assert float(study.measure("mhc n=4", "grad_max")) == pytest.approx(2 * sum(VALUES["mhc n=4"].values()) / 3)
    with pytest.raises(ValueError, match="no finished run of seed 7 has 'grad_max'"):
        study.measure("mhc n=4", "grad_max", seed=7)


def test_numbers_format_as_the_pages_write_them():
    assert Number(-0.0164).s(3) == "−0.016" and Number(8e-11).g(2) == "8e-11" and Number(8121.4).n() == "8 121"
    assert str(Number(5.17285)) == "5.173" and (Number(0.5) / Number(0.25)).f(1) == "2.0"


def test_every_page_has_its_template():
    for template, page in PAGES.items():
        assert (ROOT / template).is_file() and (ROOT / page).is_file()


def test_a_claim_can_require_an_interval_to_exclude_zero_or_a_test_to_clear():
    study = _study(VALUES)
    c = study.diff("s2hc n=4", "residual")
    assert not c.excludes_zero and not c.clears
    with pytest.raises(ValueError, match=r"no longer say .*'s2hc above'.*does not exclude 0"):
        render({"t": '{% do claim(toy.diff("s2hc n=4", "residual").mean > 0, "s2hc above", '
                     'interval=toy.diff("s2hc n=4", "residual")) %}\n'}, {"toy": study})
    with pytest.raises(ValueError, match=r"does not clear its adjustment"):
        render({"t": '{% do claim(True, "s2hc clears", clears=toy.diff("s2hc n=4", "residual")) %}\n'},
               {"toy": _study(VALUES)})
    assert render({"t": '{% do claim(True, "short", short=toy.diff("s2hc n=4", "residual")) %}ok\n'},
                  {"toy": _study(VALUES)})["t"] == "ok\n"


def _verdict(page: str) -> str:
    return page.split("## Verdict", 1)[1].split("\n## ", 1)[0]


def test_a_registered_test_that_fails_is_no_longer_called_confirmed(tmp_path):
    """Two start-confirm seeds of the residual-equivalent start raised by 0.03: the registered one-sided test no
    longer rejects, and neither the Verdict nor README's results say "confirmed" (or the rendering refuses)."""
    import json

    root = _copy_repository(tmp_path)
    committed = _start_sentences(_verdict((ROOT / "docs" / "results.md").read_text()), (ROOT / "README.md").read_text())
    assert all("confirmed" in page for page in committed)
    path = root / "docs" / "start-confirm" / "results.json"
    results = json.loads(path.read_text())
    for row in results["rows"]:
        if "gate_init=residual" in row["label"] and row["seed"] in (5, 6):
            row["val_loss"] += 0.03
    path.write_text(json.dumps(results))
    try:
        pages = render_pages(root)
    except ValueError as error:  # a claim that held for the committed data refuses: as good
        assert "no longer say" in str(error)
        return
    for page in _start_sentences(_verdict(pages["docs/results.md"]), pages["README.md"]):
        assert "confirmed" not in page and "not supported" in page


def _start_sentences(verdict: str, readme: str) -> tuple[str, str]:
    """The Verdict's bullet on the start effect and README's sentences on it (other registered tests, such as the
    depth-rate study's, say "confirmed" of themselves)."""
    return (verdict.split("**The start, asked again", 1)[1].split("\n- **", 1)[0],
            readme.split("<!-- findings", 1)[1].split("**The start**", 1)[1].split("**with depth**", 1)[0])


def test_an_interval_moved_across_zero_stops_the_sentence_it_guards(tmp_path):
    """HC − mHC at equal cost, whose interval the Verdict says lies below zero: one seed of HC raised so the interval
    crosses zero, and the rendering refuses, naming the interval."""
    import json

    root = _copy_repository(tmp_path)
    path = root / "docs" / "cost" / "results.json"
    results = json.loads(path.read_text())
    before = Study("cost", json.loads(path.read_text())).diff("hc n=4", "mhc n=4")
    assert before.high < 0
    for row in results["rows"]:
        if row["label"] == "hc n=4" and row["seed"] == 0:
            row["val_loss"] += 0.08
    path.write_text(json.dumps(results))
    after = Study("cost", results).diff("hc n=4", "mhc n=4")
    assert after.low < 0 < after.high
    with pytest.raises(ValueError, match=r"no longer say .*does not exclude 0"):
        render_pages(root)


def test_a_registered_test_is_cited_with_the_bound_and_the_p_its_decision_reads():
    """The production study registered one-sided tests: the primary (one test) is cited with its one-sided bound and
    its own p, each secondary with the Holm p over the registered contrasts, never a two-sided interval beside them."""
    import json

    production = Study("production", json.loads((ROOT / "docs" / "production" / "results.json").read_text()))
    primary = production.registered()
    assert primary.bound[0] == float("-inf") and primary.bound[1] < primary.high  # one-sided: tighter than two-sided
    assert primary.cite().startswith(f"{Number(primary.mean).s(3)} [−∞, ")
    assert f"p {Number(primary.p).f(3)} one-sided, pre-registered" in primary.cite() and "Holm" not in primary.cite()
    paper = production.registered("attn-res (block_size=2)")
    assert f"Holm p {paper.p_holm} over 7, one-sided" in paper.cite() and paper.family == 7
    assert f"{paper.high:+.3f}".replace("-", "−") not in paper.cite()  # the two-sided end is not what it decides by


def test_attention_residuals_no_longer_lowering_the_loss_stops_the_verdict(tmp_path):
    """The Verdict and README say both AttnRes reads lower the loss alone: one seed of the paper's read raised by 0.1
    takes its registered test below its adjustment, and the rendering refuses."""
    import json

    root = _copy_repository(tmp_path)
    path = root / "docs" / "production" / "results.json"
    results = json.loads(path.read_text())
    for row in results["rows"]:
        if row["label"] == "attn-res (block_size=2)" and row["seed"] == 0:
            row["val_loss"] += 0.1
    path.write_text(json.dumps(results))
    assert not Study("production", results).registered("attn-res (block_size=2)").clears
    with pytest.raises(ValueError, match="both AttnRes reads confirmed alone"):
        render_pages(root)


def test_an_equivalence_the_seeds_no_longer_bound_is_no_longer_called_equivalent(tmp_path):
    """The equivalence study's registered TOST bounds s²HC − mHC within its margin: four of its eight s²HC seeds raised
    by 0.02 take the interval past the margin, and neither the Verdict nor README's results call the two equivalent."""
    import json

    root = _copy_repository(tmp_path)
    assert "equivalent within ±" in _verdict((ROOT / "docs" / "results.md").read_text())
    path = root / "docs" / "equivalence" / "results.json"
    results = json.loads(path.read_text())
    for row in results["rows"]:
        if row["label"] == "s2hc n=4" and row["seed"] % 2:
            row["val_loss"] += 0.02
    path.write_text(json.dumps(results))
    assert not Study("equivalence", results).registered().clears
    pages = render_pages(root)
    verdict = _verdict(pages["docs/results.md"])
    assert "equivalent within ±" not in verdict and "not shown equivalent" in verdict
    readme = pages["README.md"].split("<!-- findings", 1)[1]
    assert "equivalent within ±" not in readme and "not shown equivalent" in readme


def test_the_depth_rate_verdict_follows_its_four_registered_tests(tmp_path):
    """HC's rows at thirty-two layers moved down by 2 at both rates (every seed, so the spread stays): all four
    registered tests clear and the Verdict, the section and README say HC's lead grows with depth and holding the
    sums costs it; moved up by 2, none clears and they say neither."""
    import copy
    import json

    root = _copy_repository(tmp_path)
    path = root / "docs" / "depth-rate" / "results.json"
    committed = json.loads(path.read_text())
    for shift, clears in ((-2.0, True), (2.0, False)):
        results = copy.deepcopy(committed)
        for row in results["rows"]:
            if row["label"].startswith("hc n=4 [") and row["label"].endswith("n_layers=32]"):
                row["val_loss"] += shift
        path.write_text(json.dumps(results))
        tests = evaluate_registered(results)["secondary"]
        assert len(tests) == 4 and all(t["rejected"] == clears for t in tests)
        pages = render_pages(root)
        section = pages["docs/results.md"].split("### Depth × learning rate", 1)[1].split("\n### ", 1)[0]
        readme = pages["README.md"].split("<!-- findings", 1)[1]
        for text in (_verdict(pages["docs/results.md"]), section):
            assert ("grows with depth at both" in text) == clears and ("Neither rate" in text) != clears
            assert ("costs it at thirty-two layers at both" in text) == clears
        assert ("not confirmed" in readme) != clears and ("costs it at every rate" in readme) == clears


def test_the_final_rerun_round_is_rendered_and_must_cover_every_study(tmp_path):
    """Cells of a final round (``"round": "final"``, as scripts/rerun_cells.py writes them) appear in the Rounding
    section with their commit and where each side trained, split by whether the re-run trained where its row did;
    a round that leaves a committed study out stops the rendering."""
    import json

    root = _copy_repository(tmp_path)
    path = root / "docs" / "reruns" / "cells.json"
    cells = json.loads(path.read_text())
    cells["cells"] = [c for c in cells["cells"] if "round" not in c]  # the earlier rounds; the test's own final below
    where = {"cpu": "Test CPU", "cpu_capability": "AVX512", "threads": 1}
    names = sorted(p.parent.name for p in (root / "docs").glob("*/results.json"))
    final = [{"study": name, "label": "x", "seed": 0, "name": f"{name}-cell", "committed": 5.0,
              "committed_at": "c0ffee0", "rerun": 5.0 + 0.001 * i, "difference": 0.001 * i, "commit": "deadbee",
              "code": "feedbee",
              "round": "final", "platform": where,
              "committed_platform": where if i % 2 else {**where, "cpu": "Other CPU"}}
             for i, name in enumerate(names)]
    path.write_text(json.dumps({"cells": cells["cells"] + final}))
    page = render_pages(root)["docs/results.md"]
    rounding = page.split("## Rounding", 1)[1].split("\n## ", 1)[0]
    assert "The final rerun round (section" in page  # the production section reads the cost and production cells
    assert "**The final round.**" in rounding and "`deadbee`" in rounding and "`feedbee`" in rounding
    assert f"`{names[-1]}-cell`" in rounding and "where the committed row trained" in rounding
    assert "on another CPU model or thread count" in rounding  # the even cells trained elsewhere
    assert "--control" not in rounding
    # controls: a cell trained again with its row's code; the same loss as the final round's says the CPU moved it
    controls = [{**final[i], "round": "control", "commit": "c0ffee0", "rerun": final[i]["rerun"] + moved}
                for i, moved in ((0, 0.0), (2, 0.003))]
    path.write_text(json.dumps({"cells": cells["cells"] + final + controls}))
    rounding = render_pages(root)["docs/results.md"].split("## Rounding", 1)[1].split("\n## ", 1)[0]
    assert f"--control {names[0]} --at c0ffee0" in rounding and "the commit its row trained at" in rounding
    assert "what moved it from its row is the CPU" in rounding
    assert "0.003 from the final round's re-run" in rounding and "moved it too" in rounding
    # the production section: its gated cell at its own code lands where the final round's did, the cost cell on its
    # row: no code change moved the two studies' gated runs
    same = {c["study"]: c for c in final}
    same["cost"] = {**same["cost"], "rerun": 5.0, "difference": 0.0}
    controls = [{**same["production"], "round": "control", "commit": "c0ffee0"}]
    path.write_text(json.dumps({"cells": cells["cells"] + list(same.values()) + controls}))
    page = render_pages(root)["docs/results.md"]
    assert "with the production study's own code (`c0ffee0`" in page and "no code change moved" in page
    path.write_text(json.dumps({"cells": cells["cells"] + final[1:]}))
    with pytest.raises(ValueError, match="one cell of every committed study"):
        render_pages(root)


def test_a_registered_contrast_is_found_by_its_first_configuration_or_whole():
    """Two registered contrasts may start with one configuration (the depth-rate study's interaction and its
    hold_sums contrast both start with HC at 32 layers): the first configuration alone is then refused, naming the
    contrasts, and the whole contrast finds its test."""
    import copy
    import json

    results = json.loads((ROOT / "docs" / "production" / "results.json").read_text())
    study = Study("production", results)
    paper = study.registered("attn-res (block_size=2)")
    assert study.registered(("attn-res (block_size=2)", "residual")).p == paper.p
    twice = copy.deepcopy(results)
    registration = twice["study"]["preregistered"]
    registration["contrasts"] = [*registration["contrasts"], ["attn-res (block_size=2)", "vp-residual"]]
    doubled = Study("production", twice)
    with pytest.raises(KeyError, match="two registered contrasts start with"):
        doubled.registered("attn-res (block_size=2)")
    assert doubled.registered(("attn-res (block_size=2)", "vp-residual")).against == "vp-residual"
    with pytest.raises(KeyError, match="no registered contrast is or starts with"):
        study.registered(("residual", "attn-res (block_size=2)"))


def test_a_damaged_results_json_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """A hand-damaged docs/*/results.json stops the render with one line naming the file, not a traceback."""
    import render_findings
    from findings import load_studies

    study = tmp_path / "docs" / "broken"
    study.mkdir(parents=True)
    (study / "results.json").write_text('{"rows": [1, 2,')
    with pytest.raises(ValueError, match=r"broken/results.json: not valid JSON \(.* at line 1"):
        load_studies(tmp_path / "docs")
    for template in PAGES:  # the templates, beside the damaged study
        (tmp_path / template).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / template, tmp_path / template)
    monkeypatch.setattr(render_findings, "ROOT", tmp_path)
    assert render_findings.main(["--check"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "broken/results.json: not valid JSON" in error[0]
