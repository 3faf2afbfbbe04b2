"""The engine in one process against HF transformers: preemption under a tiny pool, KV export/import between
two engines (the tiers' path without gRPC), abort frees blocks."""
import pytest
import torch

from tandem.shared.config import CacheConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.kv_connector import KVBlocks
from tandem.shared.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.integration.conftest import NUM_REFERENCE_TOKENS


def run_to_end(engine, requests):
    outs = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return outs


def greedy(n=NUM_REFERENCE_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0.0)


def prefill_kv(model_config, request_id: str, ids: list[int]):
    """A prompt's KV blocks (block size 8) and first greedy token from an engine of its own, as a prefill sends."""
    prefill = LLMEngine(model_config, CacheConfig(8, 64), SchedulerConfig(256, 8), export_kv=True)
    prefill.add_request(Request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0)))
    kv, first = [], None
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            kv += [o.kv] if o.kv is not None else []
            first = o.new_token_ids[0] if o.new_token_ids else first
    return kv, first


def test_preemption_under_a_tiny_pool_keeps_tokens_exact(model_config, hf_references):
    names = ["capital", "haiku", "raw_story", "raw_chinese"]
    engine = LLMEngine(model_config, CacheConfig(block_size=8, num_blocks=24), SchedulerConfig(32, 8))
    requests = [Request(n, hf_references[n][0], greedy()) for n in names]
    for r in requests:
        engine.add_request(r)
    preempted = 0
    outs = {n: [] for n in names}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        preempted += sum(r.num_computed_tokens == 0 and r.output_token_ids != [] for r in requests)
    assert preempted > 0, "the pool was meant to be too small for all four at once"
    for n in names:
        assert outs[n] == hf_references[n][1], n
    assert engine.num_free_blocks == 24


def test_kv_export_then_import_into_a_second_engine(model_config, hf_references):
    ids, expected = hf_references["long_summary"]
    prefill = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(100, 8), export_kv=True)
    decode = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    prefill.add_request(Request("r", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    decode.reserve(Request("r", ids, greedy()))
    first = None
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            if o.kv is not None:
                decode.import_kv("r", o.kv)
            if o.new_token_ids:
                first = o.new_token_ids[0]
    assert prefill.num_free_blocks == 64
    assert decode.finish_kv_import("r", first) is None
    outs = run_to_end(decode, [decode.requests["r"]])
    assert [first] + outs["r"] == expected


def test_abort_frees_blocks_and_rejects_oversized_requests(model_config):
    engine = LLMEngine(model_config, CacheConfig(16, 8), SchedulerConfig(64, 8))
    engine.add_request(Request("a", list(range(1, 50)), greedy(10)))
    engine.step()
    assert engine.num_free_blocks < 8
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert engine.num_free_blocks == 8 and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="holds"):
        engine.add_request(Request("b", list(range(1, 100)), greedy(100)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Request("c", [], greedy()))


def test_eos_from_prefill_finishes_on_import(model_config):
    engine = LLMEngine(model_config, CacheConfig(16, 8), SchedulerConfig(64, 8))
    engine.reserve(Request("r", [1, 2, 3], greedy()))
    engine.import_kv("r", KVBlocks(0, torch.zeros_like(engine.model_runner.kv_caches[:, :, :1])))
    out = engine.finish_kv_import("r", model_config.eos_token_ids[0])
    assert out.finish_reason == FinishReason.STOP and engine.num_free_blocks == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kernel path")
def test_cuda_kernels_give_the_cpu_greedy_tokens(model_config, hf_references):
    names = ["capital", "long_summary", "raw_chinese"]
    outs = {}
    for device in ("cpu", "cuda"):
        engine = LLMEngine(model_config, CacheConfig(16, 256), SchedulerConfig(64, 8), device)
        requests = [Request(n, hf_references[n][0], greedy()) for n in names]
        for r in requests:
            engine.add_request(r)
        outs[device] = run_to_end(engine, requests)
    assert outs["cuda"] == outs["cpu"]


def test_reservation_refusals_leave_nothing_behind(model_config):
    engine = LLMEngine(model_config, CacheConfig(16, 4), SchedulerConfig(64, 8))
    engine.reserve(Request("a", list(range(1, 49)), greedy(8)))  # 3 of 4 blocks
    with pytest.raises(MemoryError):
        engine.reserve(Request("b", list(range(1, 33)), greedy(8)))
    assert "b" not in engine.kv_cache_manager.block_tables and "b" not in engine.requests
    with pytest.raises(ValueError, match="vocabulary"):
        engine.finish_kv_import("a", model_config.vocab_size)
    assert engine.abort_request("a") and engine.num_free_blocks == 4


def test_weight_dtype_is_chosen_and_named_in_the_model_id(model_dir, model_config, hf_references):
    from tandem.shared.config import ModelConfig

    config = ModelConfig.from_dir(model_dir, dtype="bfloat16")
    assert config.weight_format == "bf16" and config.model_id != model_config.model_id
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    assert {p.dtype for p in engine.model_runner.model.parameters()} == {torch.bfloat16}
    ids, expected = hf_references["capital"]
    request = Request("r", ids, greedy(4))
    engine.add_request(request)
    outs = run_to_end(engine, [request])
    assert len(outs["r"]) == 4 and outs["r"][0] == expected[0]  # bf16 rounding may change later tokens
    assert engine.num_free_blocks == 64


def test_priority_goes_first_and_a_reservation_preempts_lower_priority(model_config, hf_references):
    """On a decode: a high-priority request's reserve() preempts the newest low-priority running request when
    the pool is full; priorities then order admission; every output still equals HF (preempted ones are
    recomputed), and the high-priority request finishes first."""
    names = ["haiku", "raw_story", "raw_chinese"]
    engine = LLMEngine(model_config, CacheConfig(block_size=8, num_blocks=12), SchedulerConfig(32, 8))
    low = [Request(n, hf_references[n][0], greedy(), priority=5) for n in names[:2]]
    for r in low:
        engine.add_request(r)
    outs = {n: [] for n in names}
    for _ in range(8):  # the low-priority pair prefills and decodes, filling most of the pool
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    ids, expected = hf_references["capital"]
    kv, first = prefill_kv(model_config, "capital", ids)
    assert engine.num_free_blocks * 8 < len(ids), "the pool was meant to be too full for the prompt"
    engine.reserve(Request("capital", ids, greedy(), priority=0, cache_salt="no prefix hit"))
    assert low[1].status == RequestStatus.WAITING and low[1].num_computed_tokens == 0  # the newest low one
    for blocks in kv:
        engine.import_kv("capital", blocks)
    assert engine.finish_kv_import("capital", first) is None
    engine.add_request(Request(names[2], hf_references[names[2]][0], greedy(), priority=1))
    finished = []
    outs["capital"] = [first]
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            finished += [o.request_id] if o.finished else []
    assert finished[0] == "capital" and finished.index(names[2]) < finished.index(names[1])
    for n in names + ["capital"]:
        assert outs[n] == hf_references[n][1], n
    assert engine.num_free_blocks == 12


def test_a_reservation_waits_for_lower_priority_blocks_still_waiting_for_kv(model_config, hf_references):
    """Priority inversion on a decode: the pool is held by a low-priority request still waiting for its KV (not
    preemptible yet). A high-priority reserve() waits instead of failing (NoCapacityError room_soon; AsyncEngine
    parks it), and gets its blocks as soon as the low one decodes (it is preempted, recomputed later and still
    equals HF); an equal-priority reserve() fails at once, so the gateway can try another decode."""
    import asyncio

    from tandem.shared.async_engine import AsyncEngine
    from tandem.shared.errors import NoCapacityError

    ids, expected = hf_references["raw_story"]
    engine = LLMEngine(model_config, CacheConfig(block_size=8, num_blocks=3), SchedulerConfig(64, 8))
    kv, first = prefill_kv(model_config, "low", ids)
    assert engine.kv_cache_manager.num_blocks_for(len(ids)) == 2, "each prompt was meant to need most of the pool"

    async def scenario():
        async_engine = AsyncEngine(engine, asyncio.get_running_loop())
        try:
            low_stream = await async_engine.reserve(Request("low", ids, greedy(8), priority=5))
            with pytest.raises(NoCapacityError) as refused:
                await async_engine.reserve(Request("equal", ids, greedy(8), priority=5))
            assert not refused.value.room_soon
            high = asyncio.create_task(async_engine.reserve(Request("high", ids, greedy(8), priority=0, cache_salt="no prefix hit")))
            await asyncio.sleep(1.0)
            assert not high.done(), "the high-priority reservation should wait for the low one's blocks"
            for blocks in kv:
                await async_engine.import_kv("low", blocks)
            await async_engine.finish_kv_import("low", first)  # decoding now: preemptible
            await asyncio.wait_for(high, 30)
            assert engine.requests["low"].status == RequestStatus.WAITING  # preempted, recomputed later
            async_engine.abort("high")
            low = [first]
            while (out := await asyncio.wait_for(low_stream.get(), 120)) is not None:
                low += out.new_token_ids
            return low
        finally:
            async_engine.stop()

    assert asyncio.run(scenario()) == expected[:8]
    assert engine.num_free_blocks == 3
