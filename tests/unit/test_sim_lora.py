"""The simulator's LoRA adapters (autoscale/sim/lora*.py, baseline_lora_routers.py): a
replica's device slots and host LRU and the loads they cost, the engine's max_loras
admission rule on a simulated replica, the Zipf workload, Ray's multiplexing choice and
iterserve's adapter-aware choice through the simulator's router."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter

import pytest

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.baseline_lora_routers import ray_multiplex_choice
from iterserve.autoscale.sim.baseline_routers import RoundRobinRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.lora import AdapterResidency, SimLoRA
from iterserve.autoscale.sim.lora_workload import with_zipf_adapters
from iterserve.autoscale.sim.prompts import SyntheticPrompt, unique_start
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.workload import WorkloadRequest

LORA = SimLoRA(max_loras=2, max_cpu_loras=3)


# ------------------------------------------------------------------ residency and loads
def test_a_load_comes_from_disk_then_from_host_after_a_device_eviction() -> None:
    slots = AdapterResidency(LORA)
    assert slots.load_seconds(["a"]) == pytest.approx(LORA.disk_load_s)
    assert slots.load_seconds(["a"]) == 0.0  # on the device: free
    slots.load_seconds(["b"])
    slots.load_seconds(["c"])  # evicts a from the device (LRU); the host keeps it
    assert list(slots.device) == ["b", "c"]
    assert slots.held() == {"a", "b", "c"}
    assert slots.load_seconds(["a"]) == pytest.approx(LORA.host_load_s)
    assert (slots.loads_from_disk, slots.loads_from_host) == (3, 1)


def test_the_host_lru_drops_the_oldest_adapter_not_on_the_device() -> None:
    slots = AdapterResidency(LORA)
    for name in ("a", "b", "c", "d"):  # d pushes a, the oldest off the device, out of host
        slots.load_seconds([name])
    assert slots.held() == {"b", "c", "d"}
    assert slots.load_seconds(["a"]) == pytest.approx(LORA.disk_load_s)


def test_adapters_in_use_are_never_evicted_and_max_loras_is_enforced() -> None:
    slots = AdapterResidency(LORA)
    slots.load_seconds(["a"])
    slots.load_seconds(["a", "b"])  # a is in use: b takes the free slot, nothing evicted
    assert set(slots.device) == {"a", "b"}
    slots.load_seconds(["b", "c"])  # a is free now: it goes, b (in use) stays
    assert set(slots.device) == {"b", "c"}
    with pytest.raises(ValueError, match="max_loras"):
        slots.load_seconds(["a", "b", "c"])


def test_the_assumed_costs_follow_bytes_over_bandwidth() -> None:
    lora = SimLoRA(adapter_bytes=50_000_000, host_to_device_bytes_s=25e9,
                   disk_read_bytes_s=1e9)
    assert lora.host_load_s == pytest.approx(0.002)
    assert lora.disk_load_s == pytest.approx(0.052)
    with pytest.raises(ValueError):
        SimLoRA(max_loras=4, max_cpu_loras=2)


# ------------------------------------------------------------------ simulated replica
def request(i: int, t: float, adapter: str | None, max_tokens: int = 16) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", t, SyntheticPrompt((), unique_start(i), 300, True),
                           max_tokens, adapter=adapter)


def run(requests: list[WorkloadRequest], lora: SimLoRA | None) -> list:
    return simulate(requests, [RoundRobinRouter()], 1, ClusterSimConfig(lora=lora)).records


def test_a_request_whose_adapter_is_not_resident_pays_its_load_before_its_first_token(
        ) -> None:
    lora = SimLoRA(max_loras=2, max_cpu_loras=2, adapter_bytes=200_000_000)
    workload = [request(0, 0.0, "a"), request(1, 5.0, "a")]
    base = run(workload, None)
    with_adapter = run(workload, lora)
    assert with_adapter[0].ttft == pytest.approx(base[0].ttft + lora.disk_load_s)
    assert with_adapter[1].ttft == pytest.approx(base[1].ttft)  # still on the device


def test_at_most_max_loras_distinct_adapters_run_at_once() -> None:
    lora = SimLoRA(max_loras=1, max_cpu_loras=1)
    apart = run([request(0, 0.0, "a"), request(1, 0.0, "b")], lora)
    assert apart[1].first_token >= apart[0].finish  # b waits for a's request to finish
    together = run([request(0, 0.0, "a"), request(1, 0.0, "a")], lora)
    assert together[1].first_token < together[0].finish


def test_a_replica_reports_the_adapters_it_holds_and_adapters_off_changes_nothing() -> None:
    workload = with_zipf_adapters(make("steady", 20.0, 3.0, seed=0), num_adapters=10)
    config = ClusterSimConfig(lora=SimLoRA(max_loras=4, max_cpu_loras=8))
    result = simulate(workload, [RoundRobinRouter()], 2, config)
    loads = result.adapter_loads
    assert loads["from_disk"] >= 1 and result.summary()["adapter_loads"] == loads
    plain = simulate(make("steady", 20.0, 3.0, seed=0), [RoundRobinRouter()], 2,
                     ClusterSimConfig())
    ignored = simulate(workload, [RoundRobinRouter()], 2, ClusterSimConfig())
    assert "adapter_loads" not in plain.summary()
    # adapters off: only the adapters' cache namespaces differ (no prompt is shared here)
    assert [r.first_token for r in ignored.records] == [r.first_token for r in plain.records]


# ------------------------------------------------------------------ workload
def test_zipf_adapters_are_seeded_skewed_and_keyed_in_their_own_namespace() -> None:
    plain = make("steady", 200.0, 10.0, seed=0)
    named = with_zipf_adapters(plain, num_adapters=100, zipf_a=1.0, base_fraction=0.25)
    assert named == with_zipf_adapters(plain, num_adapters=100, zipf_a=1.0,
                                       base_fraction=0.25)
    counts = Counter(r.adapter for r in named)
    assert 0.2 < counts[None] / len(named) < 0.3
    top = counts.most_common(2)
    assert top[0][0] in (None, "lora-1") and counts["lora-1"] > 5 * counts["lora-10"] / 2
    spec = next(r for r in named if r.adapter is not None)
    assert spec.prompt_token_ids.cache_namespace != b""
    assert next(r for r in named if r.adapter is None).prompt_token_ids.cache_namespace == b""


# ------------------------------------------------------------------ routers
def view(rid: str, adapters: tuple[str, ...] = (), waiting: int = 0, ongoing: int = 0
         ) -> ReplicaView:
    load = ReplicaLoad(kv_usage=0.1, num_waiting=waiting, num_running=1, num_free_blocks=900,
                       num_total_blocks=1000, step_token_rate=0.0, timestamp=time.time())
    return ReplicaView(rid, load.with_adapters(adapters), ongoing=ongoing)


def test_ray_multiplexing_pins_an_adapter_to_its_holder_however_long_its_queue() -> None:
    rng = random.Random(0)
    views = [view("r0"), view("r1", ("a",), waiting=50, ongoing=100), view("r2")]
    assert {ray_multiplex_choice(views, "a", rng) for _ in range(50)} == {"r1"}


def test_ray_multiplexing_sends_an_unheld_adapter_to_the_replicas_holding_fewest() -> None:
    rng = random.Random(0)
    views = [view("r0", ("x", "y", "z")), view("r1", ("x",), ongoing=5), view("r2", ("y",))]
    assert {ray_multiplex_choice(views, "a", rng) for _ in range(50)} == {"r2"}
    assert {ray_multiplex_choice(views, None, rng) for _ in range(200)} == {"r0", "r2"}


def choose(router: IterserveRouter, views: list[ReplicaView]) -> object:
    prompt = SyntheticPrompt((), unique_start(7), 64, True)
    ctx = RoutingContext(RouteRequest("q", prompt, 16, 0.0, adapter="a"), views, 0.0, 16)
    return router.choose(ctx, random.Random(0))


def test_iterserve_prefers_a_holder_within_the_slack_and_spreads_beyond_it() -> None:
    near = [view("r0"), view("r1", ("a",), waiting=1)]
    far = [view("r0"), view("r1", ("a",), waiting=4)]
    router = IterserveRouter(RouterConfig(lora_affinity_slack=1.0))
    assert choose(router, near) == "r1"
    assert choose(IterserveRouter(RouterConfig(lora_affinity_slack=1.0)), far) == "r0"
    assert choose(IterserveRouter(lora_affinity=False), near) == "r0"
    wide = IterserveRouter(RouterConfig(lora_affinity_slack=8.0))
    assert choose(wide, [dataclasses.replace(v) for v in far]) == "r1"


def test_a_replica_reports_the_adapters_running_and_its_slots_for_the_router() -> None:
    """What `prefer_adapter_holders` reads to keep a request off a replica whose slots all
    run other adapters (there it would wait for a slot without bound)."""
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

    replica = SimulatedReplica("r0", ClusterSimConfig(lora=LORA), 0.0)
    for i, adapter in enumerate("abc"):
        replica.add(request(i, 0.0, adapter, max_tokens=2000), 0.0)
    load = replica.load(1.0)
    assert load.max_loras == 2 and load.lora_running == {"a", "b"}
    assert load.has_slot_for("a") and not load.has_slot_for("c")
    off = SimulatedReplica("r1", ClusterSimConfig(), 0.0).load(0.0)
    assert off.max_loras == 0 and off.has_slot_for("c")


def test_the_simulated_router_spreads_an_adapter_as_its_share_grows() -> None:
    """The live router's rule (lora_traffic.py) in the simulator's router: 8 requests in a
    row for one adapter, all in flight, reach 3 of 4 replicas; after 40 base-model requests,
    5 for a cold adapter stay on one."""
    router = IterserveRouter()
    views = [view(f"r{i}") for i in range(4)]
    prompt = SyntheticPrompt((), unique_start(7), 64, True)

    def route(i: int, adapter: str | None) -> object:
        request = RouteRequest(f"q{i}", prompt, 16, 0.0, adapter=adapter)
        chosen = router.choose(RoutingContext(request, views, 0.0, 16), random.Random(i))
        router.on_routed(request, chosen, 0.0)
        return chosen

    assert len({route(i, "hot") for i in range(8)}) == 3
    for i in range(8):
        router.on_completed(f"q{i}", "r0", 0.0)
    for i in range(8, 48):
        route(i, None)
    assert len({route(i, "cold") for i in range(48, 53)}) == 1
