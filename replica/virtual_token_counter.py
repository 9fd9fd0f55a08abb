"""Virtual token counters: VTC's fair share between tenants (Sheng et al., OSDI 2024).

Each tenant has a counter of the service it received, in tokens divided by its weight. The
waiting tenant with the smallest counter is served next, so between backlogged tenants the
service each gets follows its weight (within 2x of the fair share at every moment, per the
paper's bound), and a tenant alone gets everything (work-conserving).

Accounting is VTC's: a request's prompt tokens are charged when it is first admitted and
each generated token when it is sampled, at the paper's costs (a generated token costs twice
a prompt token: w_p = 1, w_q = 2). Recomputation after a preemption is not charged again: it
is the engine's cost, not service the tenant received.

A tenant returning from idle (no waiting request) is lifted to the smallest counter of the
backlogged tenants, or, when none is backlogged, to the counter of the tenant that last
left the queue, so time spent idle banks no credit (the paper's Algorithm 2).
"""

from __future__ import annotations

PROMPT_TOKEN_COST = 1.0  # VTC's w_p
OUTPUT_TOKEN_COST = 2.0  # VTC's w_q: a generated token costs a decode step each


class VirtualTokenCounters:
    """Per-tenant counters of weighted service, and the tenants now backlogged."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}  # waiting requests per backlogged tenant
        self.last_left: str | None = None  # the tenant whose backlog emptied last

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge_prompt(self, tenant: str, weight: float, num_tokens: int) -> None:
        self.counters[tenant] = self.counter(tenant) + PROMPT_TOKEN_COST * num_tokens / weight

    def charge_output(self, tenant: str, weight: float) -> None:
        """One generated token (called per token per step: kept to one dict update)."""
        counters = self.counters
        counters[tenant] = counters.get(tenant, 0.0) + OUTPUT_TOKEN_COST / weight

    def start_waiting(self, tenant: str, preempted: bool = False) -> None:
        """One more waiting request of `tenant`; a tenant returning from idle is lifted. A
        preempted request's tenant is not: it was being served, not idle."""
        if self.backlog.get(tenant, 0) == 0 and not preempted:
            self._lift(tenant)
        self.backlog[tenant] = self.backlog.get(tenant, 0) + 1

    def stop_waiting(self, tenant: str) -> None:
        """One waiting request of `tenant` admitted or ended."""
        left = self.backlog[tenant] - 1
        if left:
            self.backlog[tenant] = left
            return
        del self.backlog[tenant]
        self.last_left = tenant

    def _lift(self, tenant: str) -> None:
        if self.backlog:
            floor = min(self.counter(t) for t in self.backlog)
        elif self.last_left is not None:
            floor = self.counter(self.last_left)
        else:
            return
        self.counters[tenant] = max(self.counter(tenant), floor)
