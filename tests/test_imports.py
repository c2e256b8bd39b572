"""The import direction proxies <- pipelines <- services, and one collective module per layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


STDLIB_OK = {"__future__", "math", "typing", "collections", "dataclasses", "inspect", "functools",
             "itertools", "contextlib", "os", "warnings", "abc", "enum", "numbers"}


@pytest.mark.parametrize("path", _files("proxies"), ids=lambda p: p.name)
def test_proxies_import_torch_only(path):
    extra = _imports(path) - STDLIB_OK - {"torch", "proxies"}
    assert not extra, f"{path.name} imports {extra}"


@pytest.mark.parametrize("path", _files("pipelines"), ids=lambda p: p.name)
def test_pipelines_never_import_services_ray_or_mlflow(path):
    bad = _imports(path) & {"services", "ray", "mlflow", "boto3"}
    assert not bad, f"{path.name} imports {bad}"


def _touching(folder: str, needle: str) -> list[str]:
    return sorted(p.name for p in _files(folder) if needle in p.read_text())


def test_one_module_per_layer_touches_torch_distributed():
    assert _touching("proxies", "torch.distributed") == ["sharding.py"]
    assert _touching("pipelines", "torch.distributed") == ["distributed.py"]


def test_one_module_in_services_touches_ray():
    ray_users = [p.name for p in _files("services") if "ray" in _imports(p)]
    assert ray_users == ["runtime.py"]


def _services_imported(path: Path) -> set[str]:
    """The ``services.X`` modules a file imports, anywhere in it (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("services."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "services":
                names.update(f"services.{a.name}" for a in node.names)
            elif node.module.startswith("services."):
                names.add(node.module)
    return names


def test_only_the_cli_imports_the_local_dev_stack():
    """services/stack.py starts local dev servers; production code reaches S3 through
    services/s3.py and never depends on it."""
    users = [p.name for p in _files("services") if "services.stack" in _services_imported(p)]
    assert users == ["cli.py"]


# pipelines/ modules a function may import: the data loaders, whose torchvision and PIL cost
# ~1.3 s of start-up that `proxydml --help`, `stack` and `config` never need. Any other
# function-level import of a pipelines module would be hiding an import circle.
LAZY_FOR_START_UP = {"pipelines.data.transforms", "pipelines.data.folder", "pipelines.data.emoji",
                     "pipelines.data.standard"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _pipeline_targets(node: ast.ImportFrom) -> set[str]:
    """The pipelines modules an import statement loads (a name may be a submodule)."""
    out = set()
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or (ROOT / Path(*sub.split("."))).is_dir()
        out.add(sub if is_module else node.module)
    return out


def _run_time_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, function-level) pipelines imports, leaving out ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    top_nodes = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    top, lazy = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipelines"):
            (top if node in top_nodes else lazy).update(_pipeline_targets(node))
    type_only = {t for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                 for sub in ast.walk(n) if isinstance(sub, ast.ImportFrom) and sub.module
                 for t in _pipeline_targets(sub)}
    return top, lazy - type_only - top


def test_pipelines_import_graph_has_no_circle():
    """Module-level imports among pipelines/ form no cycle (importing a submodule imports its
    package first, so that edge counts too): any module can be imported first."""
    graph: dict[str, set[str]] = {}
    for path in _files("pipelines"):
        top, _ = _run_time_imports(path)
        edges = set()
        for target in top:
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[_module(path)] = edges - {_module(path)}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import circle: " + " -> ".join([*trail, node])
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*trail, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("path", _files("pipelines"), ids=lambda p: str(p.relative_to(ROOT)))
def test_function_level_imports_in_pipelines_are_for_start_up_cost_only(path):
    _, lazy = _run_time_imports(path)
    assert lazy <= LAZY_FOR_START_UP, f"{path.name} imports {lazy - LAZY_FOR_START_UP} inside a function"


def test_torchvision_is_imported_at_module_level_only_where_nothing_imports_that_module_eagerly():
    """torchvision imports torch._dynamo (~2 CPU-s a process here): every Train worker, trial
    and CLI process would pay it on digits, which never transforms a PIL image. Only the folder
    loader (a torchvision ImageFolder) imports it at module level, and that loader itself only
    from a function."""
    eager = {_module(p) for p in _files("pipelines") + _files("services")
             if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torchvision" in ast.unparse(n)
                    for n in ast.parse(p.read_text()).body)}
    assert eager == {"pipelines.data.folder"}, eager
    importers = [_module(p) for p in _files("pipelines") + _files("services")
                 if "pipelines.data.folder" in _run_time_imports(p)[0]]
    assert not importers, importers
