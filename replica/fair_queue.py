"""The fair policy's waiting queue: priority bands strictly first, the tenant with the smallest
virtual token counter within a band (`replica/virtual_token_counter.py`; on a tie the one
with fewer requests waiting), arrival order within a tenant.

Counters move every step, so no single heap can hold the order: each (band, tenant) keeps
its own arrival-ordered heap and `peek` compares the heads, one per backlogged tenant (a
handful), so a peek costs the number of tenants, not of requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from iterserve.replica.request import Request
from iterserve.replica.virtual_token_counter import VirtualTokenCounters

Flow = tuple[int, str]  # (priority band, tenant)


class FairWaitingQueue:
    """The WaitingQueue interface (waiting_queue.py), ordered by band, counter, then arrival."""

    def __init__(self, counters: VirtualTokenCounters) -> None:
        self.counters = counters
        self._flows: dict[Flow, list[tuple[float, int, Request]]] = {}
        self._sequence = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        entries = [(self._flow_key(flow, entry), entry[-1])
                   for flow, heap in self._flows.items() for entry in heap]
        return iter([request for _, request in sorted(entries, key=lambda e: e[0])])

    def push(self, request: Request, preempted: bool = False) -> None:
        self.counters.start_waiting(request.tenant, preempted)
        flow = (request.priority, request.tenant)
        entry = (request.arrival_time, next(self._sequence), request)
        heapq.heappush(self._flows.setdefault(flow, []), entry)
        self._size += 1

    def push_front(self, request: Request) -> None:
        """A preempted request: its original arrival puts it first within its tenant, and its
        tenant keeps its counter (it was being served, not idle: nothing to lift)."""
        self.push(request, preempted=True)

    def peek(self) -> Request:
        return self._flows[self._next_flow()][0][-1]

    def flows(self) -> Iterator[tuple[Flow, float]]:
        """Each (band, tenant) with a request waiting, with its tenant's weight."""
        for flow, heap in self._flows.items():
            yield flow, heap[0][-1].tenant_weight

    def pop(self) -> Request:
        flow = self._next_flow()
        request = heapq.heappop(self._flows[flow])[-1]
        self._forget(flow, request)
        return request

    def remove(self, request: Request) -> None:
        flow = (request.priority, request.tenant)
        heap = self._flows[flow]
        heap[:] = [entry for entry in heap if entry[-1] is not request]
        heapq.heapify(heap)
        self._forget(flow, request)

    def _forget(self, flow: Flow, request: Request) -> None:
        if not self._flows[flow]:
            del self._flows[flow]
        self._size -= 1
        self.counters.stop_waiting(request.tenant)

    def _next_flow(self) -> Flow:
        if not self._flows:
            raise IndexError("peek or pop from an empty waiting queue")
        return min(self._flows, key=lambda flow: self._flow_key(flow, self._flows[flow][0]))

    def _flow_key(self, flow: Flow, entry: tuple[float, int, Request]
                  ) -> tuple[int, float, int, float, int]:
        # On equal counters the tenant with fewer requests waiting goes first: a tenant
        # back from idle is lifted to exactly the backlogged minimum, and by arrival alone
        # its request would still queue behind the backlogged tenant's oldest.
        band, tenant = flow
        return band, self.counters.counter(tenant), len(self._flows[flow]), entry[0], entry[1]
