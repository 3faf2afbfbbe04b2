"""Offering a workload to a backend at a load level, and one backend's session over every level.

Load is vLLM's: a closed loop keeps `concurrency` requests in flight (the next one is sent when one completes),
an open loop sends requests at `request_rate` per second with gamma-distributed gaps of shape `burstiness`
(1: Poisson arrivals; lower: burstier), seeded so every backend gets the same arrival times. A static-batching
backend takes batches of `concurrency` requests in order; in an open loop, all requests that have arrived by the
time it is free (its requests' times then count from their arrival).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from tandem.benchmarks.bench.backends.base import Backend, RequestResult, first_line
from tandem.benchmarks.bench.workloads import BenchRequest

WARMUP_OUTPUT_LEN = 4  # tokens of the one request each backend answers before it is timed


@dataclass(frozen=True)
class Load:
    """A closed loop with `concurrency` requests in flight, or an open loop at `request_rate` req/s (inf: all
    at once) with gamma-distributed gaps of shape `burstiness`."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self):
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load has either a concurrency or a request rate")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.request_rate:g}/s" + (f" b={self.burstiness:g}" if self.burstiness != 1 else "")

    @property
    def value(self) -> float:
        """The load on a plot's x axis: concurrency, or requests per second."""
        return self.concurrency if self.concurrency is not None else self.request_rate

    def as_json(self) -> dict:
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate  # JSON has no infinity
        return {"request_rate": rate, "burstiness": self.burstiness}


@dataclass
class RunResult:
    """One backend at one load level: every request's result and the run's wall time in seconds."""

    backend: str
    load: Load
    results: list[RequestResult]
    duration_s: float


def arrival_times_s(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0 for the first, then gaps ~ Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), whose mean is 1/rate (as vLLM's get_request). All 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def _timed(backend: Backend, request: BenchRequest) -> RequestResult:
    """backend.generate, with a failure turned into a failed result."""
    start_s = time.perf_counter()
    try:
        result = await backend.generate(request)
    except Exception as e:
        return RequestResult(request.index, request.prompt_len, start_s=start_s, end_s=time.perf_counter(),
                             error=first_line(e))  # fmt: skip
    if not result.token_times_s and result.error is None:
        result.error = "the response carried no token"
    return result


async def run_streaming(backend: Backend, requests: list[BenchRequest], load: Load, seed: int,
                        progress: tqdm) -> RunResult:
    """Offer every request to a streaming backend under load; results in request order."""
    start_s = time.perf_counter()

    async def one(request: BenchRequest, limiter: asyncio.Semaphore | None, send_at_s: float) -> RequestResult:
        if limiter is None:
            await asyncio.sleep(max(0.0, start_s + send_at_s - time.perf_counter()))
            result = await _timed(backend, request)
        else:
            async with limiter:  # FIFO: requests go in order as slots free up
                result = await _timed(backend, request)
        progress.update(1)
        return result

    if load.concurrency is not None:
        limiter = asyncio.Semaphore(load.concurrency)
        tasks = [one(r, limiter, 0.0) for r in requests]
    else:
        times = arrival_times_s(len(requests), load.request_rate, load.burstiness, seed)
        tasks = [one(r, None, t) for r, t in zip(requests, times)]
    results = await asyncio.gather(*tasks)
    return RunResult(backend.name, load, list(results), time.perf_counter() - start_s)


async def run_static(backend: Backend, requests: list[BenchRequest], load: Load, seed: int,
                     progress: tqdm) -> RunResult:
    """Offer every request to a static-batching backend under load; results in request order."""
    start_s = time.perf_counter()
    if load.concurrency is not None:
        arrivals = None
    else:
        arrivals = [start_s + t for t in arrival_times_s(len(requests), load.request_rate, load.burstiness, seed)]
    results: list[RequestResult] = []
    while len(results) < len(requests):
        first = len(results)
        if arrivals is None:
            batch = requests[first : first + load.concurrency]
            batch_start = time.perf_counter()
            starts = [batch_start] * len(batch)
        else:
            await asyncio.sleep(max(0.0, arrivals[first] - time.perf_counter()))
            now = time.perf_counter()
            last = first + 1 + sum(1 for t in arrivals[first + 1 :] if t <= now)
            batch, starts = requests[first:last], arrivals[first:last]
        try:
            done = await backend.generate_batch(batch, starts)
        except Exception as e:
            end_s = time.perf_counter()
            done = [RequestResult(r.index, r.prompt_len, start_s=s, end_s=end_s, error=first_line(e))
                    for r, s in zip(batch, starts)]  # fmt: skip
        results += done
        progress.update(len(done))
    return RunResult(backend.name, load, results, time.perf_counter() - start_s)


async def run_session(backend: Backend, request_sets: list[list[BenchRequest]], loads: list[Load], seed: int,
                      warmup: BenchRequest) -> tuple[dict, list[RunResult]]:
    """Start the backend, answer the warm-up request (a prompt no load level sends), run every load level in turn
    on its own requests (request_sets, one list per load), stop it (also on failure).

    Returns (backend.describe(), one RunResult per load). A backend that cannot start or warm up raises."""
    runs = []
    try:
        await backend.start()
        warmup = dataclasses.replace(warmup, output_len=min(WARMUP_OUTPUT_LEN, warmup.output_len))
        if backend.static_batching:
            await backend.generate_batch([warmup], [time.perf_counter()])
        else:
            await backend.generate(warmup)
        description = backend.describe()
        run = run_static if backend.static_batching else run_streaming
        for load, requests in zip(loads, request_sets):
            with tqdm(total=len(requests), desc=f"{backend.name} {load.label}", unit="req") as progress:
                runs.append(await run(backend, requests, load, seed, progress))
    finally:
        await backend.stop()
    return description, runs
