"""The iteration-level scheduler: which requests compute how many tokens this step.

One rule for everything: each request's num_computed_tokens catches up with its num_tokens.
Every step spends one token budget (max_num_batched_tokens) on at most max_num_seqs
requests: running decodes first, then running prefill chunks, then newly admitted waiting
requests. Chunked prefill, decode and preemption are cases of that rule:

* a prefill is a request with many uncomputed tokens; with chunked prefill it takes what is
  left of the budget, without it, it waits until its whole prompt fits one step;
* a decode is a request with exactly one uncomputed token (the last one sampled);
* preemption frees a running request's blocks and sends it to the front of the waiting
  queue with num_computed_tokens = 0; its generated tokens are kept and recomputed.

Policies only change who is admitted and who is preempted:
    fcfs                 arrival order; when blocks run out, preempt the newest
    priority             (priority, arrival) order; preempt the lowest priority, newest first
    max_utilization      admit greedily like fcfs; preempt lowest priority, newest first
    guaranteed_no_evict  admit only if prompt + max_tokens fit beside every running
                         request's worst case; never preempt
Static batching (`batching="static"`) admits a batch only when nothing is running and never
admits mid-batch; everything else is the same code, so the two compare fairly. As in the
static batching of HF `generate` and FasterTransformer, the batch keeps its shape until its
longest request finishes: a finished request keeps its slot and its KV blocks and is computed
as a padding row (one token a step, output discarded) until the batch ends
(`static_batch_padding=False` lets finished rows leave at once instead). Padding rows give
their blocks back early only if a live request of the batch would otherwise be preempted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.replica.request import Request, RequestStatus


class WaitingQueue:
    """Waiting requests in admission order: arrival order, or (priority, arrival)."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)

    def __iter__(self) -> Iterable[Request]:
        if self.by_priority:
            return iter([entry[-1] for entry in sorted(self._heap)])
        return iter(self._fifo)

    def push(self, request: Request) -> None:
        if self.by_priority:
            entry = (request.priority, request.arrival_time, next(self._counter), request)
            heapq.heappush(self._heap, entry)
        else:
            self._fifo.append(request)

    def push_front(self, request: Request) -> None:
        """A preempted request returns ahead of the requests that arrived after it."""
        if self.by_priority:
            self.push(request)  # its original arrival time already puts it in front
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][-1] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1] if self.by_priority else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.by_priority:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting = WaitingQueue(by_priority=config.scheduler_policy == "priority")
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_out_of_blocks = 0
        self._static_batch: set[str] = set()  # live requests of the static batch being served
        self._padding_rows: list[Request] = []  # finished rows of that batch, still holding KV
        self._last_admission = clock()

    # --------------------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------------- lifecycle
    def add_request(self, request: Request) -> None:
        self.check_fits(request)
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
        """End a request (stop, length or abort) and return its blocks (see static padding)."""
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        request.finished_time = self.clock()
        in_static_batch = request.request_id in self._static_batch
        self._static_batch.discard(request.request_id)
        self.requests.pop(request.request_id, None)
        pads = (in_static_batch and self.config.static_batch_padding
                and status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
                and request.num_computed_tokens > 0)
        if pads:
            self._padding_rows.append(request)
        else:
            self.block_manager.free(request)
        if not self._static_batch:
            self._release_padding_rows()

    def _release_padding_rows(self) -> None:
        for row in self._padding_rows:
            self.block_manager.free(row)
        self._padding_rows.clear()

    # ---------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Fill this step's token budget: running decodes, running chunks, then admissions."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes first so that long prompts never stall them, then unfinished prefills; under
        # priority-aware policies the most important grow first, so the victims of any
        # preemption are the least important.
        if self.config.scheduler_policy in ("priority", "max_utilization"):
            ordered = sorted(self.running, key=lambda r: (r.num_uncomputed_tokens != 1,
                                                          r.priority, r.arrival_time))
        else:
            decodes, prefills = [], []
            for r in self.running:
                (decodes if r.num_uncomputed_tokens == 1 else prefills).append(r)
            ordered = decodes + prefills
        scheduled_ids: set[str] = set()
        for request in ordered:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._tokens_to_compute(request, budget)
            if num_new == 0:
                continue
            if not self._make_room(request, num_new, output, scheduled_ids):
                continue
            self.block_manager.allocate(request, num_new)
            self._add_to_output(output, request, num_new)
            scheduled_ids.add(request.request_id)
            budget -= num_new
        if not output.preempted:
            budget = self._admit_waiting(output, budget)
        budget = self._schedule_padding_rows(output, budget)
        output.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return output

    def _schedule_padding_rows(self, output: SchedulerOutput, budget: int) -> int:
        """Static batching's padding: each finished row recomputes its last position."""
        for row in self._padding_rows:
            if budget == 0 or len(output.scheduled) >= self.config.max_num_seqs:
                break
            output.scheduled.append(ScheduledRequest(
                request=row,
                num_computed_tokens=row.num_computed_tokens - 1,
                num_new_tokens=1,
                block_table=self.block_manager.block_table(row.request_id),
                is_padding=True,
            ))
            budget -= 1
        return budget

    def _tokens_to_compute(self, request: Request, budget: int) -> int:
        remaining = request.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _add_to_output(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        output.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new,
                block_table=self.block_manager.block_table(request.request_id),
            )
        )

    def _make_room(
        self,
        request: Request,
        num_new: int,
        output: SchedulerOutput,
        scheduled_ids: set[str],
    ) -> bool:
        """Preempt until `request` can grow by num_new tokens; False if it was preempted."""
        while not self.block_manager.can_allocate(request, num_new):
            if self._padding_rows:
                self._release_padding_rows()  # padding is worth less than a live request
                continue
            self.num_out_of_blocks += 1
            if self.config.scheduler_policy == "guaranteed_no_evict":
                return False  # admission reserved the worst case, so this is transient
            victim = self._preemption_victim(exclude=scheduled_ids)
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preemption_victim(self, exclude: set[str]) -> Request:
        """The newest request, lowest priority first (fcfs ignores priority)."""
        candidates = [r for r in self.running if r.request_id not in exclude]
        if self.config.scheduler_policy == "fcfs":
            return max(candidates, key=lambda r: r.arrival_time)
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

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
    def _admission_open(self) -> bool:
        config = self.config
        if config.batching == "static":
            return not self.running or bool(self._static_batch)
        if config.admission_min_free_slots == 0 and config.admission_max_wait_ms == 0:
            return True
        free_slots = config.max_num_seqs - len(self.running)
        if config.admission_min_free_slots and free_slots >= config.admission_min_free_slots:
            return True
        waited_ms = (self.clock() - self._last_admission) * 1000.0
        return config.admission_max_wait_ms > 0 and waited_ms >= config.admission_max_wait_ms

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> int:
        if not self._admission_open():
            return budget
        if self.config.batching == "static" and not self.running and not self._static_batch:
            batch = itertools.islice(iter(self.waiting), self.config.max_num_seqs)
            self._static_batch = {r.request_id for r in batch}
        admitted = 0
        while len(self.waiting) > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self.config.batching == "static" and request.request_id not in self._static_batch:
                break
            hits = self.block_manager.find_cached_prefix(request)
            num_hit_tokens = len(hits) * self.block_manager.block_size
            num_new = self._tokens_to_compute_after(request, num_hit_tokens, budget)
            if num_new == 0:
                break
            if not self._fits_policy(request, num_new, hits):
                if not self._padding_rows:
                    break
                self._release_padding_rows()
                continue
            self.waiting.pop()
            if request.admitted_time is None:
                self.block_manager.record_prefix_lookup(request.num_prompt_tokens, num_hit_tokens)
                request.num_cached_tokens = num_hit_tokens
            self.block_manager.allocate(request, num_new, hits)
            request.status = RequestStatus.RUNNING
            if request.admitted_time is None:
                request.admitted_time = self.clock()
            self.running.append(request)
            self._add_to_output(output, request, num_new)
            budget -= num_new
            admitted += 1
        if admitted:
            self._last_admission = self.clock()
        return budget

    def _tokens_to_compute_after(self, request: Request, num_hit_tokens: int, budget: int) -> int:
        remaining = request.num_tokens - num_hit_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _fits_policy(self, request: Request, num_new: int, hits: list[int]) -> bool:
        manager = self.block_manager
        if self.config.scheduler_policy != "guaranteed_no_evict":
            return manager.can_allocate(request, num_new, hits)
        # Reserve the worst case of every running request and of this one.
        limit = self.config.max_model_len
        reserved = sum(
            manager.num_blocks_for(min(r.max_total_tokens, limit))
            - len(manager.block_table(r.request_id))
            for r in self.running
        )
        worst_new_tokens = min(request.max_total_tokens, limit) - len(hits) * manager.block_size
        needed = manager.num_new_blocks_needed(request, worst_new_tokens, len(hits))
        hits_in_free_pool = sum(1 for b in hits if manager.blocks[b].ref_count == 0)
        return reserved + needed + hits_in_free_pool <= manager.num_free_blocks

    # ------------------------------------------------------------------------------ update
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the requests that received a new token this step (finished ones included).
        """
        now = self.clock()
        updated: list[Request] = []
        block_size = self.block_manager.block_size
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.status != RequestStatus.RUNNING or scheduled.is_padding:
                continue  # aborted while the step ran, or a static batch's padding row
            request.num_computed_tokens += scheduled.num_new_tokens
            # A decode completes a block only when it lands on a block boundary.
            if scheduled.num_new_tokens > 1 or request.num_computed_tokens % block_size == 0:
                self.block_manager.mark_computed(request)
            token_id = runner_output.sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_times.append(now)
            updated.append(request)
            status = self._stop_status(request, token_id)
            if status is not None:
                self.finish(request, status)
        return updated

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
