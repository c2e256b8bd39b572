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
