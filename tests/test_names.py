"""One word per concept. On the command line every output directory is ``--out``; in the API "hc" alone names the
HC family, and a hyper-connection is a *connection*. The former spellings (``eval --output``, ``export``'s
positional OUT_DIR, ``num_hc_params``, ``count_hc_params``) still work and say that they are deprecated."""

from __future__ import annotations

import pytest
import torch

from s2hc.cli import main
from s2hc.models import Transformer, get_preset
from s2hc.params import count_connection_params, count_hc_params


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_eval_output_is_now_out(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    said = lines(capsys)
    assert said[0] == "s2hc: --output is deprecated and will be removed; use --out"
    assert said[-1] == f"s2hc eval: error: checkpoint '{tmp_path / 'nope'}' does not exist"


def test_export_takes_out_and_still_reads_the_positional_directory(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    said = lines(capsys)
    assert said[0] == "s2hc: the positional OUT_DIR is deprecated and will be removed; use --out OUT_DIR"
    assert said[-1] == f"s2hc export: error: checkpoint '{tmp_path / 'nope'}' does not exist"


@pytest.mark.parametrize("argv, message", [
    (["export", "run"], "the following arguments are required: --out (`s2hc export --help` lists them)"),
    (["export", "run", "a", "--out", "b"], "the output directory is given twice: --out 'b' and OUT_DIR 'a'; "
                                           "give --out alone"),
])
def test_export_needs_one_output_directory(argv, message, capsys):
    assert main(argv) == 2
    assert lines(capsys)[-1] == f"s2hc export: error: {message}"


def test_the_former_parameter_count_names_still_count_and_warn():
    with torch.device("meta"):
        model = Transformer(get_preset("tiny", family="s2hc", n_streams=4))
    with pytest.warns(DeprecationWarning, match="use num_connection_params"):
        assert model.num_hc_params() == model.num_connection_params() > 0
    with pytest.warns(DeprecationWarning, match="use count_connection_params"):
        assert count_hc_params("mhc", layers=2, dim=8, n_streams=2) == count_connection_params(
            "mhc", layers=2, dim=8, n_streams=2)
