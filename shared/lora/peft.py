"""Reading a PEFT LoRA adapter directory (what PEFT's save_pretrained writes: adapter_config.json and
adapter_model.safetensors) into the engine's layout, checking everything against the model first.

LoRA (Hu et al. 2021, arXiv 2106.09685): a linear y = x W^T gains (x A^T) B^T * scaling, with A [r, K], B [N, r],
scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023; use_rslora). Per module, r and
lora_alpha come from rank_pattern / alpha_pattern when a pattern matches its name (PEFT's rule: the first key k for
which `(.*\\.)?(k)$` matches), else from r / lora_alpha. Which modules are adapted is what the weights file holds
(PEFT loads the same); target_modules is read only to refuse the embeddings and lm_head by name.

Into the engine's fused linears (shared/lora/targets.py): per fused linear, the A matrices of the adapted parts
stack along the rank dimension (q, k, v in order), and B becomes their block-diagonal over the fused output rows
(a part not adapted has zero rows), so one shrink and one expand give every part its own delta; the scaling is
folded into B. fan_in_fan_out concerns only GPT-2's Conv1D base layers: PEFT itself resets it for nn.Linear, and
the lora_A / lora_B it saves are nn.Linear weights either way, so it changes nothing here.

Refused by name (InvalidRequestError): another peft_type, LoRA variants (DoRA, aLoRA, VeLoRA, MonteCLoRA, BD-LoRA,
Arrow, KaSA, MiCA), modules_to_save, trainable_token_indices, target_parameters, layer_replication, QALoRA, trained
biases (bias other than "none", lora_bias), adapters of embed_tokens or lm_head, a module the model lacks, a rank
above max_lora_rank, shapes that do not match the model, and a .bin (pickle) weights file.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.shared.errors import InvalidRequestError
from tandem.shared.lora.request import LoRARequest
from tandem.shared.lora.targets import FUSED_PARTS, LoRATarget

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# LoraConfig fields that select a variant with another forward (PEFT's is_lora_variant fields)
VARIANT_FIELDS = {"use_dora": "DoRA", "alora_invocation_tokens": "activated LoRA", "velora_config": "VeLoRA",
                  "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA", "arrow_config": "Arrow",
                  "kasa_config": "KaSA", "use_qalora": "QALoRA"}
# LoraConfig fields that train or change something besides the low-rank deltas of the linears
UNSUPPORTED_FIELDS = {"modules_to_save": "fully trained copies of modules", "trainable_token_indices":
                      "trained token embeddings", "target_parameters": "adapted parameters (MoE experts)",
                      "layer_replication": "replicated layers", "lora_bias": "a bias on lora_B"}
EMBEDDING_MODULES = ("embed_tokens", "lm_head")
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


def lora_key(name: str, digest: str) -> str:
    return f"{name}:{digest}"


def read_lora_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                      dtype: torch.dtype) -> LoRAAdapter:
    """Read request's PEFT directory into a LoRAAdapter for a model whose adaptable linears are targets (shared/lora/
    targets.py lora_targets), weights cast to dtype. Reads the files only (thread-safe). InvalidRequestError
    naming the adapter and what is wrong (the module's docstring lists what is refused)."""
    name, path = request.lora_name, Path(request.lora_path)

    def refuse(reason: str):
        raise InvalidRequestError(f"adapter {name!r} ({path}): {reason}")

    if not (path / ADAPTER_CONFIG).is_file():
        refuse(f"no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    if not (path / ADAPTER_WEIGHTS).is_file():
        pickled = (path / "adapter_model.bin").is_file()
        refuse(f"no {ADAPTER_WEIGHTS}" + (" (adapter_model.bin is a pickle, never read: save the adapter with "
                                           "safe_serialization=True)" if pickled else ""))
    config_bytes, weights_bytes = (path / ADAPTER_CONFIG).read_bytes(), (path / ADAPTER_WEIGHTS).read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError:
        refuse(f"{ADAPTER_CONFIG} is not valid JSON")
    if not isinstance(config, dict):
        refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    _check_config(config, refuse)
    try:
        from safetensors.torch import load

        tensors = load(weights_bytes)
    except Exception:  # (safetensors raises its own error type on a bad file)
        refuse(f"{ADAPTER_WEIGHTS} is not a safetensors file")
    modules = _modules(tensors, targets, refuse)
    rank, weights = 0, {}
    for target_name, parts in modules.items():
        target = targets[target_name]
        for module, (a, b) in parts.items():
            r = _check_module(config, target, module, a, b, max_lora_rank, refuse)
            rank = max(rank, r)
            parts[module] = (a.float(), b.float() * _scaling(config, module, r))
        weights[target_name] = _fuse(target, parts, dtype)
    if not weights:
        refuse(f"{ADAPTER_WEIGHTS} holds no lora_A / lora_B weights")
    digest = file_digest(config_bytes, weights_bytes)
    return LoRAAdapter(name, str(path), digest, rank, weights)


def file_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """SHA-256 of an adapter's config and weights files (each length-prefixed), 16 hex digits."""
    h = hashlib.sha256()
    for data in (config_bytes, weights_bytes):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _check_config(config: dict, refuse) -> None:
    if config.get("peft_type") != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for field, what in VARIANT_FIELDS.items():
        if config.get(field):
            refuse(f"{field} ({what}) is not supported: plain LoRA only")
    if config.get("init_lora_weights") == "mica":
        refuse("init_lora_weights 'mica' (MiCA, a LoRA variant) is not supported: plain LoRA only")
    for field, what in UNSUPPORTED_FIELDS.items():
        if config.get(field):
            refuse(f"{field} ({what}) is not supported: only the low-rank deltas of the linears")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config['bias']!r} (trained biases of the base model) is not supported: it must be 'none'")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        refuse(f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        refuse(f"lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        named = [m for m in EMBEDDING_MODULES if re.fullmatch(targets, m) or re.fullmatch(targets, f"model.{m}")]
    else:
        named = [m for m in EMBEDDING_MODULES for t in targets or () if t == m or t.endswith(f".{m}")]
    if named:
        refuse(f"target_modules names {named[0]}: adapters of the embeddings or the LM head are not supported")


def _modules(tensors: dict[str, torch.Tensor], targets: dict[str, LoRATarget], refuse) -> dict[str, dict]:
    """{target module name: {checkpoint module name: (lora_a, lora_b)}} of the weights file. A checkpoint module is
    a part of its target (q_proj of qkv_proj) or, as Phi-3's checkpoints name them, the fused linear itself; an
    adapter gives one or the other. Refuses keys it does not know."""
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
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


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's get_pattern_key: the value of the first pattern k with `(.*\\.)?(k)$` matching module, else default."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _check_module(config: dict, target: LoRATarget, module: str, a: torch.Tensor, b: torch.Tensor,
                  max_lora_rank: int, refuse) -> int:
    """The module's rank, once its shapes fit target and its rank is the config's and at most max_lora_rank."""
    leaf = module.rpartition(".")[2]
    out = dict(target.parts).get(leaf, target.out_features)  # (the fused linear itself: all of its rows)
    r = _pattern_value(config.get("rank_pattern"), module, config["r"])
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape[0] != out or \
            a.shape[0] != b.shape[1]:
        refuse(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
               f"[{out}, {target.in_features}] weight (an adapter of another model?)")
    if a.shape[0] != r:
        refuse(f"{module} has rank {a.shape[0]}, but its config says {r} (r, rank_pattern)")
    if not a.is_floating_point() or not b.is_floating_point():
        refuse(f"{module}: lora_A and lora_B must be float tensors, got {a.dtype} and {b.dtype}")
    if r > max_lora_rank:
        refuse(f"{module} has rank {r}, above --max-lora-rank {max_lora_rank}")
    return r


def _scaling(config: dict, module: str, r: int) -> float:
    """PEFT's LoraLayer scaling: lora_alpha / r, or / sqrt(r) with use_rslora (alpha from alpha_pattern first)."""
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


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
