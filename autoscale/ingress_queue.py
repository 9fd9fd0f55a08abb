"""The ingress's admission queue: requests held while the replicas are saturated, released
fairly between tenants with cluster-wide virtual token counters (VTC, Sheng et al. 2024).

One queue in front of every replica, so one set of counters decides who is served next
across the whole cluster (a per-replica queue keeps per-replica counters, and a light tenant
then gets its share on some replicas only). The order, as llm-d's flow control orders its
flows:

    1. priority bands strictly (a lower band number first);
    2. within a band, the tenant with the smallest weighted virtual counter (on a tie, the
       one with fewer requests held);
    3. within a tenant, arrival order.

Counters are charged per served token, prompt and generated, at VTC's costs (a generated
token twice a prompt token; `replica/virtual_token_counter.py` holds the costs and the lift),
divided by the tenant's weight. A tenant that becomes backlogged (its first held request)
is lifted to the smallest counter of the backlogged tenants, so time spent idle banks no
credit. Counters move whether or not anything is held: a tenant served while the cluster
had room has used its share.

When to hold is the saturation test's (`autoscale/ingress_saturation.py`); this queue only
orders. `len(queue)` is the held demand the autoscaler counts as queued.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from iterserve.replica.virtual_token_counter import (
    OUTPUT_TOKEN_COST,
    PROMPT_TOKEN_COST,
    VirtualTokenCounters,
)


@dataclass(frozen=True)
class HeldRequest:
    """What the queue reads of a request: its id, tenant, weight, band and arrival."""

    request_id: str
    tenant: str
    weight: float = 1.0
    band: int = 0
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"tenant {self.tenant!r}: weight must be > 0")


class IngressFairQueue:
    """Per-(band, tenant) FIFOs released by band, then the smallest counter, then arrival."""

    def __init__(self, counters: VirtualTokenCounters | None = None) -> None:
        """counters: shared by every ingress replica's queue (cluster-wide); a fresh set
        where one ingress holds the queue."""
        self.counters = counters if counters is not None else VirtualTokenCounters()
        self._flows: dict[tuple[int, str], deque[HeldRequest]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def hold(self, request: HeldRequest) -> None:
        """Queue a request; its tenant, backlogged from now, is lifted if it was idle."""
        self.counters.start_waiting(request.tenant)
        self._flows.setdefault((request.band, request.tenant), deque()).append(request)
        self._size += 1

    def release(self) -> HeldRequest:
        """The next request to dispatch (band, counter, arrival); IndexError when empty."""
        flow = self._next_flow()
        queue = self._flows[flow]
        request = queue.popleft()
        if not queue:
            del self._flows[flow]
        self._size -= 1
        self.counters.stop_waiting(request.tenant)
        return request

    def charge_served(self, tenant: str, weight: float, prompt_tokens: int = 0,
                      output_tokens: int = 0) -> None:
        """Tokens served to a tenant (prompt tokens prefilled, tokens generated)."""
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        counters = self.counters.counters
        counters[tenant] = counters.get(tenant, 0.0) + cost / weight

    def _next_flow(self) -> tuple[int, str]:
        if not self._flows:
            raise IndexError("release from an empty ingress queue")
        # a handful of backlogged tenants: a scan per release, not a heap of moving keys
        return min(self._flows, key=self._flow_key)

    def _flow_key(self, flow: tuple[int, str]) -> tuple[int, float, int, float]:
        # On equal counters the tenant with fewer requests held goes first: a tenant back
        # from idle is lifted to exactly the backlogged minimum, and by arrival alone its
        # request would still wait behind the backlogged tenant's oldest (the engine's
        # FairWaitingQueue breaks the tie the same way).
        band, tenant = flow
        queue = self._flows[flow]
        return band, self.counters.counter(tenant), len(queue), queue[0].arrival_time
