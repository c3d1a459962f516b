"""YAML read safely: the one YAML reader of s2hc (config files, ``--set`` and option values, a run's
``config.yaml``, a study's config).

:func:`load_yaml` reads with ``yaml.SafeLoader`` (plain data, never a Python object) and refuses, before anything is
constructed, a text whose aliases (``*name``) expand past :data:`MAX_YAML_VALUES` values or into themselves (an
alias bomb, "billion laughs"), or that nests deeper than the parser can read: :class:`YAMLRefused`, one line that
never shows the values. :func:`yaml_problem` is the parser's complaint in one line.
"""

from __future__ import annotations

from typing import Any

import yaml

#: The most values a YAML text may hold once its aliases (``*name``) are expanded: a config holds a few hundred.
#: A kilobyte of nested aliases (an alias bomb, "billion laughs") expands to billions, which every reader of the
#: values (a check, a copy, a message) would walk: refused at the load, before anything walks them.
MAX_YAML_VALUES = 100_000


class YAMLRefused(yaml.YAMLError):
    """A YAML text s2hc does not read (aliases that expand too far, or to themselves; nesting too deep): one line,
    that never shows the values."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, None


class _SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, before constructing anything, a document whose aliases expand past
    :data:`MAX_YAML_VALUES` values or refer to a value that holds them."""

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)


def _check_expansion(root: yaml.Node) -> None:
    """YAMLRefused when the node graph, its aliases expanded, holds more than :data:`MAX_YAML_VALUES` values, or
    holds itself. Walked once per node (shared nodes counted by multiplication), without recursion."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return list(node.value) if isinstance(node, yaml.SequenceNode) else []

    while stack:
        node, done = stack.pop()
        if done:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(MAX_YAML_VALUES + 1, 1 + sum(sizes[id(child)] for child in children(node)))
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise YAMLRefused(f"its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values (an alias "
                                  "bomb?); write the values out, or use fewer aliases")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise YAMLRefused("an alias (*name) refers to a value that contains it: the value would be endless")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children(node) if id(child) not in sizes)


def load_yaml(text: str) -> Any:
    """The value of a YAML text, read safely (``yaml.SafeLoader``: no Python objects), the one YAML reader of s2hc
    (config files, ``--set`` and option values, a run's ``config.yaml``). ``yaml.YAMLError`` when it is not YAML,
    and :class:`YAMLRefused` (one of them) when its aliases expand past :data:`MAX_YAML_VALUES` values or into
    themselves, or it nests too deep for the parser."""
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise YAMLRefused("it nests values too deep to read (RecursionError)") from None


def yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's problem at its line and column (1-based), in one line."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
