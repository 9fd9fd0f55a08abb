"""llm-d-style flow control in front of the routers: hold requests while the pool is saturated.

llm-d's gateway (the Gateway API inference extension's flow controller) queues a request
at the gateway when its saturation detector says the pool is saturated, and dispatches
the held requests, as capacity frees, by priority band strictly, then a fairness policy
between the flows (tenants) of a band, then FCFS within a flow. The engines behind it run
their own policy (vLLM's FCFS by default).

Here the order is the engine's own fair queue (`replica/fair_queue.FairWaitingQueue`:
band, then the tenant with the smallest virtual token counter, then arrival), with the
counters charged as the gateway can see service: a request's prompt tokens when it is
dispatched, its output tokens when its response has ended (VTC's costs; the gateway sees
no token before the stream does). The saturation test is `GatewaySaturation`'s: every
running replica at its queue depth or KV usage. The gate reads each replica's state as of
its last step boundary (tens of ms old), standing for llm-d's detector, which scrapes every
50 ms and ignores metrics older than 200 ms; not the routers' 0.5 s routing stats, on which
a gate releases late and leaves the pool idle between reports.
"""

from __future__ import annotations

from collections.abc import Iterable

from iterserve.autoscale.sim.state import RUNNING, ReplicaSlot
from iterserve.autoscale.sim.tenancy import GatewaySaturation, SimTenancy
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.fair_queue import FairWaitingQueue
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.virtual_token_counter import OUTPUT_TOKEN_COST, VirtualTokenCounters

# A held request's stand-in in the fair queue: the queue reads its band, tenant, weight
# and arrival only (one SamplingParams for all: it is never scheduled).
_HELD_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


def pool_is_saturated(loads: Iterable[tuple[int, float]], saturation: GatewaySaturation
                      ) -> bool:
    """Whether every replica is saturated; loads: each running replica's waiting requests
    and KV usage (no replica: not saturated, the requests wait at the routers as before)."""
    any_replica = False
    for waiting, kv_usage in loads:
        any_replica = True
        if waiting < saturation.queue_depth and kv_usage < saturation.kv_usage:
            return False
    return any_replica


class FlowControlGate:
    """The gateway's held requests, released in the fair queue's order (module docstring)."""

    def __init__(self, tenancy: SimTenancy, saturation: GatewaySaturation) -> None:
        self.tenancy = tenancy
        self.saturation = saturation
        self.counters = VirtualTokenCounters()
        self.queue = FairWaitingQueue(self.counters)
        self._held: dict[str, tuple[int, WorkloadRequest]] = {}  # id -> (router, request)

    def __len__(self) -> int:
        return len(self.queue)

    watches_steps = False  # released at stats polls and completions (module docstring)

    def offers(self, slot: ReplicaSlot) -> bool:
        """Every replica under max_ongoing_requests is offered to the router."""
        return True

    def pool_has_room(self, slots: Iterable[ReplicaSlot]) -> bool:
        return not pool_is_saturated(
            ((s.replica.scheduler.num_waiting, s.replica.block_manager.usage)
             for s in slots if s.state == RUNNING), self.saturation)

    def hold(self, router_index: int, spec: WorkloadRequest) -> None:
        tenant = self.tenancy.tenant(spec.tenant)
        # the prompt is the workload's (a SyntheticPrompt stands in for the list, as in
        # SimulatedReplica.add): the queue only counts on its band, tenant and arrival
        stand_in = Request(spec.request_id, spec.prompt_token_ids,  # type: ignore[arg-type]
                           _HELD_PARAMS, spec.arrival_time, priority=tenant.priority,
                           tenant=tenant.name, tenant_weight=tenant.weight)
        self.queue.push(stand_in)
        self._held[spec.request_id] = (router_index, spec)

    def release(self) -> tuple[int, WorkloadRequest]:
        """The next request to dispatch (its router, the request); its prompt is charged."""
        stand_in = self.queue.pop()
        router_index, spec = self._held.pop(stand_in.request_id)
        self.dispatched(spec)
        return router_index, spec

    def dispatched(self, spec: WorkloadRequest) -> None:
        """A request leaves the gateway for a replica (held or not): its prompt's charge."""
        tenant = self.tenancy.tenant(spec.tenant)
        self.counters.charge_prompt(tenant.name, tenant.weight, len(spec.prompt_token_ids))

    def completed(self, spec: WorkloadRequest, output_tokens: int) -> None:
        """Its response ended: its output tokens' charge (VTC's w_q each)."""
        tenant = self.tenancy.tenant(spec.tenant)
        # charge_prompt's arithmetic at the output cost: one update, not one per token
        self.counters.charge_prompt(tenant.name, tenant.weight,
                                    round(OUTPUT_TOKEN_COST * output_tokens))
