"""Prefix caching in one engine against HF transformers fp32 greedy: warm output equals cold output token for token
at and around block boundaries, with requests sharing a prefix in flight beside unrelated ones, the same prompt
again and again, prompts extending a request that ended on a stop token, and under forced eviction."""
import pytest

from tandem.shared.config import CacheConfig, KVTierConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tests.prompts import LONG_TEXT

BS = 16
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def base_ids(tokenizer):
    return tokenizer(LONG_TEXT, add_special_tokens=False).input_ids  # about 300 tokens


def make_engine(model_config, num_blocks=256, budget=64):
    return LLMEngine(model_config, CacheConfig(BS, num_blocks), SchedulerConfig(budget, 8))


def run(engine, prompts: dict[str, list[int]], n=NUM_TOKENS, stop_token_ids=()) -> dict[str, list[int]]:
    requests = {}
    for rid, ids in prompts.items():
        params = SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
        requests[rid] = Request(rid, ids, params)
        engine.add_request(requests[rid])
    outs = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    run.cached = {rid: r.num_cached_tokens for rid, r in requests.items()}
    run.tiers = {rid: r.num_tier_cached_tokens for rid, r in requests.items()}
    return outs


def test_warm_equals_cold_at_and_around_block_boundaries(model_config, base_ids, hf_greedy):
    engine = make_engine(model_config)
    tail = [1000, 2000, 3000]
    assert run(engine, {"cold": base_ids[:100]})["cold"] == hf_greedy(base_ids[:100], NUM_TOKENS)
    for cut in (31, 32, 33, 47, 48, 49, 64, 99):  # shares cut tokens with the cold prompt, then differs
        ids = base_ids[:cut] + tail
        assert run(engine, {"warm": ids})["warm"] == hf_greedy(ids, NUM_TOKENS), cut
        # every shared token is reused: the full blocks, and a copy of the cold prompt's block holding the rest
        assert run.cached["warm"] == cut, cut
    assert engine.num_free_blocks == 256


def test_shared_prefix_in_flight_beside_unrelated_requests(model_config, base_ids, hf_greedy, hf_references):
    engine = make_engine(model_config)
    prefix = base_ids[:80]
    wave = {f"s{i}": prefix + [500 + i] * (i + 1) for i in range(4)}
    wave.update({name: hf_references[name][0] for name in ("capital", "raw_story")})
    for _ in range(2):  # the second wave finds the first one's blocks (the first shares within itself as it runs)
        outs = run(engine, wave)
        for rid, ids in wave.items():
            assert outs[rid] == hf_greedy(ids, NUM_TOKENS), rid
    # the second wave finds the first one's blocks, the last partly filled one too: all but the last token
    assert all(run.cached[f"s{i}"] == 80 + i for i in range(4))
    assert engine.stats().prefix_cache_hits > 0


def test_same_prompt_again_and_again(model_config, base_ids, hf_greedy):
    engine = make_engine(model_config)
    ids = base_ids[:70]
    for i in range(4):
        assert run(engine, {f"r{i}": ids})[f"r{i}"] == hf_greedy(ids, NUM_TOKENS)
        assert run.cached[f"r{i}"] == (0 if i == 0 else 69)  # 4 full blocks and 5 tokens of the next one


def test_prompt_extending_a_request_that_ended_on_a_stop_token(model_config, base_ids, hf_greedy):
    """The next chat turn: the earlier request's prompt and output (KV of its output tokens too) are reused."""
    engine = make_engine(model_config)
    ids = base_ids[:40]
    full = hf_greedy(ids, 30)
    stop = full[20]
    out = run(engine, {"turn1": ids}, n=30, stop_token_ids=[stop])["turn1"]
    assert out == full[: full.index(stop) + 1]
    turn2 = ids + out + [42, 43, 44]
    assert run(engine, {"turn2": turn2})["turn2"] == hf_greedy(turn2, NUM_TOKENS)
    assert run.cached["turn2"] >= (len(ids) + len(out) - 1) // BS * BS  # blocks holding output tokens reused


def test_forced_eviction_keeps_outputs_exact(model_config, base_ids, hf_greedy):
    engine = make_engine(model_config, num_blocks=14)  # 224 slots: a few prompts' worth
    prompts = [base_ids[i * 40 : i * 40 + 90] for i in range(4)] + [base_ids[:90]]
    for i, ids in enumerate(prompts):
        assert run(engine, {f"r{i}": ids})[f"r{i}"] == hf_greedy(ids, NUM_TOKENS), i
    assert engine.kv_cache_manager.block_pool.num_evictions > 0
    assert run.cached["r4"] < 80  # the first prompt's blocks were (partly) evicted
    assert engine.num_free_blocks == 14


def test_tier_hits_and_a_restart_keep_outputs_exact_and_the_prefix_index_true(model_config, base_ids, hf_greedy,
                                                                              redis_server, tmp_path):
    """A pool of 14 blocks evicts prompts' blocks to a host tier of 8 blocks, whose evictions go to disk (tails
    first): prompt 1 comes back from the host tier, prompt 0 from disk, then a new engine on the same directory (a
    restarted instance) serves prompt 0 from its disk; every output equals HF's. The engine publishes its KV events
    to a real Redis: after every step its entries there are exactly its cached_block_tiers(), and tiered_prefixes
    counts each prompt's run at the fastest tier holding each block (the restart's first batch publishes the disk
    blocks of the new incarnation)."""
    import asyncio

    from tandem.shared.block_hash import hash_request_blocks
    from tandem.shared.cluster_state.prefix_index import KVEventPublisher, PrefixIndex, _suffix
    from tandem.shared.kv_events import KV_TIERS

    block_bytes = CacheConfig(BS, 14).block_bytes(model_config)
    tiers = KVTierConfig(8 * block_bytes, str(tmp_path / "kv"), 64 * block_bytes)
    prompts = [base_ids[i * 40 : i * 40 + 90] for i in range(4)]  # (no block in common)

    async def body():
        def start(incarnation, model=None):
            engine = LLMEngine(model_config, CacheConfig(BS, 14), SchedulerConfig(64, 8), model=model,
                               kv_tier_config=tiers, kv_events=True)  # fmt: skip
            return engine, KVEventPublisher(redis_server.url, "prefill-1", incarnation, engine.hash_contract,
                                            _no_rebuild)  # fmt: skip

        async def check(engine, publisher):
            batch = engine.take_kv_events()
            if batch is not None:
                await publisher.publish(batch)
            held = engine.kv_cache_manager.cached_block_tiers()
            members = await index.redis.smembers(f"{index.ns}:inc:prefill-1:{publisher.incarnation}:blocks")
            assert {m.decode() for m in members} == {h.hex() + _suffix(t) for h, t in held}
            tiers_of = {}
            for h, t in held:
                tiers_of.setdefault(h, set()).add(t)
            for ids in prompts:
                expected = dict.fromkeys(KV_TIERS, 0)
                for h in hash_request_blocks(ids[:80], engine.hash_contract):
                    if h not in tiers_of:
                        break
                    expected[min(tiers_of[h], key=KV_TIERS.index)] += 1
                live = {"prefill-1": publisher.incarnation}
                assert (await index.tiered_prefixes(hash_request_blocks(ids[:80], engine.hash_contract), live))[
                    "prefill-1"] == expected  # fmt: skip

        engine, publisher = start("inc-a")
        index = PrefixIndex(redis_server.url, engine.hash_contract)
        for i, ids in enumerate(prompts):  # each evicts the one before it: pool -> host -> disk
            assert run(engine, {f"r{i}": ids})[f"r{i}"] == hf_greedy(ids, NUM_TOKENS), i
            await check(engine, publisher)
        for i in (1, 0):  # loaded back into the pool from the host and the disk tier
            assert run(engine, {f"again{i}": prompts[i]})[f"again{i}"] == hf_greedy(prompts[i], NUM_TOKENS), i
            assert run.cached[f"again{i}"] >= 80, i  # its 5 full prompt blocks (the last token is computed)
            assert run.tiers[f"again{i}"] == {("host" if i else "disk"): 80}, i  # (what Usage.cached_tokens_* say)
            await check(engine, publisher)
        stats = engine.stats()
        assert stats.kv_tier_hits == {"host": 5, "disk": 5} and stats.kv_tier_load_failures == {"host": 0, "disk": 0}
        assert stats.kv_tier_load_s.keys() == {"host", "disk"}
        engine.close()  # (a clean stop: the pool's and host tier's blocks go to disk, and the writes finish)
        await publisher.close()
        engine, publisher = start("inc-b", model=engine.model_runner.model)  # restarted on the warm disk tier
        await check(engine, publisher)
        assert engine.stats().kv_tier_blocks["disk"] > 0
        assert await index.cleanup({"prefill-1": "inc-b"}) == 1
        assert run(engine, {"warm": prompts[0]})["warm"] == hf_greedy(prompts[0], NUM_TOKENS)
        assert run.cached["warm"] >= 80 and engine.stats().kv_tier_hits == {"host": 0, "disk": 5}
        await check(engine, publisher)
        engine.close()
        await publisher.close(), await index.close()

    asyncio.run(body())


def test_kv_tiers_without_prefix_caching_are_refused_by_name(model_config, tmp_path):
    with pytest.raises(ValueError, match="need prefix caching"):
        LLMEngine(model_config, CacheConfig(BS, 14, enable_prefix_caching=False), SchedulerConfig(64, 8),
                  kv_tier_config=KVTierConfig(1 << 30))


async def _no_rebuild():
    raise AssertionError("no rebuild expected: every batch is published in order")
