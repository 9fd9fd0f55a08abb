"""AsyncLLMEngine: an LLMEngine driven by one background thread, streamed to asyncio.

The engine (scheduler, block manager, runner) is touched by its own thread only. Callers
send it commands (add, abort) through a thread-safe queue; it runs steps whenever there is
work and hands each step's outputs back to the caller's event loop in one batch. A forward
pass therefore never blocks the event loop that serves HTTP.

Closing a `generate` stream early (client disconnect, task cancellation, aclose) aborts its
request in `finally`, which frees every KV block the request held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.config import EngineConfig
from iterserve.replica.errors import (
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestFailedError,
)
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.lora_adapter import LoRACheck, LoRARequest
from iterserve.replica.lora_manager import UnknownAdapterError
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.request import TenantShare
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.stats import (
    FINISH_REASON_ABORT,
    FINISH_REASON_ERROR,
    EngineStats,
    StatLogger,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.25  # the idle stats tick: how often an idle loop refreshes stats and metrics


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_children: int
    num_finished: int = 0  # counted by the consumer
    num_finished_sent: int = 0  # counted by the engine thread


@dataclass
class _Command:
    run: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, start: bool = True) -> None:
        self.engine = LLMEngine(config)
        self.startup = self.engine.startup
        self.config = self.engine.config
        self.model_name = self.engine.model_name
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stats = self.engine.stats()
        self._draining = False
        self._stopped = False
        self._dead: BaseException | None = None
        # One lock per adapter name, held by a read-back and by an unload: an unload never
        # falls between a read-back's "still loaded?" and its register (see _serve_lora).
        self._lora_locks: dict[str, asyncio.Lock] = {}
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> AsyncLLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ------------------------------------------------------------------------- public API
    async def generate(
        self,
        prompt_token_ids: list[int] | str,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_namespace: CacheNamespace = b"",
        lora_request: LoRARequest | None = None,
        tenant: TenantShare | None = None,
        lora_still_loaded: LoRACheck | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream output deltas of every child; raises before yielding on bad input.
        cache_namespace: where its prefix-cache blocks live (replica/block_keys.py);
        `lora_request`: its adapter, read first (off the engine thread) if not yet served,
        and then only if `lora_still_loaded` says its version was not unloaded meanwhile."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._draining:
            raise EngineDrainingError("the engine is draining and admits no new requests")
        if lora_request is not None:
            await self._serve_lora(lora_request, lora_still_loaded)
        lora_name = lora_request.name if lora_request is not None else None
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sampling_params.n)
        # Arrival is now, not when the engine thread runs the add command: a busy loop
        # takes it only after its current step, and that wait is part of the TTFT.
        arrival = self.engine.clock()

        def add(engine: LLMEngine) -> None:
            bound = engine.config.scheduler.max_waiting_requests
            waiting = engine.num_waiting_requests  # the count stats() reports
            if bound is not None and waiting >= bound:
                raise QueueFullError(waiting)
            engine.add_request(prompt_token_ids, sampling_params, request_id, priority,
                               arrival_time=arrival, cache_namespace=cache_namespace,
                               lora_name=lora_name, tenant=tenant)
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self._submit(add))
        except asyncio.CancelledError:
            # The caller left while the request was being admitted: the add command still
            # runs (see _run_commands), so abort whatever it added.
            self._submit(lambda engine: self._abort(engine, request_id))
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.num_finished += 1
                    if stream.num_finished == stream.num_children:
                        finished = True
                        return
        finally:
            if not finished:
                self._submit(lambda engine: self._abort(engine, request_id))

    def list_loras(self) -> list[str]:
        """The adapters the engine serves (thread-safe: read under the manager's lock)."""
        return self.engine.list_loras()

    def resident_loras(self) -> list[str]:
        """The adapters in host memory or a device slot (thread-safe, as list_loras)."""
        return self.engine.resident_loras()

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter in `path` as `name`: read and checked in a worker thread, so the
        engine's running batch goes on (LoRALoadError names what is wrong)."""
        await asyncio.to_thread(self.engine.add_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving `name`, on the engine thread (AdapterInUseError while requests use
        it, UnknownAdapterError if not served)."""
        async with self._lora_lock(name):
            await self.call(lambda engine: engine.remove_lora(name))

    async def _serve_lora(self, lora: LoRARequest, still_loaded: LoRACheck | None) -> None:
        """Make `lora` servable here before its request is added. An adapter this engine
        does not serve (it started later, or an unload dropped it) is read back from its
        folder only if `still_loaded` says so, under the name's lock: an unload that raced
        the request's admission either ran first (then the check says no: a 404) or waits
        for the register, and then finds the request in the engine (409) or drops the
        adapter before the request is added (a 404 there). Either way no replica keeps an
        unloaded adapter."""
        if self.engine.lora is not None and lora.name in self.list_loras():
            # evicted from host memory by the LRU: read it here, not in the engine's step
            await asyncio.to_thread(self.engine.lora.hold, lora.name)
            return
        async with self._lora_lock(lora.name):
            if lora.name in self.list_loras():
                return
            if still_loaded is not None and not await still_loaded(lora):
                raise UnknownAdapterError(lora.name)
            await self.load_lora(lora.name, lora.path)

    def _lora_lock(self, name: str) -> asyncio.Lock:
        return self._lora_locks.setdefault(name, asyncio.Lock())

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda engine: self._abort(engine, request_id)))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (or idle tick); safe from any thread."""
        return self._stats

    async def cached_block_hashes(self) -> dict[str, list[int]] | None:
        """The prefix cache's stable block hashes per KV tier
        (`LLMEngine.cached_block_hashes`), taken
        on the engine thread between steps: that thread alone changes the cache."""
        return await self.call(lambda engine: engine.cached_block_hashes())

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._submit(lambda engine: engine.add_stat_logger(stat_logger))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (for inspection and tests)."""
        return await asyncio.wrap_future(self._submit(fn))

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting and wait for in-flight requests; True if all finished in time."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stats.num_running == 0 and self._stats.num_waiting == 0 and not self._streams:
                return True
            await asyncio.sleep(0.05)
        return False

    async def end_requests(self, message: str) -> int:
        """Stop admitting and end every request now (a drain that ran out of time): each
        stream raises EngineDrainingError(message), which its client sees as a 503 error
        (in-band after the first chunk), and the blocks are freed. Returns how many ended."""
        self._draining = True

        def end(engine: LLMEngine) -> int:
            ended = list(self._streams.items())
            self._streams.clear()
            for request_id, stream in ended:
                engine.abort_request(request_id)
                try:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                     EngineDrainingError(message))
                except RuntimeError:  # that caller's event loop is closed: nobody to tell
                    continue
            return len(ended)

        return int(await self.call(end))

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self.engine.constrained.shutdown()  # the grammar-compile threads
        disk = getattr(self.engine.runner, "disk_tier", None)
        if disk is not None:  # its queued writes land, so a replica restarted here finds them
            disk.close(timeout_s=10.0)

    # ----------------------------------------------------------------------- engine thread
    def _submit(self, run: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        command = _Command(run)
        if self._dead is not None or self._stopped:
            command.done.set_exception(EngineDeadError("the engine is not running"))
            return command.done
        self._commands.put(command)
        self._wakeup.set()
        return command.done

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        engine.abort_request(request_id)
        self._streams.pop(request_id, None)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._stats = self.engine.stats()
                else:
                    self.engine.log_idle_stats()
                    self._stats = self.engine.stats()
                    self._wakeup.wait(IDLE_WAIT_S)
                    self._wakeup.clear()
        except BaseException as error:  # noqa: BLE001 - every stream must learn the loop died
            logger.exception("engine loop died")
            self._dead = error
            dead = EngineDeadError(f"the engine loop died: {error!r}")
            self._end_streams(dead)
            self._fail_pending_commands(dead)
            self._count_unfinished(FINISH_REASON_ERROR)
            return
        self._end_streams(EngineDeadError("the engine shut down"))
        self._count_unfinished(FINISH_REASON_ABORT)

    def _end_streams(self, error: EngineDeadError) -> None:
        for stream in list(self._streams.values()):
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:  # that caller's event loop is closed: nobody to tell
                continue
        self._streams.clear()

    def _count_unfinished(self, reason: str) -> None:
        """Requests the engine will never finish (it stopped or died) end under `reason`,
        once, and the stat loggers see them: a dashboard counts every request sent."""
        try:
            self.engine.end_all_requests(reason)
            self.engine.log_idle_stats()
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a broken engine may not even count; say so
            logger.exception("could not count the unfinished requests of a stopped engine")

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            # A caller that was cancelled cancels its Future (asyncio.wrap_future); the command
            # still runs (an add must be followed by its abort, an abort must happen), but its
            # result goes nowhere: setting it on a cancelled Future raises InvalidStateError.
            wanted = command.done.set_running_or_notify_cancel()
            try:
                result = command.run(self.engine)
            except Exception as error:  # noqa: BLE001 - handed to the caller, not swallowed
                if wanted:
                    command.done.set_exception(error)
                else:
                    logger.debug("command of a cancelled caller failed: %r", error)
                continue
            if wanted:
                command.done.set_result(result)

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command.done.set_running_or_notify_cancel():  # False: the caller is gone
                command.done.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop,
                      list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:
                # One child failed: the caller raises this, and closing its stream aborts the
                # request's other children.
                failure = RequestFailedError(f"the request failed in the engine: {output.error}")
                by_loop.setdefault(stream.loop, []).append((stream.queue, failure))
                self._streams.pop(output.request_id, None)
                continue
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
            if output.finished:
                stream.num_finished_sent += 1
                if stream.num_finished_sent == stream.num_children:
                    self._streams.pop(output.request_id, None)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                # The caller's event loop is closed: nobody is listening, so free the requests.
                for _, output in items:
                    if isinstance(output, RequestOutput):  # a failed request already ended
                        self._abort(self.engine, output.request_id)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, output in items:
        q.put_nowait(output)
