"""Dependencies point one way (docs/architecture.md has the map): kernels know tensors, not the engine; the
engine (shared/) knows nothing of gRPC, the services or the offline tools."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "shared", "services", "tools", "benchmarks", "v1")  # each is tandem.<name>
# package -> the project packages it may import (any import, lazy ones inside functions too); v1: the gRPC stubs
ALLOWED = {
    "kernels": set(),
    "shared": {"kernels"},
    "services": {"shared", "kernels", "v1"},
    "tools": {"shared", "kernels"},
}
# The `tandem` CLI runs the offline tools (importing them only when their command is given: prepare-model
# directly, quantize and eval-quant by name through importlib).
EXCEPTIONS = {("services/cli.py", "tools")}


def package_of(module: str) -> str:
    """"tandem.shared.engine" -> "shared", "grpc.aio" -> "grpc"."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tandem" and len(parts) > 1 else parts[0]


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {package_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(package_of(node.module))
    return names & {*PACKAGES, "grpc", "grpc_health"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_lower_layers(package):
    wrong = {}
    for path in sorted((REPO / package).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        bad = {p for p in imported_packages(path) - ALLOWED[package] - {package} if (rel, p) not in EXCEPTIONS}
        if package in ("kernels", "shared"):
            assert not imported_packages(path) & {"grpc", "grpc_health", "v1"}, f"{rel} imports gRPC"
        if bad - {"grpc", "grpc_health"}:
            wrong[rel] = sorted(bad)
    assert not wrong, wrong
