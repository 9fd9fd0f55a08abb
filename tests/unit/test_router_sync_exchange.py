"""Router sync in the Ray adapter (autoscale/router_sync.py): the log's exchange, one
router's side of it, and two hand-built KVAwareRouters sharing an in-process hub (the Ray
actor that hosts the log in production is exercised in
tests/integration/test_router_ray.py)."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.router_sync import (
    COMPLETED,
    HEARD_TTL_S,
    ROUTED,
    RouterSync,
    SyncEvent,
    SyncLog,
)
from iterserve.autoscale.signals import ReplicaLoad

SYNCED = RouterConfig(drain_inflight_waiting=True, router_sync_period_s=0.01)


def routed(request_id: str, replica: str = "x", at: float = 1.0) -> SyncEvent:
    return SyncEvent(ROUTED, request_id, replica, at, 300, 200)


class LocalHub:
    """The hub's exchange without Ray: one SyncLog, awaited as the actor would be."""

    def __init__(self, log: SyncLog) -> None:
        self.log = log
        self.down = False

    async def exchange(self, router_id: str, events: list[SyncEvent], cursor: int | None
                       ) -> tuple[list[SyncEvent], int, bool]:
        if self.down:
            raise ConnectionError("hub gone")
        return self.log.exchange(router_id, events, cursor)


def test_a_router_reads_the_others_events_once_and_never_its_own() -> None:
    log = SyncLog()
    assert log.exchange("a", [routed("a1")], None) == ([], 1, False)
    theirs, cursor_b, lost = log.exchange("b", [routed("b1")], None)
    assert (theirs, cursor_b, lost) == ([], 2, False)  # a first exchange reads nothing old
    theirs, cursor_a, _ = log.exchange("a", [routed("a2")], 1)
    assert [e.request_id for e in theirs] == ["b1"] and cursor_a == 3
    theirs, cursor_b, _ = log.exchange("b", [], cursor_b)
    assert [e.request_id for e in theirs] == ["a2"] and cursor_b == 3
    assert log.exchange("b", [], cursor_b)[0] == []
    assert log.stats() == {"routers": 2, "events": 3}


def test_a_router_that_fell_behind_the_log_is_told_it_lost_events() -> None:
    log = SyncLog(capacity=3)
    log.exchange("a", [], None)
    log.exchange("b", [routed(f"b{i}") for i in range(5)], None)
    theirs, cursor, lost = log.exchange("a", [], 0)
    assert lost and [e.request_id for e in theirs] == ["b2", "b3", "b4"] and cursor == 5
    with pytest.raises(ValueError):
        SyncLog(capacity=0)


def _core() -> KVRouterCore[str]:
    return KVRouterCore(SYNCED)


def _stats() -> ReplicaLoad:
    return ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=1000,
                       num_total_blocks=1000, step_token_rate=0.0, timestamp=0.5)


def test_heard_sends_count_in_flight_until_their_completion_is_heard() -> None:
    log = SyncLog()
    mine, peer = _core(), _core()
    me = RouterSync(mine, lambda: LocalHub(log), 0.01)
    other = RouterSync(peer, lambda: LocalHub(log), 0.01)
    known = {"x": "X", "y": "Y"}.get
    asyncio.run(me.exchange_once(known))
    asyncio.run(other.exchange_once(known))
    other.sent("r1", "x", 1.0, 300, 200)
    other.sent("r2", "gone", 1.0, 300, 200)  # a replica this router does not know
    asyncio.run(other.exchange_once(known))
    asyncio.run(me.exchange_once(known))
    correction = mine.in_flight.correction("X", _stats())
    assert correction is not None and (correction.requests, correction.prefill_tokens) == (
        1, 200)
    assert len(me._heard) == 1 and len(mine.in_flight) == 1 and len(mine.affinity) == 0
    other.completed("r1", "x")
    other.completed("mine", "x")  # a completion of something never heard: ignored
    asyncio.run(other.exchange_once(known))
    asyncio.run(me.exchange_once(known))
    assert len(me._heard) == 0 and len(mine.in_flight) == 0
    assert len(peer.in_flight) == 0  # the peer's own tracker is fed by its own router


def test_a_lost_hub_forgets_the_heard_sends_keeps_the_outbox_and_reconnects() -> None:
    hubs = [LocalHub(SyncLog())]
    core = _core()
    core.routed("own", "X", 1.0, None, 300, prefill_tokens=200)
    sync = RouterSync(core, lambda: hubs[-1], 0.01)
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    hubs[-1].log.exchange("peer", [routed("p1")], None)
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    assert len(sync._heard) == 1 and len(core.in_flight) == 2
    sync.sent("own2", "x", 2.0, 300, 200)
    hubs[-1].down = True
    with pytest.raises(ConnectionError):
        asyncio.run(sync.exchange_once({"x": "X"}.get))
    assert len(sync._heard) == 0 and len(core.in_flight) == 1  # its own send stays in flight
    hubs.append(LocalHub(SyncLog()))  # the next exchange asks for a new hub
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    assert hubs[-1].log.stats()["events"] == 1  # the send made while the hub was down


def test_a_heard_send_never_completed_is_forgotten_after_its_ttl() -> None:
    log, clock = SyncLog(), [100.0]
    core = _core()
    sync = RouterSync(core, lambda: LocalHub(log), 0.01, clock=lambda: clock[0])
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    log.exchange("peer", [routed("p1"), SyncEvent(COMPLETED, "p0", "x")], None)
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    assert len(sync._heard) == 1
    clock[0] += HEARD_TTL_S + 1
    asyncio.run(sync.exchange_once({"x": "X"}.get))
    assert len(sync._heard) == 0 and len(core.in_flight) == 0


def test_sync_needs_the_drained_waiting_count() -> None:
    with pytest.raises(ValueError, match="drain_inflight_waiting"):
        RouterConfig(router_sync_period_s=0.05)
    with pytest.raises(ValueError):
        RouterConfig(drain_inflight_waiting=True, router_sync_period_s=0.0)
    assert RouterConfig().router_sync_period_s is None


def test_two_kv_aware_routers_share_their_sends_through_the_hub() -> None:
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        ReplicaID,
        RequestMetadata,
    )
    from ray.serve.request_router import PendingRequest

    from iterserve.autoscale.router import KVAwareRouter

    deployment = DeploymentID("LLMReplica", "app")
    replica = ReplicaID("x", deployment)
    log = SyncLog()
    routers = []
    for _ in range(2):
        router = KVAwareRouter(deployment_id=deployment,
                               handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(**SYNCED.model_dump())
        router._sync._hub_factory = lambda: LocalHub(log)  # in production: RayHub
        router._replica_ids = {"x": replica}
        routers.append(router)
    a, b = routers

    async def run() -> None:
        for router in routers:
            await router._sync.exchange_once(router._replica_ids.get)
        meta = RequestMetadata(request_id="r1", internal_request_id="r1")
        pending = PendingRequest(args=[list(range(1, 100))], kwargs={}, metadata=meta,
                                 future=None)
        a.on_request_routed(pending, replica, None)
        await a._sync.exchange_once(a._replica_ids.get)
        await b._sync.exchange_once(b._replica_ids.get)
        assert b._core.in_flight.in_flight(replica) == 1
        a.on_request_completed(replica, "r1")
        await a._sync.exchange_once(a._replica_ids.get)
        await b._sync.exchange_once(b._replica_ids.get)
        assert b._core.in_flight.in_flight(replica) == 0

    asyncio.run(run())


def test_the_loop_reports_every_exchange_and_goes_on_after_a_failure() -> None:
    hub = LocalHub(SyncLog(capacity=2))
    outcomes: list[str] = []
    sync = RouterSync(_core(), lambda: hub, 0.005, on_exchange=outcomes.append)

    async def run() -> None:
        sync.ensure_running({"x": "X"}.get)
        await asyncio.sleep(0.03)
        hub.down = True
        await asyncio.sleep(0.02)
        hub.down = False
        hub.log.exchange("peer", [routed(f"p{i}") for i in range(5)], None)  # > capacity
        await asyncio.sleep(0.03)
        sync._task.cancel()

    asyncio.run(run())
    assert "ok" in outcomes and "failed" in outcomes and sync.failures >= 1
    assert outcomes[-1] == "ok"  # reconnected to the (same) hub after the failures
