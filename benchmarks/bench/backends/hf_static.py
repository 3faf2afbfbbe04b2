"""hf-static: HF transformers fp32 `generate` with static batching, the baseline of plain PyTorch serving.

A batch (left-padded to its longest prompt) runs greedy for the batch's longest output, min_new_tokens =
max_new_tokens so no row stops early; each request counts only its own output_len tokens. A LogitsProcessor
timestamps every generation step: a request's tokens are timed at their steps (TTFT = its batch's first step),
but all of them arrive when the batch ends (E2E = until the batch is done), as a static batch returns them.
"""
from __future__ import annotations

import asyncio
import gc
import time
from concurrent.futures import ThreadPoolExecutor

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.workloads import BenchRequest


class StepTimer:
    """A transformers LogitsProcessor that records when each generation step's logits are ready
    (time.perf_counter() seconds) and leaves the scores as they are."""

    def __init__(self):
        self.times_s: list[float] = []

    def __call__(self, input_ids, scores):
        self.times_s.append(time.perf_counter())
        return scores


class HFStaticBackend:
    name = "hf-static"
    static_batching = True

    def __init__(self, model_dir: str, threads: int):
        self.model_dir = model_dir
        self.threads = threads
        self.model = None
        self.pad_token_id: int | None = None
        # NOTE: every torch call runs on this one thread: run on whichever thread asyncio.to_thread picked, a
        # decode step took 43 to 68 ms from one run to the next (2 threads, 2 cores); on one thread, 42 to 50.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hf-static")

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.threads)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()

    async def generate_batch(self, requests: list[BenchRequest], start_times_s: list[float]) -> list[RequestResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._generate_batch, requests, start_times_s)

    def _generate_batch(self, requests: list[BenchRequest], start_times_s: list[float]) -> list[RequestResult]:
        import torch
        from transformers import LogitsProcessorList

        width = max(r.prompt_len for r in requests)
        input_ids = torch.tensor([[self.pad_token_id] * (width - r.prompt_len) + list(r.prompt_token_ids)
                                  for r in requests])  # [batch, width], left-padded  # fmt: skip
        attention_mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in requests])
        num_new = max(r.output_len for r in requests)
        timer = StepTimer()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                                      min_new_tokens=num_new, do_sample=False, pad_token_id=self.pad_token_id,
                                      logits_processor=LogitsProcessorList([timer]))  # fmt: skip
        end_s = time.perf_counter()
        results = []
        for row, (request, start_s) in enumerate(zip(requests, start_times_s)):
            result = RequestResult(request.index, request.prompt_len, start_s=start_s, end_s=end_s)
            result.output_token_ids = out[row, width : width + request.output_len].tolist()
            result.token_times_s = timer.times_s[: request.output_len]
            results.append(result)
        return results

    async def stop(self) -> None:
        self.model = None
        self._thread.shutdown()
        gc.collect()

    def describe(self) -> dict:
        return {"library": "transformers generate, static batches", "weights": "float32", "threads": self.threads}
