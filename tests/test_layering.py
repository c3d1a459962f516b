"""The package imports one way (docs/design.md section 4): no cycles, lower layers never import higher ones, packages
of one layer import each other only where design.md names the pair, and every module that runs the command line in
a subprocess is named there. The lists are read from design.md itself, so the document and the check cannot differ.

Every ``import`` and ``from ... import`` of an s2hc module counts, at module level or inside a function, so a
cycle cannot hide in a lazy import. Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DESIGN = ROOT / "docs" / "design.md"


def _section_4() -> str:
    text = DESIGN.read_text(encoding="utf-8")
    return text[text.index("## 4. The package"):text.index("## 5. Conventions")]


def design_layers() -> list[list[str]]:
    """The layer list of docs/design.md section 4, top first: the indented block whose lines start with ``→``
    (the first without), each naming its packages before a run of spaces."""
    lines = _section_4().split("\n\n    ", 1)[1].split("\n\n", 1)[0].splitlines()
    layers = []
    for line in lines:
        names = re.split(r"\s{2,}", line.strip().removeprefix("→ "))[0]
        layers.append([name if name == "s2hc" else f"s2hc.{name}" for name in re.split(r",\s*", names)])
    return layers


def _named_in(paragraph_title: str) -> list[str]:
    """The backticked items of the paragraph (and its bullet list) that starts with ``**paragraph_title**``."""
    text = _section_4()
    paragraphs = text[text.index(f"**{paragraph_title}**"):].split("\n\n")
    block = [paragraphs[0], *(p for p in itertools.takewhile(lambda p: p.startswith("- "), paragraphs[1:]))]
    return re.findall(r"`([^`]+)`", "\n".join(block))


def allowed_same_layer() -> set[tuple[str, str]]:
    """``(importer, imported)`` package pairs of design.md's "Same-layer imports" list."""
    pairs = [item.split(" → ") for item in _named_in("Same-layer imports") if " → " in item]
    return {(a.strip(), b.strip()) for a, b in pairs}


def cli_subprocess_modules() -> set[str]:
    return {item for item in _named_in("The command line as a subprocess.") if re.fullmatch(r"s2hc\.[\w.]+", item)}


LAYERS = design_layers()


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "s2hc").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The s2hc modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(known)
            targets |= subs or {module}
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
    resolved = set()
    for target in targets:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        if target in known and target != name:
            resolved.add(target)
    return resolved


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_of(name: str) -> int:
    best = None
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if name == prefix or (prefix != "s2hc" and name.startswith(prefix + ".")):
                best = index
    if best is None:
        raise AssertionError(f"module {name} is in no layer; add its package to the layer list of docs/design.md "
                             "section 4")
    return best


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target] if target in path else [node, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def package_of(name: str) -> str:
    """``s2hc.study.runner`` -> ``s2hc.study``; top-level modules are their own package."""
    return ".".join(name.split(".")[:2])


def test_no_module_imports_a_higher_layer():
    wrong = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_packages_of_one_layer_import_each_other_only_where_design_md_says():
    found = {
        (package_of(name), package_of(target))
        for name, targets in graph().items()
        for target in targets
        if layer_of(target) == layer_of(name) and package_of(target) != package_of(name)
        and package_of(name) != "s2hc" and package_of(target) != "s2hc"
    }
    allowed = allowed_same_layer()
    assert found <= allowed, f"same-layer imports not named in docs/design.md section 4: {sorted(found - allowed)}"
    assert allowed <= found, f"docs/design.md names same-layer imports that no longer exist: {sorted(allowed - found)}"


def _runs_the_cli(node: ast.AST) -> bool:
    """A list that starts the ``s2hc`` program or runs ``-m s2hc``."""
    if not isinstance(node, ast.List):
        return False
    values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    return values[:1] == ["s2hc"] or any(a == "-m" and b == "s2hc" for a, b in zip(values, values[1:]))


def test_every_subprocess_call_of_the_cli_is_named_in_design_md():
    found = {name for name, path in modules().items()
             if any(_runs_the_cli(node) for node in ast.walk(ast.parse(path.read_text())))}
    assert found == cli_subprocess_modules()


def test_the_layer_list_is_read_from_design_md():
    """The reading itself, so a reformatted list cannot leave the checks above with nothing to check."""
    assert LAYERS[0] == ["s2hc.checks", "s2hc.io", "s2hc.devices", "s2hc.extras", "s2hc.reports", "s2hc.init_rng",
                         "s2hc.hub", "s2hc.yaml_safety", "s2hc.schedule", "s2hc.counts"]
    assert LAYERS[-1] == ["s2hc.cli", "s2hc.__main__"] and ["s2hc.upcycle"] in LAYERS
    assert all(layer_of(name) is not None for name in modules())  # every module is in a layer
    assert ("s2hc.hf", "s2hc.evaluate") in allowed_same_layer()
    assert {"s2hc.study.runner", "s2hc.train.distributed"} <= cli_subprocess_modules()


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The graph counts a lazy import, so the two tests above could fail."""
    package = tmp_path / "s2hc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (package / "b.py").write_text("from . import a\n")
    known = {"s2hc": package / "__init__.py", "s2hc.a": package / "a.py", "s2hc.b": package / "b.py"}
    assert imports_of("s2hc.a", known["s2hc.a"], known) == {"s2hc.b"}
    assert imports_of("s2hc.b", known["s2hc.b"], known) == {"s2hc.a"}
