"""The package imports one way (docs/design.md section 4): no cycles, lower layers never import higher ones.

Every ``import`` and ``from ... import`` of an s2hc module counts, at module level or inside a function, so a
cycle cannot hide in a lazy import. Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Left to right: a module may import from its own layer's package or from layers to its left.
LAYERS = [
    ["s2hc.checks", "s2hc.io", "s2hc.devices", "s2hc.extras"],
    ["s2hc.mixers", "s2hc.triton_kernels"],
    ["s2hc.connection"],
    ["s2hc", "s2hc.models", "s2hc.data", "s2hc.params", "s2hc.compat"],
    ["s2hc.config"],
    ["s2hc.rundir"],
    ["s2hc.diagnostics"],
    ["s2hc.train"],
    ["s2hc.compare", "s2hc.study", "s2hc.evaluate", "s2hc.hf", "s2hc.bench"],
    ["s2hc.upcycle"],
    ["s2hc.cli", "s2hc.__main__"],
]


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
        raise AssertionError(f"module {name} is in no layer of tests/test_layering.py; add it to LAYERS")
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


def test_no_module_imports_a_higher_layer():
    wrong = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(name)
    ]
    assert not wrong, "\n".join(wrong)


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
