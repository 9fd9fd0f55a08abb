"""What one router knows about its requests in flight: `InFlightTracker` and the
`Correction` it gives the router's score per replica (plain data; times are passed in)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from iterserve.autoscale.signals import ReplicaLoad

R = TypeVar("R", bound=Hashable)  # a replica id


@dataclass(frozen=True)
class Correction:
    """What this router knows about a replica beyond its (stale) stats."""

    requests: int  # requests sent that the replica's stats do not reflect yet
    prompt_tokens: int = 0  # their KV footprint (prompt + max_tokens), when known (0: unknown)
    committed_tokens: int = 0  # KV footprint of every request sent and not seen complete
    prefill_tokens: float = 0  # uncached prompt tokens of the unseen requests (0: unknown)
    # With drain_prefill: prefill_tokens is the prefill still queued at the replica at this
    # time (the last unseen send), draining at its prefill_token_rate; None: not drained.
    prefill_as_of: float | None = None
    # With drain_waiting: how many of the unseen requests are still in that queue at
    # prefill_as_of (the rest are computing or done: running, not waiting); None: all are.
    waiting: int | None = None


class InFlightTracker(Generic[R]):
    """The router's own count of requests it routed and has not seen complete.

    Keyed by Serve's internal request id: `on_request_completed` fires for every dispatched
    request, including ones the replica rejected (which never saw `on_request_routed`), so
    unknown ids are ignored. Times are passed in, never read.

    Kept per replica, in routing order, with each replica's committed total, so that
    `corrections` (called for every request) reads only the requests routed since each
    replica's stats, not every request in flight (thousands at 64+ replicas).
    """

    def __init__(self, drain_prefill: bool = False, drain_waiting: bool = False) -> None:
        """drain_prefill: the unseen requests' prefill tokens form a queue that drains at
        the replica's reported prefill_token_rate (RouterConfig.drain_inflight_prefill);
        drain_waiting (with drain_prefill): only the unseen requests still in that queue
        count as waiting (RouterConfig.drain_inflight_waiting)."""
        if drain_waiting and not drain_prefill:
            raise ValueError("drain_waiting counts what is left of the drained prefill "
                             "queue: it needs drain_prefill")
        self.drain_prefill = drain_prefill
        self.drain_waiting = drain_waiting
        self._by_request: dict[str, tuple[R, float, int, int]] = {}
        self._by_replica: dict[R, dict[str, tuple[float, int, int]]] = {}
        self._committed: dict[R, int] = {}
        # Per replica: the latest routing time, or None once times went backwards (a clock
        # step): then the unseen requests are no longer a tail and every one is read.
        self._last_at: dict[R, float | None] = {}
        # Per replica: (the stats timestamp, the Correction given for it), dropped when its
        # requests change: most replicas change neither between two requests.
        self._given: dict[R, tuple[float | None, Correction]] = {}
        # Called with a replica whose requests changed (a router's ScoreTable listens).
        self.on_change: Callable[[R], None] | None = None

    def routed(self, request_id: str, replica_id: R, at: float, prompt_tokens: int = 0,
               prefill_tokens: int = 0) -> None:
        """prompt_tokens: the request's KV footprint (prompt + max_tokens);
        prefill_tokens: its prompt tokens the replica must compute (uncached)."""
        self.completed(request_id)
        self._by_request[request_id] = (replica_id, at, prompt_tokens, prefill_tokens)
        entries = self._by_replica.setdefault(replica_id, {})
        entries[request_id] = (at, prompt_tokens, prefill_tokens)
        self._given.pop(replica_id, None)
        if self.on_change is not None:
            self.on_change(replica_id)
        self._committed[replica_id] = self._committed.get(replica_id, 0) + prompt_tokens
        last = self._last_at.get(replica_id, at)
        self._last_at[replica_id] = None if last is None or at < last else at

    def completed(self, request_id: str) -> R | None:
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return None
        replica_id = entry[0]
        entries = self._by_replica[replica_id]
        del entries[request_id]
        self._given.pop(replica_id, None)
        if self.on_change is not None:
            self.on_change(replica_id)
        if entries:
            self._committed[replica_id] -= entry[2]
        else:
            del self._by_replica[replica_id], self._committed[replica_id]
            del self._last_at[replica_id]
        return replica_id

    def forget_replica(self, replica_id: R) -> None:
        for key in list(self._by_replica.get(replica_id, ())):
            self.completed(key)

    def in_flight(self, replica_id: R) -> int:
        return len(self._by_replica.get(replica_id, ()))

    def corrections(self, loads: Mapping[R, ReplicaLoad | None]) -> dict[R, Correction]:
        """Per replica: requests routed after its stats were taken (unseen) and the KV
        footprint of everything in flight there."""
        return {rid: self._correction(rid, entries, loads.get(rid))
                for rid, entries in self._by_replica.items()}

    def correction(self, replica_id: R, load: ReplicaLoad | None) -> Correction | None:
        """`corrections(...)[replica_id]` for one replica (None: nothing in flight there)."""
        entries = self._by_replica.get(replica_id)
        return None if entries is None else self._correction(replica_id, entries, load)

    def _correction(self, rid: R, entries: dict[str, tuple[float, int, int]],
                    load: ReplicaLoad | None) -> Correction:
        stamp = None if load is None else load.timestamp
        cached = self._given.get(rid)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        if load is None or self._last_at[rid] is None:
            unseen = [e for e in entries.values() if load is None or e[0] > load.timestamp]
        else:
            unseen = []
            for entry in reversed(entries.values()):  # newest first: the unseen tail
                if entry[0] <= stamp:
                    break
                unseen.append(entry)
        tokens = sum(t for _, t, _ in unseen)
        prefill: float = sum(p for _, _, p in unseen)
        as_of, waiting = None, None
        if self.drain_prefill and unseen and load is not None and load.prefill_token_rate > 0:
            prefill, as_of, still_queued = self._queued_prefill(unseen, load)
            waiting = still_queued if self.drain_waiting else None
        correction = Correction(len(unseen), tokens, self._committed[rid], prefill, as_of,
                                waiting)
        self._given[rid] = (stamp, correction)
        return correction

    @staticmethod
    def _queued_prefill(unseen: list[tuple[float, int, int]], load: ReplicaLoad
                        ) -> tuple[float, float, int]:
        """(prefill tokens still queued, as of the last unseen send, how many unseen sends
        are still in the queue then): a fluid first-come-first-served queue that holds the
        replica's reported queued prefill at its stats and drains at its
        prefill_token_rate, each unseen send (at, footprint, prefill) joining it in
        routing order."""
        rate, last = load.prefill_token_rate, load.timestamp
        queued = ahead = float(load.queued_prefill_tokens)  # ahead: the replica's own queue
        sends: deque[float] = deque()  # each unseen send's prefill not computed yet
        # sorted by (at, prefill) as before, so that ties give the same floats
        for at, p in sorted((at, p) for at, _, p in unseen):
            drained = rate * (at - last)
            queued = max(0.0, queued - drained) + p
            ahead, drained = max(0.0, ahead - drained), max(0.0, drained - ahead)
            while sends and sends[0] <= drained:
                drained -= sends.popleft()
            if sends:
                sends[0] -= drained
            sends.append(float(p))
            last = at
        return queued, last, len(sends)

    def __len__(self) -> int:
        return len(self._by_request)
