"""KVConnector over a real KVCacheManager and Scheduler and a stand-in pool tensor: reserve holds exact blocks (or
preempts, or refuses), import_kv writes at the reserved block ids and never over cached ones, finish_kv_import
refuses a truncated transfer, save_kv copies each step's filled blocks once."""
from types import SimpleNamespace

import pytest
import torch

from tandem.shared.block_hash import HashContract
from tandem.shared.config import ModelConfig, SchedulerConfig
from tandem.shared.errors import InvalidRequestError, NoCapacityError
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.kv_connector import KVBlocks, KVConnector
from tandem.shared.request import RequestStatus
from tandem.shared.scheduler import Scheduler
from tests.unit.factories import make_request

NUM_LAYERS, BLOCK_SIZE, VOCAB_SIZE = 2, 4, 100


def make_kv_connector(num_blocks=8, is_kv_producer=False, prefix_caching=False,
                      max_num_batched_tokens=16) -> KVConnector:
    """A connector over a pool [NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, 1 kv head, head_dim 2] of zeros."""
    model_config = ModelConfig("m", "m", VOCAB_SIZE, 8, 16, NUM_LAYERS, 1, 1, 2, 1e-5, 1e4, 64, False, (0,), "d")
    contract = HashContract(BLOCK_SIZE, model_config.model_id, "fp32") if prefix_caching else None
    kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, contract)
    model_runner = SimpleNamespace(device=torch.device("cpu"),
                                   kv_caches=torch.zeros(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, 1, 2))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens, 8), kv_cache_manager)
    return KVConnector(model_config, model_runner, kv_cache_manager, scheduler, is_kv_producer)


def make_kv(first_block_index, num_blocks, value=1.0, layer_start=0, num_layers=NUM_LAYERS) -> KVBlocks:
    return KVBlocks(first_block_index, torch.full((num_layers, 2, num_blocks, BLOCK_SIZE, 1, 2), value), layer_start)


def test_reserve_import_finish():
    c = make_kv_connector()
    request = make_request("r", num_prompt_tokens=10)
    assert c.reserve(request) == 0
    assert request.status == RequestStatus.WAITING_FOR_KV
    assert c.kv_cache_manager.get_block_table("r") == [0, 1, 2]
    c.import_kv(request, make_kv(0, 2, value=1.0))
    c.import_kv(request, make_kv(2, 1, value=2.0, layer_start=0, num_layers=1))
    assert c.num_blocks_imported == 2  # (block 2 counts once its last layer came)
    c.import_kv(request, make_kv(2, 1, value=3.0, layer_start=1, num_layers=1))
    assert c.num_blocks_imported == 3
    pool = c.model_runner.kv_caches
    assert pool[:, :, [0, 1]].eq(1.0).all() and pool[0, :, 2].eq(2.0).all() and pool[1, :, 2].eq(3.0).all()
    assert pool[:, :, 3:].eq(0.0).all()
    c.finish_kv_import(request, 7)
    assert request.num_computed_tokens == 10
    with pytest.raises(InvalidRequestError, match="is not waiting for KV"):
        c.import_kv(request, make_kv(0, 1))


def test_finish_refuses_a_truncated_transfer_and_changes_nothing():
    c = make_kv_connector()
    request = make_request("r", num_prompt_tokens=10)
    c.reserve(request)
    c.import_kv(request, make_kv(0, 3, layer_start=0, num_layers=1))
    c.import_kv(request, make_kv(0, 1, layer_start=1, num_layers=1))
    with pytest.raises(InvalidRequestError, match=r"KV transfer incomplete: 2 of the 3 blocks it needed lack layers "
                                                  r"\(the first: block 1\)"):
        c.finish_kv_import(request, 7)
    assert request.status == RequestStatus.WAITING_FOR_KV and request.num_computed_tokens == 0
    c.import_kv(request, make_kv(1, 2, layer_start=1, num_layers=1))
    c.finish_kv_import(request, 7)
    assert request.num_computed_tokens == 10


@pytest.mark.parametrize("kv, message", [
    (make_kv(2, 2), r"KV blocks 2..4 exceed the request's 3 reserved blocks"),
    (make_kv(0, 1, layer_start=1), "KV layers from 1 overrun the model's 2 layers"),
])
def test_import_refuses_blocks_or_layers_past_the_reservation(kv, message):
    c = make_kv_connector()
    request = make_request("r", num_prompt_tokens=10)
    c.reserve(request)
    with pytest.raises(InvalidRequestError, match=message):
        c.import_kv(request, kv)
    assert c.model_runner.kv_caches.eq(0.0).all()


@pytest.mark.parametrize("token_id", [-1, VOCAB_SIZE])
def test_finish_refuses_a_first_token_outside_the_vocabulary(token_id):
    c = make_kv_connector()
    request = make_request("r", num_prompt_tokens=4)
    c.reserve(request)
    c.import_kv(request, make_kv(0, 1))
    with pytest.raises(InvalidRequestError, match=f"first token id {token_id} is outside the vocabulary"):
        c.finish_kv_import(request, token_id)


def test_cached_prefix_blocks_are_neither_needed_nor_overwritten():
    c = make_kv_connector(prefix_caching=True)
    first = make_request("a", num_prompt_tokens=10)
    c.reserve(first)
    c.import_kv(first, make_kv(0, 3, value=1.0))
    c.finish_kv_import(first, 7)  # publishes its 2 full blocks
    second = make_request("b", num_prompt_tokens=10)
    assert c.reserve(second) == 8
    assert c.kv_cache_manager.get_block_table("b")[:2] == [0, 1]
    c.import_kv(second, make_kv(0, 3, value=5.0))  # (a prefill that skipped nothing)
    pool = c.model_runner.kv_caches
    assert pool[:, :, [0, 1]].eq(1.0).all() and pool[:, :, c.kv_cache_manager.get_block_table("b")[2]].eq(5.0).all()
    assert c.num_blocks_imported == 3 + 1
    third = make_request("c", num_prompt_tokens=10)
    c.reserve(third)
    c.import_kv(third, make_kv(2, 1))  # the cached blocks never came: not needed
    c.finish_kv_import(third, 7)


def make_prioritized_request(request_id, num_prompt_tokens, priority):
    request = make_request(request_id, num_prompt_tokens)
    request.priority = priority
    return request


def test_reserve_preempts_lower_priority_running_or_refuses():
    c = make_kv_connector(num_blocks=4)
    running = make_prioritized_request("low", 8, priority=5)
    c.kv_cache_manager.allocate_slots(running, 8)  # blocks 0, 1
    running.status = RequestStatus.RUNNING
    c.scheduler.running.append(running)
    waiting = make_prioritized_request("wait", 4, priority=9)
    c.reserve(waiting)  # block 2
    high = make_prioritized_request("high", 8, priority=0)
    c.reserve(high)  # needs 2 of the 1 free: preempts "low"
    assert c.scheduler.running == [] and running.status == RequestStatus.WAITING
    assert c.kv_cache_manager.get_block_table("high") == [3, 1]  # the free one, then one of "low"s (freed last first)
    with pytest.raises(NoCapacityError, match="no room for 8 prompt tokens of KV") as refused:
        c.reserve(make_prioritized_request("equal", 8, priority=0))
    assert refused.value.room_soon  # "wait" (priority 9) holds a block: preemptible once its KV came
    assert "equal" not in c.kv_cache_manager.block_tables and c.kv_cache_manager.num_free_blocks == 1
    c.request_finished(waiting)
    c.kv_cache_manager.free(waiting)
    with pytest.raises(NoCapacityError) as refused:
        c.reserve(make_prioritized_request("big", 12, priority=0))
    assert not refused.value.room_soon  # nothing of lower priority waits for KV


def run_prefill(c: KVConnector, request) -> list[dict[str, KVBlocks]]:
    """Schedule the request's prompt step by step; what save_kv returned after each step."""
    c.scheduler.add_request(request)
    saved = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        out = c.scheduler.schedule()
        saved.append(c.save_kv(out))
        request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
    return saved


def saved_block_ids(kv: KVBlocks) -> tuple[int, list[int]]:
    """(first_block_index, the pool block ids its data came from): numbered_pool's blocks hold their id."""
    return kv.first_block_index, kv.data[0, 0, :, 0, 0, 0].int().tolist()


def numbered_pool(c: KVConnector) -> None:
    c.model_runner.kv_caches[:] = torch.arange(8.0).view(1, 1, 8, 1, 1, 1)  # block i holds i


def test_save_kv_copies_each_filled_block_once_partial_last_block_included():
    c = make_kv_connector(is_kv_producer=True, max_num_batched_tokens=6)  # chunks of 6 and 4 tokens
    numbered_pool(c)
    request = make_request("r", num_prompt_tokens=10, max_tokens=1)
    first, last = run_prefill(c, request)
    assert saved_block_ids(first["r"]) == (0, [0])  # block 1 is not full yet
    assert saved_block_ids(last["r"]) == (1, [1, 2])  # the partial last block with the last chunk
    assert first["r"].data.shape == (NUM_LAYERS, 2, 1, BLOCK_SIZE, 1, 2) and c.num_blocks_exported == 3
    c.request_finished(request)
    assert c._num_exported_blocks == {}


def test_save_kv_skips_the_blocks_the_decode_holds():
    c = make_kv_connector(is_kv_producer=True)
    numbered_pool(c)
    request = make_request("r", num_prompt_tokens=10, max_tokens=1)
    request.kv_skip_blocks = 2
    [saved] = run_prefill(c, request)
    assert saved_block_ids(saved["r"]) == (2, [2]) and c.num_blocks_exported == 1


def test_save_kv_is_empty_unless_producer():
    c = make_kv_connector()
    assert run_prefill(c, make_request("r", num_prompt_tokens=10)) == [{}]
