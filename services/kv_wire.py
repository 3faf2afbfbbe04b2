"""KV blocks on the wire: raw tensor bytes plus dtype / shape / layer metadata in protobuf (never pickle).

Messages are split by blocks and layers to stay under max_bytes each, well inside gRPC's message limit.
The receiver refuses blocks whose model id, dtype, block size or shape differ from its own.
"""
from __future__ import annotations

import torch

from shared.config import CacheConfig, ModelConfig, dtype_name
from shared.engine import KVBlocks
from shared.errors import InvalidRequestError
from tandem.v1 import decode_pb2

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def kv_to_messages(
    request_id: str, kv: KVBlocks, model_config: ModelConfig, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[decode_pb2.KVBlocksMessage]:
    """Split exported blocks (all layers) into messages of at most max_bytes of tensor data (at least one
    block of one layer each)."""
    data = kv.data.contiguous()
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = data.shape
    per_layer_block = data[0, :, 0].numel() * data.element_size()
    blocks_per_msg = max(1, min(num_blocks, max_bytes // (per_layer_block * num_layers)))
    layers_per_msg = num_layers if blocks_per_msg > 1 else max(1, min(num_layers, max_bytes // per_layer_block))
    messages = []
    for b in range(0, num_blocks, blocks_per_msg):
        nb = min(blocks_per_msg, num_blocks - b)
        for layer in range(0, num_layers, layers_per_msg):
            nl = min(layers_per_msg, num_layers - layer)
            chunk = data[layer : layer + nl, :, b : b + nb].contiguous()
            messages.append(
                decode_pb2.KVBlocksMessage(
                    request_id=request_id,
                    model_id=model_config.model_id,
                    dtype=dtype_name(data.dtype),
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    layer_start=layer,
                    layer_end=layer + nl,
                    first_block_index=kv.first_block_index + b,
                    num_blocks=nb,
                    data=chunk.view(torch.uint8).numpy().tobytes(),
                )
            )
    return messages


def kv_from_message(msg: decode_pb2.KVBlocksMessage, model_config: ModelConfig, cache_config: CacheConfig) -> KVBlocks:
    """Check a message against this instance and view its bytes as a tensor. InvalidRequestError on any
    mismatch."""
    want = {
        "model_id": model_config.model_id,
        "dtype": cache_config.kv_dtype,
        "block_size": cache_config.block_size,
        "num_kv_heads": model_config.num_key_value_heads,
        "head_dim": model_config.head_dim,
    }
    for field, expected in want.items():
        got = getattr(msg, field)
        if got != expected:
            raise InvalidRequestError(f"KV transfer refused: {field} is {got!r}, this decode instance has {expected!r}")
    if not 0 <= msg.layer_start < msg.layer_end <= model_config.num_hidden_layers:
        raise InvalidRequestError(
            f"KV transfer refused: layer range [{msg.layer_start}, {msg.layer_end}) is out of bounds")
    shape = (msg.layer_end - msg.layer_start, 2, msg.num_blocks, msg.block_size, msg.num_kv_heads, msg.head_dim)
    expected_bytes = torch.Size(shape).numel() * cache_config.dtype.itemsize
    if len(msg.data) != expected_bytes:
        raise InvalidRequestError(
            f"KV transfer refused: {len(msg.data)} bytes for shape {shape}, expected {expected_bytes}")
    data = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(cache_config.dtype).view(shape)
    return KVBlocks(msg.first_block_index, data, msg.layer_start)
