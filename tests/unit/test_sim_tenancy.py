"""Tenants in the cluster simulator: the engine's own policies order the simulated replicas'
queues, SLO admission refuses at once, llm-d-style flow control holds at the gateway, the
ingress queue holds while no replica has room.

Each test runs a small overloaded cluster (one or two replicas, seconds of virtual time)
and checks a property that disappears when the sharing is taken away (the fcfs run beside
it is the control that shows the check can fail).
"""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.autoscale.autoscaling_policy import ScalingContext
from iterserve.autoscale.ingress_saturation import IngressSaturation
from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.gateway_flow_control import FlowControlGate, pool_is_saturated
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.results import SimResult
from iterserve.autoscale.sim.tenancy import GatewaySaturation, SimTenancy, SimTenant
from iterserve.autoscale.sim.tenant_workloads import (
    backlogged,
    backlogged_tenants,
    noisy_neighbour,
)
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.router_tournament.tenant_fairness_report import (
    jain_index,
    share_errors,
    tenant_figures,
)

CAPACITY = 20.0  # requests/s one simulated replica sustains of this shape (about)
TWO = (SimTenant("a", 1.0, 0, 2.0), SimTenant("b", 1.0, 0, 2.0))


def run(requests: list[WorkloadRequest], tenancy: SimTenancy, replicas: int = 1,
        stop_s: float = 1e9) -> SimResult:
    config = dataclasses.replace(ClusterSimConfig(seed=0), tenancy=tenancy,
                                 max_virtual_s=stop_s)
    return simulate(requests, [IterserveRouter()], replicas, config)


def p99_of(result: SimResult, requests: list[WorkloadRequest], tenant: str) -> float:
    ids = {r.request_id for r in requests if r.tenant == tenant}
    return percentile([r.ttft for r in result.records
                       if r.request_id in ids and r.ttft is not None], 99)


def noisy(duration_s: float = 8.0) -> list[WorkloadRequest]:
    """a at 10x b, together 2x one replica's capacity."""
    b_rate = 2.0 * CAPACITY / 11
    return noisy_neighbour(b_rate, 10 * b_rate, duration_s, seed=0)


def test_the_fair_policy_keeps_the_light_tenant_out_of_the_heavy_ones_queue() -> None:
    requests = noisy()
    fcfs = run(requests, SimTenancy(TWO, "fcfs"))
    fair = run(requests, SimTenancy(TWO, "fair"))
    assert p99_of(fcfs, requests, "b") > 1.0  # b waits behind a's queue
    assert p99_of(fair, requests, "b") < 0.3 * p99_of(fcfs, requests, "b")
    assert p99_of(fair, requests, "a") > 1.0  # a's excess is what waits
    assert fair.num_finished == fcfs.num_finished == len(requests)  # nothing lost


def test_the_priority_policy_reads_each_tenants_band() -> None:
    requests = noisy()
    bands = (SimTenant("a", 1.0, 1), SimTenant("b", 1.0, 0))
    same_band = run(requests, SimTenancy(TWO, "priority"))
    b_first = run(requests, SimTenancy(bands, "priority"))
    assert p99_of(b_first, requests, "b") < 0.3 * p99_of(same_band, requests, "b")


def test_backlogged_tenants_are_served_by_weight_under_fair_and_not_under_fcfs() -> None:
    tenants = backlogged_tenants((1.0, 2.0, 4.0))
    requests = backlogged(tenants, [CAPACITY] * 3, 12.0, seed=0)  # 3x one replica's capacity
    shares = {}
    for policy in ("fcfs", "fair"):
        tenancy = SimTenancy(tenants, policy)
        result = run(requests, tenancy, stop_s=22.0)  # the window's running requests end
        shares[policy] = tenant_figures(result.records, requests, tenancy, 12.0)
    assert max(abs(e) for e in shares["fair"]["share_errors"].values()) < 0.2
    assert shares["fair"]["jain_weighted_tokens"] > 0.98
    # arrival order serves them alike: w4 gets about a third, not four sevenths
    assert shares["fcfs"]["share_errors"]["w4"] < -0.3
    assert shares["fcfs"]["jain_weighted_tokens"] < 0.8


def test_slo_admission_refuses_at_once_and_the_admitted_meet_their_objective() -> None:
    requests = noisy()
    plain = run(requests, SimTenancy(TWO, "fair"))
    slo = run(requests, SimTenancy(TWO, "fair", slo_admission=True))
    assert not any(r.rejected for r in plain.records)
    refused = [r for r in slo.records if r.rejected]
    assert refused and all(r.first_token is None and r.routed is not None for r in refused)
    admitted = [r for r in slo.records if not r.rejected]
    assert all(r.done for r in admitted)  # nothing admitted is dropped
    met = sum(r.ttft <= 2.0 for r in admitted)
    assert met >= 0.95 * len(admitted)
    assert met > sum(r.ttft <= 2.0 for r in plain.records)  # goodput at least fair's


def test_flow_control_holds_at_the_gateway_and_releases_the_light_tenant_first() -> None:
    requests = noisy()
    fcfs = run(requests, SimTenancy(TWO, "fcfs"))
    gated = run(requests, SimTenancy(TWO, "fcfs", gateway=GatewaySaturation()))
    assert gated.num_finished == len(requests)
    assert p99_of(gated, requests, "b") < 0.2 * p99_of(fcfs, requests, "b")
    # not overloaded (two replicas): never saturated, nothing held, fcfs's own figures
    plain2 = run(requests, SimTenancy(TWO, "fcfs"), replicas=2)
    gated2 = run(requests, SimTenancy(TWO, "fcfs", gateway=GatewaySaturation()), replicas=2)
    assert [r.ttft for r in gated2.records] == [r.ttft for r in plain2.records]


def test_the_gate_orders_held_requests_by_band_then_counter_then_arrival() -> None:
    tenants = (SimTenant("heavy"), SimTenant("light"), SimTenant("vip", priority=-1))
    gate = FlowControlGate(SimTenancy(tenants, gateway=GatewaySaturation()),
                           GatewaySaturation())
    prompt = (7,) * 100
    gate.hold(0, WorkloadRequest("h0", 0.0, prompt, 8, tenant="heavy"))
    assert gate.release()[1].request_id == "h0"  # heavy's counter: 100 prompt tokens
    for i, (tenant, t) in enumerate([("heavy", 1.0), ("heavy", 1.1), ("light", 2.0),
                                     ("vip", 3.0)]):
        gate.hold(0, WorkloadRequest(f"r{i}", t, prompt, 8, tenant=tenant))
    order = [gate.release()[1].request_id for _ in range(4)]
    assert order == ["r3", "r2", "r0", "r1"]  # band first, the lighter tenant, arrival


def test_the_pool_is_saturated_only_when_every_replica_is() -> None:
    rule = GatewaySaturation(queue_depth=5, kv_usage=0.8)
    assert pool_is_saturated([(5, 0.1), (0, 0.9)], rule)
    assert not pool_is_saturated([(5, 0.1), (3, 0.5)], rule)
    assert not pool_is_saturated([], rule)


def test_jain_index_and_share_errors() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    errors = share_errors({"w1": 10.0, "w2": 20.0, "w4": 50.0}, {"w1": 1, "w2": 2, "w4": 4})
    assert errors["w1"] == pytest.approx((10 / 80) / (1 / 7) - 1)


def test_tenancy_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="engine_policy"):
        SimTenancy(TWO, "lottery")
    with pytest.raises(ValueError, match="unique"):
        SimTenancy((SimTenant("a"), SimTenant("a")))
    with pytest.raises(ValueError, match="weight"):
        SimTenant("a", weight=0.0)
    assert SimTenancy(TWO).tenant("nobody").weight == 1.0


def ingress_run(requests: list[WorkloadRequest], tenants: tuple[SimTenant, ...],
                replicas: int = 1) -> SimResult:
    """The ingress queue's arm as the tournament cell runs it: fcfs engines, Serve's
    max_ongoing_requests at the ingress's in-flight bound."""
    saturation = IngressSaturation()
    config = dataclasses.replace(ClusterSimConfig(seed=0), max_virtual_s=1e9,
                                 tenancy=SimTenancy(tenants, "fcfs", ingress=saturation),
                                 max_ongoing_requests=saturation.max_in_flight)
    return simulate(requests, [IterserveRouter()], replicas, config)


def test_the_ingress_queue_holds_the_heavy_tenants_excess_and_sends_the_light_one_first(
        ) -> None:
    requests = noisy()
    fcfs = run(requests, SimTenancy(TWO, "fcfs"))
    ingress = ingress_run(requests, TWO)
    assert ingress.num_finished == len(requests)  # nothing lost
    assert p99_of(ingress, requests, "b") < 0.1 * p99_of(fcfs, requests, "b")
    assert p99_of(ingress, requests, "a") > 1.0  # a's excess is what waits, at the ingress
    held_a = [r for r in ingress.records if r.request_id.startswith("a-")
              and r.routed - r.arrival > 0.5]
    assert held_a and all(r.first_token - r.routed < 0.5 for r in held_a)
    # not overloaded (two replicas): held only through bursts of prompts, fcfs's tails
    plain2 = run(requests, SimTenancy(TWO, "fcfs"), replicas=2)
    ingress2 = ingress_run(requests, TWO, 2)
    assert ingress2.num_finished == len(requests)
    for tenant in ("a", "b"):
        assert p99_of(ingress2, requests, tenant) < 1.1 * p99_of(plain2, requests, tenant)


def test_held_requests_are_queued_demand_for_the_autoscaler() -> None:
    requests = noisy(4.0)
    seen: list[float] = []

    class Recorder:  # an autoscaling policy that records what it is shown
        name = "recorder"

        def desired_replicas(self, ctx: ScalingContext) -> int:
            seen.append(ctx.queued_at_handles)
            return 1  # hold the cluster at one replica: the queue stays

    saturation = IngressSaturation()
    config = dataclasses.replace(ClusterSimConfig(seed=0), max_virtual_s=1e9,
                                 tenancy=SimTenancy(TWO, "fcfs", ingress=saturation),
                                 max_ongoing_requests=saturation.max_in_flight)
    simulate(requests, [IterserveRouter()], 1, config, autoscaler=Recorder())
    assert max(seen) > 50  # the routers' own queues stay empty: these are held requests
