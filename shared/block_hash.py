"""Prefix-cache block hashes: one implementation for the gateway, the prefill tier and the decode tier.

A full block's hash chains its parent's: h_i = H(h_{i-1}, token ids of block i, extra keys of block i), the method
of vLLM's hash_block_tokens, so equal hashes mean equal prefixes up to and including that block. H is SHA-256 over a
canonical byte encoding, truncated to 128 bits: stable across processes, machines and Python versions (never
Python's hash(), which PYTHONHASHSEED salts). The chain starts from a root that hashes the HashContract: the
algorithm, a fixed seed, the block size, the model id with its weight format, and the KV dtype, so instances whose
KV could differ never produce a common hash. A request's cache_salt enters the first block's extra keys: two salts
never share a block; so does its LoRA adapter's identity (name and digest of its files: shared/lora/peft.py), so
KV never crosses adapters and one adapter hashes alike on every instance. Extra keys are a tuple of str/int.

Only full blocks are hashed; a partial last block never is.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

HASH_ALGORITHM = "sha256-128"  # SHA-256 truncated to 16 bytes
HASH_SEED = "tandem-prefix-cache-v1"
HASH_BYTES = 16

BlockHash = bytes  # HASH_BYTES bytes


@dataclass(frozen=True)
class HashContract:
    """What makes two instances' block hashes comparable. Each instance registers its own; the gateway uses the
    prefix index of an instance only when its contract equals the gateway's (a mismatch is logged)."""

    block_size: int
    model_id: str  # name:digest:weight format (shared.config.ModelConfig.model_id)
    kv_dtype: str
    algorithm: str = HASH_ALGORITHM
    seed: str = HASH_SEED

    @property
    def root_hash(self) -> BlockHash:
        """The parent of every request's first block."""
        return _digest(json.dumps(asdict(self), sort_keys=True).encode())

    @property
    def contract_id(self) -> str:
        """A short id of this contract (hex), used to namespace the index in Redis."""
        return self.root_hash.hex()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HashContract:
        return cls(**d)


def _digest(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()[:HASH_BYTES]


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """H(parent, token ids, extra keys). token_ids: one block's ids (ints in [0, 2^32)); extra_keys: str/int
    values (JSON-encoded, in order). Raises ValueError on ids out of range or other extra-key types."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    try:
        ids = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2^32): {e}") from None
    extra = b""
    if extra_keys:
        if not all(isinstance(k, str | int) for k in extra_keys):
            raise ValueError(f"extra keys must be str or int, got {extra_keys!r}")
        extra = json.dumps(list(extra_keys)).encode()
    return _digest(parent + struct.pack("<I", len(token_ids)) + ids + extra)


def block_extra_keys(block_index: int, cache_salt: str | None, variant: str | None = None,
                     lora_key: str | None = None) -> tuple:
    """Extra keys of logical block block_index of a request, on the first block only: the cache salt, the
    request's KV variant (ModelConfig.kv_variant: a longrope model's prompts past its original context compute
    every position with the long factors, so their KV differs from a shorter prompt's for the same tokens), and
    its LoRA adapter's identity (Request.lora_key: "name:digest"; None for the base model)."""
    if block_index != 0:
        return ()
    return ((f"salt:{cache_salt}",) if cache_salt is not None else ()) + ((f"kv:{variant}",) if variant else ()) \
        + ((f"lora:{lora_key}",) if lora_key is not None else ())


def hash_request_blocks(token_ids: Sequence[int], contract: HashContract, cache_salt: str | None = None,
                        parent_hashes: Sequence[BlockHash] = (), variant: str | None = None,
                        lora_key: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of token_ids, in order. parent_hashes: hashes already computed for the leading
    blocks (extended, not recomputed: a decoding request adds one block at a time). variant, lora_key:
    block_extra_keys'."""
    bs = contract.block_size
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else contract.root_hash
    for i in range(len(hashes), len(token_ids) // bs):
        parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs],
                                   block_extra_keys(i, cache_salt, variant, lora_key))
        hashes.append(parent)
    return hashes
