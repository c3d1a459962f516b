"""Every ```python block of README.md and docs/*.md runs as written, and the docs list what the project ships.

A page's blocks run in order in one namespace (a page's blocks continue one another as its text does), in a fresh
directory (the runs they train land under the test's tmp_path), with one token cache for the module and the
figures off (drawing them takes seconds; tests/test_api.py checks them). Each block is a test of its own, so a
failure names the page and the block. README.md and docs/api.md are run by tests/test_readme.py, which also checks
what their blocks make: here their blocks are skipped, saying so.

A block that needs an optional extra (it imports ``s2hc.hf`` or ``transformers``: the hf extra) is skipped with
the reason when the extra is absent. A block that has to stay a fragment would start with a line ``# fragment:
WHY``, recognised and skipped here; none does: every block is complete.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Pages whose blocks another test runs (with checks of its own), and which one.
RUN_ELSEWHERE = {"README.md": "tests/test_readme.py", "docs/api.md": "tests/test_readme.py"}
#: The first line of a block that must stay a fragment (none today).
FRAGMENT = "# fragment:"
#: What a block needs, by what it imports: the extra and its modules.
EXTRAS = {"s2hc.hf": ("hf", ("transformers", "safetensors")), "transformers": ("hf", ("transformers",))}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def pages() -> list[str]:
    """Every page with a python block: README.md and the Markdown files under docs/."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p.relative_to(ROOT).as_posix() for p in found if python_blocks(p.read_text(encoding="utf-8"))]


def blocks() -> list[tuple[str, int]]:
    return [(page, k) for page in pages() for k in range(len(python_blocks((ROOT / page).read_text())))]


def missing_extra(block: str) -> str | None:
    """Why ``block`` cannot run here (an extra it imports is not installed), or None."""
    for module, (extra, needs) in EXTRAS.items():
        if re.search(rf"^\s*(import|from)\s+{re.escape(module)}\b", block, flags=re.M):
            absent = [name for name in needs if importlib.util.find_spec(name) is None]
            if absent:
                return f"needs the {extra} extra ({', '.join(absent)} not installed): pip install 's2hc[{extra}]'"
    return None


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory) -> Path:
    """One token cache ($S2HC_CACHE_DIR) for the module: the embedded corpus is tokenised once."""
    return tmp_path_factory.mktemp("s2hc-cache")


_OUTCOMES: dict[str, list[tuple[str, object]]] = {}


def run_page(page: str, directory: Path, token_cache: Path) -> list[tuple[str, object]]:
    """Each block of ``page`` run in order in one namespace: ``("ok", None)``, ``("skip", reason)`` or
    ``("error", exception)`` per block (after an error the blocks that follow are not run: they build on it)."""
    from s2hc.diagnostics import plots

    outcomes: list[tuple[str, object]] = []
    namespace: dict = {"__name__": "__main__"}
    failed = None
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        patch.setenv("S2HC_CACHE_DIR", str(token_cache))
        patch.setattr(plots, "have_matplotlib", lambda: False)
        for k, block in enumerate(python_blocks((ROOT / page).read_text())):
            if failed is not None:
                outcomes.append(("skip", f"not run: block {failed} of {page} failed"))
            elif block.lstrip().startswith(FRAGMENT):
                outcomes.append(("skip", f"marked as a fragment: {block.strip().splitlines()[0]}"))
            elif (reason := missing_extra(block)) is not None:
                outcomes.append(("skip", reason))
            else:
                try:
                    exec(compile(block, f"{page} block {k}", "exec"), namespace)
                except Exception as error:  # noqa: BLE001 - reported by the block's own test
                    failed = k
                    outcomes.append(("error", error))
                else:
                    outcomes.append(("ok", None))
    return outcomes


@pytest.mark.parametrize(("page", "index"), blocks(), ids=[f"{p}[{k}]" for p, k in blocks()])
def test_every_python_block_runs_as_written(page, index, tmp_path_factory, token_cache):
    if page in RUN_ELSEWHERE:
        pytest.skip(f"{page}'s blocks are run by {RUN_ELSEWHERE[page]}")
    if page not in _OUTCOMES:
        _OUTCOMES[page] = run_page(page, tmp_path_factory.mktemp(page.replace("/", "-")), token_cache)
    kind, detail = _OUTCOMES[page][index]
    if kind == "skip":
        pytest.skip(str(detail))
    if kind == "error":
        raise detail


def test_the_pages_run_elsewhere_have_blocks():
    """The pages left to tests/test_readme.py are pages with blocks (a page renamed is not silently dropped)."""
    assert set(RUN_ELSEWHERE) <= set(pages())


def test_the_readme_extras_table_names_every_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras = set(extras) - {"test", "dev"}  # the test suite's, not a user's
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `([\w-]+)` \|", readme, flags=re.M))
    assert sorted(extras - table) == [], "extras of pyproject.toml that README.md's table of extras leaves out"


def test_the_study_page_names_every_shipped_study_config():
    text = (ROOT / "docs" / "study.md").read_text()
    shipped = text[text.index("Shipped:"):].split("\n\n", 1)[0]
    configs = sorted(p.name for p in (ROOT / "configs").glob("study-*.yaml"))
    assert [name for name in configs if f"`{name}`" not in shipped] == [], "study configs docs/study.md leaves out"
