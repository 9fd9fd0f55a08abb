"""One tournament cell: a workload, a cluster size, a load, a router (or an autoscaler).

The contestants (fresh policy objects per run, one per ingress router), the capacity probe
that turns "80 % load" into a request rate, and `run_cell`, which simulates one cell and
summarises it with bootstrap intervals. Used by `tournament.py`; each function is
picklable so cells run in worker processes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
from iterserve.autoscale.sim.baseline_autoscalers import (
    FixedReplicas,
    IterserveAutoscaler,
    RayAutoscalingConfig,
    RayDefaultAutoscaler,
    ThresholdAutoscaler,
    ThresholdConfig,
)
from iterserve.autoscale.sim.baseline_cache_routers import (
    DynamoRouter,
    LlmdRouter,
    RayPrefixAffinityRouter,
    SglangRouter,
)
from iterserve.autoscale.sim.baseline_routers import (
    LeastKVRouter,
    PowerOfTwoRouter,
    RandomRouter,
    RoundRobinRouter,
)
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.results import SimResult
from iterserve.autoscale.sim.routing_context import AutoscalingPolicy, RoutingPolicy
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.tenant_salt import salted_by_tenant
from iterserve.autoscale.sim.traces import read_trace, speed_up
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.router_tournament.tournament_stats import (
    bootstrap_mean_rate,
    bootstrap_percentile,
)
from iterserve.replica.sim_runner import CostModel, SimulatorConfig

TTFT_SLO_S = 2.0
ITL_SLO_S = 0.100
NUM_INGRESS_ROUTERS = 2  # independent routers (one per ingress replica), sharing nothing
CAPACITY_PROBE_REPLICAS = 8

ROUTERS: dict[str, Callable[[], RoutingPolicy]] = {
    "random": RandomRouter,
    "round-robin": RoundRobinRouter,
    "pow2": PowerOfTwoRouter,
    "least-kv": LeastKVRouter,
    "llm-d": LlmdRouter,
    "llm-d-precise": lambda: LlmdRouter(precise=True),
    "dynamo": DynamoRouter,
    "ray-prefix": RayPrefixAffinityRouter,
    "sglang": SglangRouter,
    "iterserve": IterserveRouter,
    # the same router without the replicas' cache answers: what the Ray adapter runs today
    "iterserve-nocache": lambda: IterserveRouter(name="iterserve-nocache",
                                                 use_replica_cache=False),
    # the router before drain_inflight_prefill: the unseen sends' prefill counted in full
    "iterserve-nodrain": lambda: IterserveRouter(RouterConfig(drain_inflight_prefill=False),
                                                 name="iterserve-nodrain"),
    # only the unseen sends still queued for prefill count as waiting (for router sync)
    "iterserve-waitdrain": lambda: IterserveRouter(RouterConfig(drain_inflight_waiting=True),
                                                   name="iterserve-waitdrain"),
}


def autoscaler_for(name: str, lo: int, hi: int, fixed: int,
                   startup_s: float = 30.0) -> AutoscalingPolicy:
    """The autoscaling contestants with bounds [lo, hi]; `fixed` for the static arm;
    `startup_s` (the cell's replica start-up) for iterserve's look-ahead arm."""
    if name == "fixed":
        return FixedReplicas(fixed)
    if name == "ray-default":
        return RayDefaultAutoscaler(RayAutoscalingConfig(min_replicas=lo, max_replicas=hi))
    if name == "keda-threshold":
        return ThresholdAutoscaler(ThresholdConfig(min_replicas=lo, max_replicas=hi))
    if name == "iterserve":
        return IterserveAutoscaler(AutoscaleConfig(min_replicas=lo, max_replicas=hi))
    if name == "iterserve-ahead":  # the headroom rule looking one start-up ahead
        scaler = IterserveAutoscaler(AutoscaleConfig(min_replicas=lo, max_replicas=hi,
                                                     startup_s=startup_s))
        scaler.name = name
        return scaler
    raise ValueError(f"unknown autoscaler {name!r}")


AUTOSCALERS = ("fixed", "ray-default", "keda-threshold", "iterserve")


def sim_config(cost_scale: dict[str, float] | None = None, seed: int = 0) -> ClusterSimConfig:
    """The default simulated cluster (Llama-3-8B on H100), coefficients optionally scaled:
    {"a_s": 0.5} halves the fixed step cost, {"*": 2.0} doubles every coefficient."""
    cost = CostModel()
    for name, factor in (cost_scale or {}).items():
        fields = [f.name for f in dataclasses.fields(CostModel)] if name == "*" else [name]
        cost = dataclasses.replace(cost, **{f: getattr(cost, f) * factor for f in fields})
    return ClusterSimConfig(sim=SimulatorConfig(cost=cost), seed=seed)


def _sustained(requests: list[WorkloadRequest], config: ClusterSimConfig, duration_s: float
               ) -> tuple[float, float]:
    """(completions, arrivals) per second, round-robin on CAPACITY_PROBE_REPLICAS replicas,
    counted between 1/3 of the run and its end (past the warm-up)."""
    result = simulate(requests, [RoundRobinRouter() for _ in range(NUM_INGRESS_ROUTERS)],
                      CAPACITY_PROBE_REPLICAS,
                      dataclasses.replace(config, max_virtual_s=duration_s))
    lo = duration_s / 3
    done = sum(1 for r in result.records if r.finish is not None and r.finish >= lo)
    arrivals = sum(1 for r in requests if r.arrival_time >= lo)
    return done / (duration_s - lo), arrivals / (duration_s - lo)


def probe_capacity(workload: str, cost_scale: dict[str, float] | None = None,
                   duration_s: float = 30.0, start_rate: float = 16.0) -> float:
    """Requests per second per replica the cluster sustains with round-robin routing.

    Offers rising rates to CAPACITY_PROBE_REPLICAS replicas until completions (counted
    between 1/3 of the run and its end, past the warm-up) fall below 85 % of arrivals:
    that completion rate, per replica, is the capacity. Round-robin, so that 'capacity'
    does not depend on a contestant's cache luck.
    """
    config = sim_config(cost_scale)
    rate = start_rate
    while True:
        completion_rate, arrivals = _sustained(make(workload, rate, duration_s, seed=1),
                                               config, duration_s)
        if completion_rate < 0.85 * arrivals:
            return completion_rate / CAPACITY_PROBE_REPLICAS
        rate *= 2


def probe_trace_capacity(requests: list[WorkloadRequest], max_model_len: int | None = None,
                         duration_s: float = 120.0, start_rate: float = 8.0,
                         min_duration_s: float = 30.0) -> float:
    """`probe_capacity` for a trace: its first `duration_s` seconds (fewer where the sped-up
    trace ends sooner, down to `min_duration_s`, the generators' probe window), sped up to
    rising rates. Longer than the generators' probe where it can be, since a trace's long
    prompts take seconds each."""
    config = sim_config()
    if max_model_len is not None:
        config = dataclasses.replace(config, max_model_len=max_model_len)
    span = max(r.arrival_time for r in requests) or 1.0
    rate = start_rate
    while True:
        speed = rate / (len(requests) / span)
        window = min(duration_s, span / speed)
        if window < min_duration_s:
            raise ValueError(f"the trace lasts {span / speed:.0f} s at {rate:g} req/s: too "
                             f"short to probe the capacity over {min_duration_s:.0f} s")
        head = [r for r in speed_up(requests, speed) if r.arrival_time < window]
        completion_rate, arrivals = _sustained(head, config, window)
        if completion_rate < 0.85 * arrivals:
            return completion_rate / CAPACITY_PROBE_REPLICAS
        rate *= 2


def slo_scale(cost_scale: dict[str, float] | None) -> float:
    """The factor the SLO scales by under a cost scaling: k when every coefficient is
    scaled by k ({"*": k}: the same cluster running k times slower or faster, at the same
    fraction of its capacity, so every latency scales by about k and an unscaled SLO would
    measure the line, not the routers), 1 for no or a partial scaling."""
    if cost_scale and set(cost_scale) == {"*"}:
        return float(cost_scale["*"])
    return 1.0


def _goodput(records: list, ttft_slo_s: float, itl_slo_s: float, span: float,
             seed: int) -> list[float]:
    good = [r.done and r.ttft <= ttft_slo_s and r.itl_p99 <= itl_slo_s for r in records]
    return bootstrap_mean_rate(good, span, seed).to_list()


def summarise(result: SimResult, seed: int, scale: float = 1.0) -> dict[str, Any]:
    """The cell's figures: p50/p99 TTFT with bootstrap 95 % intervals, p99 ITL,
    throughput, goodput (requests with TTFT <= 2 s and their own p99 ITL <= 100 ms, both
    times `scale`, per second of the arrival window) with its interval (and, where
    scale != 1, under the unscaled SLO too), preemptions, prefix-cache hit rate,
    GPU-hours, TTFT-SLO attainment."""
    records = result.records
    ttfts = result.ttfts()
    ttft_slo, itl_slo = TTFT_SLO_S * scale, ITL_SLO_S * scale
    # the arrival window, the same for every contestant of a cell (the run's end is not)
    span = max(max(r.arrival for r in records) - min(r.arrival for r in records), 1e-9)
    met_ttft = sum(1 for r in records if r.ttft is not None and r.ttft <= ttft_slo)
    out = {
        "requests": len(records),
        "finished": result.num_finished,
        "ttft_p50_s": bootstrap_percentile(ttfts, 50, seed).to_list(),
        "ttft_p99_s": bootstrap_percentile(ttfts, 99, seed).to_list(),
        "itl_p99_s": result.itl_percentile(99),
        "itl_p50_s": result.itl_percentile(50),
        "throughput_tok_s": result.throughput(),
        "slo_ttft_s": ttft_slo,
        "slo_itl_s": itl_slo,
        "goodput_rps": _goodput(records, ttft_slo, itl_slo, span, seed),
        "preemptions": sum(r.preemptions for r in records),
        "prefix_hit_rate": result.prefix_hit_rate,
        "gpu_hours": result.gpu_seconds / 3600.0,
        "ttft_slo_attainment": met_ttft / len(records),
        "end_time_s": result.end_time,
    }
    if scale != 1.0:
        out["goodput_unscaled_rps"] = _goodput(records, TTFT_SLO_S, ITL_SLO_S, span, seed)
    return out


def cell_requests(cell: dict[str, Any]) -> list[WorkloadRequest]:
    """The cell's workload: its trace file replayed at its speed (a "trace" key, with
    "speed" and optionally "hash_block_size"), else the named generator at the cell's rate
    and duration; with "tenant_cache_isolation" true, each tenant's prompts in its own
    cache namespace (`sim/tenant_salt.py`), as the ingress salts them by default."""
    if "trace" in cell:
        return speed_up(read_trace(cell["trace"], cell.get("hash_block_size")), cell["speed"])
    requests = make(cell["workload"], cell["rate"], cell["duration_s"], cell["seed"])
    if cell.get("tenant_cache_isolation"):
        requests = salted_by_tenant(requests)
    return requests


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """cell: workload, replicas, rate (requests/s), duration_s, router, seed, cost_scale;
    or, in place of the generated workload, a trace (`cell_requests`); optional autoscaler
    (name), min/max/fixed replicas, the routers' information: ingress_routers (default
    NUM_INGRESS_ROUTERS), routing_stats_period_s and router_sync_delay_s, and the replicas'
    max_model_len and startup_delay_s (default the simulator's). Returns cell + its
    summary."""
    config = sim_config(cell.get("cost_scale"), cell["seed"])
    information = {k: cell[k] for k in ("routing_stats_period_s", "router_sync_delay_s",
                                        "max_model_len", "startup_delay_s") if k in cell}
    if information:
        config = dataclasses.replace(config, **information)
    requests = cell_requests(cell)
    routers = [ROUTERS[cell["router"]]()
               for _ in range(cell.get("ingress_routers", NUM_INGRESS_ROUTERS))]
    autoscaler = None
    if cell.get("autoscaler"):
        autoscaler = autoscaler_for(cell["autoscaler"], cell["min_replicas"],
                                    cell["max_replicas"], cell["replicas"],
                                    config.startup_delay_s)
    cpu = time.process_time()
    result = simulate(requests, routers, cell["replicas"], config, autoscaler)
    out = dict(cell)
    out["cpu_s"] = time.process_time() - cpu  # what `tournament --estimate` calibrates on
    out.update(summarise(result, cell["seed"], slo_scale(cell.get("cost_scale"))))
    if autoscaler is not None:
        out["replicas_over_time"] = [(t, run, start) for t, run, start, _ in
                                     result.replicas_over_time]
    return out
