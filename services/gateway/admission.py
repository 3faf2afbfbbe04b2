"""Admission control at the gateway: how many requests it serves at once, how many wait for a turn and for how long,
and what a refused client is told.

A request takes a slot for its whole life (AdmissionQueue.slot). With every slot taken it waits, best priority
first then oldest (vLLM's priority order), at most max_wait_s (then OverloadedError) and never past its own
deadline (then DeadlineError); with max_waiting requests already waiting it is refused at once. A refusal is
OverloadedError: RESOURCE_EXHAUSTED (HTTP 429) with a retry hint, sent as gRPC's server pushback trailer
`grpc-retry-pushback-ms` (gRFC A6) and HTTP's `Retry-After`.
The same wait bound applies while every decode's KV pool is full (placement.Placer.place waits for room).
check_predicted_ttft refuses at once a request whose deadline its prefill's queue would already miss.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from contextlib import asynccontextmanager

from tandem.services.gateway.router import Route
from tandem.shared.errors import DeadlineError, NoCapacityError

RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0
DURATION_EWMA_ALPHA = 0.1  # weight of each finished request in the mean request duration


class OverloadedError(NoCapacityError):
    """The gateway refuses a request for lack of room (every slot busy and the wait bound passed, or the waiting
    room full, or every decode's KV pool full): RESOURCE_EXHAUSTED / HTTP 429. retry_after_s: when a retry is
    likely to be admitted, in seconds (whole seconds >= 1)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(f"{message}; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    """Slots for max_running requests at once; up to max_waiting more wait for one, each at most max_wait_s
    (seconds). Event-loop only (not thread-safe)."""

    def __init__(self, max_running: int, max_waiting: int, max_wait_s: float):
        self.max_running, self.max_waiting, self.max_wait_s = max_running, max_waiting, max_wait_s
        self.num_running = 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # heap of (priority, arrival, granted)
        self._arrivals = itertools.count()
        self._mean_duration_s = 1.0  # of a request holding a slot (EWMA)

    @property
    def num_waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    def retry_after_s(self) -> float:
        """Seconds until the requests ahead of a new one are likely through: (waiting + 1) requests at the rate
        the slots free up (max_running per mean request duration), rounded up, in [1, 60]."""
        seconds = (self.num_waiting + 1) * self._mean_duration_s / self.max_running
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(seconds)))

    @asynccontextmanager
    async def slot(self, priority: int = 0, time_remaining=lambda: None):
        """Hold one slot for the body. time_remaining() -> seconds left before the request's deadline, or None.
        OverloadedError when the waiting room is full or no slot came within max_wait_s; DeadlineError when the
        request's deadline came first."""
        if self.num_running >= self.max_running or self.num_waiting:
            await self._wait(priority, time_remaining())
        else:
            self.num_running += 1
        start = time.monotonic()
        try:
            yield
        finally:
            duration = time.monotonic() - start
            self._mean_duration_s += DURATION_EWMA_ALPHA * (duration - self._mean_duration_s)
            self.num_running -= 1
            self._grant_next()

    async def _wait(self, priority: int, time_left: float | None) -> None:
        if self.num_waiting >= self.max_waiting:
            raise OverloadedError(f"the gateway is overloaded: {self.num_running} requests running and "
                                  f"{self.num_waiting} waiting (--max-waiting-requests)", self.retry_after_s())
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), granted))
        timeout = self.max_wait_s if time_left is None else max(0.0, min(self.max_wait_s, time_left))
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout)
        except TimeoutError:
            if granted.done():  # (granted just as the wait ended: keep the slot)
                return
            granted.cancel()
            if timeout < self.max_wait_s:
                raise DeadlineError(f"the request's deadline passed while it waited {timeout:.1f} s for a slot "
                                    f"({self.num_running} running, --max-concurrent-requests {self.max_running})"
                                    ) from None  # fmt: skip
            raise OverloadedError(f"the gateway is overloaded: no request slot came free within {timeout:.1f} s "
                                  f"({self.num_running} running, --max-concurrent-requests {self.max_running})",
                                  self.retry_after_s()) from None  # fmt: skip
        except BaseException:
            if not granted.cancel():  # (the slot was granted as the caller gave up: pass it on)
                self.num_running -= 1
                self._grant_next()
            raise

    def _grant_next(self) -> None:
        while self._waiting and self.num_running < self.max_running:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                self.num_running += 1
                granted.set_result(None)


def check_predicted_ttft(route: Route, num_prompt_tokens: int, time_left_s: float | None) -> None:
    """DeadlineError when the route's prefill would take longer than time_left_s (seconds) to reach this prompt's
    first token: its queue plus the prompt's uncached tokens at the rate its recent steps computed
    (InstanceInfo.tokens_per_s). Nothing is checked without a deadline, a prefill or a measured rate."""
    prefill = route.prefill
    if time_left_s is None or prefill is None or not prefill.tokens_per_s:
        return
    num_tokens = prefill.num_queued_tokens + num_prompt_tokens - route.prefill_cached_tokens
    predicted_s = num_tokens / prefill.tokens_per_s
    if predicted_s > time_left_s:
        raise DeadlineError(f"refused at once: the predicted time to first token ({predicted_s:.1f} s: "
                            f"{num_tokens} tokens to compute on prefill {prefill.instance_id} at "
                            f"{prefill.tokens_per_s:.0f} tokens/s) exceeds the {time_left_s:.1f} s left before the "
                            "request's deadline")  # fmt: skip
