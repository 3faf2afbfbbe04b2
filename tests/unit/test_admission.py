"""The gateway's admission queue (services/gateway/admission.py) and its refusal of a request whose predicted time to
first token exceeds its deadline (check_predicted_ttft)."""
import asyncio

import pytest

from tandem.services.gateway.admission import AdmissionQueue, OverloadedError, check_predicted_ttft
from tandem.services.gateway.router import Route
from tandem.shared.errors import DeadlineError
from tandem.shared.cluster_state.registry import InstanceInfo


def run(coro):
    return asyncio.run(coro)


async def hold(queue: AdmissionQueue, release: asyncio.Event, order: list, name: str, priority: int = 0,
               time_left=None):
    async with queue.slot(priority, lambda: time_left):
        order.append(name)
        await release.wait()


def test_slots_are_granted_best_priority_first_then_oldest():
    async def body():
        queue, release, order = AdmissionQueue(1, 10, 30.0), asyncio.Event(), []
        first = asyncio.create_task(hold(queue, release, order, "first"))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(hold(queue, release, order, name, priority))
                   for name, priority in (("late-low", 5), ("urgent", -1), ("normal-a", 0), ("normal-b", 0))]
        await asyncio.sleep(0.01)
        assert order == ["first"] and queue.num_running == 1 and queue.num_waiting == 4
        release.set()
        await asyncio.gather(first, *waiters)
        assert order == ["first", "urgent", "normal-a", "normal-b", "late-low"]
        assert queue.num_running == 0 and queue.num_waiting == 0

    run(body())


def test_a_full_waiting_room_refuses_at_once_and_a_long_wait_is_refused_with_a_retry_hint():
    async def body():
        queue, release, order = AdmissionQueue(1, 1, 0.2), asyncio.Event(), []
        first = asyncio.create_task(hold(queue, release, order, "first"))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold(queue, release, order, "waiter"))
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError) as refused:
            await hold(queue, release, order, "third")
        assert "--max-waiting-requests" in str(refused.value) and refused.value.retry_after_s >= 1
        with pytest.raises(OverloadedError) as timed_out:
            await waiter
        assert "within 0.2 s" in str(timed_out.value) and "retry after" in str(timed_out.value)
        release.set()
        await first
        assert order == ["first"] and queue.num_running == 0 and queue.num_waiting == 0

    run(body())


def test_a_wait_ends_at_the_request_deadline_and_a_cancelled_waiter_gives_no_slot_away():
    async def body():
        queue, release, order = AdmissionQueue(1, 10, 30.0), asyncio.Event(), []
        first = asyncio.create_task(hold(queue, release, order, "first"))
        await asyncio.sleep(0)
        with pytest.raises(DeadlineError, match="waited 0.1 s for a slot"):
            await hold(queue, release, order, "short-deadline", time_left=0.1)
        cancelled = asyncio.create_task(hold(queue, release, order, "cancelled"))
        later = asyncio.create_task(hold(queue, release, order, "later"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        release.set()
        await asyncio.gather(first, later, cancelled, return_exceptions=True)
        assert order == ["first", "later"] and queue.num_running == 0 and queue.num_waiting == 0

    run(body())


def test_retry_hint_grows_with_the_waiting_requests_and_the_mean_duration():
    queue = AdmissionQueue(4, 100, 30.0)
    assert queue.retry_after_s() == 1.0
    queue._mean_duration_s = 20.0
    assert queue.retry_after_s() == 5.0  # (0 waiting + 1) x 20 s / 4 slots
    assert AdmissionQueue(1, 10, 30.0).retry_after_s() >= 1.0


def test_predicted_ttft_over_the_deadline_is_refused_at_once():
    prefill = InstanceInfo("prefill-a", "prefill", "127.0.0.1:1", "m", 16, num_queued_tokens=9_000, tokens_per_s=1000)
    decode = InstanceInfo("decode-a", "decode", "127.0.0.1:2", "m", 16)
    route = Route(decode, prefill, prefill_cached_tokens=0)
    check_predicted_ttft(route, 1000, None)  # no deadline: nothing to check
    check_predicted_ttft(route, 1000, 10.5)  # (9,000 + 1,000) tokens at 1,000/s = 10 s
    with pytest.raises(DeadlineError, match=r"predicted time to first token \(10.0 s.*prefill-a.*9.5 s left"):
        check_predicted_ttft(route, 1000, 9.5)
    unmeasured = InstanceInfo("prefill-b", "prefill", "127.0.0.1:3", "m", 16, num_queued_tokens=10**6)
    check_predicted_ttft(Route(decode, unmeasured), 1000, 0.1)  # no rate yet: never refused on a guess
    check_predicted_ttft(Route(decode, None), 1000, 0.1)  # the decode computes the prompt: no prefill queue
