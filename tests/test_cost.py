"""The verdicts at equal cost (s2hc.study.cost): the tokens and seconds a baseline needs to reach a configuration's
loss, read from curves written by hand (inside them, on them, and beyond them on both sides), their summary over
seeds on the log scale, MFU, the verdicts of hand-made rows, and results without them (older rows)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from s2hc.study import cost
from s2hc.study.report import verdicts, write_report

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/findings.py, the findings pages' renderer
#: A baseline's validation curve: (tokens, loss), with a rise at 300 tokens. Its running minimum is
#: 5.0, 4.0, 4.0, 3.0.
CURVE = [(100, 5.0), (200, 4.0), (300, 4.2), (400, 3.0)]


@pytest.mark.parametrize("target, expected", [
    (4.5, 150.0),  # halfway from (100, 5.0) to (200, 4.0)
    (4.1, 190.0),  # the first crossing; the raw curve crosses 4.1 again between 300 and 400
    (3.5, 350.0),  # from the running minimum's (300, 4.0): the raw curve's (300, 4.2) would give 358.3
    (4.0, 200.0), (3.0, 400.0), (5.0, 100.0),  # on an evaluation
])
def test_the_tokens_to_reach_a_loss_inside_the_curve(target, expected):
    assert cost.cost_to_reach(CURVE, target) == {"value": pytest.approx(expected)}
    assert cost.speedup(CURVE, target, 200.0) == {"value": pytest.approx(expected / 200.0)}


def test_beyond_the_curve_is_a_bound_never_an_extrapolation():
    # below the baseline's best (3.0): it never got there, so it needs more than its 400 tokens
    assert cost.cost_to_reach(CURVE, 2.5) == {"value": None, "beyond": "below", "bound": 400.0}
    assert cost.speedup(CURVE, 2.5, 200.0) == {"value": None, "beyond": "below", "bound": 2.0}
    # above its first evaluation (5.0): it was there before 100 tokens
    assert cost.cost_to_reach(CURVE, 5.5) == {"value": None, "beyond": "above", "bound": 100.0}
    assert cost.speedup(CURVE, 5.5, 400.0) == {"value": None, "beyond": "above", "bound": 0.25}
    with pytest.raises(ValueError, match="empty curve"):
        cost.cost_to_reach([], 1.0)


def test_the_wall_clock_speedup_by_hand():
    seconds = [(2.0, 5.0), (5.0, 4.0), (9.0, 3.0)]  # cumulative training seconds at each evaluation
    assert cost.speedup(seconds, 3.5, 6.0) == {"value": pytest.approx(7.0 / 6.0)}  # 5 + 0.5 × 4 = 7 s
    assert cost.speedup(seconds, 2.0, 6.0) == {"value": None, "beyond": "below", "bound": 1.5}
    assert cost.speedup(seconds, 6.0, 4.0) == {"value": None, "beyond": "above", "bound": 0.5}


def test_ratios_over_seeds_on_the_log_scale():
    summary = cost.summarize_ratios({0: {"value": 2.0}, 1: {"value": 0.5}}, tests=True)
    half = scipy_stats.t.ppf(0.975, 1) * math.log(2)  # std of ±ln 2 is ln 2 · √2, over √2
    assert summary["geometric_mean"] == pytest.approx(1.0) and summary["p"] == pytest.approx(1.0)
    assert summary["ci95"] == pytest.approx([math.exp(-half), math.exp(half)])
    assert summary["beyond"] is None and summary["n"] == 2
    assert cost.summarize_ratios({0: {"value": 2.0}}, tests=True)["ci95"] is None  # one seed: no interval
    # a seed beyond the curve: a bound on the geometric mean, no interval or test
    bound = cost.summarize_ratios({0: {"value": 2.0}, 1: {"value": None, "beyond": "below", "bound": 4.0}}, True)
    assert bound["beyond"] == "below" and bound["bound"] == pytest.approx(math.sqrt(8))
    assert bound["geometric_mean"] is None and bound["ci95"] is None and bound["p"] is None
    mixed = cost.summarize_ratios({0: {"value": None, "beyond": "above", "bound": 0.5},
                                   1: {"value": None, "beyond": "below", "bound": 4.0}}, True)
    assert mixed["beyond"] == "mixed" and mixed["bound"] is None


# ---------------------------------------------------------------------------------------------- rows by hand

PLATFORM = {"step": 0, "cpu": "Test CPU", "device": "cpu", "threads": 2,
            "matmul_peak": {"flops_per_s": 1e10, "dtype": "float32", "size": 512, "repeats": 7, "threads": 2}}


def _row(label: str, family: str, seed: int, val: list[tuple[int, float]], seconds: list[float] | None,
         tokens_per_s: float = 1000.0, flops: int | None = 1_000_000) -> dict:
    return {
        "label": label, "family": family, "options": {}, "n_streams": 1 if family == "residual" else 4,
        "settings": {}, "seed": seed, "status": "finished", "val_loss": val[-1][1], "name": f"{label}-{seed}",
        "curves": {"train": [], "val": [list(p) for p in val]},
        "timing": {"tokens_per_s": tokens_per_s, "median_step_s": 0.1, "val_seconds": seconds},
        "platform": [PLATFORM],
        "cost": {"version": 1, "tokens_per_step": 100, "precision": "float32",
                 "flops": None if flops is None else {"train_per_token": flops}},
    }


def _results(rows: list[dict]) -> dict:
    return {"study": {"baselines": ["residual"], "train": {}, "configurations": [], "seeds": [0, 1]}, "rows": rows}


def hand_results() -> dict:
    """A residual baseline (steps 1 to 4, 100 tokens a step: CURVE) and two configurations over seeds 0 and 1:
    ``fast`` reaches 4.5 and 3.5 in 2 steps (200 tokens), ``best`` goes below the baseline's best."""
    base_seconds = [1.0, 2.0, 3.0, 4.0]
    rows = []
    for seed in (0, 1):
        rows.append(_row("residual", "residual", seed, [(s, loss) for s, (_, loss) in zip((1, 2, 3, 4), CURVE)],
                         base_seconds))
        rows.append(_row("fast", "s2hc", seed, [(1, 5.2), (2, 4.5 if seed == 0 else 3.5)], [1.5, 3.0],
                         tokens_per_s=500.0, flops=1_200_000))
        rows.append(_row("best", "mhc", seed, [(2, 4.0), (4, 2.5 + 0.1 * seed)], None, flops=None))
    return _results(rows)


def test_the_verdicts_of_rows_by_hand():
    found = verdicts(hand_results())
    assert found["format"] == "s2hc-verdicts" and found["version"] == 2
    fast, best = found["baselines"]["residual"]
    assert (fast["configuration"], fast["against"], fast["seeds"]) == ("fast", "residual", [0, 1])
    # tokens: the baseline needs 150 (seed 0, loss 4.5) and 350 (seed 1, loss 3.5) where `fast` spent 200
    tokens = fast["token_speedup"]
    assert tokens["per_seed"] == {0: {"value": pytest.approx(0.75)}, 1: {"value": pytest.approx(1.75)}}
    assert tokens["geometric_mean"] == pytest.approx(math.sqrt(0.75 * 1.75)) and tokens["p_holm"] is not None
    # seconds: the baseline's 1, 2, 3, 4 s at its evaluations: 1.5 s and 3.5 s, where `fast` trained 3 s
    wall = fast["wall_clock_speedup"]
    assert wall["per_seed"] == {0: {"value": pytest.approx(0.5)}, 1: {"value": pytest.approx(3.5 / 3)}}
    assert wall["cpu"] and wall["device"] == "CPU: Test CPU" and wall["unit"] == "measured training seconds"
    # MFU: train FLOPs per token × tokens/s over the measured peak (1e10)
    mfu = fast["mfu"]
    assert mfu["per_seed"] == {0: pytest.approx(0.06), 1: pytest.approx(0.06)}
    assert mfu["baseline_mean"] == pytest.approx(0.1) and mfu["ratio"]["geometric_mean"] == pytest.approx(0.6)
    assert mfu["peak"] == ["CPU, measured float32 512² matmul, 2 threads"]
    assert fast["loss"]["per_seed"] == {0: pytest.approx(1.5), 1: pytest.approx(0.5)}
    # `best`: below the baseline's best on both seeds (a bound, 400 / 400 tokens); no seconds, no FLOP count
    assert best["token_speedup"]["beyond"] == "below" and best["token_speedup"]["bound"] == pytest.approx(1.0)
    assert best["token_speedup"]["per_seed"][0] == {"value": None, "beyond": "below", "bound": 1.0}
    assert not best["wall_clock_speedup"]["available"] and "hold no training seconds" in (
        best["wall_clock_speedup"]["reason"])
    assert not best["mfu"]["available"] and best["mfu"]["reason"] == "no FLOP count in the row"
    json.dumps(found)  # plain JSON


def test_the_report_says_the_verdicts_in_one_line_each():
    report = "\n".join(cost.verdict_lines(verdicts(hand_results())))
    assert "## Verdicts at equal cost" in report and "Against `residual`:" in report
    fast = next(line for line in report.splitlines() if line.startswith("- **fast** against"))
    assert "Δ validation loss +1.0000 [" in fast and "token speedup 1.15× [" in fast
    assert "step time 1.00× the baseline's, trained 3 s against 4 s" in fast
    assert "wall-clock speedup 0.76× [" in fast and "(CPU: Test CPU)" in fast
    assert "MFU 6 % [95 % CI 6 %, 6 %] against 10 % (ratio 0.60×" in fast
    assert "peak: CPU, measured float32 512² matmul" in fast
    best = next(line for line in report.splitlines() if line.startswith("- **best** against"))
    assert "token speedup > 1.00× (below the baseline's best: it never reached this loss), no test: Holm counts it " \
           "as p = 1 over 2 against `residual`" in best
    assert "wall-clock speedup unavailable (" in best and "MFU unavailable (no FLOP count in the row)" in best


def test_the_verdicts_open_with_one_headline_per_configuration():
    lines = cost.verdict_lines(verdicts(hand_results()))
    start = lines.index("In one line each (means over seeds; the detail below):")
    assert lines[start + 2:start + 5] == [
        "- **residual**: final validation loss 3.0000 (the baseline)",
        "- **fast**: final validation loss 4.0000; token speedup 1.15×, wall-clock speedup 0.76× vs `residual` "
        "(3.0000)",
        "- **best**: final validation loss 2.5500; token speedup > 1.00×, wall-clock speedup unavailable vs "
        "`residual` (3.0000)"]
    assert start < lines.index("Against `residual`:")  # before the detailed bullets


def test_a_speedup_that_cannot_be_read_is_said_in_words_not_as_a_bound():
    """A baseline evaluated once (a short run evaluated only at its end) has no curve: no speedup can be read, and
    none is printed as a bound; nor a wall-clock speedup from runs whose measured CPU peaks say the machine was
    busy."""
    results = hand_results()
    for row in results["rows"]:
        if row["label"] == "residual":
            row["curves"]["val"] = row["curves"]["val"][-1:]
            row["timing"]["val_seconds"] = row["timing"]["val_seconds"][-1:]
    lines = cost.verdict_lines(verdicts(results))
    fast = next(line for line in lines if line.startswith("- **fast** against"))
    token = fast.split("; token speedup ", 1)[1].split("; wall-clock", 1)[0]
    assert token.startswith("cannot be read (the baseline was evaluated once (seed 0, 1): no curve to read it from; "
                            "evaluate several times (--eval-every))") and "<" not in token and ">" not in token
    assert "wall-clock speedup cannot be read (the baseline was evaluated once" in fast
    assert ("- **fast**: final validation loss 4.0000; token speedup not readable (one evaluation), wall-clock "
            "speedup not readable (one evaluation) vs `residual` (3.0000)") in lines

    results = hand_results()
    for row in results["rows"]:
        if row["label"] == "fast" and row["seed"] == 1:  # another job took half the CPU when it started
            row["platform"] = [{**PLATFORM, "matmul_peak": {**PLATFORM["matmul_peak"], "flops_per_s": 5e9}}]
    found = verdicts(results)
    fast = next(e for e in found["baselines"]["residual"] if e["configuration"] == "fast")
    assert fast["token_speedup"]["unreadable"] is None  # tokens do not depend on the machine
    assert fast["wall_clock_speedup"]["unreadable"].startswith("a busy machine: the CPU's matmul peak measured at "
                                                               "the runs' starts differs 2.0× between them (seed 1;")
    line = next(x for x in cost.verdict_lines(found) if x.startswith("- **fast** against"))
    assert "wall-clock speedup cannot be read (a busy machine" in line


def test_results_without_the_cost_have_no_verdicts(tmp_path):
    """A committed study's results.json predates the rows' cost: it still loads, its report has no verdicts (the
    committed report is unchanged: tests/test_study.py), and no verdicts.json is written (a stale one goes)."""
    shutil.copy(ROOT / "docs" / "study" / "results.json", tmp_path / "results.json")
    (tmp_path / "verdicts.json").write_text("{}")
    results = json.loads((tmp_path / "results.json").read_text())
    assert not cost.has_cost(results) and verdicts(results)["baselines"] == {}
    report = write_report(tmp_path).read_text()
    assert "Verdicts at equal cost" not in report and not (tmp_path / "verdicts.json").exists()
    # rows with the cost but measured by a run that logged no training seconds: that measure alone is missing
    rows = hand_results()["rows"]
    for row in rows:
        row["timing"]["val_seconds"] = None
    entry = verdicts(_results(rows))["baselines"]["residual"][0]
    assert entry["token_speedup"]["available"] and not entry["wall_clock_speedup"]["available"]


def test_a_findings_page_reads_the_verdicts_the_report_gives():
    """scripts/findings.py's ``Study.verdict``: the report's verdict entry, its texts and numbers."""
    from findings import Study

    study = Study("hand", hand_results())
    fast = study.verdict("fast", "residual")
    assert fast.token.startswith("1.15× [") and fast.token_value.f(2) == "1.15"
    assert fast.wall.endswith("(CPU: Test CPU)") and fast.wall_value.f(2) == "0.76"
    assert fast.mfu == "6 % [6 %, 6 %]" and fast.mfu_value.f(1) == "6.0"
    assert fast.loss.startswith("+1.000 [") and fast.seeds == "2 seeds"
    best = study.verdict("best", "residual")
    assert best.token == "> 1.00× (below the baseline's best: it never reached this loss)"
    assert best.wall.startswith("unavailable (") and best.mfu == "unavailable (no FLOP count in the row)"
    with pytest.raises(KeyError, match="has no verdict of 'fast' against 'best'"):
        study.verdict("fast", "best")


def test_a_findings_page_tabulates_the_verdicts():
    from findings import Study

    table = Study("hand", hand_results()).verdict_table("residual").splitlines()
    assert table[0].startswith("| configuration | Δ validation loss") and len(table) == 6
    assert table[2].startswith("| fast | +1.000 [") and "| 1.00× | 1.15× [" in table[2]
    assert table[2].endswith("| 6 % [6 %, 6 %] |")
    assert table[3].startswith("| best |") and "| > 1.00× | unavailable |" in table[3]
    assert table[5] == ("`>` a bound: the baseline never reached the configuration's final loss in its run. Wall "
                        "clock measured on CPU: Test CPU.")
    with pytest.raises(KeyError, match="no verdicts against 'fast'"):
        Study("hand", hand_results()).verdict_table("fast")
