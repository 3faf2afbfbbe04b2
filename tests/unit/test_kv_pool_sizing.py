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


@pytest.mark.parametrize("kv_dtype, row, ratio", [("fp8_e4m3", 64, 4.0), ("fp8_e5m2", 64, 4.0), ("int8", 68, 3.76)])
def test_a_quantized_pool_counts_its_packed_rows(model_config, monkeypatch, kv_dtype, row, ratio):
    """An fp8 row is head_dim code bytes (64 against fp32's 256 for head_dim 64: 4x the blocks); an int8 row adds
    its 4-byte fp32 scale (68: 256 / 68 = 3.76x the blocks)."""
    assert CacheConfig(16, 8, kv_dtype).block_bytes(model_config) == 2 * 2 * 16 * 3 * row
    free = 10 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": free})())
    fp32 = make_runner(model_config, CacheConfig(16, None, "float32", memory_utilization=0.01))
    quantized = make_runner(model_config, CacheConfig(16, None, kv_dtype, memory_utilization=0.01))
    assert quantized.kv_caches.dtype == torch.uint8 and quantized.kv_caches.shape[-1] == row
    assert quantized.cache_config.num_blocks == int(free * 0.01) // (2 * 2 * 16 * 3 * row)
    assert quantized.cache_config.num_blocks / fp32.cache_config.num_blocks == pytest.approx(ratio, abs=0.01)


def test_kv_dtype_flags_and_the_hash_contract(monkeypatch):
    """--kv-dtype takes the quantized names (and --kv-cache-dtype, vLLM's name, is the same flag); each KV dtype
    gives its own prefix-cache contract, so instances of different KV dtypes never share a block."""
    import argparse

    from tandem.services.flags import add_engine_args
    from tandem.shared.block_hash import HashContract

    parser = argparse.ArgumentParser()
    add_engine_args(parser, tier="decode")
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_dtype == "fp8_e4m3"
    assert parser.parse_args(["--kv-dtype", "int8"]).kv_dtype == "int8"
    _, cache, _ = EngineArgs(kv_dtype="fp8_e5m2").create_configs("decode", default_model_dir())
    assert cache.kv_dtype == "fp8_e5m2" and cache.kv_quant == "fp8_e5m2"
    roots = {HashContract(16, "m:abc:fp32", kv).root_hash for kv in ("float32", "fp8_e4m3", "fp8_e5m2", "int8")}
    assert len(roots) == 4
    with pytest.raises(ValueError, match="unknown KV dtype 'fp8'"):
        CacheConfig(16, 8, "fp8")
