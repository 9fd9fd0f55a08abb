"""Scheduling policies as objects: who runs first, who is preempted, who is admitted.

The scheduler (`replica/scheduler.py`) owns the one rule (every request's computed tokens
catch up with its tokens, within one token budget per step). A policy only answers three
questions, each over plain values, chosen once from the config at construction:

    order_running(running)           in which order running requests grow this step, each
                                     with its uncomputed token count
    choose_victim(candidates)        which running request to preempt (None: never preempt)
    fits(request, num_new, hits, running, blocks)    whether a waiting request may be admitted
    wants_short_step(admitted), is_backlogged(request)   whether the step that admitted a
                                     request admits no backlogged tenant's after it (fair)
    prefill_shares(running, budget)  each tenant's cap on this step's prefill tokens (fair;
                                     None: no cap)
    make_waiting_queue()             the waiting queue in the policy's order

    fcfs                 arrival order; when blocks run out, preempt the newest
    priority             (priority, arrival) order; preempt the lowest priority, newest first
    max_utilization      admit greedily like fcfs; preempt lowest priority, newest first
    guaranteed_no_evict  admit only if prompt + max_tokens fit beside every running
                         request's worst case; never preempt
    fair                 priority bands strictly first, then the tenant with the smallest
                         virtual token counter (VTC, replica/virtual_token_counter.py), then
                         arrival; preempt the lowest band's heaviest tenant's newest request
                         (with fair_preempts_heavier=False: the lowest band's newest, so a
                         light tenant's request never evicts older work of a heavy one);
                         a step that admits the request of a tenant with nothing else
                         waiting, while another tenant is backlogged, admits no backlogged
                         tenant's request after it: its first token comes at the step's
                         end, which their prompts would put off (they run in the next
                         step; the cost is one step's fixed time per such request);
                         while tenants of a band contend, each one's prompts take at most
                         its weighted share of a step's budget (replica/prefill_shares.py;
                         off with fair_prefill_share=False)

A new policy is one subclass registered in POLICIES. How batches are formed (continuous or
static) is the other, independent strategy: `replica/batching_policy.py`.
"""

from __future__ import annotations

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.fair_queue import FairWaitingQueue
from iterserve.replica.prefill_shares import PrefillShares, step_prefill_shares
from iterserve.replica.request import Request
from iterserve.replica.virtual_token_counter import VirtualTokenCounters
from iterserve.replica.waiting_queue import WaitingQueue


def decodes_first(running: list[Request]) -> list[tuple[Request, int]]:
    """Decodes before prefill chunks, each group in admission order, so long prompts never
    stall decodes; each request with its uncomputed token count (1: a decode), counted once
    here because the scheduler reads it per request per step."""
    pending = [(r, r.num_uncomputed_tokens) for r in running]
    decodes = [p for p in pending if p[1] == 1]
    if len(decodes) == len(pending):
        return decodes
    return decodes + [p for p in pending if p[1] != 1]


class SchedulingPolicy:
    """fcfs: arrival order everywhere; the newest running request is preempted first."""

    name = "fcfs"
    waiting_by_priority = False  # the waiting queue's order: arrival, or (priority, arrival)
    counters: VirtualTokenCounters | None = None  # the fair policy's: its queue and charges

    def __init__(self, max_model_len: int, preempts_heavier: bool = True,
                 shares_prefill: bool = True) -> None:
        """preempts_heavier, shares_prefill: read by the fair policy alone (see the module
        docstring)."""
        self.max_model_len = max_model_len

    def make_waiting_queue(self) -> WaitingQueue | FairWaitingQueue:
        return WaitingQueue(by_priority=self.waiting_by_priority)

    def order_running(self, running: list[Request]) -> list[tuple[Request, int]]:
        return decodes_first(running)

    def choose_victim(self, candidates: list[Request]) -> Request | None:
        return max(candidates, key=_arrival, default=None)

    def fits(self, request: Request, num_new: int, hits: list[int], running: list[Request],
             blocks: BlockManager) -> bool:
        return blocks.can_allocate(request, num_new, hits)

    def wants_short_step(self, admitted: Request) -> bool:
        """Whether the step that just admitted `admitted` should admit no backlogged
        tenant's request after it (only the fair policy asks)."""
        return False

    def is_backlogged(self, request: Request) -> bool:
        """Whether a waiting request's tenant has more requests waiting behind it."""
        return False

    def prefill_shares(self, running: list[Request], budget: int) -> PrefillShares | None:
        """Each tenant's cap on this step's prefill tokens (only the fair policy caps)."""
        return None


class PriorityPolicy(SchedulingPolicy):
    """priority: admit and grow the most important first; preempt the least important."""

    name = "priority"
    waiting_by_priority = True

    def order_running(self, running: list[Request]) -> list[tuple[Request, int]]:
        # Decodes first, then the most important grow first, so the victims of any
        # preemption later in the step are the least important.
        pending = [(r, r.num_uncomputed_tokens) for r in running]
        return sorted(pending, key=lambda p: (p[1] != 1, p[0].priority, p[0].arrival_time))

    def choose_victim(self, candidates: list[Request]) -> Request | None:
        return max(candidates, key=_priority_then_arrival, default=None)


class MaxUtilizationPolicy(PriorityPolicy):
    """max_utilization: admit in arrival order as fcfs does, preempt as priority does."""

    name = "max_utilization"
    waiting_by_priority = False


class GuaranteedNoEvictPolicy(SchedulingPolicy):
    """guaranteed_no_evict: admission reserves every request's worst case; never preempt."""

    name = "guaranteed_no_evict"

    def choose_victim(self, candidates: list[Request]) -> Request | None:
        return None  # admission reserved the worst case, so running short is transient

    def fits(self, request: Request, num_new: int, hits: list[int], running: list[Request],
             blocks: BlockManager) -> bool:
        reserved = sum(blocks.num_blocks_for(self._worst_case_tokens(r))
                       - blocks.num_blocks_held(r.request_id) for r in running)
        worst_new = self._worst_case_tokens(request) - len(hits) * blocks.block_size
        return reserved + blocks.num_blocks_to_admit(request, worst_new, hits) <= blocks.num_free_blocks

    def _worst_case_tokens(self, request: Request) -> int:
        return min(request.max_total_tokens, self.max_model_len)


class FairSharePolicy(PriorityPolicy):
    """fair: bands, then VTC between tenants, then arrival (see the module docstring)."""

    name = "fair"

    def __init__(self, max_model_len: int, preempts_heavier: bool = True,
                 shares_prefill: bool = True) -> None:
        """shares_prefill: cap contending tenants' prefill tokens a step (needs chunked
        prefill: a prompt longer than its share could otherwise never run)."""
        super().__init__(max_model_len)
        self.preempts_heavier = preempts_heavier
        self.shares_prefill = shares_prefill
        self.counters = VirtualTokenCounters()
        self.waiting = FairWaitingQueue(self.counters)

    def make_waiting_queue(self) -> FairWaitingQueue:
        return self.waiting

    def order_running(self, running: list[Request]) -> list[tuple[Request, int]]:
        # Decodes first, in admission order (each takes one token: their order matters only
        # when the budget runs out); then the lightest tenants' prefills grow first. Only
        # the prefills are sorted: the decodes are most of a batch, every step.
        pending = decodes_first(running)
        first_prefill = next((i for i, p in enumerate(pending) if p[1] != 1), len(pending))
        if first_prefill >= len(pending) - 1:
            return pending
        prefills = sorted(pending[first_prefill:], key=lambda p: self.rank(p[0]))
        return pending[:first_prefill] + prefills

    def choose_victim(self, candidates: list[Request]) -> Request | None:
        if not self.preempts_heavier:
            return super().choose_victim(candidates)
        return max(candidates, key=self.rank, default=None)

    def wants_short_step(self, admitted: Request) -> bool:
        # A tenant with nothing else waiting, while another tenant is backlogged: within its
        # share, and its first token waits for this step's end, which a backlogged tenant's
        # prompts admitted after it would put off (they go in the next step instead).
        backlog = self.counters.backlog
        return admitted.tenant not in backlog and bool(backlog)

    def is_backlogged(self, request: Request) -> bool:
        return self.counters.backlog.get(request.tenant, 0) > 1

    def prefill_shares(self, running: list[Request], budget: int) -> PrefillShares | None:
        # A tenant is present with a request waiting or running (decoding included: its
        # next request is likely on its way, and would wait out a step full of the others'
        # prompts). One tenant ever seen (served or waiting) costs nothing more per step; a
        # tenant alone among several known costs one pass over the running requests.
        counters = self.counters
        if not self.shares_prefill or (len(counters.counters) < 2 and (
                not counters.backlog or counters.backlog.keys() <= counters.counters.keys())):
            return None
        tenants = {r.tenant for r in running}
        if len(tenants) < 2 and tenants.issuperset(self.counters.backlog):
            return None  # one tenant (or none): nothing to share
        present = {(r.priority, r.tenant): r.tenant_weight for r in running}
        present.update(self.waiting.flows())
        if len(present) < 2:
            return None
        return step_prefill_shares(present.items(), budget)

    def rank(self, request: Request) -> tuple[int, float, float]:
        """Lower runs first: its band, its tenant's counter, its arrival."""
        return request.priority, self.counters.counter(request.tenant), request.arrival_time


POLICIES: dict[str, type[SchedulingPolicy]] = {
    policy.name: policy
    for policy in (SchedulingPolicy, PriorityPolicy, MaxUtilizationPolicy, GuaranteedNoEvictPolicy,
                   FairSharePolicy)
}


def make_policy(name: str, max_model_len: int, preempts_heavier: bool = True,
                shares_prefill: bool = True) -> SchedulingPolicy:
    try:
        return POLICIES[name](max_model_len, preempts_heavier, shares_prefill)
    except KeyError:
        raise ValueError(f"unknown scheduler_policy {name!r}; choose one of "
                         f"{', '.join(POLICIES)}") from None


def _arrival(request: Request) -> float:
    return request.arrival_time


def _priority_then_arrival(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
