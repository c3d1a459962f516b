"""docs/design.md's recipes ("Adding a mixing family", "Adding a connection form", "Adding an architecture") list
every file they touch, and the lists stay true: checked against the newest of each kind already added, whose code
is referenced from exactly the source files its recipe lists (and every listed file exists and names it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "s2hc"

#: recipe title -> (the example it is checked on: its module's file name and the names it defines that others use)
EXAMPLES = {
    "Adding a mixing family": ("isometric", {"IsometricMixer"}),
    "Adding a connection form": ("wide_residual", {"WideResidual", "WideResidualForm", "WIDE_RESIDUAL"}),
    "Adding an architecture": ("mistral", {"MISTRAL"}),
}


def recipe_files(title: str) -> list[str]:
    """The backticked paths of the recipe's "Files it touches:" paragraph."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    start = text.index(f"**{title}")
    end = text.find("\n**", start + 1)
    recipe = text[start:end if end != -1 else None]
    match = re.search(r"Files it touches: (.*?)(?:\n\n|\Z)", recipe, flags=re.S)
    assert match, f"design.md's {title!r} has no 'Files it touches:' list"
    return re.findall(r"`([^`]+)`", match.group(1))


def referencing(module: str, names: set[str]) -> set[str]:
    """The source files (repository paths) other than ``module``'s own that import it or use one of ``names`` in
    code (not in a docstring)."""
    found = set()
    for path in SRC.rglob("*.py"):
        if path.stem == module:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            imports = isinstance(node, ast.ImportFrom) and (
                (node.module or "").split(".")[-1] == module or any(alias.name == module for alias in node.names))
            uses = (isinstance(node, ast.Name) and node.id in names) or (
                isinstance(node, ast.Attribute) and node.attr in names) or (
                isinstance(node, ast.alias) and node.name in names)
            if imports or uses:
                found.add(path.relative_to(ROOT).as_posix())
                break
    return found


@pytest.mark.parametrize("title", list(EXAMPLES))
def test_each_recipe_lists_every_source_file_its_newest_example_touches(title):
    module, names = EXAMPLES[title]
    listed = [path.replace("NAME", module) for path in recipe_files(title)]
    for path in listed:
        assert (ROOT / path).exists(), f"{title}: listed {path} does not exist"
    listed_sources = {path for path in listed if path.startswith("src/")}
    assert referencing(module, names) <= listed_sources, f"{title}: a source file it touches is not listed"
    spoken = module.replace("_", "-")
    for path in listed_sources:  # and every listed source file does touch it: no stale entry
        text = (ROOT / path).read_text(encoding="utf-8")
        assert module in text or spoken in text or any(name in text for name in names), f"{title}: {path}"
