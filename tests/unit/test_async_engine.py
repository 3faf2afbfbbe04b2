"""AsyncEngine's typed interface over a stand-in engine (the real one runs in tests/integration): commands reach
the engine thread and come back as results or exceptions, outputs reach their request's stream, and an id
already streaming is refused."""
import asyncio

import pytest

from tandem.shared.async_engine import AsyncEngine
from tandem.shared.engine import RequestOutput
from tandem.shared.engine_stats import EngineStats
from tandem.shared.errors import InvalidRequestError, NoCapacityError, UnknownRequestError
from tandem.shared.request import FinishReason, StructuredOutputParams
from tests.unit.factories import make_request


class FakeEngine:
    """Records calls; finish_kv_import finishes the request at once; import_kv knows no request."""

    def __init__(self):
        self.calls, self.requests, self.last_step_num_tokens = [], {}, 0
        self.structured_output_manager = self  # (matcher below)

    def matcher(self, constraint):
        import threading

        return ("grammar compiled on", threading.current_thread().name)

    def has_unfinished_requests(self):
        return False

    def reserve(self, request):
        self.calls.append(("reserve", request.request_id))

    def add_request(self, request):
        self.calls.append(("add_request", request.request_id))
        if request.grammar is not None:
            self.calls.append(request.grammar)

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

    def close(self):
        self.calls.append(("close",))


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


async def grammar_scenario():
    fake = FakeEngine()
    engine = AsyncEngine(fake, asyncio.get_running_loop())
    try:
        await engine.add_request(make_request("g", structured_output=StructuredOutputParams(regex="[0-9]+")))
        _, (what, thread) = fake.calls
        assert what == "grammar compiled on" and thread not in ("engine", "MainThread")
    finally:
        engine.stop()


def test_a_grammar_is_compiled_off_the_engine_thread_before_admission():
    asyncio.run(grammar_scenario())


class FullEngine(FakeEngine):
    """reserve() finds no room until `room` is set; room_soon as given."""

    def __init__(self, room_soon):
        super().__init__()
        self.room, self.room_soon = False, room_soon

    def reserve(self, request):
        if not self.room:
            raise NoCapacityError("no room", room_soon=self.room_soon)
        super().reserve(request)


async def parking_scenario():
    fake = FullEngine(room_soon=True)
    engine = AsyncEngine(fake, asyncio.get_running_loop())
    try:
        requests = [make_request(name) for name in ("late", "first", "gone")]
        for request, priority in zip(requests, (3, 1, 0)):
            request.priority = priority
        waiting = [asyncio.create_task(engine.reserve(r)) for r in requests]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in waiting)  # parked, not failed
        waiting[2].cancel()  # its caller gives up: the parked reservation goes with it
        await asyncio.sleep(0.3)
        fake.room = True
        await asyncio.wait_for(asyncio.gather(*waiting[:2]), 5)
        assert [c for c in fake.calls if c[0] == "reserve"] == [("reserve", "first"), ("reserve", "late")]
        fake.room, fake.room_soon = False, False
        with pytest.raises(NoCapacityError):  # no room coming: refused at once
            await asyncio.wait_for(engine.reserve(make_request("refused")), 5)
    finally:
        engine.stop()


def test_a_reservation_that_will_fit_soon_waits_best_priority_first():
    asyncio.run(parking_scenario())


class SteppingEngine(FakeEngine):
    """Steps while it holds requests; each step records when it started and which requests it ran, and takes about
    20 ms."""

    def __init__(self):
        super().__init__()
        self.running, self.steps, self.starts = set(), [], []

    def add_request(self, request):
        self.running.add(request.request_id)

    def abort_request(self, request_id):
        self.running.discard(request_id)
        return True

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        import time

        self.starts.append(time.monotonic())
        self.steps.append(set(self.running))
        time.sleep(0.02)
        return []


async def abort_scenario():
    fake = SteppingEngine()
    engine = AsyncEngine(fake, asyncio.get_running_loop())
    try:
        await engine.add_request(make_request("long"))
        await asyncio.sleep(0.2)
        steps_before = len(fake.steps)
        engine.abort("long")  # (what a cancelled gRPC call or an expired deadline does on a tier)
        await engine.stats()  # a command queued behind the abort: answered once the abort has run
        after = fake.steps[steps_before:]
        # at most the step already running when abort() was called still held the request
        assert sum("long" in s for s in after) <= 1 and steps_before > 0
    finally:
        engine.stop()


def test_an_abort_frees_the_request_before_the_next_step():
    asyncio.run(abort_scenario())


class FailingEngine(SteppingEngine):
    """Every step raises gloo's error for a rank gone; tensor_parallel: whether it stands for an instance of several
    ranks (LLMEngine.tp_workers set)."""

    def __init__(self, tensor_parallel: bool):
        super().__init__()
        self.tp_workers = object() if tensor_parallel else None

    def step(self):
        super().step()
        self.requests = dict.fromkeys(self.running)  # (what _abort_all ends)
        raise RuntimeError("Connection closed by peer")


async def failed_step_scenario(tensor_parallel: bool, with_on_lost: bool):
    """(the stream's outputs within 0.5 s, the on_lost calls, the steps taken, AsyncEngine.lost)."""
    fake, lost = FailingEngine(tensor_parallel), []
    engine = AsyncEngine(fake, asyncio.get_running_loop(), on_lost=lost.append if with_on_lost else None)
    try:
        stream = await engine.add_request(make_request("a"))
        outputs = []
        try:
            while (out := await asyncio.wait_for(stream.get(), 0.5)) is not None:
                outputs.append(out)
        except asyncio.TimeoutError:
            pass
        await engine.stats()  # (commands are still answered)
        return outputs, lost, len(fake.steps), engine.lost
    finally:
        engine.stop()


def test_a_failed_step_ends_the_batch_or_loses_a_tensor_parallel_instance():
    # one process: the batch ends with an error (ABORT), and the engine serves on
    outputs, lost, _, state = asyncio.run(failed_step_scenario(False, True))
    assert [(o.finish_reason, o.error) for o in outputs] == [(FinishReason.ABORT, "engine step failed")]
    assert lost == [] and state is None
    # tensor-parallel: lost, stepping no more; its requests get no output (the service ends their calls) ...
    outputs, lost, steps, state = asyncio.run(failed_step_scenario(True, True))
    assert outputs == [] and steps == 1
    assert lost == [state] and "RuntimeError: Connection closed by peer" in state
    # ... or, with no one to end them, an error naming the loss
    outputs, lost, steps, state = asyncio.run(failed_step_scenario(True, False))
    assert [(o.finish_reason, o.error) for o in outputs] == [(FinishReason.ABORT, state)] and steps == 1


async def interval_scenario():
    import time

    fake = SteppingEngine()
    engine = AsyncEngine(fake, asyncio.get_running_loop())
    try:
        await engine.add_request(make_request("a"))
        await asyncio.sleep(0.2)
        full_speed = len(fake.starts)
        engine.step_interval_s = 0.1
        await asyncio.sleep(0.05)
        paced_from = len(fake.starts)
        await asyncio.sleep(0.5)
        gaps = [b - a for a, b in zip(fake.starts[paced_from:], fake.starts[paced_from + 1:])]
        engine.step_interval_s = 2.0
        await asyncio.sleep(0.3)  # (the engine thread now waits out the 2 s between two steps)
        start = time.monotonic()
        await engine.stats()
        answered_s = time.monotonic() - start
        return full_speed, gaps, answered_s
    finally:
        engine.stop()


def test_a_step_interval_spaces_the_steps_and_commands_run_in_between():
    """With step_interval_s, steps start at least that far apart (the 20 ms steps ran back to back before), and a
    command sent in between is answered at once, not after the interval."""
    full_speed, gaps, answered_s = asyncio.run(interval_scenario())
    assert full_speed >= 5  # (0.2 s of 20 ms steps at full speed)
    assert len(gaps) >= 3 and min(gaps) >= 0.1 - 1e-3, gaps
    assert answered_s < 1.0, answered_s
