"""Package layout and build-time gRPC stubs (the metadata is in pyproject.toml).

One import root, `tandem`, mapped onto the checkout's top-level folders: tandem.services <- services/,
tandem.shared <- shared/, tandem.kernels <- kernels/, tandem.tools <- tools/, tandem.benchmarks <- benchmarks/,
tandem and tandem.v1 (the gRPC stubs) <- proto/tandem/. Every build (wheel, sdist, editable) generates the stubs
from proto/tandem/v1/*.proto first, so a wheel built from a clean clone holds them.
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
FOLDERS = ("services", "shared", "kernels", "tools", "benchmarks")  # each is tandem.<folder>
DATA_FOLDERS = ("kernels/cpu", "tools/data")  # no __init__.py: data the wheel carries (pyproject package-data)
PROTO_DIR = ROOT / "proto"


def package_layout() -> tuple[list[str], dict[str, str]]:
    """(packages, package_dir). Folders that are absent (the Docker image's dependency layer copies only the
    project's metadata) are left out."""
    packages, package_dir = [], {}
    if (PROTO_DIR / "tandem").is_dir():
        package_dir["tandem"] = "proto/tandem"
        packages += ["tandem", *(f"tandem.{p}" for p in find_packages(PROTO_DIR / "tandem"))]
    for folder in FOLDERS:
        if (ROOT / folder).is_dir():
            package_dir[f"tandem.{folder}"] = folder
            packages += [f"tandem.{folder}", *(f"tandem.{folder}.{p}" for p in find_packages(ROOT / folder))]
    packages += [f"tandem.{folder.replace('/', '.')}" for folder in DATA_FOLDERS if (ROOT / folder).is_dir()]
    return packages, package_dir


def generate_grpc_stubs() -> None:
    """proto/tandem/v1/X.proto -> X_pb2.py, X_pb2_grpc.py, X_pb2.pyi beside it, where missing or older."""
    protos = sorted((PROTO_DIR / "tandem" / "v1").glob("*.proto"))
    stale = [p for p in protos if not (stub := p.with_name(p.stem + "_pb2.py")).exists()
             or stub.stat().st_mtime < p.stat().st_mtime]
    if not stale:
        return
    from grpc_tools import protoc  # a build requirement (pyproject.toml [build-system])

    for proto in stale:
        argv = ["protoc", f"-I{PROTO_DIR}", f"--python_out={PROTO_DIR}", f"--grpc_python_out={PROTO_DIR}",
                f"--pyi_out={PROTO_DIR}", str(proto)]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithStubs(build_py):
    def run(self):
        generate_grpc_stubs()
        super().run()


packages, package_dir = package_layout()
setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPyWithStubs})
