"""The iteration-level scheduler: which requests compute how many tokens this step.

One rule for everything: each request's num_computed_tokens catches up with its num_tokens.
Every step spends one token budget (max_num_batched_tokens) on at most max_num_seqs
requests: running requests first (in the policy's order: decodes, then prefill chunks),
then newly admitted waiting requests. Chunked prefill, decode and preemption are cases of
that rule:

* a prefill is a request with many uncomputed tokens; with chunked prefill it takes what is
  left of the budget, without it, it waits until its whole prompt fits one step;
* a decode is a request with exactly one uncomputed token (the last one sampled);
* preemption frees a running request's blocks and sends it to the front of the waiting
  queue with num_computed_tokens = 0; its generated tokens are kept and recomputed.

Async scheduling (`plans_ahead=True`): step N+1 is planned while step N runs. `schedule()`
then counts the tokens it plans as computed at once (as vLLM v1 always does) and each token
a sampling request is about to get as a placeholder, so the next plan treats every running
request as one token longer; `update()` fills in the sampled tokens and finishes what
stopped, one step late. Synchronously, `update()` counts the computed tokens instead, so a
plan that is dropped without running leaves no trace.

Who is admitted, who grows first and who is preempted is the scheduling policy's answer
(`replica/scheduling_policy.py`: fcfs, priority, max_utilization, guaranteed_no_evict); how
batches form is the batching strategy's (`replica/batching_policy.py`: continuous, static).
Both are objects chosen once here, so this file holds only the rule.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from iterserve.replica.batching_policy import make_batching
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.fair_queue import FairWaitingQueue
from iterserve.replica.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.replica.prefill_shares import PrefillShares
from iterserve.replica.request import Request, RequestStatus
from iterserve.replica.scheduling_policy import SchedulingPolicy, make_policy
from iterserve.replica.waiting_queue import WaitingQueue

_NO_TOKENS: frozenset[int] = frozenset()


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        plans_ahead: bool = False,
        policy: SchedulingPolicy | None = None,
        max_loras: int = 0,
    ) -> None:
        """policy: a SchedulingPolicy object to use instead of config.scheduler_policy's;
        max_loras: most distinct LoRA adapters among the running requests (0: no LoRA)."""
        self.config = config
        self.max_loras = max_loras
        self.plans_ahead = plans_ahead  # async scheduling: see the module docstring
        self.block_manager = block_manager
        self.clock = clock
        self.policy = policy or make_policy(
            config.scheduler_policy, config.max_model_len or 0, config.fair_preempts_heavier,
            config.fair_prefill_share and config.enable_chunked_prefill)
        self.batching = make_batching(config, clock, block_manager)
        self.counters = self.policy.counters  # the fair policy's; None: nothing is charged
        self.waiting: WaitingQueue | FairWaitingQueue = self.policy.make_waiting_queue()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self.num_out_of_blocks = 0

    # --------------------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens of the admitted requests not computed yet (running prefills and
        waiting requests; a waiting request's prefix-cache hits are not known yet): the
        prefill work ahead of a request that arrives now."""
        queued = 0
        for request in itertools.chain(self.running, self.waiting):
            left = len(request.prompt_token_ids) - request.num_computed_tokens
            if left > 0:
                queued += left
        return queued

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None once it finished (or never was)."""
        return self.requests.get(request_id)

    def unfinished_requests(self) -> Iterable[Request]:
        """Every unfinished request (waiting, running or preempted), in no set order."""
        return self.requests.values()

    def all_running_have_output(self) -> bool:
        """Whether every running request has sampled at least once (benchmarks' warm-up)."""
        return all(r.num_output_tokens > 0 for r in self.running)

    # ------------------------------------------------------------------------- lifecycle
    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        params = request.sampling_params
        request.output_length_limit = min(params.max_tokens,
                                          self.config.max_model_len - request.num_prompt_tokens)
        eos = _NO_TOKENS if params.ignore_eos else request.eos_token_ids
        # Without stop ids the engine's one EOS set is shared: fewer cache lines per step.
        request.stopping_token_ids = eos | frozenset(params.stop_token_ids) \
            if params.stop_token_ids else eos
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def check_fits(self, request: Request) -> None:
        """Reject at once a request that could never run, rather than let it hang."""
        limit = self.config.max_model_len
        if request.num_prompt_tokens + 1 > limit:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but this model's context "
                f"is {limit} tokens including at least one generated token; shorten the prompt"
            )
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; send at least one token")
        worst = min(request.max_total_tokens, limit)  # what it needs running alone, at worst
        blocks = self.block_manager.num_blocks_for(worst)
        if blocks > self.block_manager.num_total_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks ({worst} tokens) but the cache has only "
                f"{self.block_manager.num_total_blocks}; shorten the prompt or max_tokens"
            )

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and return its blocks, unless static
        batching keeps them as a padding row."""
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        request.finished_time = self.clock()
        self.requests.pop(request.request_id, None)
        if not self.batching.retire(request, status):
            self.block_manager.free(request)

    # ---------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Fill this step's token budget: running requests, then admissions, then padding."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running_status = RequestStatus.RUNNING
        try_allocate = self.block_manager.try_allocate
        planned, plans_ahead = output.scheduled, self.plans_ahead
        shares = self.policy.prefill_shares(self.running, budget)  # None: no tenant capped
        for request, remaining in self.policy.order_running(self.running):
            if budget == 0:
                break
            if request.status is not running_status:
                continue  # preempted earlier in this loop
            if request.num_output_placeholders and not self._plannable(request):
                continue  # waits for the token it is being sampled
            capped = shares is not None and remaining > 1  # a prefill chunk, tenants contend
            if capped:
                num_new = self._tokens_to_compute(remaining, shares.tokens_left(request, budget))
            elif remaining <= budget:
                num_new = remaining  # all of it (every decode), without a call
            else:
                num_new = self._tokens_to_compute(remaining, budget)
            if num_new == 0:
                continue
            table = try_allocate(request, num_new)
            if table is None:
                if not self._make_room(request, num_new, output):
                    continue
                self.block_manager.allocate(request, num_new)
                table = self.block_manager.block_table(request.request_id)
            # _add_to_output, inlined: this loop runs for every running request every step.
            samples = num_new == remaining
            computed = request.num_computed_tokens
            planned.append(ScheduledRequest(request, computed, num_new, table, False, samples))
            if plans_ahead:
                request.num_computed_tokens = computed + num_new
                if samples:
                    request.num_output_placeholders += 1
            budget -= num_new
            if capped:
                shares.spend(request, num_new)
        if not output.preempted:
            budget = self._admit_waiting(output, budget, shares)
        budget = self.batching.schedule_padding(output, budget)
        output.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if not output.is_empty:  # an empty step may not run (async scheduling): its copies
            # (blocks read from disk for a request not admitted) wait, pinned, for the next
            output.kv_spills, output.kv_disk_loads = self.block_manager.take_disk_copies()
            output.kv_stores, output.kv_loads = self.block_manager.take_kv_copies()
            output.kv_writes = self.block_manager.take_opened_writes()
        return output

    def _plannable(self, request: Request) -> bool:
        """A request with a token still being sampled is planned past it only if its
        sampling does not read that token and it may still grow."""
        if request.sampling_reads_output:
            return False  # waits one step: its sampling needs the token in flight
        params = request.sampling_params
        num_out = request.num_output_tokens + request.num_output_placeholders
        # Already at its length limit: the token in flight is its last.
        return (num_out < params.max_tokens
                and request.num_tokens + request.num_output_placeholders
                < self.config.max_model_len)

    def _tokens_to_compute(self, remaining: int, budget: int) -> int:
        """How many of a request's `remaining` uncomputed tokens (after any prefix-cache
        hits) to compute this step: all, or with chunked prefill as many as the budget
        allows, else none."""
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _add_to_output(self, output: SchedulerOutput, request: Request, num_new: int,
                       samples: bool, block_table: list[int]) -> None:
        """Plan num_new tokens of the request (planning ahead: count them as computed);
        `samples`: they are all its uncomputed tokens, so a token is sampled after them."""
        computed = request.num_computed_tokens
        output.scheduled.append(ScheduledRequest(request, computed, num_new, block_table, False,
                                                 samples))
        if self.plans_ahead:
            request.num_computed_tokens = computed + num_new
            if samples:
                request.num_output_placeholders += 1

    def _make_room(
        self,
        request: Request,
        num_new: int,
        output: SchedulerOutput,
    ) -> bool:
        """Preempt until `request` can grow by num_new tokens; False if it cannot this step.
        Requests already planned this step are never the victims."""
        while not self.block_manager.can_allocate(request, num_new):
            if self.batching.release_padding():
                continue
            self.num_out_of_blocks += 1
            planned = {id(s.request) for s in output.scheduled}
            candidates = [r for r in self.running if id(r) not in planned]
            victim = self.policy.choose_victim(candidates)
            if victim is None:
                return False  # the policy never preempts: the shortage is transient
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        output.preempted.append(request)

    # ---------------------------------------------------------------------------- admission
    def _admit_waiting(self, output: SchedulerOutput, budget: int,
                       shares: PrefillShares | None) -> int:
        """Admit waiting requests into what is left of the budget; `shares`: contending
        tenants' caps (the head's tenant at its cap ends the admissions: it is the tenant
        owed the most, and the step is meant to end short)."""
        if not self.batching.admission_open(len(self.running)):
            return budget
        self.batching.start_admission(self.waiting, len(self.running))
        manager = self.block_manager
        admitted = 0
        adapter_waits: list[Request] = []
        short_step = False  # a light tenant's prompt is in: no backlogged tenant's after it
        while len(self.waiting) > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if short_step and self.policy.is_backlogged(request):
                break
            if not self.batching.admits(request) or request.num_output_placeholders:
                break  # not in the static batch, or its preempted step is still in flight
            if not self._adapter_fits(request):
                # Its adapter would need a slot the running adapters hold: it steps aside
                # for this step and later requests may run (vLLM's rule), rather than
                # holding every request behind it, base-model ones included.
                adapter_waits.append(self.waiting.pop())
                continue
            hits = manager.find_cached_prefix(request)
            num_hit_tokens = len(hits) * manager.block_size
            remaining = request.num_uncomputed_tokens - num_hit_tokens
            num_new = self._tokens_to_compute(
                remaining, budget if shares is None else shares.tokens_left(request, budget))
            if num_new == 0:
                break
            if not self.policy.fits(request, num_new, hits, self.running, manager):
                if not self.batching.release_padding():
                    break
                continue
            self.waiting.pop()
            if request.admitted_time is None:
                manager.record_prefix_lookup(request.num_prompt_tokens, hits)
                request.num_cached_tokens = num_hit_tokens
            manager.allocate(request, num_new, hits)
            request.status = RequestStatus.RUNNING
            if request.admitted_time is None:
                request.admitted_time = self.clock()
                if self.counters is not None:  # VTC charges a prompt once, when admitted
                    self.counters.charge_prompt(request.tenant, request.tenant_weight,
                                                request.num_prompt_tokens)
            self.running.append(request)
            self._add_to_output(output, request, num_new, num_new == remaining,
                                manager.block_table(request.request_id))
            budget -= num_new
            if shares is not None:
                shares.spend(request, num_new)
            admitted += 1
            short_step = short_step or self.policy.wants_short_step(request)
        for request in reversed(adapter_waits):  # back in front, in their order
            self.waiting.push_front(request)
        self.batching.admitted(admitted)
        return budget

    def _adapter_fits(self, request: Request) -> bool:
        """Whether running `request` keeps the running adapters within max_loras (vLLM's
        rule: one step holds at most max_loras distinct adapters).

        A request that does not fit waits without an age limit, as in vLLM's v1 scheduler
        (it moves such a request to `skipped_waiting` and prepends it again, with no
        timeout): a slot frees when the last running request of an adapter ends, but under
        steady traffic for the running adapters (admitted past it: their adapter runs) it
        can wait indefinitely. Not bounded here, as not there; the router steers new
        requests away from a replica whose slots are full (autoscale/lora_affinity.py), and
        a client that stops waiting aborts the request (its disconnect)."""
        if request.lora_name is None:
            return True
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in running or len(running) < self.max_loras

    # ------------------------------------------------------------------------------ update
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Fill in the sampled tokens of a finished step and finish what stopped.

        Returns the requests that received a new token this step (finished ones included).
        A request that finished or was aborted while the step ran gets nothing: under async
        scheduling that discards the one extra token computed for it.
        """
        now = self.clock()
        updated: list[Request] = []
        block_size = self.block_manager.block_size
        mark_computed = self.block_manager.mark_computed
        sampled = runner_output.sampled_token_ids
        running, preempted = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        plans_ahead = self.plans_ahead
        counters = self.counters
        for scheduled in output.scheduled:
            request = scheduled.request
            status = request.status
            if scheduled.is_padding or (status is not running and status is not preempted):
                continue  # a static batch's padding row, or it ended while the step ran
            num_new = scheduled.num_new_tokens
            computed = scheduled.num_computed_tokens + num_new
            if not plans_ahead:
                if status is not running:
                    continue
                request.num_computed_tokens = computed
            # A decode completes a block only when it lands on a block boundary.
            if num_new > 1 or computed % block_size == 0:
                mark_computed(request, computed)
            if not scheduled.samples:
                continue
            if plans_ahead:
                request.num_output_placeholders -= 1
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue
            outputs = request.output_token_ids
            outputs.append(token_id)
            if counters is not None:
                counters.charge_output(request.tenant, request.tenant_weight)
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_times.append(now)
            updated.append(request)
            if token_id not in request.stopping_token_ids \
                    and len(outputs) < request.output_length_limit:
                continue  # neither a stop token nor the length limit: it goes on
            try:
                stop = self._stop_status(request, token_id)
            except Exception as error:  # noqa: BLE001 - its stop check failed: it alone ends
                request.error = f"{type(error).__name__}: {error}"
                stop = RequestStatus.FINISHED_ERROR
            if stop is not None:
                self.finish(request, stop)
        return updated

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        num_tokens = len(request.prompt_token_ids) + num_out
        if num_out >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
