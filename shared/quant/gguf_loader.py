"""Load a llama GGUF file's Q4_0 / Q4_1 / Q8_0 linears straight into the canonical INT4 / INT8 layout.

The integer codes are repacked, never dequantized to float. Block formats (ggml, 32 weights along K per block):
    Q4_0: fp16 d, 16 bytes of nibbles          w = (q - 8) * d          -> scale d, zero 8
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = q * d + m            -> scale d, zero -m / d
    Q8_0: fp16 d, 32 int8                      w = q * d                -> int8, one scale per 32 (group_size 32)
In a Q4 block, byte j holds weight j in its low nibble and weight j + 16 in its high nibble; the canonical layout
pairs weights 2p and 2p + 1 instead, so the codes are reordered.

llama.cpp's converter permutes the rows of attn_q / attn_k for its rope layout; they are permuted back as
transformers' GGUF loader does (rows viewed as [heads, head_dim / 2, 2] -> [heads, 2, head_dim / 2]). Rows carry
their own codes, scales and zeros, so the permutation is exact. Embeddings and norms are returned as float32
(token_embd is dequantized with the gguf package; a Q8_0 output projection, or a Q8_0 token_embd it is tied to,
also stays int8 as lm_head.qweight / lm_head.scales); GGUF tensor names are mapped to HF names.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.int4_format import pack_int4
from tandem.shared.quant.config import QuantConfig

GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
GGUF_LAYER_FLOATS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GGUF_GLOBAL_FLOATS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
SUPPORTED = {"Q4_0", "Q4_1", "Q8_0"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def _field_int(reader, key: str) -> int:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return int(field.parts[field.data[0]][0])


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


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over path.

    Raises:
        ValueError naming the file: not a GGUF file, or a truncated or corrupt one (the reader's own error, e.g.
            a numpy reshape error, names neither)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"{path} cannot be read as GGUF (truncated or corrupt?): {e}") from e


def load_gguf_state(path: str | Path) -> tuple[dict[str, torch.Tensor], QuantConfig]:
    """Read a llama-architecture GGUF into (canonical state dict with HF names, QuantConfig).

    Raises:
        ValueError: not a (complete) GGUF file, another architecture, a linear in an unsupported type (e.g.
            Q6_K), or an unknown tensor.
    """
    from gguf import dequantize

    reader = open_gguf(path)
    if "general.architecture" not in reader.fields:
        raise ValueError(f"{path} has no general.architecture metadata")
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, got architecture {arch!r}")
    n_head = _field_int(reader, "llama.attention.head_count")
    n_kv = _field_int(reader, "llama.attention.head_count_kv")
    state, types = {}, Counter()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        match = _BLOCK_RE.match(tensor.name)
        if match and match.group(2) in GGUF_LINEARS:
            if qtype not in SUPPORTED:
                raise ValueError(f"{tensor.name}: GGUF type {qtype} is not supported (only {sorted(SUPPORTED)})")
            types[qtype] += 1
            raw = np.asarray(tensor.data)
            tensors = decode_q8_0(raw) if qtype == "Q8_0" else decode_q4(raw, with_min=qtype == "Q4_1")
            if match.group(2) in ("attn_q", "attn_k"):
                index = unpermute_rows(raw.shape[0], n_head if match.group(2) == "attn_q" else n_kv)
                tensors = {k: v[index] for k, v in tensors.items()}
            prefix = f"model.layers.{match.group(1)}.{GGUF_LINEARS[match.group(2)]}"
            state.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
            continue
        if match and match.group(2) in GGUF_LAYER_FLOATS:
            name = f"model.layers.{match.group(1)}.{GGUF_LAYER_FLOATS[match.group(2)]}.weight"
        elif tensor.name in GGUF_GLOBAL_FLOATS:
            name = GGUF_GLOBAL_FLOATS[tensor.name]
        elif tensor.name == "rope_freqs.weight":
            continue  # derived from the config by the model
        else:
            raise ValueError(f"unknown GGUF tensor {tensor.name!r}")
        if name in ("model.embed_tokens.weight", "lm_head.weight") and qtype == "Q8_0":
            # NOTE: the output projection keeps its int8 codes (what llama.cpp multiplies with): the same values
            # as the float copy, read at a quarter of the bytes. A tied one is the embedding's codes.
            state.update({f"lm_head.{k}": v for k, v in decode_q8_0(np.asarray(tensor.data)).items()})
            if name == "lm_head.weight":
                continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        state[name] = torch.from_numpy(values.reshape(shape).copy())
    if not types:
        raise ValueError(f"{path} holds no attention/MLP weights")
    return state, _config_for(types)


def gguf_quant_config(path: str | Path) -> QuantConfig:
    """QuantConfig of a GGUF file from its tensor headers only (the most common linear type names it)."""
    reader = open_gguf(path)
    types = Counter(t.tensor_type.name for t in reader.tensors
                    if (m := _BLOCK_RE.match(t.name)) and m.group(2) in GGUF_LINEARS)
    if not types:
        raise ValueError(f"{path} holds no attention/MLP weights")
    return _config_for(types)


def _config_for(types: Counter) -> QuantConfig:
    qtype = types.most_common(1)[0][0]
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype} is not supported (only {sorted(SUPPORTED)})")
    return QuantConfig(bits=8 if qtype == "Q8_0" else 4, group_size=32, method="gguf", gguf_type=qtype.lower())
