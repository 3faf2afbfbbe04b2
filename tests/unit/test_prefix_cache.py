"""The prefix cache of the KV cache manager and the block hashes: exact block ids, hit lengths, eviction order."""
import os
import subprocess
import sys

import pytest

from tandem.shared import block_hash
from tandem.shared.block_hash import HashContract, hash_block_tokens, hash_request_blocks
from tandem.shared.config import SchedulerConfig
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.kv_events import BlockRemoved, BlockStored
from tandem.shared.request import Request, SamplingParams
from tandem.shared.scheduler import Scheduler

BS = 4
CONTRACT = HashContract(BS, "m:abc:fp32", "fp32")


def make_request(request_id, tokens, salt=None):
    return Request(request_id, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def make_manager(num_blocks=8, contract=CONTRACT):
    return KVCacheManager(num_blocks, BS, contract, record_events=True)


def run_prompt(kv, request):
    """Admit as the scheduler does, compute the whole prompt, publish its full blocks."""
    block_ids, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, block_ids)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return block_ids, num_cached


def test_hit_takes_longest_cached_run_and_always_leaves_the_last_token():
    kv = make_manager()
    a = make_request("a", range(1, 11))  # 10 tokens: blocks [1-4] [5-8] + partial
    run_prompt(kv, a)
    assert kv.get_block_table("a") == [0, 1, 2]
    kv.free(a)
    b = make_request("b", list(range(1, 9)) + [99, 98])  # shares 8 tokens = 2 full blocks
    assert run_prompt(kv, b) == ([0, 1], 8)
    c = make_request("c", range(1, 9))  # exactly 2 blocks: the last token must be computed -> 1 block
    assert kv.get_computed_blocks(c) == ([0], 4)


def test_in_use_blocks_are_shared_not_evicted_and_lru_evicts_tails_first():
    kv = make_manager(num_blocks=6)
    a = make_request("a", range(1, 13))  # 3 full blocks
    run_prompt(kv, a)
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53, 54])  # shares 2 blocks with running a
    run_prompt(kv, b)
    assert kv.get_block_table("b")[:2] == [0, 1]
    assert kv.block_pool.blocks[0].ref_cnt == 2
    kv.free(a)  # blocks 0, 1 still used by b; block 2 free but cached
    assert kv.block_pool.get_cached_block(hash_request_blocks(list(range(1, 13)), CONTRACT)[2], (9, 10, 11, 12)) == 2
    # b holds 0, 1, 3, 4: free are 5 (never used) and 2 (cached); new blocks come from the front of the queue
    assert list(kv.block_pool.free_block_queue) == [5, 2]
    d = make_request("d", range(100, 108))
    assert kv.allocate_slots(d, 8)
    assert kv.get_block_table("d") == [5, 2]  # block 2 evicted only once nothing else was free
    assert kv.block_pool.num_evictions == 1
    assert not kv.allocate_slots(make_request("e", range(200, 210)), 10)  # b's blocks are never taken


def test_hash_collision_never_serves_other_tokens(monkeypatch):
    monkeypatch.setattr(block_hash, "_digest", lambda data: b"\0" * 16)  # every block hashes alike
    kv = make_manager()
    run_prompt(kv, make_request("a", range(1, 10)))
    assert kv.get_computed_blocks(make_request("b", range(20, 29))) == ([], 0)


def test_salts_and_contracts_separate_hashes():
    tokens = list(range(1, 9))
    assert hash_request_blocks(tokens, CONTRACT, "t1") != hash_request_blocks(tokens, CONTRACT, "t2")
    assert hash_request_blocks(tokens, CONTRACT, "t1")[1] != hash_request_blocks(tokens, CONTRACT)[1]
    assert hash_request_blocks(tokens, CONTRACT, "")[0] != hash_request_blocks(tokens, CONTRACT)[0]  # set, if empty
    int8 = HashContract(BS, "m:abc:int8-fp32", "fp32")
    assert set(hash_request_blocks(tokens, CONTRACT)).isdisjoint(hash_request_blocks(tokens, int8))
    kv = make_manager()
    run_prompt(kv, make_request("a", range(1, 10), salt="t1"))
    assert kv.get_computed_blocks(make_request("b", range(1, 10), salt="t2")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", range(1, 10), salt="t1"))[1] == 8


def test_hashes_are_the_same_in_processes_with_different_hash_seeds():
    code = ("from tandem.shared.block_hash import HashContract, hash_request_blocks;"
            "print(hash_request_blocks(list(range(40)), HashContract(16, 'm', 'fp32'), 'salt')[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                           capture_output=True, text=True, check=True).stdout for seed in ("0", "1", "12345")}
    assert len(outs) == 1
    assert outs.pop().strip() == hash_request_blocks(list(range(40)), HashContract(16, "m", "fp32"), "salt")[-1].hex()


def test_hash_inputs_are_checked():
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(CONTRACT.root_hash, [-1])
    with pytest.raises(ValueError, match="16 bytes"):
        hash_block_tokens(b"x", [1])


def test_events_record_stores_and_evictions_in_order():
    kv = make_manager(num_blocks=2)
    a = make_request("a", range(1, 9))  # 2 full blocks
    run_prompt(kv, a)
    h = hash_request_blocks(list(range(1, 9)), CONTRACT)
    assert kv.block_pool.take_events() == [BlockStored((h[0], h[1]))]
    kv.free(a)
    assert kv.allocate_slots(make_request("b", range(50, 54)), 4)  # takes block 1 (a's tail), evicting it
    assert kv.block_pool.take_events() == [BlockRemoved((h[1],))]
    assert kv.block_pool.take_events() == []
    assert kv.cached_block_hashes() == [h[0]]


def test_preempted_request_is_recomputed_from_its_cached_prefix():
    s = Scheduler(SchedulerConfig(64, 8), make_manager(num_blocks=4))
    a, b = make_request("a", range(1, 9)), make_request("b", range(20, 28))
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    for r in (a, b):  # both prompts computed and published
        r.num_computed_tokens = 8
        s.kv_cache_manager.cache_full_blocks(r)
        r.output_token_ids = [5]
    out = s.schedule()  # a needs a third block: b is preempted, its blocks stay cached
    assert out.preempted_requests == [b] and b.num_computed_tokens == 0
    s.kv_cache_manager.free(a)
    s.running.remove(a)
    out = s.schedule()  # b comes back: its first block is a hit, the rest (and its output token) computed
    assert b.num_computed_tokens == 4 and out.num_scheduled_tokens == {"b": 5}
    assert b.num_cached_tokens == 0  # counted at its first admission


def complete_step(s: Scheduler, out) -> None:
    """What the engine does after a forward: advance each scheduled request, publish its full blocks."""
    for r in out.scheduled_requests:
        r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
        s.kv_cache_manager.cache_full_blocks(r)


def test_waiting_request_takes_a_prefix_being_computed_from_the_cache_instead_of_recomputing_it():
    s = Scheduler(SchedulerConfig(8, 8), make_manager(num_blocks=16))  # 8 tokens per step: 2 blocks
    shared = list(range(1, 13))  # 3 full blocks
    a, b = make_request("a", shared + [90, 91]), make_request("b", shared + [80, 81, 82])
    c = make_request("c", range(40, 46))  # unrelated: admitted beside a
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()  # a's first two blocks fill the budget; b waits for them
    assert out.num_scheduled_tokens == {"a": 8}
    complete_step(s, out)
    kv = s.kv_cache_manager  # the queue estimate counts none of b's shared prefix: 2 blocks cached, 1 in flight
    assert kv.num_reusable_tokens(b, kv.blocks_in_flight(s.running)) == 12
    assert kv.num_reusable_tokens(b, set()) == 8 and kv.num_reusable_tokens(c, set()) == 0
    out = s.schedule()  # b's next block (a's third) is still in flight; c is not held up behind b
    assert out.num_scheduled_tokens == {"a": 6, "c": 2}
    complete_step(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c": 4, "b": 3} and b.num_cached_tokens == 12  # 3 shared blocks hit
    assert s.kv_cache_manager.get_block_table("b")[:3] == s.kv_cache_manager.get_block_table("a")[:3]


def test_no_wait_with_caching_off_or_for_an_unshared_prefix():
    for contract, shared in ((None, True), (CONTRACT, False)):
        s = Scheduler(SchedulerConfig(64, 8), make_manager(num_blocks=16, contract=contract))
        a = make_request("a", range(1, 13))
        b = make_request("b", range(1, 13) if shared else range(50, 62))
        s.add_request(a)
        s.add_request(b)
        assert s.schedule().num_scheduled_tokens == {"a": 12, "b": 12}


def test_partial_block_is_copied_for_a_request_that_continues_it_and_lost_when_reallocated():
    s = Scheduler(SchedulerConfig(64, 8), make_manager(num_blocks=8))
    kv = s.kv_cache_manager
    a = make_request("a", range(1, 7))  # 6 tokens: a full block and 2 tokens of a partial one
    s.add_request(a)
    complete_step(s, s.schedule())
    a.output_token_ids = [7]
    complete_step(s, s.schedule())  # a decode step computes token 7's KV; a then samples 8 and finishes
    a.output_token_ids = [7, 8]
    assert a.num_computed_tokens == 7
    partial_block = kv.get_block_table("a")[1]
    s.remove_request(a)
    kv.free(a)
    # a beam of a (its prompt + its tokens): block 0 shared, a's partial block (5, 6, 7) copied, 1 token computed
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1} and b.num_cached_tokens == 7
    assert partial_block == 1 and kv.get_block_table("b") == [0, 2]  # a's block 0; a fresh block for the copy
    assert out.block_copies == [(1, 2)]
    assert s.schedule().block_copies == []  # taken once
    # diverging inside the partial block: only the common tokens are copied
    c = make_request("c", [1, 2, 3, 4, 5, 99, 98])
    assert kv.get_partial_block(c, 1) == (partial_block, 1)
    # another salt, another prefix, or a shorter request (its last token is always computed): no partial hit
    assert kv.get_partial_block(make_request("d", [1, 2, 3, 4, 5, 6, 7], salt="x"), 1) is None
    assert kv.get_partial_block(make_request("e", [9, 2, 3, 4, 5, 6, 7]), 1) is None
    assert kv.get_partial_block(make_request("f", [1, 2, 3, 4, 5]), 1) is None
    # once the block is allocated again its KV is gone: no entry
    assert kv.allocate_slots(make_request("g", range(50, 50 + 4 * kv.num_free_blocks)), 4 * kv.num_free_blocks)
    assert kv.get_partial_block(c, 1) is None and 1 not in kv.block_pool.continuation_of


def test_a_cached_full_block_serves_a_hit_inside_it_even_while_in_use():
    s = Scheduler(SchedulerConfig(64, 8), make_manager(num_blocks=8))
    kv = s.kv_cache_manager
    a = make_request("a", range(1, 11))  # blocks [1-4] [5-8] (both cached after the step) and [9, 10]
    s.add_request(a)
    complete_step(s, s.schedule())
    # b shares block 0 and 3 tokens of a's block 1, which a (still running) holds: a copy of it, 7 tokens cached
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 99, 98])
    s.add_request(b)
    out = s.schedule()
    assert b.num_cached_tokens == 7 and out.num_scheduled_tokens["b"] == 2
    assert kv.get_block_table("b") == [0, 3, 4] and out.block_copies == [(1, 3)]
    assert kv.block_pool.blocks[1].ref_cnt == 1  # only a holds block 1: b has its own copy
    # a block is a continuation only while cached: evicted, it serves no hit inside it
    s.remove_request(a), s.remove_request(b)
    kv.free(a), kv.free(b)
    kv.allocate_slots(make_request("g", range(50, 50 + 4 * kv.num_free_blocks)), 4 * kv.num_free_blocks)
    assert kv.block_pool.continuations == {} and kv.block_pool.cached_blocks == {}


def test_partial_hit_in_the_first_block_and_with_caching_off():
    for contract in (CONTRACT, None):
        s = Scheduler(SchedulerConfig(64, 8), make_manager(num_blocks=8, contract=contract))
        a = make_request("a", [1, 2, 3])
        s.add_request(a)
        complete_step(s, s.schedule())
        s.remove_request(a)
        s.kv_cache_manager.free(a)
        b = make_request("b", [1, 2, 3, 4])
        s.add_request(b)
        out = s.schedule()
        assert out.num_scheduled_tokens == {"b": 1 if contract else 4}
        assert len(out.block_copies) == (1 if contract else 0)
