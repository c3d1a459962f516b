"""The README's examples run as written."""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 16, 64)
    assert namespace["H"]["res"].shape == (2, 16, 4, 4)


def test_the_wrap_a_branch_example_runs(capsys):
    runpy.run_path(str(ROOT / "examples" / "wrap_a_branch.py"), run_name="__main__")
    assert "row sums" in capsys.readouterr().out
