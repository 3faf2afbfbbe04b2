"""Load a GGUF file's Q4_0 / Q4_1 / Q8_0 linears straight into the canonical INT4 / INT8 layout.

The integer codes are repacked, never dequantized to float. Block formats (ggml, 32 weights along K per block):
    Q4_0: fp16 d, 16 bytes of nibbles          w = (q - 8) * d          -> scale d, zero 8
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = q * d + m            -> scale d, zero -m / d
    Q8_0: fp16 d, 32 int8                      w = q * d                -> int8, one scale per 32 (group_size 32)
In a Q4 block, byte j holds weight j in its low nibble and weight j + 16 in its high nibble; the canonical layout
pairs weights 2p and 2p + 1 instead, so the codes are reordered.

Architectures (general.architecture, llama.cpp's tensor names per MODEL_ARCH in gguf-py's constants.py):
    llama   Llama 2/3.x, and Mistral (llama.cpp writes it as llama). Its converter permutes the rows of attn_q /
            attn_k (weights and biases) for its rope layout; they are permuted back as transformers' GGUF loader
            does (rows viewed as [heads, head_dim / 2, 2] -> [heads, 2, head_dim / 2]), with the head counts read
            from the file. Rows carry their own codes, scales and zeros, so the permutation is exact.
    qwen2   attn_q/k/v.bias, float (kept beside the quantized weights); no permutation (NeoX rope, as HF's).
    qwen3   attn_q_norm / attn_k_norm (per-head RMSNorm weights); no permutation.
    phi3    attn_qkv (q, k, v rows stacked) and ffn_up holding gate and up (HF's gate_up_proj), returned under
            HF Phi-3's fused names, which apply_quantized_state splits into the model's projections; no
            permutation. rope_factors_long/short (longrope, Phi-3 128k) are refused, as for the HF checkpoint.
Anything else (Gemma: llama.cpp stores its norms as 1 + weight; MoE families) is refused by name. The model's
architecture comes from the --model directory's config.json; check_gguf_fits refuses a file written for another
one. Embeddings and norms are returned as float32 (token_embd is dequantized with the gguf package; a Q8_0 output
projection, or a Q8_0 token_embd it is tied to, also stays int8 as lm_head.qweight / lm_head.scales); GGUF tensor
names are mapped to HF names.
"""
from __future__ import annotations

import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.int4_format import pack_int4
from tandem.shared.quant.config import QuantConfig
from tandem.shared.quant.gguf_file import GGUFFile

GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj"}
# general.architecture -> (the HF model_types whose weights it holds, its linears that differ from GGUF_LINEARS)
GGUF_ARCHITECTURES = {"llama": (("llama", "mistral"), {}), "qwen2": (("qwen2",), {}), "qwen3": (("qwen3",), {}),
                      "phi3": (("phi3",), {"ffn_up": "mlp.gate_up_proj"})}
PERMUTED_QK = ("llama",)  # the architectures whose q/k rows llama.cpp's converter permutes
GGUF_LAYER_FLOATS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                     "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GGUF_GLOBAL_FLOATS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
SUPPORTED = {"Q4_0", "Q4_1", "Q8_0"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _field_int(reader: GGUFFile, key: str) -> int:
    value = reader.fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata lacks {key}" if value is None else f"GGUF metadata {key} is not an integer")
    return value


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: new[r] = old[index[r]]."""
    return torch.arange(n_rows).view(n_head, n_rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def decode_q4(blocks: np.ndarray, with_min: bool) -> dict[str, torch.Tensor]:
    """Q4_0 / Q4_1 bytes [N, K // 32 * bytes_per_block] -> canonical INT4 tensors (group_size 32)."""
    n = blocks.shape[0]
    blocks = blocks.reshape(n, -1, 20 if with_min else 18)  # [N, K // 32, block bytes]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, K // 32]
    qs = torch.from_numpy(blocks[..., 4 if with_min else 2:].copy())  # [N, K // 32, 16]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # [N, K // 32, 32]: weight j, then weight j + 16
    if not with_min:
        zeros = torch.full_like(d, 8.0)
        scales = d
    else:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        flat = d == 0  # constant block w = m: code 0 with zero -sign(m) and scale |m| reproduces it
        codes[flat] = 0
        scales = torch.where(flat, torch.where(m != 0, m.abs(), torch.ones_like(m)), d)
        zeros = -m / scales
    return {"qweight": pack_int4(codes.reshape(n, -1)), "scales": scales, "zeros": zeros}


def decode_q8_0(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Q8_0 bytes [N, K // 32 * 34] -> canonical grouped INT8 tensors (qweight int8 [N, K], scales [N, K // 32])."""
    n = blocks.shape[0]
    blocks = blocks.reshape(n, -1, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, -1)
    return {"qweight": q, "scales": d}


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at path, its header read (shared/quant/gguf_file.py).

    Raises:
        ValueError naming the file: not a GGUF file, or a truncated or corrupt one."""
    try:
        return GGUFFile(path)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"{path} cannot be read as GGUF (truncated or corrupt?): {e}") from e


def gguf_architecture(reader, path: str | Path) -> str:
    """The file's general.architecture; ValueError naming it unless GGUF_ARCHITECTURES has it."""
    arch = reader.fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path} has no general.architecture metadata")
    if arch not in GGUF_ARCHITECTURES:
        why = " (llama.cpp stores Gemma's norms as 1 + weight)" if arch.startswith("gemma") else ""
        raise ValueError(f"GGUF architecture {arch!r} is not supported{why}; supported: "
                         + ", ".join(f"{a} ({'/'.join(types)})" for a, (types, _) in GGUF_ARCHITECTURES.items()))
    return arch


def check_gguf_fits(path: str | Path, model_config) -> None:
    """Refuse a GGUF file written for another architecture or head layout than model_config's (the engine's
    ModelConfig or an HF config: model_type, num_attention_heads, num_key_value_heads), which would otherwise
    load into the right shapes with the wrong q/k row order. ValueError naming both."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    model_type = getattr(model_config, "model_type", None)
    if model_type not in GGUF_ARCHITECTURES[arch][0]:
        raise ValueError(f"{path} is a GGUF of architecture {arch!r}, for model_type "
                         f"{'/'.join(GGUF_ARCHITECTURES[arch][0])}; the model is {model_type!r}")
    heads = (_field_int(reader, f"{arch}.attention.head_count"), _field_int(reader, f"{arch}.attention.head_count_kv"))
    model_heads = (model_config.num_attention_heads, model_config.num_key_value_heads)
    if heads != model_heads:
        raise ValueError(f"{path} has {heads[0]} query and {heads[1]} key/value heads; the model has "
                         f"{model_heads[0]} and {model_heads[1]}")


def load_gguf_state(path: str | Path) -> tuple[dict[str, torch.Tensor], QuantConfig]:
    """Read a GGUF file of a supported architecture into (canonical state dict with HF names, QuantConfig).

    Raises:
        ValueError: not a (complete) GGUF file, another architecture, a linear in an unsupported type (e.g.
            Q6_K), longrope factors, or an unknown tensor.
    """
    from gguf import dequantize

    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    linears = GGUF_LINEARS | GGUF_ARCHITECTURES[arch][1]
    n_head = _field_int(reader, f"{arch}.attention.head_count")
    n_kv = _field_int(reader, f"{arch}.attention.head_count_kv")
    state, types = {}, Counter()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        match = _BLOCK_RE.match(tensor.name)
        block, part, kind = match.groups() if match else (None, None, None)
        permute = arch in PERMUTED_QK and part in ("attn_q", "attn_k")
        # (GGUF shapes list K first: the last is the rows, of a weight or a bias)
        index = unpermute_rows(int(tensor.shape[-1]), n_head if part == "attn_q" else n_kv) if permute else None
        if part in linears and kind == "weight":
            if qtype not in SUPPORTED:
                raise ValueError(f"{tensor.name}: GGUF type {qtype} is not supported (only {sorted(SUPPORTED)})")
            types[qtype] += 1
            raw = np.asarray(tensor.data)
            tensors = decode_q8_0(raw) if qtype == "Q8_0" else decode_q4(raw, with_min=qtype == "Q4_1")
            if index is not None:
                tensors = {k: v[index] for k, v in tensors.items()}
            prefix = f"model.layers.{block}.{linears[part]}"
            state.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
            continue
        if part in linears:  # a bias (Qwen2's q/k/v), in float beside the codes
            name = f"model.layers.{block}.{linears[part]}.bias"
        elif part in GGUF_LAYER_FLOATS and kind == "weight":
            name = f"model.layers.{block}.{GGUF_LAYER_FLOATS[part]}.weight"
        elif tensor.name in GGUF_GLOBAL_FLOATS:
            name = GGUF_GLOBAL_FLOATS[tensor.name]
        elif tensor.name == "rope_freqs.weight":
            continue  # derived from the config by the model
        elif tensor.name.startswith("rope_factors_"):
            raise ValueError(f"{path}: {tensor.name} holds longrope factors (Phi-3 128k); rope_type 'longrope' "
                             f"is not supported")
        else:
            raise ValueError(f"unknown GGUF tensor {tensor.name!r} for architecture {arch!r}")
        if name in ("model.embed_tokens.weight", "lm_head.weight") and qtype == "Q8_0":
            # NOTE: the output projection keeps its int8 codes (what llama.cpp multiplies with): the same values
            # as the float copy, read at a quarter of the bytes. A tied one is the embedding's codes.
            state.update({f"lm_head.{k}": v for k, v in decode_q8_0(np.asarray(tensor.data)).items()})
            if name == "lm_head.weight":
                continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        value = torch.from_numpy(values.reshape(shape).copy())
        state[name] = value if index is None else value[index].contiguous()
    if not types:
        raise ValueError(f"{path} holds no attention/MLP weights")
    return state, _config_for(types)


def gguf_quant_config(path: str | Path) -> QuantConfig:
    """QuantConfig of a GGUF file from its tensor headers only (the most common linear type names it)."""
    reader = open_gguf(path)
    gguf_architecture(reader, path)  # (refused at start, by name)
    types = Counter(t.tensor_type.name for t in reader.tensors
                    if (m := _BLOCK_RE.match(t.name)) and m.group(2) in GGUF_LINEARS and m.group(3) == "weight")
    if not types:
        raise ValueError(f"{path} holds no attention/MLP weights")
    return _config_for(types)


def _config_for(types: Counter) -> QuantConfig:
    qtype = types.most_common(1)[0][0]
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype} is not supported (only {sorted(SUPPORTED)})")
    return QuantConfig(bits=8 if qtype == "Q8_0" else 4, group_size=32, method="gguf", gguf_type=qtype.lower())
