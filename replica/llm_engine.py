"""LLMEngine: the synchronous engine. One `step()` is one iteration of continuous batching.

    add_request(...)      validate, tokenize if needed, queue (n > 1: one child per sample)
    step() -> outputs     schedule -> runner.execute -> scheduler.update -> detokenize
    abort_request(id)     finish now and free every block of every child

Async scheduling (`async_scheduling`, on by default with CUDA) overlaps the CPU with the
device, as vLLM v1's step_with_batch_queue and SGLang's overlap scheduler do. One step():

    schedule N+1 -> runner.launch(N+1)        the device still runs N; N+1 queues behind it
    N.result()   -> update -> detokenize      while the device runs N+1

The plan for N+1 assumes every request in N yields one token (a placeholder the runner fills
in from N's sampled ids on the device). Stop and finish decisions about N's tokens are
therefore taken one step late: a request that finished in N was also computed in N+1, and
that extra token is discarded in update (it never reaches the caller) and its blocks freed
at once. A request whose sampling reads its previous tokens (penalties, min_tokens, grammar)
is not planned past a token in flight: it waits one step, so its sampling stays exact. A
runner error in one request reaches the engine with the step's result, a step late, and
ends that request alone.

Callers that need concurrency use AsyncLLMEngine, which drives this class from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EngineConfig
from iterserve.replica.detokenizer import IncrementalDetokenizer
from iterserve.replica.errors import is_device_fault
from iterserve.replica.loader import read_generation_config, read_model_config
from iterserve.replica.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from iterserve.replica.request import Request, RequestStatus
from iterserve.replica.resolve import resolve_engine_config
from iterserve.replica.runner_base import Runner, StepHandle
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.stats import EngineStats, FinishedRequestStats, IterationStats, StatLogger
from iterserve.replica.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 2.0  # window of the step_token_rate signal


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        config = resolve_engine_config(config)  # unchanged when the deployment resolved it
        model_path = Path(config.model)
        model_config = read_model_config(model_path)
        self.config = config
        self.clock = clock
        self.model_name = config.served_model_name
        self.tokenizer = Tokenizer.from_pretrained(model_path)
        generation = read_generation_config(model_path)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            generation.eos_token_ids
        )
        self.runner = self._build_runner(config, model_path, model_config.vocab_size)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks(), config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, clock,
                                   plans_ahead=bool(config.async_scheduling))
        self._in_flight: InFlightStep | None = None  # async scheduling: the launched step
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.children: dict[str, list[str]] = {}  # parent id -> child ids
        self.pending_children: dict[str, list[Request]] = {}  # held until child 0 prefilled
        self.stat_loggers: list[StatLogger] = []
        self._recent_steps: deque[tuple[float, int]] = deque()
        self._last_step_tokens = 0
        self._ids = itertools.count()

    @staticmethod
    def _build_runner(config: EngineConfig, model_path: Path, vocab_size: int) -> Runner:
        if config.runner == "simulated":
            from iterserve.replica.sim_runner import SimulatedRunner

            return SimulatedRunner(config, vocab_size)
        from iterserve.replica.model_runner import ModelRunner

        return ModelRunner(config, model_path)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # -------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Bad input raises ValueError."""
        params = sampling_params or SamplingParams()
        prompt_ids = self._prompt_token_ids(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        for name, num in (("logprobs", params.logprobs),
                          ("prompt_logprobs", params.prompt_logprobs)):
            if num is not None and num > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= {self.config.max_logprobs}, got {num}")
        arrival = self.clock() if arrival_time is None else arrival_time
        children = [
            Request(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=list(prompt_ids),
                sampling_params=params,
                arrival_time=arrival,
                priority=priority,
                eos_token_ids=self.eos_token_ids,
                index=i,
                parent_id=request_id,
            )
            for i in range(params.n)
        ]
        self.scheduler.check_fits(children[0])
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            self.pending_children[request_id] = children[1:]
        self.children[request_id] = [c.request_id for c in children]
        for child in children:
            self.detokenizers[child.request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
        return request_id

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request and all of its children; returns their final outputs."""
        outputs = []
        for child in self.pending_children.pop(request_id, []):
            outputs.append(self._final_abort_output(child))
        for child_id in self.children.get(request_id, []):
            request = self.scheduler.abort_request(child_id)
            if request is not None:
                self.runner.release(child_id)
                outputs.append(self._final_abort_output(request))
        self._forget(request_id)
        return outputs

    def _final_abort_output(self, request: Request) -> RequestOutput:
        request.status = RequestStatus.FINISHED_ABORTED
        return self._output(request, [], "", None)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.pending_children)
                or self._in_flight is not None)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.children)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: queued (preempted ones included) or held back as later
        children of an n > 1 request. The count `stats()` reports and admission bounds."""
        return self.scheduler.num_waiting + sum(map(len, self.pending_children.values()))

    # ------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration and return a delta for every request that got a token or ended.

        Fault isolation: an exception raised by one request's work (its inputs, its sampling
        row, its detokenization) ends that request alone with finish_reason "error"; its batch
        mates' tokens stand. Only a device fault (`is_device_fault`) escapes, and stops the loop.
        """
        if self.config.async_scheduling:
            return self._step_overlapped()
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        return self._finish_step(start, scheduler_output, runner_output)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Plan and launch step N+1, then finish step N while the device runs N+1."""
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        launched = None
        if not scheduler_output.is_empty:
            try:
                launched = InFlightStep(start, scheduler_output,
                                        self.runner.launch(scheduler_output))
            except Exception as error:  # noqa: BLE001 - a device fault is re-raised
                if is_device_fault(error):
                    raise
                return self._settle_and_isolate(start, scheduler_output, error)
        outputs = self.finish_in_flight()
        self._in_flight = launched
        return outputs

    def _settle_and_isolate(self, start: float, scheduler_output: SchedulerOutput,
                            error: Exception) -> list[RequestOutput]:
        """A batched launch raised: finish the step in flight (its tokens become the inputs
        this step was missing), then run this step request by request, synchronously, so
        that only the requests at fault end and the next plan starts from settled state."""
        logger.warning("a batched launch raised %r; running its requests one by one", error)
        outputs = self.finish_in_flight()
        runner_output = self._execute_one_by_one(scheduler_output)
        return outputs + self._finish_step(start, scheduler_output, runner_output)

    def finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the launched step, if any (async scheduling), and return its outputs."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            return []
        return self._finish_step(previous.start, previous.scheduler_output,
                                 previous.handle.result())

    def _finish_step(self, start: float, scheduler_output: SchedulerOutput,
                     runner_output: RunnerOutput) -> list[RequestOutput]:
        """Fill in a step's sampled tokens, stream them, and forget what finished. Under
        async scheduling this runs a step late: a request may have ended meanwhile."""
        self._record_prompt_logprobs(runner_output)
        failed = [s.request for s in scheduler_output.scheduled
                  if s.request.request_id in runner_output.failed and not s.request.is_finished]
        outputs = [self._fail(r, runner_output.failed[r.request_id]) for r in failed]
        updated = self.scheduler.update(scheduler_output, runner_output)
        outputs += [self._detokenize_or_fail(r, runner_output) for r in updated]
        self._release_pending_children()
        finished = [r for r in updated if r.is_finished] + failed
        for request in finished:
            self.runner.release(request.request_id)
            self._forget_child(request)
        self._record(start, scheduler_output, updated, finished)
        return outputs

    def _record_prompt_logprobs(self, runner_output: RunnerOutput) -> None:
        """Keep each chunk's prompt logprobs on its request (before update can finish it)."""
        for request_id, chunk in runner_output.prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                request.record_prompt_logprobs(chunk)

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run the batch; if a batched operation raises, run each request alone to find which
        request's inputs it choked on, and fail only those."""
        try:
            return self.runner.execute(scheduler_output)
        except Exception as error:  # noqa: BLE001 - a device fault is re-raised
            if is_device_fault(error):
                raise
            logger.warning("a batched step raised %r; running its requests one by one", error)
            return self._execute_one_by_one(scheduler_output)

    def _execute_one_by_one(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        merged = RunnerOutput()
        for scheduled in scheduler_output.scheduled:
            if scheduled.is_padding:
                continue
            alone = SchedulerOutput(scheduled=[scheduled], num_batched_tokens=scheduled.num_new_tokens)
            try:
                merged.merge(self.runner.execute(alone))
            except Exception as error:  # noqa: BLE001 - this request's failure; device faults raise
                if is_device_fault(error):
                    raise
                merged.failed[scheduled.request.request_id] = f"{type(error).__name__}: {error}"
        return merged

    def _fail(self, request: Request, reason: str) -> RequestOutput:
        """End one request with an error: its blocks are freed, its client is told why."""
        logger.warning("request %s failed in the engine: %s", request.request_id, reason)
        if not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        return dataclasses.replace(self._output(request, [], "", None), error=reason)

    def _detokenize_or_fail(self, request: Request, runner_output: RunnerOutput) -> RequestOutput:
        try:
            return self._detokenize(request, runner_output)
        except Exception as error:  # noqa: BLE001 - this request's failure; device faults raise
            if is_device_fault(error):
                raise
            return self._fail(request, f"{type(error).__name__}: {error}")

    def _detokenize(self, request: Request, runner_output: RunnerOutput) -> RequestOutput:
        token_id = request.output_token_ids[-1]
        detokenizer = self.detokenizers[request.request_id]
        text, matched_stop = detokenizer.add([token_id])
        if matched_stop is not None and not request.is_finished:
            request.stop_reason = matched_stop
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished and matched_stop is None:
            text += detokenizer.flush()
        logprobs = runner_output.logprobs.get(request.request_id)
        output = self._output(request, [token_id], text, [logprobs] if logprobs else None)
        if request.wants_prompt_logprobs and request.num_output_tokens == 1:
            output.prompt_logprobs = list(request.prompt_logprobs)
        return output

    def _output(self, request: Request, token_ids: list[int], text: str,
                logprobs: list | None) -> RequestOutput:
        return RequestOutput(
            request_id=request.parent_id or request.request_id,
            index=request.index,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=logprobs,
            stop_reason=request.stop_reason,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
        )

    def _release_pending_children(self) -> None:
        """Children of an n > 1 request join once the first child has prefilled the prompt,
        so that they find its blocks in the prefix cache instead of recomputing them."""
        for parent_id in list(self.pending_children):
            first = self.children[parent_id][0]
            head = self.scheduler.get_request(first)
            if head is None or head.num_output_tokens > 0:
                for child in self.pending_children.pop(parent_id):
                    self.scheduler.add_request(child)

    def _forget_child(self, request: Request) -> None:
        self.detokenizers.pop(request.request_id, None)
        parent = request.parent_id or request.request_id
        siblings = self.children.get(parent, [])
        unfinished = any(self.scheduler.get_request(s) is not None for s in siblings)
        if not unfinished and parent not in self.pending_children:
            self.children.pop(parent, None)

    def _forget(self, request_id: str) -> None:
        for child_id in self.children.pop(request_id, []):
            self.detokenizers.pop(child_id, None)

    # ----------------------------------------------------------------------------- stats
    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    def stats(self) -> EngineStats:
        now = self.clock()
        while self._recent_steps and now - self._recent_steps[0][0] > RATE_WINDOW_S:
            self._recent_steps.popleft()
        recent_tokens = sum(tokens for _, tokens in self._recent_steps)
        manager = self.block_manager
        return EngineStats(
            timestamp=time.time(),
            num_running=self.scheduler.num_running,
            num_waiting=self.num_waiting_requests,
            num_total_blocks=manager.num_total_blocks,
            num_free_blocks=manager.num_free_blocks,
            kv_usage=manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_out_of_blocks=self.scheduler.num_out_of_blocks,
            last_step_tokens=self._last_step_tokens,
            step_token_rate=recent_tokens / RATE_WINDOW_S,
            prefix_cache_queries=manager.prefix_queries,
            prefix_cache_hits=manager.prefix_hits,
            max_waiting_requests=self.config.scheduler.max_waiting_requests,
        )

    def _record(self, start: float, output: SchedulerOutput, updated: list[Request],
                finished: list[Request]) -> None:
        now = self.clock()
        self._last_step_tokens = output.num_batched_tokens
        self._recent_steps.append((now, output.num_batched_tokens))
        if not self.stat_loggers:
            return
        ttfts, itls = [], []
        for request in updated:
            if request.num_output_tokens == 1:
                ttfts.append(request.first_token_time - request.arrival_time)
            elif len(request.token_times) >= 2:
                itls.append(request.token_times[-1] - request.token_times[-2])
        iteration = IterationStats(
            timestamp=time.time(),
            step_time_s=now - start,
            num_prompt_tokens=output.num_prefill_tokens,
            num_generation_tokens=len(updated),
            num_scheduled_requests=len(output.scheduled),
            num_preempted=len(output.preempted),
            time_to_first_tokens_s=ttfts,
            inter_token_latencies_s=itls,
        )
        finished_stats = [finished_request_stats(r) for r in finished]
        snapshot = self.stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration, finished_stats)


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A launched step whose sampled tokens are not yet on the host."""

    start: float
    scheduler_output: SchedulerOutput
    handle: StepHandle


def finished_request_stats(request: Request) -> FinishedRequestStats:
    end = request.finished_time or request.arrival_time
    admitted = request.admitted_time or end
    first = request.first_token_time
    return FinishedRequestStats(
        finish_reason=request.finish_reason or "abort",
        e2e_latency_s=end - request.arrival_time,
        queue_time_s=admitted - request.arrival_time,
        prefill_time_s=(first - admitted) if first is not None else 0.0,
        decode_time_s=(end - first) if first is not None else 0.0,
        time_to_first_token_s=(first - request.arrival_time) if first is not None else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        max_tokens=request.sampling_params.max_tokens,
    )
