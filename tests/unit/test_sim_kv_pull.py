"""KV pulls between simulated replicas (autoscale/sim/kv_pull.py): the cost decision, the
router's credit, blocks landing in a receiver's cache, a pull failing because the holder
evicted the blocks meanwhile, and a small cluster cell with pulls on and off."""

from __future__ import annotations

import dataclasses
import itertools
import random

from iterserve.autoscale.kv_pull_cost import credit_pulls
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.block_manager import SimBlockManager
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.kv_pull import (
    KVPulls,
    SimKVPulls,
    prompt_chain,
    pull_fraction,
    worth_pulling,
)
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.simulated_replica import SimulatedReplica
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.sim_runner import CostModel

KV_BYTES = 131072  # Llama-3-8B bf16, the simulator's default model
_ids = itertools.count()


def test_a_pull_is_taken_only_when_it_beats_prefilling_those_tokens() -> None:
    cost = CostModel()  # 30 us a prefill token
    # 1024 tokens = 134 MB: 5.4 ms at 25 GB/s, 134 ms at 1 GB/s, against 30.7 ms of prefill
    assert worth_pulling(SimKVPulls(network_gb_s=25.0), cost, 1024, KV_BYTES)
    assert not worth_pulling(SimKVPulls(network_gb_s=1.0), cost, 1024, KV_BYTES)
    # one block behind a 1 ms latency: 16 tokens prefill in 0.48 ms
    assert not worth_pulling(SimKVPulls(pull_latency_s=1e-3), cost, 16, KV_BYTES)
    assert not worth_pulling(SimKVPulls(), cost, 0, KV_BYTES)
    slow, fast = (pull_fraction(SimKVPulls(network_gb_s=bw), 1024, KV_BYTES, 34_000)
                  for bw in (1.0, 25.0))
    assert slow == 1.0 and 0.1 < fast < 0.25


def test_the_router_credits_a_light_replica_with_what_a_pull_from_the_holder_saves() -> None:
    def fraction(rid: str, tokens: int) -> float:
        return {"b": 0.2, "c": 1.0}[rid]

    answers = credit_pulls(charged={"a": 1000}, pullable={"a": 1000}, held={"a": 1000},
                           replica_ids=["a", "b", "c"], fraction=fraction)
    # the holder keeps its own answer; b gets 80 % of the prefix; c's pull costs as much as
    # computing, so it is worth nothing
    assert answers == {"a": 1000, "b": 800}
    # a replica that holds part of it is credited only the rest
    partial = credit_pulls({"a": 1000, "b": 400}, {"a": 1000, "b": 400}, {"a": 1000, "b": 400},
                           ["a", "b"], lambda rid, n: 0.5)
    assert partial == {"a": 1000, "b": 700}


def _load(num_waiting: int) -> ReplicaLoad:
    return ReplicaLoad(kv_usage=0.3, num_waiting=num_waiting, num_running=8,
                       num_free_blocks=1000, num_total_blocks=2000, step_token_rate=0.0,
                       timestamp=0.0, prefill_token_rate=34000.0,
                       queued_prefill_tokens=num_waiting * 4096)


def _picks(pulls: SimKVPulls | None, holder_waiting: int) -> set[object]:
    """Where the router sends a 4k-token prompt that only "holder" caches, "light" idle."""
    prompt = list(range(4097))
    views = [ReplicaView("holder", _load(holder_waiting)), ReplicaView("light", _load(0))]
    picks = set()
    for i in range(10):  # every shuffle of the two
        ctx = RoutingContext(RouteRequest(f"q{i}", prompt, 16, 0.0), views, 0.0, 16,
                             prefix_cache=lambda p, ids: {"holder": 4096})
        picks.add(IterserveRouter(kv_pulls=pulls).choose(ctx, random.Random(i)))
    return picks


def test_the_pull_aware_router_routes_past_a_busy_holder_when_a_pull_is_cheaper() -> None:
    # an idle holder keeps its prefix's requests, pulls or not
    assert _picks(SimKVPulls(), 0) == _picks(None, 0) == {"holder"}
    # one request waiting there: queuing behind it costs more than pulling 4k tokens at
    # 12.5 GB/s (43 ms) to the idle replica; blind to pulls (or at 1 GB/s, slower than
    # computing) the router stays with the holder
    assert _picks(SimKVPulls(), 1) == {"light"}
    assert _picks(None, 1) == _picks(SimKVPulls(network_gb_s=1.0), 1) == {"holder"}


def _finished_prefix(replica: SimulatedReplica, prompt: list[int], now: float) -> float:
    """Run a request of this prompt to completion on the replica: its blocks stay cached."""
    spec = WorkloadRequest(f"w{next(_ids)}", now, prompt, max_tokens=1)
    replica.add(spec, now)
    while replica.wake_time is not None:
        now = replica.wake_time
        replica.advance(now)
    replica.block_manager.check_invariants()
    return now


def test_pulled_blocks_land_in_the_receivers_cache_and_its_lookup_finds_them() -> None:
    config = ClusterSimConfig(num_blocks=64, block_size=4)
    holder, receiver = (SimulatedReplica(rid, config, 0.0) for rid in ("h", "r"))
    prompt = list(range(1000, 1041))  # 10 cacheable blocks
    _finished_prefix(holder, prompt, 0.0)
    pulls = KVPulls(SimKVPulls(), config.sim.cost, KV_BYTES, 4)
    spec = WorkloadRequest("p", 1.0, prompt, max_tokens=4)
    plan = pulls.plan(spec, receiver, {"h": [40]}, {"h": holder, "r": receiver})
    assert plan is not None and plan.holder == "h" and plan.num_blocks == 10
    assert pulls.read(plan, holder) is not None
    pulls.land(plan, receiver)
    assert pulls.counts["taken"] == 1 and pulls.counts["landed_blocks"] == 10
    assert pulls.counts["bytes_moved"] == 10 * 4 * KV_BYTES
    receiver.block_manager.check_invariants()
    request = Request("q", prompt, SamplingParams(max_tokens=1), 0.0)
    assert len(receiver.block_manager.find_cached_prefix(request)) == 10
    # landing the same chain again writes nothing and keeps the accounting whole
    assert receiver.block_manager.land_blocks(plan.chain) == 0
    receiver.block_manager.check_invariants()


def test_a_full_receiver_lands_only_what_its_free_blocks_take() -> None:
    manager = SimBlockManager(4, 4, True)
    busy = Request("busy", list(range(13)), SamplingParams(max_tokens=1), 0.0)
    manager.allocate(busy, 13)  # 4 blocks in use, none free
    chain = prompt_chain(list(range(500, 521)), 4, 5)
    assert manager.land_blocks(chain) == 0
    manager.free(busy)
    assert manager.land_blocks(chain) == 4  # 4 blocks free: the chain's first 4 land
    manager.check_invariants()


def test_a_pull_from_a_holder_that_evicted_the_blocks_meanwhile_fails_and_is_counted() -> None:
    config = ClusterSimConfig(num_blocks=16, block_size=4)
    holder, receiver = (SimulatedReplica(rid, config, 0.0) for rid in ("h", "r"))
    prompt = list(range(1000, 1041))
    now = _finished_prefix(holder, prompt, 0.0)
    pulls = KVPulls(SimKVPulls(), config.sim.cost, KV_BYTES, 4)
    plan = pulls.plan(WorkloadRequest("p", now, prompt, max_tokens=4), receiver, {"h": [40]},
                      {"h": holder, "r": receiver})
    assert plan is not None
    _finished_prefix(holder, list(range(5000, 5061)), now)  # 16 blocks: evicts the prefix
    assert pulls.read(plan, holder) is None
    assert pulls.counts["failed"] == 1 and pulls.counts["taken"] == 0
    assert pulls.read(plan, None) is None  # a holder gone altogether fails the same way
    assert pulls.counts["failed"] == 2


def test_a_small_cell_with_pulls_on_pulls_and_finishes_every_request() -> None:
    requests = make("multi-tenant", 12.0, 6.0, seed=0)
    base = ClusterSimConfig(num_blocks=2048, seed=0)
    results = {}
    for name, pulls in (("off", None), ("on", SimKVPulls()),
                        ("slow", SimKVPulls(network_gb_s=1.0))):
        config = dataclasses.replace(base, kv_pulls=pulls)
        routers = [IterserveRouter(kv_pulls=pulls) for _ in range(2)]
        results[name] = simulate(requests, routers, 8, config).summary()
    for summary in results.values():
        assert summary["finished"] == len(requests)
    assert "kv_pulls" not in results["off"]
    on, slow = results["on"]["kv_pulls"], results["slow"]["kv_pulls"]
    assert on["taken"] > 0 and on["landed_blocks"] > 0 and on["bytes_moved"] > 0
    # at 1 GB/s a pull never beats prefilling on the simulated H100: none is taken
    assert slow["taken"] == 0 and slow["declined"] > 0
    assert results["on"]["prefix_hit_rate"] > results["off"]["prefix_hit_rate"]
