"""``s2hc.reports``: the Markdown table builder and the number formats every report shares."""

from __future__ import annotations

import math

import pytest

from s2hc import reports
from s2hc.reports import DASH, table


def test_table_has_the_header_the_alignment_row_and_one_line_per_row():
    assert table(["family", "loss", "note"], [["s2hc", 2.5, "ok"]]) == [
        "| family | loss | note |", "|---|---:|---:|", "| s2hc | 2.5 | ok |"]
    assert table(["a", "b", "c"], [], align="lcr")[1] == "|---|:---:|---:|"


def test_cells_escape_the_column_separator_and_newlines():
    lines = table(["x|y", "value"], [["a|b", "line\nbreak"]])
    assert lines[0] == "| x\\|y | value |" and lines[2] == "| a\\|b | line break |"
    assert lines[2].replace("\\|", "").count("|") == 3  # two cells, not three


def test_none_is_a_dash_and_values_are_formatted():
    assert table(["a", "b", "c", "d"], [[None, 12345, True, False]])[2] == f"| {DASH} | 12,345 | yes | **no** |"


@pytest.mark.parametrize(("align", "rows"), [("lr", [["one"]]), ("lx", []), ("l", [])])
def test_a_table_that_does_not_fit_its_header_is_refused(align, rows):
    with pytest.raises(ValueError, match="align must|rows\\[0\\] has 1 cells"):
        table(["a", "b"], rows, align=align if align != "lr" else None)


@pytest.mark.parametrize(("value", "text"), [
    (None, DASH), (0.0, "0"), (0.5, "0.5"), (1.23456, "1.235"), (1 + 2e-7, "1 + 2.0e-07"), (3e-8, "3.00e-08"),
    (2.5e5, "2.50e+05"), (-0.25, "-0.25"), (math.inf, "inf"), (7, "7"), (1_377_408, "1,377,408"),
])
def test_number(value, text):
    assert reports.number(value) == text


def test_losses_means_ratios_counts():
    assert reports.loss(8.18279) == "8.1828" and reports.loss(None) == DASH and reports.loss(math.nan) == DASH
    assert reports.mean_std(8.2, None) == "8.2000"
    assert reports.mean_std(8.2, 0.01) == "8.2000 ± 0.0100"
    assert reports.mean_std(8.2, 0.01, [8.1, 8.3]) == "8.2000 ± 0.0100 [8.1000, 8.3000]"
    assert reports.mean_std(None, 0.1) == DASH
    assert reports.ratio(1.6912) == "1.69×" and reports.ratio(None) == DASH
    assert reports.count(11461.4) == "11,461" and reports.count(None) == DASH
    assert reports.fixed(1.23456, 2) == "1.23" and reports.sci(3.14159e-8) == "3.1e-08"
    assert reports.p_value(0.0004) == "< 0.001" and reports.p_value(0.0421) == "0.042"
    assert reports.mib(3 * 2**20) == "3 MiB"


@pytest.mark.parametrize(("count", "text"), [
    (999, "999"), (1000, "1 K"), (25_693_808, "25.7 M"), (2_029_400_632, "2.03 B"), (999_999, "1 M"),
    (12.5, "12.5"), (3e15, "3e+03 T"),
])
def test_human(count, text):
    assert reports.human(count) == text


def test_the_leaf_module_imports_nothing_of_s2hc():
    source = reports.__file__
    with open(source) as handle:
        imports = [line for line in handle if line.startswith(("import ", "from "))]
    assert not [line for line in imports if "s2hc" in line or line.startswith("from .")]
