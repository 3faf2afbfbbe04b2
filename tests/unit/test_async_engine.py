"""AsyncEngine's typed interface over a stand-in engine (the real one runs in tests/integration): commands reach
the engine thread and come back as results or exceptions, outputs reach their request's stream, and an id
already streaming is refused."""
import asyncio

import pytest

from shared.async_engine import AsyncEngine
from shared.engine import EngineStats, RequestOutput
from shared.errors import InvalidRequestError, UnknownRequestError
from shared.request import FinishReason
from tests.unit.factories import make_request


class FakeEngine:
    """Records calls; finish_kv_import finishes the request at once; import_kv knows no request."""

    def __init__(self):
        self.calls, self.requests, self.last_step_num_tokens = [], {}, 0

    def has_unfinished_requests(self):
        return False

    def reserve(self, request):
        self.calls.append(("reserve", request.request_id))

    def add_request(self, request):
        self.calls.append(("add_request", request.request_id))

    def import_kv(self, request_id, kv):
        raise UnknownRequestError(f"unknown request {request_id!r}")

    def finish_kv_import(self, request_id, first_token_id):
        return RequestOutput(request_id, [], FinishReason.STOP)

    def fail_kv_import(self, request_id, error):
        return None

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))
        return True

    def stats(self):
        return EngineStats("m", 16, 8, 8, 0, len(self.calls))

    def take_kv_events(self):
        return None


async def scenario():
    fake = FakeEngine()
    engine = AsyncEngine(fake, asyncio.get_running_loop())
    try:
        stream = await engine.reserve(make_request("a"))
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.reserve(make_request("a"))
        with pytest.raises(UnknownRequestError):
            await engine.import_kv("nobody", None)
        await engine.finish_kv_import("a", 7)
        finished = await asyncio.wait_for(stream.get(), 5)
        assert finished.finish_reason == FinishReason.STOP and await stream.get() is None
        await engine.add_request(make_request("b"))
        engine.abort("b")
        stats = await engine.stats()  # queued behind the abort, so it sees it
        assert fake.calls == [("reserve", "a"), ("add_request", "b"), ("abort", "b")] and stats.num_waiting == 3
    finally:
        engine.stop()


def test_typed_commands_run_on_the_engine_thread_in_order():
    asyncio.run(scenario())


async def reused_id_scenario():
    engine = AsyncEngine(FakeEngine(), asyncio.get_running_loop())
    try:
        await engine.reserve(make_request("a"))  # admission 0
        engine.abort("a")  # the client cancelled; the engine may still have outputs of it on their way
        stream = await engine.reserve(make_request("a"))  # admission 1, same id
        engine._deliver([(0, RequestOutput("a", [99], FinishReason.STOP))])  # made for admission 0: dropped
        engine._publish([RequestOutput("a", [22])])  # made now: tagged with admission 1
        assert (await asyncio.wait_for(stream.get(), 5)).new_token_ids == [22]
        assert stream.empty()
    finally:
        engine.stop()


def test_outputs_of_an_aborted_request_never_reach_a_new_request_with_its_id():
    asyncio.run(reused_id_scenario())
