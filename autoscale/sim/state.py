"""The cluster simulator's per-replica and per-router state (`cluster_sim.ClusterSim`'s)."""

from __future__ import annotations

import gc
import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from iterserve.autoscale.router_policy import Correction
from iterserve.autoscale.sim.routing_context import ReplicaView, RoutingPolicy
from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

STARTING, RUNNING, DRAINING, STOPPED = "starting", "running", "draining", "stopped"


@dataclass(eq=False)
class ReplicaSlot:
    """A replica's life in the cluster (the engine exists once it is running)."""

    replica_id: str
    created_at: float
    state: str = STARTING
    replica: SimulatedReplica | None = None
    stopped_at: float | None = None
    ongoing: int = 0  # requests in flight there, from every router
    samples: deque = field(default_factory=deque)  # (t, kv, waiting, running)
    wake_at: float | None = None


@dataclass(eq=False)
class RouterState:
    """One ingress router: its policy, and what it alone knows (its in-flight requests)."""

    index: int
    policy: RoutingPolicy
    rng: random.Random
    queue: deque = field(default_factory=deque)  # requests waiting for a free replica
    ongoing: dict[str, int] = field(default_factory=dict)
    committed: dict[str, int] = field(default_factory=dict)  # prompt + max_tokens in flight
    unseen: dict[str, dict[str, int]] = field(default_factory=dict)  # sent after the stats
    unseen_tokens: dict[str, int] = field(default_factory=dict)
    views: dict[str, ReplicaView] = field(default_factory=dict)  # valid until a change
    # The views of the replicas offered to the last request, in the cluster's order of its
    # free replicas (`offered_for`, that list), and the replicas whose view was dropped
    # since: the next request patches those few rather than looking up every view.
    offered: list[ReplicaView] = field(default_factory=list)
    offered_for: list[str] | None = None
    changed: set[str] = field(default_factory=set)

    def correction(self, replica_id: str) -> Correction:
        """What `InFlightTracker.corrections` gives for this replica, kept incrementally."""
        unseen = self.unseen.get(replica_id)
        committed = self.committed.get(replica_id, 0)
        if not unseen and not committed:
            return Correction(0)
        return Correction(len(unseen or ()), self.unseen_tokens.get(replica_id, 0), committed)

    def routed(self, replica_id: str, request_id: str, tokens: int) -> None:
        self.ongoing[replica_id] = self.ongoing.get(replica_id, 0) + 1
        self.committed[replica_id] = self.committed.get(replica_id, 0) + tokens
        self.unseen.setdefault(replica_id, {})[request_id] = tokens
        self.unseen_tokens[replica_id] = self.unseen_tokens.get(replica_id, 0) + tokens
        self.drop_view(replica_id)

    def completed(self, replica_id: str, request_id: str, tokens: int) -> None:
        self.ongoing[replica_id] -= 1
        self.committed[replica_id] -= tokens
        unseen = self.unseen.get(replica_id)
        if unseen and request_id in unseen:
            self.unseen_tokens[replica_id] -= unseen.pop(request_id)
        self.drop_view(replica_id)

    def stats_published(self, replica_id: str) -> None:
        """The replica's new stats reflect everything routed to it so far."""
        self.unseen.pop(replica_id, None)
        self.unseen_tokens.pop(replica_id, None)
        self.drop_view(replica_id)

    def drop_view(self, replica_id: str) -> None:
        """Its view is out of date: the next request builds it anew."""
        self.views.pop(replica_id, None)
        self.changed.add(replica_id)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The run allocates millions of small objects and frees them all by reference
    counting (it builds no reference cycles); Python's cyclic collector would traverse the
    live ones again and again, about a quarter of the run's CPU time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
