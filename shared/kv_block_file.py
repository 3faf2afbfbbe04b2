"""One KV block in one file: the disk tier's format (shared/kv_disk_tier.py DiskTier), an atomic write and a checked read.

Layout, little endian:
    magic        8 bytes, b"TKVBLK01" (the format and its version)
    header_len   u32
    header       JSON: {"contract": the hash contract's root hash (hex), "block_hash": hex, "token_ids": [...],
                 "dtype": "float32", "shape": [...]}
    payload      the block's bytes: kv_caches[:, :, block_id] (every layer, K and V) in the pool's element type,
                 contiguous; opaque here (a quantized KV layout is uint8 rows, stored the same way)
    checksum     8 bytes, XXH3-64 of everything before it

write_block_file writes to a temporary name in the same directory, fsyncs and renames, so a reader sees a whole
file or none; a crash mid-write leaves only a temporary file (DiskTier deletes those when it starts).
read_block_file checks the magic, the lengths, the header against what the caller expects, and the checksum, and
raises CorruptBlockFile on any mismatch: the caller deletes the file and counts a miss, never serves it.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tandem.shared.block_hash import BlockHash

MAGIC = b"TKVBLK01"
SUFFIX = ".kvb"  # a whole block file: <block hash hex>.kvb
TMP_SUFFIX = ".tmp"  # a file being written (or left by a crash)
_LEN = struct.Struct("<I")
_CHECKSUM_BYTES = 8


class CorruptBlockFile(Exception):
    """A block file that is truncated, altered, or not the block asked for."""


@dataclass(frozen=True, slots=True)
class BlockFileHeader:
    contract: str  # root hash hex of the hash contract it was written under
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "uint8"
    shape: tuple[int, ...]


def block_file_name(block_hash: BlockHash) -> str:
    return block_hash.hex() + SUFFIX


def encode_block(header: BlockFileHeader, data: torch.Tensor) -> bytes:
    """The file's bytes for one block. data: the block's tensor (any dtype; CPU, contiguous or not)."""
    head = json.dumps({"contract": header.contract, "block_hash": header.block_hash.hex(),
                       "token_ids": list(header.token_ids), "dtype": header.dtype,
                       "shape": list(header.shape)}).encode()  # fmt: skip
    payload = data.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    body = MAGIC + _LEN.pack(len(head)) + head + payload
    return body + xxhash.xxh3_64_digest(body)


def write_block_file(path: Path, header: BlockFileHeader, data: torch.Tensor) -> int:
    """Write one block atomically (temporary file, fsync, rename) to path; returns the file's size in bytes.
    OSError when the disk refuses (nothing is left at path then)."""
    blob = encode_block(header, data)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(blob)


def _parse_header(blob: bytes, size: int) -> tuple[BlockFileHeader, int]:
    """The header of a file of size bytes starting with blob, and where its payload starts. CorruptBlockFile."""
    if blob[:len(MAGIC)] != MAGIC or len(blob) < len(MAGIC) + _LEN.size:
        raise CorruptBlockFile("not a tandem KV block file")
    (head_len,) = _LEN.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if len(blob) < start + head_len:
        raise CorruptBlockFile("truncated header")
    try:
        d = json.loads(blob[start : start + head_len])
        header = BlockFileHeader(d["contract"], bytes.fromhex(d["block_hash"]), tuple(d["token_ids"]), d["dtype"],
                                 tuple(d["shape"]))  # fmt: skip
        dtype = getattr(torch, header.dtype)
        assert isinstance(dtype, torch.dtype)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise CorruptBlockFile(f"bad header: {e}") from None
    payload_start = start + head_len
    numel = 1
    for n in header.shape:
        numel *= n
    if size != payload_start + numel * dtype.itemsize + _CHECKSUM_BYTES:
        raise CorruptBlockFile(f"size {size} does not match its header")
    return header, payload_start


def read_block_header(path: Path, max_header_bytes: int = 1 << 20) -> BlockFileHeader:
    """The header of a block file, its size checked against it (the checksum is not: read_block_file checks it).
    CorruptBlockFile, or OSError when the file cannot be read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        blob = f.read(min(size, max_header_bytes))
    return _parse_header(blob, size)[0]


def read_block_file(path: Path, contract: str, block_hash: BlockHash, token_ids: tuple[int, ...],
                    dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The block stored at path, as a CPU tensor of shape and dtype, after checking that the file is whole
    (checksum), written under contract, and holds block_hash with exactly token_ids. CorruptBlockFile on any
    mismatch; OSError (FileNotFoundError) when the file cannot be read."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < _CHECKSUM_BYTES or xxhash.xxh3_64_digest(blob[:-_CHECKSUM_BYTES]) != blob[-_CHECKSUM_BYTES:]:
        raise CorruptBlockFile("checksum mismatch")
    header, start = _parse_header(blob, len(blob))
    expected = (contract, block_hash, tuple(token_ids), str(dtype).removeprefix("torch."), tuple(shape))
    if (header.contract, header.block_hash, header.token_ids, header.dtype, header.shape) != expected:
        raise CorruptBlockFile("the file holds another block, contract or layout")
    payload = bytearray(blob[start:-_CHECKSUM_BYTES])
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
