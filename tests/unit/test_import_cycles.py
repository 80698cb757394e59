"""memrad's modules import one another without a cycle, lazy imports and type-only ones included.

A cycle that only a lazy (in-function) or `if TYPE_CHECKING:` import closes fails nothing at run
time, so nothing else would catch it; it still means two modules cannot be read, tested or
moved apart. The graph is read from the source with `ast`, so nothing is imported.
"""

import ast
from pathlib import Path

MEMRAD = Path(__file__).resolve().parents[2] / "memrad"


def module_names() -> dict[str, Path]:
    """{dotted name: file} of every module of memrad/ (a package by its __init__.py)."""
    names = {}
    for path in MEMRAD.rglob("*.py"):
        parts = path.relative_to(MEMRAD.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The memrad modules `name` imports anywhere in its file: at the top, in functions, under
    TYPE_CHECKING. `from a import b` names the module a.b where b is one, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        step = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    step.append(target)
        frontier = step
    raise AssertionError(f"no cycle through {start}")


def test_the_reader_sees_lazy_and_type_only_imports():
    graph = import_graph()
    assert "memrad.protocol" in graph["memrad.server.context"]  # a top-level import
    assert "memrad.engine.model.loader" in graph["memrad.engine.decode.builder"]  # one inside `main`


def test_cycles_are_found_and_named():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_memrad_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in memrad/:\n" + "\n".join(" -> ".join(cycle) for cycle in found)
