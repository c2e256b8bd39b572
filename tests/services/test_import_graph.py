"""No import circle inside services/: the module graph, imports at any depth, is acyclic.

An import inside a function is a dependency too (it only hides it until the call), so every
``import``/``from ... import`` anywhere in a file counts. The graph is restricted to
``services.*`` modules; ``from services import x`` counts as an edge only where ``x`` is a
module of services/.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SERVICES.glob("*.py")) if p.stem != "__init__"}


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The services modules ``path`` imports anywhere (module top level, functions, classes)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "services" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y (inside services/)
                base = (node.module or "").split(".")[0]
            elif node.module and node.module.split(".")[0] == "services":
                base = node.module.split(".")[1] if "." in node.module else ""
            else:
                continue
            if base:
                found.add(base)
            else:  # from services import x, y: the names that are modules
                found.update(a.name for a in node.names)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, set(modules)) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_finds_a_cycle_through_function_level_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    source = tmp_path / "x.py"
    source.write_text("import os\nfrom services.s3 import s3_client\n\n\ndef f():\n"
                      "    from services import runtime, not_a_module\n    import services.stack as st\n"
                      "    from .uris import redact\n")
    assert _imported(source, {"s3", "runtime", "stack", "uris"}) == {"s3", "runtime", "stack", "uris"}


def test_services_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"cli", "runtime", "s3", "stack"} <= set(graph), sorted(graph)  # the files were read
    cycle = find_cycle(graph)
    edges = "\n".join(f"  {m} -> {', '.join(sorted(d)) or '-'}" for m, d in sorted(graph.items()))
    assert cycle is None, f"import circle in services/: {' -> '.join(cycle or [])}\n{edges}"
