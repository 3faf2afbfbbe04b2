"""KV blocks on the wire: raw tensor bytes plus dtype / shape / layer metadata in protobuf (never pickle).

Messages are split by blocks and layers to stay under max_bytes each, well inside gRPC's message limit.
The receiver refuses blocks whose model id, dtype, block size or shape differ from its own. dtype is the KV dtype's
name (--kv-dtype: float32, bfloat16, float16, or a quantized fp8_e4m3, fp8_e5m2, int8); a quantized block's bytes
are its packed rows (kernels/kv_quant.py: head_dim codes + the fp32 scale per token and head), so the scales
travel inside the data and the checksum covers them.

Integrity: each data message carries the XXH3-64 of its bytes (xxhash, already a dependency for the model
digest: about 0.08 ms per 4 MiB message here, 50 GiB/s, against 1.2 ms for zlib.crc32, and 64 bits rather
than 32), and the last message states the data messages and blocks sent; KVTransferTally checks both on the
receiving side, and KVConnector.finish_kv_import checks that every layer of every block the decode lacked came.
"""
from __future__ import annotations

import torch
import xxhash

from tandem.kernels.kv_quant import row_size
from tandem.shared.config import CacheConfig, ModelConfig, dtype_name
from tandem.shared.errors import InvalidRequestError
from tandem.shared.kv_connector import KVBlocks
from tandem.v1 import decode_pb2

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def kv_to_messages(
    request_id: str, kv: KVBlocks, model_config: ModelConfig, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    kv_dtype: str | None = None,
) -> list[decode_pb2.KVBlocksMessage]:
    """Split exported blocks (all layers; the model's KV heads kv.head_start.. of the data's) into messages of
    at most max_bytes of tensor data (at least one block of one layer each). kv_dtype: the pool's KV dtype name
    (CacheConfig.kv_dtype; None: the data's float type's name); a quantized pool's data is uint8 rows
    (kernels/kv_quant.row_size)."""
    data = kv.data.contiguous()
    num_layers, _, num_blocks, block_size, num_kv_heads, row = data.shape
    kv_dtype = kv_dtype or dtype_name(data.dtype)
    head_dim = model_config.head_dim
    assert row == row_size(head_dim, kv_dtype), (row, head_dim, kv_dtype)
    per_layer_block = data[0, :, 0].numel() * data.element_size()
    blocks_per_msg = max(1, min(num_blocks, max_bytes // (per_layer_block * num_layers)))
    layers_per_msg = num_layers if blocks_per_msg > 1 else max(1, min(num_layers, max_bytes // per_layer_block))
    messages = []
    for b in range(0, num_blocks, blocks_per_msg):
        nb = min(blocks_per_msg, num_blocks - b)
        for layer in range(0, num_layers, layers_per_msg):
            nl = min(layers_per_msg, num_layers - layer)
            raw = data[layer : layer + nl, :, b : b + nb].contiguous().view(torch.uint8).numpy().tobytes()
            messages.append(
                decode_pb2.KVBlocksMessage(
                    request_id=request_id,
                    model_id=model_config.model_id,
                    dtype=kv_dtype,
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    layer_start=layer,
                    layer_end=layer + nl,
                    first_block_index=kv.first_block_index + b,
                    num_blocks=nb,
                    data=raw,
                    checksum=checksum(raw),
                )
            )
            if kv.head_start:  # (absent: 0; two single-rank instances send what they always sent)
                messages[-1].kv_head_start = kv.head_start
    return messages


def checksum(data: bytes) -> int:
    """XXH3-64 of a message's data bytes (KVBlocksMessage.checksum), an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(data)


def last_message(request_id: str, first_token_id: int | None, num_messages_sent: int,
                 num_blocks_sent: int) -> decode_pb2.KVBlocksMessage:
    """The message that ends a transfer: the first sampled token (None: a shard stream's end, TransferKVShard) and
    the totals the receiver checks (num_messages_sent: data messages before it; num_blocks_sent: blocks they
    carried, each counted once)."""
    msg = decode_pb2.KVBlocksMessage(request_id=request_id, num_messages_sent=num_messages_sent,
                                     num_blocks_sent=num_blocks_sent)
    if first_token_id is not None:
        msg.first_token_id = first_token_id
    return msg


class KVTransferTally:
    """The receiver's count of one TransferKV stream: its request id (every message must name the same one), its
    data messages and the blocks they carried (a block counts once its last layer has come), checked against
    the totals of the last message. Methods raise InvalidRequestError naming the field at fault."""

    def __init__(self, request_id: str, num_layers: int):
        if not request_id:
            raise InvalidRequestError("KV transfer refused: request_id is required")
        self.request_id, self.num_layers = request_id, num_layers
        self.num_messages = self.num_blocks = 0

    def add(self, msg: decode_pb2.KVBlocksMessage) -> None:
        """Count a message (before its data is used): its request id must be the stream's."""
        if msg.request_id != self.request_id:
            raise InvalidRequestError(f"KV transfer refused: request_id changed mid-stream from {self.request_id!r} "
                                      f"to {msg.request_id!r}")  # fmt: skip
        if msg.num_blocks:
            self.num_messages += 1
            if msg.layer_end == self.num_layers:
                self.num_blocks += msg.num_blocks

    def check_totals(self, last: decode_pb2.KVBlocksMessage) -> None:
        """The last message's totals against what arrived: a transfer with messages lost or added is refused."""
        for field, received in (("num_messages_sent", self.num_messages), ("num_blocks_sent", self.num_blocks)):
            if not last.HasField(field):
                raise InvalidRequestError(f"KV transfer refused: the last message lacks {field}")
            if getattr(last, field) != received:
                raise InvalidRequestError(f"KV transfer incomplete: {field} is {getattr(last, field)}, "
                                          f"{received} arrived")  # fmt: skip


def kv_from_message(msg: decode_pb2.KVBlocksMessage, model_config: ModelConfig, cache_config: CacheConfig,
                    kv_heads: tuple[int, int] | None = None) -> KVBlocks:
    """Check a data message (num_blocks > 0) against this instance and its checksum, and view its bytes as a
    tensor [layer_end - layer_start, 2, num_blocks, block_size, num_kv_heads, row] in the pool's element type (row:
    head_dim; a quantized KV dtype's kernels/kv_quant.row_size bytes). kv_heads: the model's KV heads [start, end)
    this rank holds (shared/parallel/kv_heads.py; None: all); the message's heads [kv_head_start, kv_head_start +
    num_kv_heads) must lie inside them.
    InvalidRequestError naming the field on any mismatch (the block range is checked on import, against the
    request's reserved blocks: KVConnector.import_kv)."""
    want = {
        "model_id": model_config.model_id,
        "dtype": cache_config.kv_dtype,
        "block_size": cache_config.block_size,
        "head_dim": model_config.head_dim,
    }
    for field, expected in want.items():
        got = getattr(msg, field)
        if got != expected:
            raise InvalidRequestError(f"KV transfer refused: {field} is {got!r}, this decode instance has {expected!r}")
    start, end = kv_heads or (0, model_config.num_key_value_heads)
    if not (msg.num_kv_heads and start <= msg.kv_head_start and msg.kv_head_start + msg.num_kv_heads <= end):
        raise InvalidRequestError(f"KV transfer refused: kv_head_start {msg.kv_head_start} and num_kv_heads "
                                  f"{msg.num_kv_heads} name KV heads this decode rank does not hold (it holds "
                                  f"[{start}, {end}))")  # fmt: skip
    if not 0 <= msg.layer_start < msg.layer_end <= model_config.num_hidden_layers:
        raise InvalidRequestError(
            f"KV transfer refused: layer range [{msg.layer_start}, {msg.layer_end}) is out of bounds")
    shape = (msg.layer_end - msg.layer_start, 2, msg.num_blocks, msg.block_size, msg.num_kv_heads,
             cache_config.row_size(model_config))
    expected_bytes = torch.Size(shape).numel() * cache_config.dtype.itemsize
    if len(msg.data) != expected_bytes:
        raise InvalidRequestError(
            f"KV transfer refused: {len(msg.data)} bytes for shape {shape}, expected {expected_bytes}")
    if not msg.HasField("checksum"):
        raise InvalidRequestError("KV transfer refused: checksum is missing")
    if checksum(msg.data) != msg.checksum:
        raise InvalidRequestError(f"KV transfer refused: checksum mismatch for blocks {msg.first_block_index}.."
                                  f"{msg.first_block_index + msg.num_blocks} of layers [{msg.layer_start}, "
                                  f"{msg.layer_end}): the data is corrupt")  # fmt: skip
    data = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(cache_config.dtype).view(shape)
    return KVBlocks(msg.first_block_index, data, msg.layer_start, msg.kv_head_start)
