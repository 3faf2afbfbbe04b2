import pytest

from tandem.shared.block_pool import BlockPool
from tandem.shared.kv_cache_manager import KVCacheManager
from tests.unit.factories import make_request


def test_block_pool_allocates_in_order_and_recycles_freed_blocks_last():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([0])
    assert pool.allocate(3) == [2, 3, 0]
    assert pool.num_free_blocks == 0


def test_block_pool_refuses_more_than_free_without_taking_any():
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_allocate_slots_grows_block_table_by_block_size():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(num_prompt_tokens=6)
    assert kv.allocate_slots(req, 6)
    assert kv.get_block_table("r0") == [0, 1]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2)  # slots 6, 7 fit in block 1
    assert kv.get_block_table("r0") == [0, 1]
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)
    assert kv.get_block_table("r0") == [0, 1, 2]


def test_allocate_slots_fails_cleanly_when_full_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1 and kv.get_block_table("b") == []
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 3


def test_blocks_wholly_before_the_sliding_window_are_freed_once_and_stay_cached():
    from tandem.shared.block_hash import HashContract

    kv = KVCacheManager(num_blocks=8, block_size=4, hash_contract=HashContract(4, "m", "float32"), sliding_window=6)
    req = make_request(num_prompt_tokens=13)
    assert kv.allocate_slots(req, 13)
    req.num_computed_tokens = 13
    kv.cache_full_blocks(req)
    # the next query (position 13) sees positions 8..13: blocks 0 and 1 (positions 0..7) are never read again
    assert kv.num_blocks_before_window(13) == 2 and kv.num_blocks_before_window(5) == 0
    kv.free_out_of_window_blocks(req)
    assert kv.get_block_table("r0") == [None, None, 2, 3] and kv.num_free_blocks == 6
    kv.free_out_of_window_blocks(req)  # (again: nothing more to free)
    assert kv.num_free_blocks == 6
    kv.free(req)  # frees the rest, not the freed two again
    assert kv.num_free_blocks == 8
    again = make_request("again", num_prompt_tokens=13)  # the freed blocks kept their hashes: still a prefix hit
    assert kv.get_computed_blocks(again) == ([0, 1, 2], 12)


def test_without_a_window_no_block_is_freed_early():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(num_prompt_tokens=13)
    assert kv.allocate_slots(req, 13)
    req.num_computed_tokens = 13
    kv.free_out_of_window_blocks(req)
    assert kv.get_block_table("r0") == [0, 1, 2, 3]
