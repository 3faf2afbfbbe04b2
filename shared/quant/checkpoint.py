"""Quantized checkpoints on disk: tandem's own format, plus loaders that convert HF AWQ, HF GPTQ and GGUF into
the canonical state dict (see modules.py) that apply_quantized_state swaps into a model.

Tandem format: a directory with
    model.safetensors   canonical tensors: "<linear>.qweight|scales|zeros" + every float tensor (embeddings,
                        norms; AWQ changes the norms), tied lm_head omitted
    config.json         the model config + "quantization_config": {"quant_method": "tandem", "bits": 4|8,
                        "group_size": G|null, "method": "rtn|gptq|awq|gguf"}
    tokenizer files     copied from the source model directory
It is a complete model: an engine builds the architecture from config.json and fills it with
apply_quantization, without the float checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.shared.model_files import read_safetensors
from tandem.shared.quant.config import QuantConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def save_quantized(out_dir: str | Path, state: dict[str, torch.Tensor], config: QuantConfig,
                   source_dir: str | Path) -> Path:
    """Write a tandem checkpoint: state (canonical tensors + float tensors), source_dir's config.json with the
    quantization_config added, and source_dir's tokenizer files. Returns the directory."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)  # as readable as the other files (save_file: 0600)
    model_config = json.loads((source_dir / "config.json").read_text())
    model_config["quantization_config"] = config.to_json()
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2))
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists():
            shutil.copy2(source_dir / name, out_dir / name)
    return out_dir


def read_quant_config(model_dir: Path) -> dict | None:
    """The raw "quantization_config" of model_dir/config.json, or None for an unquantized checkpoint."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(qc, (dict, type(None))):
        raise ValueError(f"{path}: expected a JSON object with an optional quantization_config object")
    return qc


def load_quantized_state(source: str | Path) -> tuple[dict[str, torch.Tensor], QuantConfig]:
    """Read any supported quantized checkpoint into (canonical state dict, QuantConfig).

    Args:
        source: a .gguf file (Q4_0/Q4_1/Q8_0 linears), or a directory whose config.json has a quantization_config
            with quant_method "tandem", "awq" (GEMM) or "gptq".
    Raises:
        ValueError: unquantized or unsupported checkpoint, or a malformed tensor.
    """
    source = Path(source)
    if source.suffix == ".gguf":
        from tandem.shared.quant.gguf_loader import load_gguf_state

        return load_gguf_state(source)
    qc = read_quant_config(source)
    if qc is None:
        raise ValueError(f"{source}/config.json has no quantization_config: it is a float checkpoint")
    method = qc.get("quant_method")
    if method == "tandem":
        return read_safetensors(source), _tandem_config(qc)
    if method in ("awq", "gptq"):
        from tandem.shared.quant.hf_formats import convert_hf_awq, convert_hf_gptq

        convert = convert_hf_awq if method == "awq" else convert_hf_gptq
        try:
            return convert(read_safetensors(source), qc)
        except KeyError as e:
            raise ValueError(f"{source} says quant_method {method!r} but lacks the tensor {e}") from e
    raise ValueError(f"unsupported quant_method {method!r} (supported: tandem, awq, gptq, or a .gguf file)")


def detect_quant_config(source: str | Path | None) -> QuantConfig:
    """QuantConfig of a model directory or GGUF file without reading the weights (fp32 for a float dir)."""
    if source is None:
        return QuantConfig()
    source = Path(source)
    if source.suffix == ".gguf":
        from tandem.shared.quant.gguf_loader import gguf_quant_config

        return gguf_quant_config(source)
    qc = read_quant_config(source)
    if qc is None:
        return QuantConfig()
    if qc.get("quant_method") == "tandem":
        return _tandem_config(qc)
    if qc.get("quant_method") in ("awq", "gptq"):
        return QuantConfig(bits=qc.get("bits"), group_size=qc.get("group_size"), method=qc["quant_method"])
    raise ValueError(f"unsupported quant_method {qc.get('quant_method')!r}")


def _tandem_config(qc: dict) -> QuantConfig:
    config = QuantConfig.from_json(qc)
    if config.method == "gguf":  # GGUF weights are read from .gguf files; `tandem quantize` never writes them
        raise ValueError("a tandem checkpoint's method is rtn, gptq or awq, not 'gguf'")
    return config
