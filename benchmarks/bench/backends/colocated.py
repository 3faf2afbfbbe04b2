"""colocated: our engine in this process, without gRPC or KV transfer: one LLMEngine on AsyncEngine's thread,
with a step budget of the prefill tier's default (512 tokens), so that each step computes prompt chunks and
decode tokens of the running batch together (chunked prefill + continuous batching in one engine).

It gets the workload's token ids, the ones the gateway computes for the same raw prompts. A token is timed when
its step's output reaches this event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from tandem.benchmarks.bench.backends.base import RequestResult, weights_description
from tandem.benchmarks.bench.workloads import BenchRequest
from tandem.shared.engine_args import TIER_DEFAULTS, EngineArgs


class ColocatedBackend:
    name = "colocated"
    static_batching = False

    def __init__(self, model_dir: str, engine_args: EngineArgs, threads: int, request_timeout_s: float = 600):
        """engine_args: as the cluster's (quantization, block size, ...); max_num_batched_tokens None means the
        prefill tier's default; threads: torch threads of this process."""
        budget = engine_args.max_num_batched_tokens or TIER_DEFAULTS["prefill"]["max_num_batched_tokens"]
        self.engine_args = dataclasses.replace(engine_args, max_num_batched_tokens=budget, threads=threads)
        self.model_dir = model_dir
        self.request_timeout_s = request_timeout_s
        self.engine = None
        self._ids = itertools.count()

    async def start(self) -> None:
        from tandem.shared.async_engine import AsyncEngine, build_engine

        engine = build_engine(self.engine_args, "decode", self.model_dir)
        self.engine = AsyncEngine(engine, asyncio.get_running_loop())

    async def generate(self, request: BenchRequest) -> RequestResult:
        from tandem.shared.request import FinishReason, Request, SamplingParams

        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        engine_request = Request(f"bench-{next(self._ids)}", list(request.prompt_token_ids), params)
        result = RequestResult(request.index, request.prompt_len, start_s=time.perf_counter())
        stream = await self.engine.add_request(engine_request)
        finished = False
        try:
            async with asyncio.timeout(self.request_timeout_s):
                while (out := await stream.get()) is not None:
                    if out.new_token_ids:
                        result.token_times_s.append(time.perf_counter())
                        result.output_token_ids.extend(out.new_token_ids)
                    if out.finish_reason is FinishReason.ABORT:
                        raise RuntimeError(f"the engine aborted the request: {out.error or 'no reason given'}")
            finished = True
        finally:
            if not finished:  # timeout, abort or cancel: free its blocks
                self.engine.abort(engine_request.request_id)
        result.end_s = time.perf_counter()
        return result

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def describe(self) -> dict:
        return {
            "engine_args": dataclasses.asdict(self.engine_args),
            "tier_configs": "decode defaults, max_num_batched_tokens as the prefill tier",
            "weights": weights_description(self.engine_args.create_model_config(self.model_dir)),
        }
