"""Router sync in the cluster simulator (ClusterSimConfig.router_sync_delay_s): every router
hears of its peers' sends and completions, once each, that long after them; what it hears
counts in its in-flight view and nowhere else; and no request is left in flight anywhere."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable

import pytest

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.baseline_routers import PowerOfTwoRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.routing_context import PeerSyncedPolicy, RouteRequest
from iterserve.autoscale.sim.workload import WorkloadRequest

SMALL = ClusterSimConfig(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=512,
                         max_model_len=2048)


def workload(n: int = 240, rate: float = 40.0, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(10, 4000) for _ in range(96)) for _ in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        ids = rng.choice(prefixes) + tuple(rng.randrange(10, 4000)
                                           for _ in range(rng.randint(20, 300)))
        out.append(WorkloadRequest(f"q{i}", t, ids, rng.randint(4, 80)))
    return out


class RecordingRouter(IterserveRouter):
    """IterserveRouter that writes down what it routes and what it hears from its peers."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = {}
        self.heard: list[tuple[str, float, float]] = []  # request id, sent_at, heard at
        self.heard_done: list[str] = []

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        self.sent[request.request_id] = now
        super().on_routed(request, replica_id, now)

    def on_peer_routed(self, request: RouteRequest, replica_id: Hashable, sent_at: float,
                       prefill_tokens: int, now: float) -> None:
        self.heard.append((request.request_id, sent_at, now))
        super().on_peer_routed(request, replica_id, sent_at, prefill_tokens, now)

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        if request_id not in self.sent:
            self.heard_done.append(request_id)
        super().on_completed(request_id, replica_id, now)


def synced(delay: float) -> ClusterSimConfig:
    return dataclasses.replace(SMALL, router_sync_delay_s=delay)


def test_every_peer_send_and_completion_is_heard_once_after_the_delay() -> None:
    routers = [RecordingRouter(), RecordingRouter()]
    result = simulate(workload(), routers, 3, synced(0.05))
    assert result.num_finished == 240
    finish = {r.request_id: r.finish for r in result.records}
    for me, peer in ((routers[0], routers[1]), (routers[1], routers[0])):
        assert me.sent and sorted(r for r, _, _ in me.heard) == sorted(peer.sent)
        for request_id, sent_at, heard_at in me.heard:
            assert sent_at == peer.sent[request_id]
            assert heard_at == pytest.approx(sent_at + 0.05)
        # the run ends with its last completion: those of its last 0.05 s go unheard
        unheard = {r for r in peer.sent if finish[r] > result.end_time - 0.05}
        assert sorted(me.heard_done) == sorted(set(peer.sent) - unheard)
        assert len(me.core.in_flight) == len(unheard) < 10  # nothing else left in flight


def test_sync_is_deterministic_and_changes_the_run() -> None:
    runs = [simulate(workload(), [IterserveRouter(), IterserveRouter()], 3,
                     synced(0.01)).to_json() for _ in range(2)]
    assert runs[0] == runs[1]
    alone = simulate(workload(), [IterserveRouter(), IterserveRouter()], 3, SMALL).to_json()
    assert alone != runs[0]


def test_sync_needs_routers_that_hear_their_peers() -> None:
    assert isinstance(IterserveRouter(), PeerSyncedPolicy)
    assert not isinstance(PowerOfTwoRouter(), PeerSyncedPolicy)
    with pytest.raises(ValueError, match="PeerSyncedPolicy"):
        simulate(workload(20), [PowerOfTwoRouter(), PowerOfTwoRouter()], 2, synced(0.01))
    with pytest.raises(ValueError, match="router_sync_delay_s"):
        synced(-0.01)


def test_a_heard_send_counts_in_flight_but_moves_no_affinity_or_routed_work() -> None:
    core: KVRouterCore[str] = KVRouterCore(RouterConfig())
    stats = ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=1000,
                        num_total_blocks=1000, step_token_rate=0.0, timestamp=1.0)
    key, tokens = core.request_key(list(range(1, 200)), 50)
    core.peer_routed("p1", "a", sent_at=1.2, num_tokens=tokens, prefill_tokens=150)
    correction = core.in_flight.correction("a", stats)
    assert (correction.requests, correction.prompt_tokens, correction.committed_tokens) == (
        1, tokens, tokens)
    assert len(core.affinity) == 0 and len(core.routed_work) == 0
    # a send made before the replica's stats is already in them: not counted again
    later = dataclasses.replace(stats, timestamp=1.3)
    assert core.in_flight.correction("a", later).requests == 0
    core.completed("p1")
    assert core.in_flight.correction("a", stats) is None
    assert key is not None
