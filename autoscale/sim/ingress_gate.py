"""The ingress admission queue in the simulated cluster: held while no replica has room,
released fairly with cluster-wide counters (the production policy objects, run here as is).

The order is `autoscale/ingress_queue.IngressFairQueue`'s (band, then the tenant with the
smallest weighted virtual counter, then arrival), one queue for all the cluster's ingress
routers, so one set of counters. The hold test is `autoscale/ingress_saturation`'s, over
each running replica's requests in flight (the cluster's exact count, as an ingress counts
its own sends), its prompt tokens not yet prefilled (the engine's count, as of the
replica's last step boundary) and its KV usage. The router is offered only the replicas
with room, and a held request may go at every step boundary (a step that prefilled
prompts makes room without any request finishing).

Charges: a request's prompt tokens when it is dispatched (a replica with room admits it at
its next step, so its prefill is served within a step or two of leaving the queue), its
generated tokens when its response ends. The live ingress sees every token as it streams
and can charge each one as served; the simulator charges a response's tokens in one update
at its end, since a per-token event would cost a step's worth of work per request.
"""

from __future__ import annotations

from collections.abc import Iterable

from iterserve.autoscale.ingress_queue import HeldRequest, IngressFairQueue
from iterserve.autoscale.ingress_saturation import (
    IngressSaturation,
    ReplicaRoom,
    cluster_has_room,
    replica_has_room,
)
from iterserve.autoscale.sim.state import RUNNING, ReplicaSlot
from iterserve.autoscale.sim.tenancy import SimTenancy
from iterserve.autoscale.sim.workload import WorkloadRequest


class IngressGate:
    """The cluster's ingress queue (module docstring); FlowControlGate's interface."""

    watches_steps = True  # room can appear at any step's end: the cluster asks then

    def __init__(self, tenancy: SimTenancy, saturation: IngressSaturation) -> None:
        self.tenancy = tenancy
        self.saturation = saturation
        self.queue = IngressFairQueue()
        self._held: dict[str, tuple[int, WorkloadRequest]] = {}  # id -> (router, request)
        # replica id -> ((steps, waiting, running), its queued prompt tokens then): the
        # count walks its requests, so it is taken again only once one of those moved
        self._queued: dict[str, tuple[tuple[int, int, int], int]] = {}

    def __len__(self) -> int:
        return len(self.queue)

    def pool_has_room(self, slots: Iterable[ReplicaSlot]) -> bool:
        return cluster_has_room((self._room(s) for s in slots if s.state == RUNNING),
                                self.saturation)

    def offers(self, slot: ReplicaSlot) -> bool:
        """Whether a request may go to this running replica now."""
        return replica_has_room(self._room(slot), self.saturation)

    def _room(self, slot: ReplicaSlot) -> ReplicaRoom:
        replica = slot.replica
        scheduler = replica.scheduler
        key = (replica.num_steps, scheduler.num_waiting, scheduler.num_running)
        known = self._queued.get(slot.replica_id)
        if known is None or known[0] != key:
            known = self._queued[slot.replica_id] = (key, scheduler.num_queued_prefill_tokens())
        return ReplicaRoom(slot.ongoing, known[1], replica.block_manager.usage)

    def hold(self, router_index: int, spec: WorkloadRequest) -> None:
        tenant = self.tenancy.tenant(spec.tenant)
        self.queue.hold(HeldRequest(spec.request_id, tenant.name, tenant.weight,
                                    tenant.priority, spec.arrival_time))
        self._held[spec.request_id] = (router_index, spec)

    def release(self) -> tuple[int, WorkloadRequest]:
        """The next request to dispatch (its router, the request); its prompt is charged."""
        router_index, spec = self._held.pop(self.queue.release().request_id)
        self.dispatched(spec)
        return router_index, spec

    def dispatched(self, spec: WorkloadRequest) -> None:
        """A request leaves the ingress for a replica (held or not): its prompt's charge."""
        tenant = self.tenancy.tenant(spec.tenant)
        self.queue.charge_served(tenant.name, tenant.weight,
                                 prompt_tokens=len(spec.prompt_token_ids))

    def completed(self, spec: WorkloadRequest, output_tokens: int) -> None:
        """Its response ended: its generated tokens' charge."""
        tenant = self.tenancy.tenant(spec.tenant)
        self.queue.charge_served(tenant.name, tenant.weight, output_tokens=output_tokens)
