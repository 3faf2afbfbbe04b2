"""AsyncEngine: runs an LLMEngine on its own thread; asyncio callers talk to it through typed methods.

Each method puts a typed command on one queue; the engine thread runs the queued commands between steps and
dispatches them in one place (_execute), so the engine needs no locks and callers can reach nothing else of it
(as mini-sglang's scheduler takes typed messages). Each request's outputs arrive on its own asyncio.Queue; a
None marks the end.

NOTE: a request id can be reused once its request is aborted, while outputs the engine made for the old one are
still on their way to the event loop. So each admission gets a serial number, the engine thread tags every output
with the serial of the admission it belongs to, and a stream takes only outputs with its own serial.

Over 400 lines on purpose: the typed commands and the one loop that dispatches them read together.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tandem.shared.block_hash import BlockHash
from tandem.shared.config import CacheConfig, ModelConfig
from tandem.shared.engine_args import EngineArgs
from tandem.shared.engine import LLMEngine, RequestOutput
from tandem.shared.engine_stats import EngineStats, StepStats
from tandem.shared.errors import InvalidRequestError, NoCapacityError
from tandem.shared.kv_connector import KVBlocks
from tandem.shared.kv_events import KVEventBatch
from tandem.shared.lora.manager import LoRAInfo
from tandem.shared.lora.peft import LoRAAdapter
from tandem.shared.lora.request import LoRARequest
from tandem.shared.request import FinishReason, Request

log = logging.getLogger(__name__)


# -- the commands the engine thread takes --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request
    reserve: bool  # decode tier: hold blocks for KV from a prefill instead of computing the prompt
    serial: int  # this admission's number (see the module's NOTE)


@dataclass(frozen=True, slots=True)
class ImportKV:
    request_id: str
    kv: KVBlocks


@dataclass(frozen=True, slots=True)
class FinishKVImport:
    request_id: str
    first_token_id: int


@dataclass(frozen=True, slots=True)
class FailKVImport:
    request_id: str
    error: str


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class GetStats:
    pass


@dataclass(frozen=True, slots=True)
class GetKVSnapshot:
    pass


@dataclass(frozen=True, slots=True)
class AddLoRA:
    adapter: LoRAAdapter  # read and checked already (LLMEngine.read_lora, off the engine thread)


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    lora_name: str


@dataclass(frozen=True, slots=True)
class ListLoRAs:
    pass


Command = (AddRequest | ImportKV | FinishKVImport | FailKVImport | Abort | GetStats | GetKVSnapshot | AddLoRA
           | RemoveLoRA | ListLoRAs)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[StepStats], None] | None = None, on_lost: Callable[[str], None] | None = None):
        """on_step: called on the engine thread with each step's StepStats (metrics; must be quick and
        thread-safe). on_lost: for a tensor-parallel engine, called on the event loop with the reason once a step
        fails (a rank died mid-step, or rank 0 failed between its messages and the collectives): the ranks may be
        out of step, so the instance steps no more (lost). Its requests are then no request's own failure: they get
        no output, and on_lost's caller ends them as the instance's death would (services/engine_main.py stops the
        server: their calls end UNAVAILABLE and the gateway places them elsewhere). Without on_lost they end with
        the error (ABORT). A single-process engine whose step fails keeps serving: that batch ends with an
        error."""
        self._engine = engine
        self._loop = loop
        self._on_step = on_step
        self._on_lost = on_lost
        self.lost: str | None = None  # why the tensor-parallel instance can step no more, once it cannot
        self._commands: queue.SimpleQueue[tuple[Command, asyncio.Future | None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[int, asyncio.Queue]] = {}  # request id -> (admission serial, queue)
        self._serials = itertools.count()
        self._engine_serials: dict[str, int] = {}  # engine thread: request id -> serial of the admitted request
        # engine thread: reservations waiting for room that lower-priority requests will free (NoCapacityError
        # room_soon), tried again after every step and batch of commands, best priority first
        self._parked: list[tuple[AddRequest, asyncio.Future]] = []
        self._stopped = False
        # seconds from one step's start to the next one's at least, commands still run in between (0: none): a
        # decode yielding its CPUs to a prefill that shares them (services/engine_main.py _yield_to_prefill)
        self.step_interval_s = 0.0
        # the prefix cache's change batches (LLMEngine.take_kv_events), for the prefix index publisher
        self.kv_events: asyncio.Queue[KVEventBatch] = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def model_config(self) -> ModelConfig:
        return self._engine.model_config  # frozen: safe to read from any thread

    @property
    def cache_config(self) -> CacheConfig:
        return self._engine.cache_config

    @property
    def tp_workers(self):
        """The other ranks of a tensor-parallel engine (shared/parallel/executor.py TensorParallelWorkers), or None:
        fixed at start. Their pipes are the engine thread's once it steps (services/kv_shards.py starts their KV
        transfer before the server serves)."""
        return self._engine.tp_workers

    # -- the interface (event-loop thread) -----------------------------------------------------------------
    async def add_request(self, request: Request) -> asyncio.Queue:
        """Queue a request to compute from its first token; return the queue its RequestOutputs arrive on."""
        return await self._admit(request, reserve=False)

    async def reserve(self, request: Request) -> asyncio.Queue:
        """Decode tier: hold blocks for the prompt's KV (LLMEngine.reserve); return the output queue. When the
        blocks it needs are held by requests of lower priority still waiting for their KV, it waits until those
        decode and can be preempted (or the caller gives up) instead of failing with NoCapacityError."""
        return await self._admit(request, reserve=True)

    async def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Write received KV blocks into the request's reserved blocks (LLMEngine.import_kv)."""
        await self._call(ImportKV(request_id, kv))

    async def finish_kv_import(self, request_id: str, first_token_id: int) -> None:
        """The prompt's KV is complete: the request joins the running batch (or finishes, if first_token_id
        ends it; that output goes to its stream)."""
        await self._call(FinishKVImport(request_id, first_token_id))

    async def fail_kv_import(self, request_id: str, error: str) -> None:
        """A KV transfer broke: fail the request if it still waits for KV (its stream gets an ABORT with error)."""
        await self._call(FailKVImport(request_id, error))

    async def stats(self) -> EngineStats:
        return await self._call(GetStats())

    async def kv_snapshot(self) -> tuple[int, list[tuple[BlockHash, str]]]:
        """(seq of the last KV event batch, every (block hash, tier) the prefix cache holds), taken at one instant: the
        state a rebuilt prefix index starts from (events not yet handed out go out first, as batch seq)."""
        return await self._call(GetKVSnapshot())

    async def add_lora(self, lora: LoRARequest | LoRAAdapter) -> bool:
        """Serve a LoRA adapter from the next step on (LLMEngine.add_lora): a LoRARequest's directory is read and
        checked on a worker thread first (a LoRAAdapter was read already), so the steps go on meanwhile.
        InvalidRequestError naming the adapter."""
        adapter = await asyncio.to_thread(self._engine.read_lora, lora) if isinstance(lora, LoRARequest) else lora
        return await self._call(AddLoRA(adapter))

    async def remove_lora(self, lora_name: str) -> None:
        """Stop serving an adapter (LLMEngine.remove_lora: its running requests finish with it)."""
        await self._call(RemoveLoRA(lora_name))

    async def list_loras(self) -> list[LoRAInfo]:
        return await self._call(ListLoRAs())

    def abort(self, request_id: str) -> None:
        """Drop the stream and abort on the engine (blocks freed at once); safe if already finished.

        NOTE: queued behind every earlier command, so it also undoes an admission still in the queue.
        """
        self._streams.pop(request_id, None)
        self._commands.put((Abort(request_id), None))

    def stop(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=5)
        self._engine.close()  # (the KV tiers' threads: the disk tier's pending writes finish)

    async def _admit(self, request: Request, reserve: bool) -> asyncio.Queue:
        """InvalidRequestError if the id is in use here or its structured_output does not compile (compiled on a
        worker thread first, so that a large grammar does not stall the engine's batch). If admission fails or the
        caller is cancelled meanwhile, the request is aborted, so nothing stays behind."""
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        serial = next(self._serials)
        self._streams[request_id] = (serial, stream)
        try:
            constraint = request.sampling_params.structured_output
            if constraint is not None and request.grammar is None:  # compiled off the engine thread
                request.grammar = await asyncio.to_thread(self._engine.structured_output_manager.matcher, constraint)
            await self._call(AddRequest(request, reserve, serial))
        except BaseException:
            self.abort(request_id)
            raise
        return stream

    async def _call(self, command: Command):
        future = self._loop.create_future()
        self._commands.put((command, future))
        return await future

    # -- engine thread -------------------------------------------------------------------------------------
    def _execute(self, command: Command):
        """Run one command on the engine; the one place that touches it on behalf of callers."""
        engine = self._engine
        match command:
            case AddRequest(request, reserve, serial):
                (engine.reserve if reserve else engine.add_request)(request)
                self._engine_serials[request.request_id] = serial
            case ImportKV(request_id, kv):
                engine.import_kv(request_id, kv)
            case FinishKVImport(request_id, first_token_id):
                self._publish([engine.finish_kv_import(request_id, first_token_id)])
            case FailKVImport(request_id, error):
                self._publish([engine.fail_kv_import(request_id, error)])
            case Abort(request_id):
                engine.abort_request(request_id)
                self._engine_serials.pop(request_id, None)
                self._parked = [(c, f) for c, f in self._parked if c.request.request_id != request_id]
            case GetStats():
                return engine.stats()
            case GetKVSnapshot():
                self._publish_kv_events()
                return engine.kv_event_seq, engine.kv_cache_manager.cached_block_tiers()
            case AddLoRA(adapter):
                return engine.add_lora(adapter)
            case RemoveLoRA(lora_name):
                engine.remove_lora(lora_name)
            case ListLoRAs():
                return engine.list_loras()
            case _:
                raise TypeError(f"unknown engine command {command!r}")
        return None

    def _run(self) -> None:
        while not self._stopped:
            if self.lost is not None:  # (commands are still answered; nothing steps)
                self._drain_commands(timeout=0.5)
                if self._on_lost is None:
                    self._publish(self._abort_all(self.lost))
                continue
            if not self._engine.has_unfinished_requests():
                self._drain_commands(timeout=0.5)
            else:  # a stalled engine (queued work, no room) waits for a command instead of spinning
                self._drain_commands(timeout=0.01 if self._engine.last_step_num_tokens == 0 else None)
            self._retry_parked()
            self._publish_kv_events()  # (commands change the cache too: a finished KV import publishes blocks)
            if self._stopped or not self._engine.has_unfinished_requests():
                continue
            step_start = time.monotonic()
            try:
                outputs = self._engine.step()
            except Exception as e:
                log.exception("engine step failed")
                outputs = self._step_failed(e)
            self._publish(outputs)
            if self._on_step is not None and self._engine.last_step_stats is not None:
                try:
                    self._on_step(self._engine.last_step_stats)
                except Exception:  # (metrics must never stop the engine)
                    log.exception("on_step failed")
            self._retry_parked()
            self._publish_kv_events()
            while not self._stopped and (left := step_start + self.step_interval_s - time.monotonic()) > 0:
                self._drain_commands(timeout=left)

    def _drain_commands(self, timeout: float | None) -> None:
        """Run queued commands; wait up to timeout seconds for the first one (None: do not wait)."""
        try:
            item = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._run_command(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, command: Command, future: asyncio.Future | None) -> None:
        """Execute a command and answer its caller; a reservation that will fit soon is parked instead."""
        try:
            result, error = self._execute(command), None
        except NoCapacityError as e:
            if e.room_soon and isinstance(command, AddRequest) and future is not None:
                self._parked.append((command, future))
                return
            result, error = None, e
        except Exception as e:
            result, error = None, e
        if future is not None:
            self._loop.call_soon_threadsafe(_resolve, future, result, error)
        elif error is not None:
            log.error("engine command %s failed: %r", type(command).__name__, error)

    def _retry_parked(self) -> None:
        """Try the parked reservations again, best priority (then oldest) first."""
        parked = sorted(self._parked, key=lambda item: item[0].request.priority)
        self._parked = []
        for command, future in parked:
            self._run_command(command, future)

    def _step_failed(self, error: Exception) -> list[RequestOutput]:
        """The outputs of a step that raised. One process: a bug must not take the service down, so the batch's
        requests end with an error and the engine keeps serving. Tensor-parallel: the instance is lost
        (see __init__'s on_lost)."""
        if self._engine.tp_workers is None:
            return self._abort_all("engine step failed")
        self.lost = f"a step of this tensor-parallel instance failed ({type(error).__name__}: {error})"
        if self._on_lost is None:
            return self._abort_all(self.lost)
        self._loop.call_soon_threadsafe(self._on_lost, self.lost)
        return []

    def _abort_all(self, error: str) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self._engine.requests):
            self._engine.abort_request(request_id)
            outputs.append(RequestOutput(request_id, [], FinishReason.ABORT, error))
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last batch to the event loop (engine thread)."""
        batch = self._engine.take_kv_events()
        if batch is not None:
            self._loop.call_soon_threadsafe(self.kv_events.put_nowait, batch)

    def _publish(self, outputs: list[RequestOutput | None]) -> None:
        """Send outputs to the event loop, each tagged with its admission's serial (engine thread)."""
        tagged = []
        for out in outputs:
            if out is None:
                continue
            serial = self._engine_serials.pop if out.finished else self._engine_serials.get
            tagged.append((serial(out.request_id, None), out))
        if tagged:
            self._loop.call_soon_threadsafe(self._deliver, tagged)

    # -- event loop ----------------------------------------------------------------------------------------
    def _deliver(self, tagged: list[tuple[int | None, RequestOutput]]) -> None:
        """Hand outputs to their streams (event-loop thread); one made for an earlier admission of the same id is
        dropped."""
        for serial, out in tagged:
            serial_and_stream = self._streams.get(out.request_id)
            if serial_and_stream is None or serial_and_stream[0] != serial:
                continue
            stream = serial_and_stream[1]
            stream.put_nowait(out)
            if out.finished:
                stream.put_nowait(None)
                self._streams.pop(out.request_id, None)


def build_engine(engine_args: EngineArgs, tier: str, model_dir: str, export_kv: bool = False,
                 kv_events: bool = False, tp_worker_module: str | None = None) -> LLMEngine:
    """The LLMEngine of engine_args for tier (model_dir when engine_args.model is None), built to be stepped on
    AsyncEngine's thread with engine_args.threads torch threads (set here, for that thread to take) and the tier's
    kernel threads (kernels/cpu_ext.py set_num_threads; they serve whichever thread calls the kernels).
    tp_worker_module: what tensor-parallel ranks > 0 run (ParallelConfig.worker_module; None: its default).

    NOTE: built with one torch thread: built with several on this thread, its steps on the engine thread ran about
    2x slower at 2 threads (measured 69-71 vs 38-43 ms per decode step at batch 1)."""
    import torch

    from tandem.kernels import cpu_ext

    model_config, cache_config, scheduler_config = engine_args.create_configs(tier, model_dir)
    kernel_threads = engine_args.resolved_kernel_threads(tier)
    torch.set_num_threads(1)
    engine = LLMEngine(model_config, cache_config, scheduler_config, engine_args.device, export_kv=export_kv,
                       kv_events=kv_events, speculative_config=engine_args.create_speculative_config(),
                       kv_tier_config=engine_args.create_kv_tier_config(),
                       lora_config=engine_args.create_lora_config(),
                       parallel_config=engine_args.create_parallel_config(tier, tp_worker_module))
    torch.set_num_threads(engine_args.threads)
    if engine.model_runner.device.type == "cpu":
        cpu_ext.set_num_threads(kernel_threads)
    return engine


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
