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
from collections.abc import Callable
from pathlib import Path

from iterserve.replica.block_keys import CacheNamespace, with_adapter
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EngineConfig
from iterserve.replica.constrained_requests import ConstrainedRequests
from iterserve.replica.detokenizer import IncrementalDetokenizer
from iterserve.replica.engine_lora import EngineLoRA
from iterserve.replica.engine_stats import EngineStatsReporting
from iterserve.replica.errors import is_device_fault
from iterserve.replica.fault_isolation import execute_isolating_faults, execute_one_by_one
from iterserve.replica.host_kv_eviction import make_eviction_policy
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.loader import read_generation_config, read_model_config
from iterserve.replica.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from iterserve.replica.request import Request, RequestStatus, TenantShare
from iterserve.replica.resolve import resolve_engine_config
from iterserve.replica.runner_base import Runner, StepHandle
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.slo_admission import check_ttft_slo
from iterserve.replica.startup import StartupRecorder
from iterserve.replica.stats import (
    FINISH_REASON_ABORT,
    FINISH_REASON_ERROR,
)
from iterserve.replica.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.02  # how long an otherwise idle step waits for a grammar to compile


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class LLMEngine(EngineStatsReporting, EngineLoRA):
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        # Its start-up stages (replica/startup.py), the runner's merged in below.
        self.startup = StartupRecorder()
        with self.startup.stage("model_config"):
            config = resolve_engine_config(config)  # unchanged when the deployment resolved it
            model_path = Path(config.model)
            model_config = read_model_config(model_path)
        self.config = config
        self.clock = clock
        self.model_name = config.served_model_name
        with self.startup.stage("tokenizer"):
            self.tokenizer = Tokenizer.from_pretrained(model_path)
            generation = read_generation_config(model_path)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            generation.eos_token_ids
        )
        self.runner = self._build_runner(config, model_path, model_config.vocab_size)
        runner_startup = getattr(self.runner, "startup", None)
        if runner_startup is not None:
            self.startup.merge(runner_startup)
        with self.startup.stage("engine_start"):
            self.block_manager = BlockManager(self.runner.num_kv_blocks(),
                                              config.cache.block_size,
                                              config.cache.enable_prefix_caching,
                                              self._host_kv_index(config),
                                              getattr(self.runner, "disk_tier", None))
            self.scheduler = Scheduler(config.scheduler, self.block_manager, clock,
                                       plans_ahead=bool(config.async_scheduling),
                                       max_loras=config.max_loras if config.enable_lora else 0)
            self.init_lora(config)
            self.constrained = ConstrainedRequests(self.tokenizer, self.runner.vocab_size,
                                                   sorted(self.eos_token_ids))
        self._in_flight: InFlightStep | None = None  # async scheduling: the launched step
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.children: dict[str, list[str]] = {}  # parent id -> child ids
        self.pending_children: dict[str, list[Request]] = {}  # held until child 0 prefilled
        self.init_stats()
        self._ids = itertools.count()

    @staticmethod
    def _build_runner(config: EngineConfig, model_path: Path, vocab_size: int) -> Runner:
        if config.runner == "simulated":
            from iterserve.replica.sim_runner import SimulatedRunner

            return SimulatedRunner(config, vocab_size)
        from iterserve.replica.model_runner import ModelRunner

        return ModelRunner(config, model_path)

    def _host_kv_index(self, config: EngineConfig) -> HostKVIndex | None:
        """The index of the runner's host KV tier, if the config asks for one."""
        if config.cache.kv_offloading_size is None:
            return None
        if config.runner != "model":
            raise ValueError(f"kv_offloading_size needs runner='model' (the host KV tier "
                             f"holds real KV tensors), not runner={config.runner!r}")
        num_slots = self.runner.num_host_kv_blocks()
        policy = make_eviction_policy(config.cache.kv_offloading_eviction_policy, num_slots)
        return HostKVIndex(num_slots, policy)

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
        cache_namespace: CacheNamespace = b"",
        lora_name: str | None = None,
        tenant: TenantShare | None = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Bad input raises ValueError;
        `lora_name` not registered raises UnknownAdapterError. cache_namespace: the
        prefix-cache namespace of its blocks (replica/block_keys.py), narrowed here to its
        adapter's. tenant: whom it is served for (the fair policy's counters)."""
        params = sampling_params or SamplingParams()
        self.check_lora_name(lora_name)
        prompt_ids = self._prompt_token_ids(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        for name, num in (("logprobs", params.logprobs),
                          ("prompt_logprobs", params.prompt_logprobs)):
            if num is not None and num > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= {self.config.max_logprobs}, got {num}")
        self.constrained.check(params)
        arrival = self.clock() if arrival_time is None else arrival_time
        share = tenant or TenantShare()
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
                lora_name=lora_name,
                cache_namespace=with_adapter(cache_namespace, lora_name),
                tenant=share.name,
                tenant_weight=share.weight,
            )
            for i in range(params.n)
        ]
        self.scheduler.check_fits(children[0])
        now = self.clock()
        check_ttft_slo(self.scheduler.unfinished_requests(), len(prompt_ids) * params.n,
                       priority, share, self.scheduler.counters is not None,
                       self.drain_rate(now), self.active_tenants.of_band(priority, now),
                       self.config.scheduler.slo_admission_headroom)
        self.active_tenants.admitted(priority, share, now)
        if self.constrained.attach(children, params):
            self.constrained.hold(request_id, children)  # joins the scheduler once compiled
        else:
            self._schedule_children(request_id, children)
        self.children[request_id] = [c.request_id for c in children]
        for child in children:
            self.detokenizers[child.request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
        return request_id

    def _schedule_children(self, request_id: str, children: list[Request]) -> None:
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            self.pending_children[request_id] = children[1:]

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
        return self._end_request(request_id, FINISH_REASON_ABORT)

    def end_all_requests(self, reason: str) -> list[str]:
        """End every unfinished request under `reason` ("abort" at shutdown, "error" when the
        loop died), freeing its blocks; returns the ids of the requests ended."""
        request_ids = list(self.children)
        for request_id in request_ids:
            self._end_request(request_id, reason)
        return request_ids

    def _end_request(self, request_id: str, reason: str) -> list[RequestOutput]:
        outputs = []
        held = self.constrained.release(request_id) + self.pending_children.pop(request_id, [])
        for child in held:
            outputs.append(self._final_abort_output(child, reason))
        for child_id in self.children.get(request_id, []):
            request = self.scheduler.abort_request(child_id)
            if request is not None:
                self.runner.release(child_id)
                outputs.append(self._final_abort_output(request, reason))
        self._forget(request_id)
        return outputs

    def _final_abort_output(self, request: Request, reason: str) -> RequestOutput:
        request.status = RequestStatus.FINISHED_ABORTED
        self._count_finished(request, reason)
        return self._output(request, [], "", None)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.pending_children)
                or bool(self.constrained.held) or self._in_flight is not None)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: queued (preempted ones included) or held back as later
        children of an n > 1 request. The count `stats()` reports and admission bounds."""
        return (self.scheduler.num_waiting + sum(map(len, self.pending_children.values()))
                + self.constrained.num_held)  # and those whose grammar is compiling

    # ------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration and return a delta for every request that got a token or ended.

        Fault isolation: an exception raised by one request's work (its inputs, its sampling
        row, its detokenization) ends that request alone with finish_reason "error"; its batch
        mates' tokens stand. Only a device fault (`is_device_fault`) escapes, and stops the loop.
        """
        admitted = self._admit_compiled_grammars()
        if self.config.async_scheduling and not self._has_running_grammars():
            return admitted + self._step_overlapped()
        # A grammar's next bitmask needs the token just sampled: no step may run ahead.
        outputs = admitted + self.finish_in_flight()
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        runner_output = execute_isolating_faults(self.runner, scheduler_output)
        return outputs + self._finish_step(start, scheduler_output, runner_output)

    def _has_running_grammars(self) -> bool:
        return any(r.constraint is not None and r.constraint.grammar is not None
                   for r in self.scheduler.unfinished_requests())

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
        runner_output = execute_one_by_one(self.runner, scheduler_output)
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
        self.scheduler.block_manager.close_writes(scheduler_output.kv_writes)
        self._record_prompt_logprobs(runner_output)
        failed = [s.request for s in scheduler_output.scheduled
                  if s.request.request_id in runner_output.failed and not s.request.is_finished]
        outputs = [self._fail(r, runner_output.failed[r.request_id]) for r in failed]
        updated = self.scheduler.update(scheduler_output, runner_output)
        self._advance_grammars(updated)
        outputs += [self._detokenize_or_fail(r, runner_output) for r in updated]
        self._release_pending_children()
        finished = [r for r in updated if r.is_finished] + failed
        for request in finished:
            self.runner.release(request.request_id)
            self._forget_child(request)
            self._count_finished(request, request.finish_reason or FINISH_REASON_ERROR)
        self._record(start, scheduler_output, updated)
        return outputs

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Schedule requests whose grammar compiled; end those whose grammar failed."""
        if not self.constrained.held:
            return []
        if not self.scheduler.has_unfinished_requests():
            self.constrained.wait_for_any(GRAMMAR_WAIT_S)
        failed = []
        for parent_id, children, error in self.constrained.take_compiled():
            if error is None:
                self._schedule_children(parent_id, children)
                continue
            for child in children:
                child.constraint.error = error
                child.status = RequestStatus.FINISHED_ERROR
                failed.append(self._output(child, [], "", None))
            self._forget(parent_id)
        return failed

    def _advance_grammars(self, updated: list[Request]) -> None:
        """Matchers take the sampled token; a dead end finishes its request alone."""
        dead, complete = self.constrained.advance(updated)
        for request in dead:
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        for request in complete:
            if not request.is_finished:  # e.g. ignore_eos: the grammar has nothing left
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _record_prompt_logprobs(self, runner_output: RunnerOutput) -> None:
        """Keep each chunk's prompt logprobs on its request (before update can finish it)."""
        for request_id, chunk in runner_output.prompt_logprobs.items():
            request = self.scheduler.get_request(request_id)
            if request is not None:
                request.record_prompt_logprobs(chunk)

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
        if request.constraint is not None and request.constraint.error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            return self._output(request, [], "", None)  # the dead end's token is not sent
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
            error=request.error or (request.constraint.error if request.constraint is not None
                                    else None),
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


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A launched step whose sampled tokens are not yet on the host."""

    start: float
    scheduler_output: SchedulerOutput
    handle: StepHandle
