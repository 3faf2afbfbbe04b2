"""Configuration records: the model's architecture, the KV cache and the scheduler's budgets."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from shared.model_files import fingerprint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype; ValueError on anything else."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture read from an HF config.json."""

    path: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    digest: str
    weight_format: str = "fp32"
    quantization: str | None = None  # quantized checkpoint (dir or .gguf) whose linears replace the float ones

    @property
    def model_id(self) -> str:
        """Identity checked by KV transfer and block hashes: the name and weight format of the checkpoint the
        weights come from (the quantized one when there is one, since it fills every tensor; so --model Q and
        --model BASE --quantization Q give the same id), and a digest of those weights plus the architecture
        fields they run with."""
        return f"{self.name}:{self.digest}:{self.weight_format}"

    @classmethod
    def from_dir(cls, path: str | Path, quantization: str | None = None) -> ModelConfig:
        """Read config.json (+ generation_config.json for extra EOS ids). ValueError if not Llama-like.

        quantization: a quantized checkpoint (tandem / HF AWQ / HF GPTQ dir, a .gguf file, or "gguf" for the
        packaged GGUF) with this model's architecture, which supplies every weight; a path that is itself a
        quantized checkpoint needs none.
        """
        from shared.model_files import packaged_gguf_path
        from shared.quant import detect_quant_config

        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not a model directory (no config.json); run `tandem prepare-model`")
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not a Llama-family model")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError("rope scaling is not supported yet")
        eos = set(_as_list(cfg.get("eos_token_id")))
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos |= set(_as_list(json.loads(gen_path.read_text()).get("eos_token_id")))
        heads = cfg["num_attention_heads"]
        if quantization == "gguf":
            quantization = str(packaged_gguf_path())
        if quantization is None and detect_quant_config(path).bits is not None:
            quantization = str(path)
        weights = path if quantization is None else Path(quantization)
        arch = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_model_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=tuple(sorted(eos)),
        )
        # The same weights run with another architecture config (rope_theta, eps, ...) are another model.
        digest = xxhash.xxh3_64_hexdigest(f"{fingerprint(weights)}|{sorted(arch.items())}".encode())[:12]
        return cls(path=str(path), name=weights.stem if weights.suffix == ".gguf" else weights.name, digest=digest,
                   weight_format=detect_quant_config(quantization).weight_format, quantization=quantization, **arch)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: num_blocks blocks of block_size token slots per layer, for K and for V."""

    block_size: int = 16
    num_blocks: int = 1024
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets: tokens computed in one forward and requests running at once."""

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64

    def __post_init__(self):
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
