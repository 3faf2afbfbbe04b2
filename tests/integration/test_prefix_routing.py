"""Prefix caching across a real cluster (real Redis, two prefill instances, one decode), fp32 greedy against HF:
prompts sharing a prefix go to the prefill that holds it (also after that prefill is killed and restarted), a
second chat turn ships only the blocks the decode lacks, a short uncached suffix is computed on the decode with
no prefill call, and routing survives Redis stopping (load-only) and resumes when it returns.

The tests that always prefill share one cluster (each with a cache salt of its own, so none sees another's cached
prefix; counters are compared with the test's own start); the one that kills and restarts a prefill runs last."""
import time

import pytest

from tandem.services.client import generate, make_request
from tests.integration.helpers import load
from tests.prompts import LONG_TEXT

NUM_TOKENS = 10


def start(model_dir, gateway_args):
    from tandem.services.launcher import LocalCluster

    engine = ["--num-blocks", "256", "--threads", "1"]
    return LocalCluster(str(model_dir), num_prefill=2, num_decode=1, prefill_args=engine, decode_args=engine,
                        gateway_args=gateway_args)  # fmt: skip (started by `with`)


@pytest.fixture(scope="module")
def routed_cluster(model_dir):
    """Two prefills and one decode; --local-prefill-tokens 0: every prompt goes to a prefill, so routing is
    visible."""
    with start(model_dir, ["--local-prefill-tokens", "0"]) as cluster:
        yield cluster


def ask(cluster, text, tokenizer, salt=None):
    out = generate(cluster.gateway_address, make_request(text, raw=True, max_tokens=NUM_TOKENS, temperature=0.0,
                                                         cache_salt=salt), timeout=300)  # fmt: skip
    return out, tokenizer(text, add_special_tokens=False).input_ids


def loads(cluster):
    return {name: load(address) for name, address in cluster.addresses.items()}


def test_shared_prefixes_go_to_the_prefill_holding_them(routed_cluster, tokenizer, hf_greedy):
    cluster, salt = routed_cluster, "shared-prefixes"
    before = loads(cluster)
    base = LONG_TEXT[:900]
    out, ids = ask(cluster, base + " First question.", tokenizer, salt)
    assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
    holder = max(("prefill0", "prefill1"),
                 key=lambda n: loads(cluster)[n].prefix_cache_queries - before[n].prefix_cache_queries)
    other = "prefill1" if holder == "prefill0" else "prefill0"
    time.sleep(1.5)  # the heartbeat and the index catch up
    for i in range(3):
        out, ids = ask(cluster, base + f" Question number {i}?", tokenizer, salt)
        assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
        assert out.cached_tokens >= len(tokenizer(base).input_ids) // 16 * 16 - 16
    now = loads(cluster)
    assert now[holder].prefix_cache_hits > before[holder].prefix_cache_hits, (before, now)
    assert now[other].prefix_cache_queries == before[other].prefix_cache_queries, (before, now)
    # a request with another salt shares nothing, so it is routed on load alone
    out, ids = ask(cluster, base + " First question.", tokenizer, salt="tenant-b")
    assert out.token_ids == hf_greedy(ids, NUM_TOKENS) and out.cached_tokens == 0


# (.ci/run's heavy pass: a cluster of its own, 20 s; make test ships only the blocks a decode lacks through a cluster
# in test_tensor_parallel_pd.py, and test_router.py places a short uncached suffix on the decode)
@pytest.mark.heavy
def test_second_turn_ships_fewer_blocks_and_short_suffix_skips_prefill(model_dir, tokenizer, hf_greedy):
    with start(model_dir, []) as cluster:
        turn1 = LONG_TEXT[:600]
        out, ids = ask(cluster, turn1, tokenizer)
        assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
        first = loads(cluster)
        shipped_first = first["decode0"].num_blocks_imported
        time.sleep(1.5)
        # a long new part: the prefill is called but ships only the blocks the decode lacks
        turn2 = turn1 + out.text + LONG_TEXT[600:1200]
        out2, ids2 = ask(cluster, turn2, tokenizer)
        assert out2.token_ids == hf_greedy(ids2, NUM_TOKENS)
        second = loads(cluster)
        shipped_second = second["decode0"].num_blocks_imported - shipped_first
        assert 0 < shipped_second < -(-len(ids2) // 16) - len(ids) // 16 + 2, (shipped_first, shipped_second)
        time.sleep(1.5)
        # a short new part: computed on the decode itself, no prefill call, no transfer
        turn3 = turn2 + out2.text + " Thanks!"
        out3, ids3 = ask(cluster, turn3, tokenizer)
        assert out3.token_ids == hf_greedy(ids3, NUM_TOKENS)
        third = loads(cluster)
        assert third["decode0"].num_blocks_imported == second["decode0"].num_blocks_imported
        for name in ("prefill0", "prefill1"):
            assert third[name].prefix_cache_queries == second[name].prefix_cache_queries, name
        assert out3.cached_tokens > 0


def test_redis_down_routes_on_load_and_recovers(routed_cluster, tokenizer, hf_greedy):
    import os
    import signal

    cluster, salt = routed_cluster, "redis-down"
    base = LONG_TEXT[:700]
    out, ids = ask(cluster, base + " One.", tokenizer, salt)
    redis = cluster.processes["redis"]
    os.kill(redis.pid, signal.SIGSTOP)  # frozen: every call times out
    try:
        out, ids = ask(cluster, base + " Two.", tokenizer, salt)
        assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    time.sleep(2)
    out, ids = ask(cluster, base + " Three.", tokenizer, salt)
    assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
    assert out.cached_tokens > 0


@pytest.mark.heavy  # (.ci/run's heavy pass: 14 s; test_faults.py and test_deployment.py restart instances too)
def test_killed_then_restarted_prefill_leaves_routing_correct(routed_cluster, tokenizer, hf_greedy):
    cluster, salt = routed_cluster, "killed-prefill"
    before = loads(cluster)
    base = LONG_TEXT[:900]
    out, ids = ask(cluster, base + " First question.", tokenizer, salt)
    holder = max(("prefill0", "prefill1"),
                 key=lambda n: loads(cluster)[n].prefix_cache_queries - before[n].prefix_cache_queries)
    other = "prefill1" if holder == "prefill0" else "prefill0"
    time.sleep(1.5)
    # killed: still registered until its TTL, its index entries still claim the prefix; the request routed
    # there is placed again on the other prefill
    placed_again = (cluster.log_dir / "gateway.log").read_text().count("placing it again")
    cluster.kill(holder)
    out, ids = ask(cluster, base + " Second question.", tokenizer, salt)
    assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
    assert (cluster.log_dir / "gateway.log").read_text().count("placing it again") > placed_again
    assert load(cluster.addresses[other]).prefix_cache_queries > before[other].prefix_cache_queries
    # restarted: a new incarnation with an empty cache; the dead one's entries are never trusted again
    cluster.restart(holder)
    time.sleep(1.5)
    out, ids = ask(cluster, base + " Third question.", tokenizer, salt)
    assert out.token_ids == hf_greedy(ids, NUM_TOKENS)
    assert out.cached_tokens > 0  # the other prefill, which holds the prefix now
    assert load(cluster.addresses[holder]).prefix_cache_queries == 0
