"""One import root: the project installs `tandem` and nothing else, a wheel built from a clean clone holds the gRPC
stubs and the C++ kernel sources and runs outside the checkout, and the checkout root shadows no installed package
(Hugging Face's `kernels`, which transformers imports, above all)."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("kernels", "shared", "services", "tools", "benchmarks")

ENGINE_STEP = r"""
import sys, torch
torch.set_num_threads(1)
import tandem
from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tandem.v1 import gateway_pb2
engine = LLMEngine(ModelConfig.from_dir(sys.argv[1]), CacheConfig(16, 16), SchedulerConfig(64, 4))
engine.add_request(Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0)))
outputs = engine.step()
print(tandem.__file__)
print(outputs[0].new_token_ids)
"""


def test_the_checkout_root_shadows_no_installed_package():
    """pytest appends the checkout root to sys.path (--import-mode=append) and every process it starts runs in
    safe-path mode, so `kernels` is Hugging Face's package (transformers >= 5.25 imports it), never kernels/."""
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and not Path(spec.origin).is_relative_to(REPO / "kernels"), spec
    from transformers.utils import is_kernels_available

    assert is_kernels_available()
    import kernels  # HF's: it has the hub loader our folder lacks

    assert hasattr(kernels, "get_kernel")
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert not Path(out.stdout.strip()).is_relative_to(REPO / "kernels"), out.stdout  # started in the checkout


def test_a_wheel_from_a_clean_clone_installs_tandem_alone_and_runs_an_engine_step(tmp_path, model_dir):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-local", str(REPO), str(clone)], check=True)
    assert not list((clone / "proto" / "tandem" / "v1").glob("*_pb2.py")), "a clean clone has no stubs"
    # no build isolation: the build requirements (setuptools, grpcio-tools) are this venv's; no network needed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(clone)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"tandem", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for proto in ("common", "gateway", "prefill", "decode"):
        assert f"tandem/v1/{proto}_pb2.py" in names and f"tandem/v1/{proto}_pb2_grpc.py" in names
    cpu_sources = {p.name for p in (REPO / "kernels" / "cpu").iterdir()}
    assert {n.removeprefix("tandem/kernels/cpu/") for n in names if n.startswith("tandem/kernels/cpu/")} == cpu_sources
    assert "tandem/tools/data/quant_tasks.jsonl" in names

    # A fresh venv whose dependencies come from this one's site-packages (a plain path entry: this venv's .pth
    # files, the editable install of the checkout among them, are not processed there).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    # ATEN_CPU_CAPABILITY=default: the engine takes its torch path; the C++ kernels would compile afresh for the
    # wheel's copy of their sources (minutes; their build is tested in tests/unit/kernels/test_cpu_ext_build.py)
    env = dict(os.environ, PYTHONSAFEPATH="1", ATEN_CPU_CAPABILITY="default")
    help_text = subprocess.run([venv / "bin" / "tandem", "--help"], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
    assert help_text.returncode == 0 and "prepare-model" in help_text.stdout, help_text.stderr
    step = subprocess.run([python, "-c", ENGINE_STEP, str(model_dir)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert step.returncode == 0, step.stderr
    installed_at, token_ids = step.stdout.strip().splitlines()[-2:]
    assert Path(installed_at).is_relative_to(site), installed_at  # the wheel's tandem, not the checkout's
    assert len(json.loads(token_ids)) == 1  # one new token: the step ran


def test_the_editable_install_maps_tandem_onto_the_folders_and_installs_no_generic_name(tmp_path):
    """Outside the checkout, tandem.<folder> is the checkout's folder and no top-level <folder> is importable."""
    code = ("import importlib.util as u, json; print(json.dumps({n: [u.find_spec(n) is not None, "
            "u.find_spec('tandem.' + n).submodule_search_locations[0]] for n in %r}))" % (FOLDERS,))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    for name in FOLDERS:
        installed, location = found[name]
        assert location == str(REPO / name)
        # kernels exists: Hugging Face's (a dependency of transformers), checked above not to be ours
        assert installed == (name == "kernels"), name
