import pytest

from tandem.shared.kv_cache_manager import BlockPool, KVCacheManager
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
