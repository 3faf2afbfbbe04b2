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


def module_name(path: Path) -> str:
    """REPO/shared/quant/layers.py -> "tandem.shared.quant.layers" (a package's __init__.py: the package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(("tandem", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph(package: str) -> dict[str, set[str]]:
    """{module: the modules of the same package it imports}: every import statement, those under TYPE_CHECKING
    and inside functions too ("from tandem.shared.quant import x" counts as importing tandem.shared.quant.x when
    that is a module, else tandem.shared.quant)."""
    modules = {module_name(p): p for p in (REPO / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_the_engine_has_no_import_cycles():
    """shared/ is a DAG, type-level imports included: no module needs another that needs it back."""
    graph = import_graph("shared")
    state, cycles = {}, []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [module, target] if target in stack else [module, target])
            elif target not in state:
                visit(target, stack + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, cycles


def test_shared_is_split_by_concern():
    """The engine imports neither the Redis clients (shared/cluster_state/, the services' alone) nor the offline
    quantization producers (tools/quant/); the Redis clients import nothing of the engine but the block hashes and
    KV events they carry."""
    graph = import_graph("shared")
    state_pkg = "tandem.shared.cluster_state"
    engine_users = {m: {t for t in targets if t.startswith(state_pkg)} for m, targets in graph.items()
                    if not m.startswith(state_pkg)}
    assert not {m: t for m, t in engine_users.items() if t}, "engine modules importing the Redis clients"
    allowed = {"tandem.shared.block_hash", "tandem.shared.kv_events"}
    for module, targets in graph.items():
        if module.startswith(state_pkg):
            assert {t for t in targets if not t.startswith(state_pkg)} <= allowed, module
