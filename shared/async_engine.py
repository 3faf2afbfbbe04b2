"""AsyncEngine: runs an LLMEngine on its own thread and hands outputs to asyncio callers.

Every touch of the engine (add, abort, KV import, stats) runs on the engine thread between steps, so the engine
itself needs no locks. Each request's outputs arrive on its own asyncio.Queue; a None marks the end.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from shared.engine import LLMEngine, RequestOutput
from shared.request import FinishReason, Request

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable, *args):
        """Run fn(*args) on the engine thread; return its result or raise its exception here."""
        future = self.loop.create_future()
        self._commands.put((fn, args, future))
        return await future

    async def add(self, admit: Callable, request: Request) -> asyncio.Queue:
        """Admit a request with admit(request) (engine.add_request or engine.reserve) and return the queue its
        outputs arrive on. ValueError if its id is in use here. If admission fails or the caller is cancelled
        meanwhile, the request is aborted, so nothing stays behind."""
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        try:
            await self.call(admit, request)
        except BaseException:
            self.abort(request.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Drop the stream and abort on the engine (blocks freed at once); safe if already finished.

        NOTE: queued behind every earlier command, so it also undoes an admission still in the queue.
        """
        self._streams.pop(request_id, None)
        self._commands.put((self.engine.abort_request, (request_id,), None))

    def stop(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=5)

    # -- engine thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._drain_commands(timeout=0.5)
            else:  # a stalled engine (queued work, no room) waits for a command instead of spinning
                self._drain_commands(timeout=0.01 if self.engine.last_step_num_tokens == 0 else None)
            if self._stopped or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not take the service down: fail this batch, keep serving
                log.exception("engine step failed")
                outputs = self._abort_all(f"engine step failed: {e}")
            if outputs:
                self.loop.call_soon_threadsafe(self.deliver, outputs)

    def _drain_commands(self, timeout: float | None) -> None:
        """Run queued commands; wait up to timeout seconds for the first one (None: do not wait)."""
        try:
            item = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, future = item
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            if future is not None:
                self.loop.call_soon_threadsafe(_resolve, future, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort_all(self, error: str) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            outputs.append(RequestOutput(request_id, [], FinishReason.ABORT, error))
        return outputs

    # -- event loop ----------------------------------------------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams (event-loop thread): step() results, and ones made elsewhere (e.g. by
        finish_kv_import)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put_nowait(out)
            if out.finished:
                stream.put_nowait(None)
                self._streams.pop(out.request_id, None)


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
