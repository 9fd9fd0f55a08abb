"""KVAwareRouter inside a real local Ray Serve: two replicas, one artificially full; and two
replicas that report their prefix caches' block hashes.

The replicas are a tiny test deployment whose record_routing_stats reports a full KV cache
when a flag file names it; the router must then send every new request to the other one.
The caching ones report the stable block hashes (replica/block_hashes.py) of every prompt
they served; a repeated long prompt must then go to the replica that served it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import block_hash_oracle  # noqa: E402
from block_hash_oracle import prompt_block_hashes  # noqa: E402
from ray import cloudpickle, serve  # noqa: E402

from iterserve.autoscale.config import RouterConfig  # noqa: E402
from iterserve.autoscale.router import request_router_config  # noqa: E402
from iterserve.autoscale.signals import ReplicaLoad  # noqa: E402

BLOCK_SIZE = 16

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]

# The test module and the oracle are not importable in Ray workers: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(block_hash_oracle)


@serve.deployment(max_ongoing_requests=100, ray_actor_options={"num_cpus": 0})
class FakeReplica:
    """Reports its load from a flag file: 'full' if the file names this replica."""

    def __init__(self, flag_file: str) -> None:
        self.flag_file = Path(flag_file)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.served = 0

    def _full(self) -> bool:
        return self.flag_file.exists() and self.flag_file.read_text().strip() == self.replica_id

    def record_routing_stats(self) -> dict:
        full = self._full()
        return ReplicaLoad(
            kv_usage=0.99 if full else 0.10, num_waiting=5 if full else 0, num_running=8,
            num_free_blocks=1 if full else 90, num_total_blocks=100, step_token_rate=0.0,
            timestamp=time.time(),
        ).to_dict()

    async def generate(self, prompt_token_ids: list[int]) -> str:
        self.served += 1
        return self.replica_id


@serve.deployment(max_ongoing_requests=100, ray_actor_options={"num_cpus": 0})
class CachingReplica:
    """Reports, as its prefix cache, the block hashes of every prompt it served."""

    def __init__(self) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.cached: set[int] = set()

    async def record_routing_stats(self) -> dict:
        load = ReplicaLoad(kv_usage=0.1, num_waiting=0, num_running=1, num_free_blocks=90,
                           num_total_blocks=100, step_token_rate=0.0, timestamp=time.time())
        return load.with_cached_blocks(self.cached, BLOCK_SIZE).to_dict()

    async def generate(self, prompt_token_ids: list[int]) -> str:
        self.cached.update(prompt_block_hashes(prompt_token_ids, BLOCK_SIZE))
        return self.replica_id


@pytest.fixture(scope="module")
def ray_serve():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=128 * 1024**2,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0}, proxy_location="Disabled")
    yield
    serve.shutdown()
    ray.shutdown()


def test_full_replica_gets_no_new_requests(ray_serve, tmp_path):
    flag = tmp_path / "full_replica"
    cfg = RouterConfig(routing_stats_period_s=0.2, prefix_affinity=False)
    app = FakeReplica.options(num_replicas=2,
                              request_router_config=request_router_config(cfg)).bind(str(flag))
    handle = serve.run(app, name="router_test", route_prefix=None)
    prompt = list(range(40))

    # Learn both replica ids (the router spreads an idle start across them).
    seen: set[str] = set()
    deadline = time.time() + 60
    while len(seen) < 2 and time.time() < deadline:
        seen.update(handle.generate.remote(prompt).result() for _ in range(10))
    assert len(seen) == 2, f"expected two replicas, saw {seen}"

    full_id = sorted(seen)[0]
    flag.write_text(full_id)
    time.sleep(1.5)  # several routing-stats periods for the controller to poll and broadcast

    # Sequential and concurrent requests alike avoid the full replica.
    chosen = [handle.generate.remote(prompt).result() for _ in range(20)]
    responses = [handle.generate.remote(prompt) for _ in range(20)]
    chosen += [r.result() for r in responses]
    assert full_id not in chosen, f"{chosen.count(full_id)} of 40 went to the full replica"

    # And once it is no longer full it is used again.
    flag.write_text("nobody")
    time.sleep(1.5)
    again = [handle.generate.remote(prompt) for _ in range(30)]
    assert full_id in {r.result() for r in again}
    serve.delete("router_test")


def test_a_repeated_prompt_goes_to_the_replica_that_reported_its_prefix(ray_serve):
    # affinity and the routed-work balance off: only the replicas' reports can keep the
    # prompt on one replica (else the router's shuffle spreads the sequential requests)
    cfg = RouterConfig(routing_stats_period_s=0.2, prefix_affinity=False, routed_work_weight=0.0)
    app = CachingReplica.options(num_replicas=2,
                                 request_router_config=request_router_config(cfg)).bind()
    handle = serve.run(app, name="cache_report_test", route_prefix=None)
    short = [1, 2, 3]  # no full block: reported by nobody, spread by the shuffle
    seen: set[str] = set()
    deadline = time.time() + 60
    while len(seen) < 2 and time.time() < deadline:
        seen.update(handle.generate.remote(short).result() for _ in range(10))
    assert len(seen) == 2, f"expected two replicas, saw {seen}"

    prompt = list(range(100, 100 + 20 * BLOCK_SIZE))
    holder = handle.generate.remote(prompt).result()
    time.sleep(1.5)  # several routing-stats periods: the holder's report reaches the router
    chosen = [handle.generate.remote(prompt).result() for _ in range(12)]
    assert set(chosen) == {holder}, f"{len(chosen) - chosen.count(holder)} of 12 went elsewhere"
    serve.delete("cache_report_test")


@serve.deployment(num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0})
class SyncIngress:
    """An ingress replica: its handle to the replicas is its own router (one per process)."""

    def __init__(self, replicas: object) -> None:
        self.replicas = replicas
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, prompt_token_ids: list[int]) -> str:
        await self.replicas.generate.remote(prompt_token_ids)
        return self.replica_id


def test_the_ingress_routers_exchange_their_sends_through_the_sync_hub(ray_serve):
    from iterserve.autoscale.router_sync import hub_name

    cfg = RouterConfig(routing_stats_period_s=0.2, drain_inflight_waiting=True,
                       router_sync_period_s=0.05)
    replicas = CachingReplica.options(name="SyncedReplica", num_replicas=2,
                                      request_router_config=request_router_config(cfg))
    handle = serve.run(SyncIngress.bind(replicas.bind()), name="sync_test", route_prefix=None)
    ingresses: set[str] = set()
    deadline = time.time() + 60
    while len(ingresses) < 2 and time.time() < deadline:  # both ingress routers at work
        ingresses.update(handle.remote(list(range(i, i + 40))).result() for i in range(10))
    assert len(ingresses) == 2, f"expected two ingress replicas, saw {ingresses}"
    # every request routed and completed is an event: two per request; the hub actor's
    # process starts with the first exchange (seconds here), the routers keep their events
    start, stats = time.time(), {}
    while time.time() < start + 30:
        try:
            hub = ray.get_actor(hub_name("sync_test", "SyncedReplica"), namespace="serve")
            stats = ray.get(hub.stats.remote())
        except ValueError:  # not registered yet
            stats = {}
        if stats.get("events", 0) >= 2 * 10 and stats["routers"] == 2:
            break
        time.sleep(0.2)
    print(f"sync hub after {time.time() - start:.1f} s: {stats}")
    assert stats.get("routers") == 2 and stats["events"] >= 2 * 10, stats
    serve.delete("sync_test")
