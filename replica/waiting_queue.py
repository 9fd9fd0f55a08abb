"""The scheduler's waiting queue: requests in admission order, arrival or (priority, arrival).

The fair policy brings its own queue with the same interface (`replica/fair_queue.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

from iterserve.replica.request import Request


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
