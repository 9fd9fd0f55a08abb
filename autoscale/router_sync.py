"""Router sync for the Ray adapter: the ingress routers tell each other their sends and
completions, so that none of them piles onto a replica the others have just filled (what
Dynamo's KV router does with `router_replica_sync`).

`SyncLog` (plain data) is the exchange: a router hands in the events it produced since its
last exchange and gets back the other routers' events after its cursor. `ray_sync_hub`
hosts one log per deployment as a named Ray actor. `RouterSync` is one router's side: its
outbox, its cursor, and `exchange_once`, which applies the peers' events to the router's
`KVRouterCore` (a heard send counts in flight, `KVRouterCore.peer_routed`); the router's
background loop awaits it every `RouterConfig.router_sync_period_s`. The cluster
simulator's counterpart is `ClusterSimConfig.router_sync_delay_s`.

What can go wrong, and what happens: a router that falls further behind than the log keeps,
a hub that is gone (its actor died with the process that created it: the next exchange
makes a new one) or a peer that never reports a completion (its process died) would leave
heard sends in flight for good; so a router forgets every heard send when it lost events or
its hub, and any heard send older than HEARD_TTL_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from iterserve.autoscale.router_state import KVRouterCore

ROUTED, COMPLETED = "routed", "completed"
LOG_CAPACITY = 100_000  # events kept by a hub: ~10 s of a 5,000-request/s deployment
HEARD_TTL_S = 600.0  # a heard send with no completion after this long is forgotten
MAX_OUTBOX = 10_000  # events kept for a hub that cannot be reached (the oldest dropped)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncEvent:
    kind: str  # ROUTED or COMPLETED
    request_id: str  # Serve's internal request id (unique across routers)
    replica: str  # ReplicaID.unique_id
    sent_at: float = 0.0  # wall-clock time of the send (ROUTED)
    num_tokens: int = 0  # its KV footprint: prompt + max_tokens (ROUTED)
    prefill_tokens: int = 0  # its prompt tokens the replica does not cache (ROUTED)


class SyncLog:
    """Every router's events in arrival order, the newest `capacity` kept; event i of the
    whole history has sequence number i, the cursor routers hand back."""

    def __init__(self, capacity: int = LOG_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._events: deque[tuple[str, SyncEvent]] = deque()
        self._first = 0  # sequence number of the oldest event kept
        self._routers: set[str] = set()

    def exchange(self, router_id: str, events: Sequence[SyncEvent], cursor: int | None
                 ) -> tuple[list[SyncEvent], int, bool]:
        """Append `events` from `router_id`; return (the other routers' events from
        `cursor` on, the new cursor, whether some of them were dropped before this router
        read them). cursor None: a router's first exchange, which reads nothing old."""
        self._routers.add(router_id)
        end_before = self._first + len(self._events)
        self._events.extend((router_id, e) for e in events)
        while len(self._events) > self._capacity:
            self._events.popleft()
            self._first += 1
        end = self._first + len(self._events)
        start = end_before if cursor is None else cursor
        lost = start < self._first
        skip = max(0, start - self._first)
        theirs = [e for rid, e in islice(self._events, skip, None) if rid != router_id]
        return theirs, end, lost

    def stats(self) -> dict[str, int]:
        return {"routers": len(self._routers), "events": self._first + len(self._events)}


class SyncHub(Protocol):
    async def exchange(self, router_id: str, events: list[SyncEvent], cursor: int | None
                       ) -> tuple[list[SyncEvent], int, bool]: ...


class RayHub:
    """A `SyncLog` in a named Ray actor, one per deployment (created by the first router
    that asks; found by the others)."""

    def __init__(self, name: str) -> None:
        import ray

        actor_class = ray.remote(num_cpus=0, max_concurrency=1)(SyncLog)
        self._actor = actor_class.options(name=name, namespace="serve",
                                          get_if_exists=True).remote()

    async def exchange(self, router_id: str, events: list[SyncEvent], cursor: int | None
                       ) -> tuple[list[SyncEvent], int, bool]:
        return await self._actor.exchange.remote(router_id, events, cursor)


def hub_name(app_name: str, deployment_name: str) -> str:
    return f"iterserve-router-sync:{app_name}:{deployment_name}"


class RouterSync:
    """One router's side of the sync: what it sent and completed since its last exchange
    (the outbox), what it heard and has not seen complete, and the exchange itself."""

    def __init__(self, core: KVRouterCore[Any], hub_factory: Callable[[], SyncHub],
                 period_s: float, clock: Callable[[], float] = time.time,
                 on_exchange: Callable[[str], None] | None = None) -> None:
        """on_exchange(outcome): told of every exchange the loop makes: "ok", "lost" (some
        peer events were dropped before this router read them) or "failed"."""
        self.router_id = uuid.uuid4().hex
        self._core = core
        self._hub_factory = hub_factory
        self._hub: SyncHub | None = None
        self.period_s = period_s
        self._clock = clock
        self._outbox: list[SyncEvent] = []
        self._cursor: int | None = None
        self._heard: dict[str, float] = {}  # heard send's request id -> when heard
        self._task: asyncio.Task[None] | None = None
        self._on_exchange = on_exchange
        self.failures = 0

    # ------------------------------------------------------------- this router's events
    def sent(self, request_id: str, replica: str, sent_at: float, num_tokens: int,
             prefill_tokens: int) -> None:
        self._post(SyncEvent(ROUTED, request_id, replica, sent_at, num_tokens, prefill_tokens))

    def completed(self, request_id: str, replica: str) -> None:
        self._post(SyncEvent(COMPLETED, request_id, replica))

    def _post(self, event: SyncEvent) -> None:
        self._outbox.append(event)
        if len(self._outbox) > MAX_OUTBOX:
            del self._outbox[0]

    # ------------------------------------------------------------------- the exchange
    async def exchange_once(self, resolve: Callable[[str], Hashable | None]) -> bool:
        """Hand the outbox to the hub and apply the peers' events (resolve: a replica's
        unique id -> its ReplicaID, None for a replica this router does not know). Returns
        whether some peer events were dropped before this router read them."""
        outbox, self._outbox = self._outbox, []
        try:
            if self._hub is None:
                self._hub = self._hub_factory()
            events, cursor, lost = await self._hub.exchange(self.router_id, outbox,
                                                            self._cursor)
        except BaseException:
            self._outbox = (outbox + self._outbox)[-MAX_OUTBOX:]
            self._hub, self._cursor = None, None  # a new hub next time, read from its end
            self.forget_heard()
            raise
        if lost:
            self.forget_heard()
        self._cursor = cursor
        now = self._clock()
        for event in events:
            if event.kind == ROUTED:
                replica_id = resolve(event.replica)
                if replica_id is not None:
                    self._core.peer_routed(event.request_id, replica_id, event.sent_at,
                                           event.num_tokens, event.prefill_tokens)
                    self._heard[event.request_id] = now
            elif self._heard.pop(event.request_id, None) is not None:
                self._core.completed(event.request_id)
        self._forget_older_than(now - HEARD_TTL_S)
        return lost

    def forget_heard(self) -> None:
        """Drop every heard send from the router's in-flight view (its own stay)."""
        for request_id in self._heard:
            self._core.completed(request_id)
        self._heard.clear()

    def _forget_older_than(self, horizon: float) -> None:
        for request_id in [r for r, at in self._heard.items() if at < horizon]:
            del self._heard[request_id]
            self._core.completed(request_id)

    # -------------------------------------------------------------------- the loop
    def ensure_running(self, resolve: Callable[[str], Hashable | None]) -> None:
        """Start the exchange loop on the running event loop (once; again if it ended)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(resolve))

    async def _run(self, resolve: Callable[[str], Hashable | None]) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                outcome = "lost" if await self.exchange_once(resolve) else "ok"
            except Exception:  # the hub is gone or unreachable: routing goes on without it
                outcome = "failed"
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    logger.warning("router sync: exchange failed (%d so far); the heard "
                                   "sends are forgotten and a new hub is asked for",
                                   self.failures, exc_info=True)
            if self._on_exchange is not None:
                self._on_exchange(outcome)
