"""The capacity planner behind `iterserve plan`: the fewest replicas that meet a latency SLO.

`plan` simulates the workload on n replicas, doubling n until the SLO holds, then bisects
down to the fewest that meet it; every point tried comes back with the answer. The command
line (workloads, traces, --gpu presets and files) is `loadtests/plan.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.policies import IterserveRouter
from iterserve.autoscale.sim.routing_context import RoutingPolicy
from iterserve.autoscale.sim.workload import WorkloadRequest

ROUTERS: dict[str, Callable[[], RoutingPolicy]] = {"iterserve": IterserveRouter}


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float = 2.0
    itl_p99_s: float = 0.1

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft_p99=2,itl_p99=0.1`` (seconds)."""
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in ("ttft_p99", "itl_p99") or not value:
                raise ValueError(
                    f"bad SLO term {part!r}: want ttft_p99=SECONDS and/or itl_p99=SECONDS")
            values[f"{name}_s"] = float(value)
        return cls(**values)


@dataclass(frozen=True)
class PlanPoint:
    replicas: int
    ttft_p99_s: float
    itl_p99_s: float
    throughput_tok_s: float
    finished: int
    requests: int

    def meets(self, slo: Slo) -> bool:
        return (self.finished == self.requests and self.ttft_p99_s <= slo.ttft_p99_s
                and self.itl_p99_s <= slo.itl_p99_s)


def evaluate(workload: Sequence[WorkloadRequest], replicas: int, config: ClusterSimConfig,
             router: str, num_routers: int) -> PlanPoint:
    result = simulate(workload, [ROUTERS[router]() for _ in range(num_routers)], replicas,
                      config)
    return PlanPoint(replicas, result.ttft_percentile(99), result.itl_percentile(99),
                     result.throughput(), result.num_finished, len(workload))


def plan(workload: Sequence[WorkloadRequest], slo: Slo, config: ClusterSimConfig,
         router: str = "iterserve", num_routers: int = 2, max_replicas: int = 256,
         ) -> tuple[int | None, list[PlanPoint]]:
    """(fewest replicas meeting the SLO or None up to max_replicas, every point tried)."""
    tried: dict[int, PlanPoint] = {}

    def point(n: int) -> PlanPoint:
        if n not in tried:
            tried[n] = evaluate(workload, n, config, router, num_routers)
        return tried[n]

    n, low = 1, 0  # low: the most replicas known to miss the SLO
    while not point(n).meets(slo):
        low = n
        if n >= max_replicas:
            return None, sorted(tried.values(), key=lambda p: p.replicas)
        n = min(2 * n, max_replicas)
    high = n
    while high - low > 1:
        mid = (low + high) // 2
        if point(mid).meets(slo):
            high = mid
        else:
            low = mid
    return high, sorted(tried.values(), key=lambda p: p.replicas)
