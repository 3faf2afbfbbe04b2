import pytest
import torch
import xxhash

from tandem.services.kv_wire import (DEFAULT_MAX_MESSAGE_BYTES, KVTransferTally, checksum, kv_from_message,
                                     kv_to_messages, last_message)
from tandem.shared.config import CacheConfig
from tandem.shared.kv_connector import KVBlocks
from tandem.v1 import decode_pb2


@pytest.fixture
def small(model_config):
    return model_config, CacheConfig(block_size=4, num_blocks=8)


def test_round_trip_split_into_small_messages(small):
    model_config, cache_config = small
    shape = (model_config.num_hidden_layers, 2, 3, 4, model_config.num_key_value_heads, model_config.head_dim)
    data = torch.randn(shape)
    msgs = kv_to_messages("r", KVBlocks(5, data), model_config, max_bytes=100_000)
    assert len(msgs) > 1 and all(len(m.data) <= 100_000 for m in msgs)
    rebuilt = torch.zeros(shape)
    for m in msgs:
        kv = kv_from_message(m, model_config, cache_config)
        b = kv.first_block_index - 5
        rebuilt[kv.layer_start : kv.layer_start + kv.data.shape[0], :, b : b + kv.data.shape[2]] = kv.data
    assert torch.equal(rebuilt, data)


@pytest.mark.parametrize("field,value", [("model_id", "other:model:fp32"), ("dtype", "bfloat16"), ("block_size", 8),
                                         ("num_kv_heads", 9), ("head_dim", 128)])  # fmt: skip
def test_mismatch_is_refused_with_clear_error(small, field, value):
    model_config, cache_config = small
    data = torch.zeros(model_config.num_hidden_layers, 2, 1, 4, model_config.num_key_value_heads, model_config.head_dim)
    msg = kv_to_messages("r", KVBlocks(0, data), model_config)[0]
    setattr(msg, field, value)
    with pytest.raises(ValueError, match=field):
        kv_from_message(msg, model_config, cache_config)


def test_truncated_bytes_are_refused(small):
    model_config, cache_config = small
    data = torch.zeros(1, 2, 1, 4, model_config.num_key_value_heads, model_config.head_dim)
    msg = kv_to_messages("r", KVBlocks(0, data), model_config)[0]
    msg.data = msg.data[:-4]
    with pytest.raises(ValueError, match="bytes"):
        kv_from_message(msg, model_config, cache_config)


def one_message(model_config, num_blocks=1):
    data = torch.randn(model_config.num_hidden_layers, 2, num_blocks, 4, model_config.num_key_value_heads,
                       model_config.head_dim)  # fmt: skip
    return kv_to_messages("r", KVBlocks(0, data), model_config)[0]


def test_every_message_carries_the_xxh3_of_its_data(small):
    model_config, _ = small
    msg = one_message(model_config)
    assert msg.HasField("checksum") and msg.checksum == xxhash.xxh3_64_intdigest(msg.data)


@pytest.mark.parametrize("corrupt", ["flip a byte", "swap halves", "checksum off by one"])
def test_corrupt_data_is_refused_by_its_checksum(small, corrupt):
    model_config, cache_config = small
    msg = one_message(model_config)
    if corrupt == "flip a byte":
        data = bytearray(msg.data)
        data[len(data) // 2] ^= 0x01
        msg.data = bytes(data)
    elif corrupt == "swap halves":
        half = len(msg.data) // 2
        msg.data = msg.data[half:] + msg.data[:half]
    else:
        msg.checksum = (msg.checksum + 1) % 2**64
    with pytest.raises(ValueError, match="checksum mismatch"):
        kv_from_message(msg, model_config, cache_config)


def test_a_data_message_without_checksum_is_refused(small):
    model_config, cache_config = small
    msg = one_message(model_config)
    msg.ClearField("checksum")
    with pytest.raises(ValueError, match="checksum is missing"):
        kv_from_message(msg, model_config, cache_config)


def test_tally_checks_the_last_messages_totals(small):
    model_config, _ = small
    msgs = kv_to_messages("r", KVBlocks(2, torch.randn(model_config.num_hidden_layers, 2, 3, 4,
                                                       model_config.num_key_value_heads, model_config.head_dim)),
                          model_config, max_bytes=20_000)  # fmt: skip
    assert len(msgs) > 3  # (split by layers: several messages per block)
    tally = KVTransferTally("r", model_config.num_hidden_layers)
    for m in msgs:
        tally.add(m)
    assert (tally.num_messages, tally.num_blocks) == (len(msgs), 3)
    tally.check_totals(last_message("r", 5, len(msgs), 3))
    with pytest.raises(ValueError, match="num_messages_sent is 99"):
        tally.check_totals(last_message("r", 5, 99, 3))
    with pytest.raises(ValueError, match="num_blocks_sent is 4"):
        tally.check_totals(last_message("r", 5, len(msgs), 4))
    with pytest.raises(ValueError, match="lacks num_messages_sent"):
        tally.check_totals(decode_pb2.KVBlocksMessage(request_id="r", first_token_id=5))


def test_tally_refuses_a_missing_or_changing_request_id(small):
    model_config, _ = small
    with pytest.raises(ValueError, match="request_id is required"):
        KVTransferTally("", model_config.num_hidden_layers)
    tally = KVTransferTally("r", model_config.num_hidden_layers)
    with pytest.raises(ValueError, match="request_id changed"):
        tally.add(decode_pb2.KVBlocksMessage(request_id="other"))


def test_checksum_costs_little_per_message():
    """XXH3-64 over a full 4 MiB message: well under a millisecond (measured ~0.08 ms here)."""
    import time

    data = bytes(torch.randint(0, 256, (DEFAULT_MAX_MESSAGE_BYTES,), dtype=torch.uint8).numpy())
    checksum(data)
    start = time.perf_counter()
    for _ in range(20):
        checksum(data)
    assert (time.perf_counter() - start) / 20 < 2e-3


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantized_kv_round_trips_byte_exact_and_names_its_dtype(model_config, kv_dtype):
    """A quantized pool's blocks (uint8 rows: head_dim codes, int8's + the fp32 scale) go as raw bytes: dtype is the KV
    dtype's name, head_dim the model's, the byte count the packed rows'; a decode of that dtype rebuilds them bit
    for bit."""
    from tandem.kernels.kv_quant import quantize

    cache_config = CacheConfig(block_size=4, num_blocks=8, kv_dtype=kv_dtype)
    shape = (model_config.num_hidden_layers, 2, 3, 4, model_config.num_key_value_heads, model_config.head_dim)
    data = quantize(torch.randn(shape), kv_dtype)
    msgs = kv_to_messages("r", KVBlocks(5, data), model_config, max_bytes=100_000, kv_dtype=kv_dtype)
    assert len(msgs) > 1 and {(m.dtype, m.head_dim) for m in msgs} == {(kv_dtype, model_config.head_dim)}
    assert sum(len(m.data) for m in msgs) == data.numel()  # (1 byte per code, 4 per int8 scale)
    assert data.numel() == torch.Size(shape).numel() * (1 if kv_dtype.startswith("fp8") else 68 / 64)
    rebuilt = torch.zeros_like(data)
    for m in msgs:
        kv = kv_from_message(m, model_config, cache_config)
        b = kv.first_block_index - 5
        rebuilt[kv.layer_start : kv.layer_start + kv.data.shape[0], :, b : b + kv.data.shape[2]] = kv.data
    assert torch.equal(rebuilt, data)


def test_quantized_kv_to_a_decode_of_another_kv_dtype_is_refused_naming_dtype(model_config):
    from tandem.kernels.kv_quant import quantize

    shape = (1, 2, 1, 4, model_config.num_key_value_heads, model_config.head_dim)
    msg = kv_to_messages("r", KVBlocks(0, quantize(torch.randn(shape), "fp8_e4m3")), model_config,
                         kv_dtype="fp8_e4m3")[0]
    for other in ("float32", "fp8_e5m2", "int8"):
        with pytest.raises(ValueError, match="dtype is 'fp8_e4m3', this decode instance has '" + other):
            kv_from_message(msg, model_config, CacheConfig(block_size=4, num_blocks=8, kv_dtype=other))


def test_the_checksum_covers_a_quantized_rows_scale(model_config):
    from tandem.kernels.kv_quant import quantize

    shape = (1, 2, 1, 4, model_config.num_key_value_heads, model_config.head_dim)
    msg = kv_to_messages("r", KVBlocks(0, quantize(torch.randn(shape), "int8")), model_config, kv_dtype="int8")[0]
    data = bytearray(msg.data)
    data[model_config.head_dim + 2] ^= 0x01  # a byte of the first row's scale
    msg.data = bytes(data)
    with pytest.raises(ValueError, match="checksum mismatch"):
        kv_from_message(msg, model_config, CacheConfig(block_size=4, num_blocks=8, kv_dtype="int8"))
