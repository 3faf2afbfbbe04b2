"""KV pool sizing: --memory-utilization against the memory free after the weights, --max-model-len, and the
flags' refusals."""
from dataclasses import replace

import psutil
import pytest
import torch

from tandem.shared.config import CacheConfig
from tandem.shared.engine_args import EngineArgs
from tandem.shared.model import LlamaForCausalLM
from tandem.shared.model_files import default_model_dir
from tandem.shared.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_config():
    config = EngineArgs().create_model_config(default_model_dir())
    return replace(config, num_hidden_layers=2)  # a 2-layer cut: the sizing only needs the KV geometry


def make_runner(model_config, cache_config) -> ModelRunner:
    with torch.device("meta"):  # no weights: the pool is what is measured
        model = LlamaForCausalLM(model_config)
    return ModelRunner(model_config, cache_config, model=model)


def test_block_bytes_is_layers_x_k_and_v_x_slots_x_heads_x_dim_x_itemsize(model_config):
    cache = CacheConfig(16, 8, "float32")
    assert cache.block_bytes(model_config) == 2 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 3 KV heads of 64, fp32


def test_memory_utilization_sizes_the_pool_from_the_memory_free_after_the_weights(model_config, monkeypatch):
    free = 10 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": free})())
    runner = make_runner(model_config, CacheConfig(16, None, "float32", memory_utilization=0.01))
    expected = int(free * 0.01) // (2 * 2 * 16 * 3 * 64 * 4)
    assert runner.cache_config.num_blocks == expected
    assert runner.kv_caches.shape[2] == expected


def test_memory_too_small_for_one_block_is_refused(model_config, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 1000})())
    with pytest.raises(ValueError, match="holds no KV block"):
        make_runner(model_config, CacheConfig(16, None, memory_utilization=0.5))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_blocks": 8, "memory_utilization": 0.5}, "give one"),
    ({"max_model_len": 10**6}, "exceeds the model's context"),
])
def test_engine_args_refuse_conflicting_or_impossible_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_configs("decode", default_model_dir())


def test_cache_config_needs_exactly_one_size():
    with pytest.raises(ValueError):
        CacheConfig(16, None)
    with pytest.raises(ValueError):
        CacheConfig(16, 8, memory_utilization=0.5)
    with pytest.raises(ValueError):
        CacheConfig(16, None, memory_utilization=1.5)


def test_max_model_len_cuts_the_context_of_gateway_and_engines_alike():
    model, cache, _ = EngineArgs(max_model_len=512).create_configs("prefill", default_model_dir())
    assert model.max_model_len == 512 and cache.num_blocks == 1024
    assert EngineArgs(max_model_len=512).create_model_config(default_model_dir()) == model
