import pytest
import torch

from services.kv_wire import kv_from_message, kv_to_messages
from shared.config import CacheConfig
from shared.engine import KVBlocks


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
