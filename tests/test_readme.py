"""The README's and docs/api.md's examples run as written: every ```python block, in order, in one namespace per
file, in a fresh directory (the runs they train land under the test's tmp_path). Their diagnostics are written as
without the plot extra (no figures: drawing them takes seconds, and tests/test_api.py checks them)."""

import json
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A docs/api.md block that needs the hf extra (transformers, safetensors) says so by importing s2hc.hf.
HF_BLOCK = "import s2hc.hf"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def without_figures(patch: pytest.MonkeyPatch) -> None:
    from s2hc.diagnostics import plots

    patch.setattr(plots, "have_matplotlib", lambda: False)


def run_blocks(blocks: list[str], name: str, namespace: dict) -> dict:
    for block in blocks:
        exec(compile(block, name, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory) -> Path:
    """One token cache ($S2HC_CACHE_DIR) for the module: the embedded corpus is tokenised once (~7 s), not per test."""
    return tmp_path_factory.mktemp("s2hc-cache")


def test_readme_python_examples_run(tmp_path, monkeypatch, token_cache):
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("S2HC_CACHE_DIR", str(token_cache))
    without_figures(monkeypatch)
    namespace = run_blocks(blocks, "README.md", {})
    assert namespace["out"].shape == (2, 16, 64)
    assert namespace["H"]["res"].shape == (2, 16, 4, 4)
    # The Python API section: a trained run, loaded, and a hand-written model's report.
    assert namespace["result"].step == 5 and (tmp_path / "runs" / "api" / "checkpoint.pt").is_file()
    assert namespace["run_config"] == namespace["config"]
    report = namespace["report"]
    assert report == Path("runs/my-model/report.md") and report.read_text().startswith("# s2hc diagnostics: `MyModel`")
    assert "pip install 's2hc[plot]'" in report.read_text()  # as without the plot extra
    measured = json.loads((report.parent / "diagnostics.json").read_text())
    assert measured["kind"] == "model" and measured["family"] == "s2hc" and measured["depth"] == 4


def test_the_wrap_a_branch_example_runs(capsys):
    runpy.run_path(str(ROOT / "examples" / "wrap_a_branch.py"), run_name="__main__")
    assert "row sums" in capsys.readouterr().out


@pytest.fixture(scope="module")
def api_run(tmp_path_factory, token_cache) -> tuple[Path, dict]:
    """docs/api.md's blocks but those needing the hf extra, run once: (their directory, their namespace)."""
    blocks = [b for b in python_blocks((ROOT / "docs" / "api.md").read_text()) if HF_BLOCK not in b]
    directory = tmp_path_factory.mktemp("api")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        patch.setenv("S2HC_CACHE_DIR", str(token_cache))
        without_figures(patch)
        namespace = run_blocks(blocks, "docs/api.md", {})
    return directory, namespace


def test_api_page_python_examples_run(api_run):
    directory, namespace = api_run
    assert len(python_blocks((ROOT / "docs" / "api.md").read_text())) >= 8
    assert namespace["result"].step == 5 and namespace["more"].step == 8
    assert namespace["mhc_config"].out == "runs/api-mhc"
    mine = json.loads((directory / "runs" / "api" / "my-diagnostics" / "diagnostics.json").read_text())
    assert mine["kind"] == "model" and mine["n_layers"] == 4 and mine["tokens"] == 256
    assert (directory / "runs" / "my-model-diagnostics" / "report.md").is_file()
    assert namespace["found"]["kind"] == "checkpoint" and namespace["found"]["depth"] == 8
    assert namespace["capture"].res.shape == (8, 256, 4, 4)


def test_api_page_hf_examples_run(api_run, monkeypatch):
    pytest.importorskip("transformers", reason="docs/api.md's export example needs the hf extra")
    pytest.importorskip("safetensors", reason="docs/api.md's export example needs the hf extra")
    directory, namespace = api_run
    blocks = [b for b in python_blocks((ROOT / "docs" / "api.md").read_text()) if HF_BLOCK in b]
    assert blocks
    monkeypatch.chdir(directory)
    namespace = run_blocks(blocks, "docs/api.md", dict(namespace))
    assert (directory / "hf-model" / "config.json").is_file()


def layout_entries(text: str) -> tuple[set[str], set[str]]:
    """``(modules, packages)`` the README's Layout block names under ``src/s2hc/``, as paths relative to it. A line
    of the tree names its entries before a run of two spaces (``x.py`` a module, ``x/`` a package, whose own lines
    are indented two more); its description, and a description's continuation lines, name none."""
    block = text[text.index("## Layout"):].split("```\n", 2)[1]
    lines = block.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("src/s2hc/")))
    modules, packages, stack = set(), set(), [""]
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip(" "))
        if indent == 0:  # the tree of src/s2hc/ ends
            break
        names = re.split(r"\s{2,}", line.strip())[0].split()
        if not all(re.fullmatch(r"\w+(\.py|/)", name) for name in names):
            continue  # a description's continuation
        assert indent % 2 == 0 and indent // 2 <= len(stack), f"README Layout: misindented {line!r}"
        stack = stack[: indent // 2]
        parent = stack[-1]
        dirs = [name for name in names if name.endswith("/")]
        assert len(dirs) <= 1, f"README Layout: one package a line, so its modules can follow it: {line!r}"
        modules |= {parent + name for name in names if name.endswith(".py")}
        for name in dirs:
            packages.add(parent + name.rstrip("/"))
            stack.append(parent + name)
    return modules, packages


def test_the_readme_layout_names_every_module():
    """Every module of src/s2hc is named in README.md's Layout (a package's ``__init__.py`` by its package), and
    everything named there exists: a module added, moved or removed changes the README with it."""
    source = ROOT / "src" / "s2hc"
    modules, packages = layout_entries((ROOT / "README.md").read_text())
    found = {p.relative_to(source).as_posix() for p in source.rglob("*.py") if "__pycache__" not in p.parts}
    expected = {name for name in found if not name.endswith("/__init__.py")}
    packages_found = {name.removesuffix("/__init__.py") for name in found if name.endswith("/__init__.py")}
    assert sorted(expected - modules) == [], "modules the README's Layout does not name"
    assert sorted(modules - expected) == [], "modules the README's Layout names that do not exist"
    assert sorted(packages_found - packages) == [], "packages the README's Layout does not name"
    assert all((source / name).is_dir() for name in packages), sorted(p for p in packages if not (source / p).is_dir())
