from tandem.shared.request import RequestStatus
from tests.unit.factories import make_request, make_scheduler


def test_prompt_larger_than_budget_is_chunked():
    s = make_scheduler(max_num_batched_tokens=8)
    req = make_request(num_prompt_tokens=20)
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 8}
    req.num_computed_tokens += 8
    assert s.schedule().num_scheduled_tokens == {"r0": 8}
    req.num_computed_tokens += 8
    assert s.schedule().num_scheduled_tokens == {"r0": 4}


def test_decode_and_prefill_chunks_share_one_step():
    s = make_scheduler(max_num_batched_tokens=8)
    decoding = make_request("d", num_prompt_tokens=4)
    decoding.num_computed_tokens = 4
    decoding.output_token_ids = [7]
    s.add_request(decoding)  # KV already present: joins the running batch
    assert decoding.status == RequestStatus.RUNNING
    s.add_request(make_request("p", num_prompt_tokens=30))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["d", "p"]
    assert out.num_scheduled_tokens == {"d": 1, "p": 7}


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", num_prompt_tokens=4))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preempts_newest_running_request_when_blocks_run_out():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8), make_request("b", 8)
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    for r in (a, b):  # both prompts computed, each fills 2 blocks exactly
        r.num_computed_tokens = 8
        r.output_token_ids = [5]
    out = s.schedule()  # each needs a third block; only preempting b makes room for a
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_requests == [b]
    assert b.num_computed_tokens == 0 and b.status == RequestStatus.WAITING
    assert s.kv_cache_manager.get_block_table("a") == [0, 1, 3]  # b freed tail first: its block 3 goes first


def test_token_ids_slices_prompt_and_output_alike():
    req = make_request(num_prompt_tokens=4)  # prompt 1..4
    req.output_token_ids = [50, 51]
    full = req.prompt_token_ids + req.output_token_ids
    for start in range(7):
        for end in range(start, 7):
            assert req.token_ids(start, end) == full[start:end]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for name, priority in (("late", 1), ("first", 0), ("low", 5), ("second", 0)):
        r = make_request(name, num_prompt_tokens=4)
        r.priority = priority
        s.add_request(r)
    assert list(s.schedule().num_scheduled_tokens) == ["first", "second"]
    assert [r.request_id for r in s.waiting] == ["late", "low"]


def test_preempts_the_lowest_priority_running_request_not_the_newest():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low, high = make_request("low", 8), make_request("high", 8)
    low.priority, high.priority = 3, 0
    s.add_request(low)  # (admitted first: without priorities the newest, high, would be preempted)
    s.add_request(high)
    s.schedule()
    for r in (low, high):
        r.num_computed_tokens = 8
        r.output_token_ids = [5]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"high": 1} and out.preempted_requests == [low]
    assert low.status == RequestStatus.WAITING and low.num_computed_tokens == 0


def test_a_waiting_high_priority_request_preempts_a_running_low_priority_one():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low = make_request("low", 12)
    low.priority = 2
    s.add_request(low)
    s.schedule()  # low holds 3 of the 4 blocks
    low.num_computed_tokens = 12
    low.output_token_ids = [5]
    high = make_request("high", 8)
    s.add_request(high)  # needs 2 blocks: only preempting low makes room
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["high"] and out.preempted_requests == [low]
    assert [r.request_id for r in s.running] == ["high"] and [r.request_id for r in s.waiting] == ["low"]
    same = make_request("same", 8)
    same.priority = 0  # equal priority never preempts: it waits
    s.add_request(same)
    high.num_computed_tokens = 8
    high.output_token_ids = [6]
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["high"] and not out.preempted_requests
