"""Reading a PEFT LoRA adapter directory (what PEFT's save_pretrained writes: adapter_config.json and
adapter_model.safetensors) into the engine's layout, checking everything against the model first.

LoRA (Hu et al. 2021, arXiv 2106.09685): a linear y = x W^T gains (x A^T) B^T * scaling, with A [r, K], B [N, r],
scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023; use_rslora). Per module, r and
lora_alpha come from rank_pattern / alpha_pattern when a pattern matches its name (PEFT's rule: the first key k for
which `(.*\\.)?(k)$` matches), else from r / lora_alpha. Which modules are adapted is what the weights file holds
(PEFT loads the same); target_modules is read only to refuse the embeddings and lm_head by name. The config is
read by shared/lora/peft_config.py (user regexes under a time budget); nothing of the weights is read before the
config and the safetensors header passed every check, so a refused adapter costs its header only.

Into the engine's fused linears (shared/lora/targets.py): per fused linear, the A matrices of the adapted parts
stack along the rank dimension (q, k, v in order), and B becomes their block-diagonal over the fused output rows
(a part not adapted has zero rows), so one shrink and one expand give every part its own delta; the scaling is
folded into B. fan_in_fan_out concerns only GPT-2's Conv1D base layers: PEFT itself resets it for nn.Linear, and
the lora_A / lora_B it saves are nn.Linear weights either way, so it changes nothing here.

Refused by name (InvalidRequestError): another peft_type, LoRA variants (DoRA, aLoRA, VeLoRA, MonteCLoRA, BD-LoRA,
Arrow, KaSA, MiCA), modules_to_save, trainable_token_indices, target_parameters, layer_replication, QALoRA, trained
biases (bias other than "none", lora_bias), adapters of embed_tokens or lm_head, a module the model lacks, a rank
above max_lora_rank, shapes that do not match the model, a malformed field (a pattern that is not a valid regex or
runs too long, a rank that is not a positive integer, an alpha that is not finite), NaN or infinite weights, a
relative lora_path, and a .bin (pickle) weights file.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.shared.errors import InvalidRequestError
from tandem.shared.lora.peft_config import (EMBEDDING_MODULES, MAX_CONFIG_BYTES, AdapterConfig, Refuse,
                                            parse_adapter_config)
from tandem.shared.lora.request import LoRARequest
from tandem.shared.lora.targets import FUSED_PARTS, LoRATarget

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_HEADER_BYTES = 16 << 20  # the safetensors header (JSON): about 100 bytes a tensor
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$")
_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_PART_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded adapter in the engine's layout. digest: SHA-256 of its two files' contents (hex, 16 digits);
    rank: its largest module rank; weights: target module name -> (lora_a [r_t, K], lora_b [N, r_t]) in the
    model's dtype, r_t the ranks of the target's adapted parts together, the scaling folded into lora_b."""

    name: str
    path: str
    digest: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def key(self) -> str:
        """The adapter's identity: name and digest. Requests carry it (Request.lora_key) and the first block of
        each hashes it, so no KV block is shared across adapters, and one adapter hashes alike on every instance."""
        return lora_key(self.name, self.digest)


class TensorInfo(NamedTuple):
    """A tensor as the safetensors header declares it: dtype name ("F32"), shape, [begin, end) in the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def lora_key(name: str, digest: str) -> str:
    return f"{name}:{digest}"


def read_lora_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                      dtype: torch.dtype) -> LoRAAdapter:
    """Read request's PEFT directory into a LoRAAdapter for a model whose adaptable linears are targets (shared/lora/
    targets.py lora_targets), weights cast to dtype. Reads the files only (thread-safe). InvalidRequestError
    naming the adapter and what is wrong (the module's docstring lists what is refused).

    Everything the config and the safetensors header tell (fields, modules, ranks, shapes, dtypes, sizes) is
    checked before any weight is read; the weights are then read through a memory map of the file, one tensor at a
    time, and checked to be finite, also once scaled and cast to dtype."""
    name, path = request.lora_name, Path(request.lora_path)
    printable = request.lora_path.isprintable()  # (no controls, format characters or lone surrogates)

    def refuse(reason: str):
        raise InvalidRequestError(f"adapter {name!r} ({path if printable else repr(request.lora_path)}): {reason}")

    if not path.is_absolute() or not printable:
        refuse("lora_path must be an absolute path of printable characters (each engine would resolve a relative "
               "one against its own working directory)")
    if not (path / ADAPTER_CONFIG).is_file():
        refuse(f"no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    if not (path / ADAPTER_WEIGHTS).is_file():
        pickled = (path / "adapter_model.bin").is_file()
        refuse(f"no {ADAPTER_WEIGHTS}" + (" (adapter_model.bin is a pickle, never read: save the adapter with "
                                           "safe_serialization=True)" if pickled else ""))
    with open(path / ADAPTER_CONFIG, "rb") as f:
        config_bytes = f.read(MAX_CONFIG_BYTES + 1)
    config = parse_adapter_config(config_bytes, refuse)
    with open(path / ADAPTER_WEIGHTS, "rb") as f:
        header, data_start = _read_header(f, refuse)
        modules = _modules(header, targets, refuse)
        ranks = {module: _check_module(config, targets[target_name], module, a, b, max_lora_rank, refuse)
                 for target_name, parts in modules.items() for module, (a, b) in parts.items()}  # fmt: skip
        if not modules:
            refuse(f"{ADAPTER_WEIGHTS} holds no lora_A / lora_B weights")
        size = _check_sizes(header, data_start, f.seek(0, 2), refuse)
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as data:
            digest = file_digest(config_bytes, data)
            weights = {target_name: _read_target(data, data_start, config, targets[target_name], parts, ranks, dtype,
                                                 refuse)
                       for target_name, parts in modules.items()}  # fmt: skip
    return LoRAAdapter(name, str(path), digest, max(ranks.values()), weights)


def file_digest(config_bytes: bytes, weights_bytes) -> str:
    """SHA-256 of an adapter's config and weights files (bytes-like, each length-prefixed), 16 hex digits."""
    h = hashlib.sha256()
    for data in (config_bytes, weights_bytes):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _read_header(f, refuse: Refuse) -> tuple[dict[str, TensorInfo], int]:
    """The safetensors header of the open file f: ({tensor name: TensorInfo}, where the data starts)."""
    not_safetensors = f"{ADAPTER_WEIGHTS} is not a safetensors file"
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or length > MAX_HEADER_BYTES:
        refuse(f"{not_safetensors} (or its header is over {MAX_HEADER_BYTES >> 20} MiB)")
    try:
        header = json.loads(f.read(length))
    except (ValueError, RecursionError):
        refuse(f"{not_safetensors} (its header is not JSON)")
    if not isinstance(header, dict):
        refuse(f"{not_safetensors} (its header is not a JSON object)")
    infos = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or not all(_is_count(n) for n in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            refuse(f"{not_safetensors} (its header entry of {key!r} is malformed)")
        infos[key] = TensorInfo(dtype, tuple(shape), begin, end)
    return infos, 8 + length


def _check_sizes(header: dict[str, TensorInfo], data_start: int, file_size: int, refuse: Refuse) -> int:
    """The file's size, once it holds exactly the data its (float) tensors declare."""
    end = data_start
    for key, info in header.items():
        nbytes = math.prod(info.shape) * FLOAT_DTYPES[info.dtype].itemsize
        if info.end - info.begin != nbytes:
            refuse(f"{ADAPTER_WEIGHTS} is not a safetensors file ({key!r}: its data_offsets do not fit its shape)")
        end = max(end, data_start + info.end)
    if file_size != end:
        refuse(f"{ADAPTER_WEIGHTS} is {file_size} bytes, but its header declares {end}: truncated or corrupt")
    return file_size


def _read_target(data: mmap.mmap, data_start: int, config: AdapterConfig, target: LoRATarget, parts: dict,
                 ranks: dict[str, int], dtype: torch.dtype, refuse: Refuse) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's fused (lora_a, lora_b) in dtype from its checked parts' data. Refuses NaN or infinite values."""
    weights = {}
    for module, infos in parts.items():
        a, b = (_tensor(data, data_start, info) for info in infos)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            refuse(f"{module}: its lora_A or lora_B holds NaN or infinite values")
        weights[module] = (a, b * config.scaling(module, ranks[module]))
    fused = _fuse(target, weights, dtype)
    if not all(torch.isfinite(t).all() for t in fused):
        refuse(f"{target.name}: its weights scaled by lora_alpha / r are not finite in {dtype} (they overflow)")
    return fused


def _tensor(data: mmap.mmap, data_start: int, info: TensorInfo) -> torch.Tensor:
    """One tensor's data (checked by _check_sizes), copied out of the map, as float32."""
    raw = torch.frombuffer(data, dtype=torch.uint8, count=info.end - info.begin, offset=data_start + info.begin)
    copy, raw = raw.clone(), None  # (no view of the map outlives this line: the map closes after the reads)
    return copy.view(FLOAT_DTYPES[info.dtype]).reshape(info.shape).float()


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _modules(tensors: dict[str, TensorInfo], targets: dict[str, LoRATarget], refuse: Refuse) -> dict[str, dict]:
    """{target module name: {checkpoint module name: (lora_a, lora_b)}} of the weights file's header. A checkpoint
    module is a part of its target (q_proj of qkv_proj) or, as Phi-3's checkpoints name them, the fused linear
    itself; an adapter gives one or the other. Refuses keys it does not know."""
    found: dict[str, dict[str, dict[str, TensorInfo]]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            refuse(f"weight {key!r} is not a lora_A / lora_B weight (DoRA magnitudes, embeddings, biases and "
                   "modules_to_save are not supported)")
        module, kind = match.groups()
        if module.rpartition(".")[2] in EMBEDDING_MODULES:
            refuse(f"it adapts {module}: adapters of the embeddings or the LM head are not supported")
        layer = _MODULE_RE.match(module)
        target_name = None
        if layer is not None:
            index, group, leaf = layer.groups()
            suffix = f"{group}.{leaf}" if f"{group}.{leaf}" in FUSED_PARTS else _PART_OF.get(leaf)
            if suffix is not None and suffix.startswith(f"{group}."):
                target_name = f"model.layers.{index}.{suffix}"
        if target_name not in targets:
            refuse(f"it adapts {module}, which this model does not have (adaptable: the q/k/v/o and gate/up/down "
                   "projections of its layers)")
        found.setdefault(target_name, {}).setdefault(module, {})[kind] = tensor
    modules = {}
    for target_name, parts in found.items():
        if target_name in parts and len(parts) > 1:
            refuse(f"it adapts {target_name} both as one linear and by its parts")
        for module, pair in parts.items():
            if set(pair) != {"lora_A", "lora_B"}:
                refuse(f"{module} has {sorted(pair)}, not both lora_A and lora_B")
        modules[target_name] = {module: (pair["lora_A"], pair["lora_B"]) for module, pair in parts.items()}
    return modules


def _check_module(config: AdapterConfig, target: LoRATarget, module: str, a: TensorInfo, b: TensorInfo,
                  max_lora_rank: int, refuse: Refuse) -> int:
    """The module's rank, once its header shapes fit target, its rank is at most max_lora_rank and the config's, and
    its dtypes are float."""
    leaf = module.rpartition(".")[2]
    out = dict(target.parts).get(leaf, target.out_features)  # (the fused linear itself: all of its rows)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != target.in_features or b.shape[0] != out or \
            a.shape[0] != b.shape[1]:
        refuse(f"{module}: lora_A {a.shape} and lora_B {b.shape} do not fit the model's "
               f"[{out}, {target.in_features}] weight (an adapter of another model?)")
    if a.shape[0] > max_lora_rank:
        refuse(f"{module} has rank {a.shape[0]}, above --max-lora-rank {max_lora_rank}")
    r = config.rank(module)
    if a.shape[0] != r:
        refuse(f"{module} has rank {a.shape[0]}, but its config says {r} (r, rank_pattern)")
    if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
        refuse(f"{module}: lora_A and lora_B must be float tensors ({', '.join(FLOAT_DTYPES)}), got {a.dtype} and "
               f"{b.dtype}")
    return r


def _fuse(target: LoRATarget, parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (lora_a [r_t, K], lora_b [N, r_t]) in dtype: its parts' A stacked along the rank in the target's
    part order, their (scaled) B a block-diagonal over its output rows; a fused module's pair as it is."""
    if len(parts) == 1 and next(iter(parts)).rpartition(".")[2] not in dict(target.parts):
        a, b = next(iter(parts.values()))
        return a.to(dtype).contiguous(), b.to(dtype).contiguous()
    by_leaf = {module.rpartition(".")[2]: pair for module, pair in parts.items()}
    rank = sum(a.shape[0] for a, _ in by_leaf.values())
    lora_a = torch.zeros(rank, target.in_features)
    lora_b = torch.zeros(target.out_features, rank)
    row = col = 0
    for leaf, out in target.parts:
        if leaf in by_leaf:
            a, b = by_leaf[leaf]
            lora_a[col : col + a.shape[0]] = a
            lora_b[row : row + out, col : col + a.shape[0]] = b
            col += a.shape[0]
        row += out
    return lora_a.to(dtype), lora_b.to(dtype)
