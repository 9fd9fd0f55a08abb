"""The ingress admission queue (autoscale/ingress_queue.py) and its saturation test
(autoscale/ingress_saturation.py): pure objects, no cluster.

Each ordering test sets up a case where arrival order alone gives the other answer, so
each fails without the rule it names.
"""

from __future__ import annotations

import pytest

from iterserve.autoscale.ingress_queue import HeldRequest, IngressFairQueue
from iterserve.autoscale.ingress_saturation import (
    IngressSaturation,
    ReplicaRoom,
    cluster_has_room,
    replica_has_room,
)
from iterserve.replica.virtual_token_counter import VirtualTokenCounters


def released(queue: IngressFairQueue) -> list[str]:
    return [queue.release().request_id for _ in range(len(queue))]


def test_a_heavy_tenants_new_request_loses_to_a_light_tenants_at_equal_priority() -> None:
    queue = IngressFairQueue()
    for name, t in (("heavy-0", 0.0), ("light-0", 0.1), ("light-1", 0.2), ("light-2", 0.25)):
        queue.hold(HeldRequest(name, name.split("-")[0], arrival_time=t))
    queue.hold(HeldRequest("heavy-1", "heavy", arrival_time=0.3))
    # heavy's requests already in flight stream their tokens: its counter moves
    queue.charge_served("heavy", 1.0, output_tokens=500)
    queue.hold(HeldRequest("heavy-new", "heavy", arrival_time=1.0))
    assert released(queue)[:2] == ["light-0", "light-1"]  # heavy-0 arrived first, but


def test_a_tenant_back_from_idle_goes_before_the_backlogged_one_at_an_equal_counter() -> None:
    queue = IngressFairQueue()
    for i in range(3):  # heavy: backlogged, served as its requests leave
        queue.hold(HeldRequest(f"heavy-{i}", "heavy", arrival_time=0.1 * i))
    queue.charge_served("heavy", 1.0, prompt_tokens=500)
    queue.hold(HeldRequest("light-new", "light", arrival_time=5.0))  # lifted to 500
    assert queue.counters.counter("light") == pytest.approx(500.0)
    assert released(queue)[0] == "light-new"  # fewer held: it wins the tie


def test_counters_move_per_served_token_prompt_and_generated_divided_by_weight() -> None:
    queue = IngressFairQueue()
    queue.charge_served("a", 1.0, prompt_tokens=10)
    assert queue.counters.counter("a") == pytest.approx(10.0)
    queue.charge_served("a", 1.0, output_tokens=3)  # VTC: a generated token costs 2
    assert queue.counters.counter("a") == pytest.approx(16.0)
    queue.charge_served("b", 2.0, prompt_tokens=10, output_tokens=3)  # weight 2: half
    assert queue.counters.counter("b") == pytest.approx(8.0)
    queue.charge_served("b", 2.0, output_tokens=1)
    assert queue.counters.counter("b") == pytest.approx(9.0)


def test_weights_decide_who_is_lighter() -> None:
    queue = IngressFairQueue()
    queue.hold(HeldRequest("w1-next", "w1", 1.0, arrival_time=1.0))
    queue.hold(HeldRequest("w4-next", "w4", 4.0, arrival_time=2.0))
    queue.charge_served("w1", 1.0, prompt_tokens=300)
    queue.charge_served("w4", 4.0, prompt_tokens=800)  # more tokens, a smaller counter
    assert released(queue) == ["w4-next", "w1-next"]


def test_bands_are_strict_whatever_the_counters() -> None:
    queue = IngressFairQueue()
    queue.charge_served("vip", 1.0, prompt_tokens=10_000)
    queue.hold(HeldRequest("light-0", "light", band=1, arrival_time=0.0))
    queue.hold(HeldRequest("vip-0", "vip", band=0, arrival_time=1.0))
    assert released(queue) == ["vip-0", "light-0"]


def test_arrival_order_within_a_tenant() -> None:
    queue = IngressFairQueue()
    for i, t in enumerate((0.5, 0.7, 0.9)):
        queue.hold(HeldRequest(f"a{i}", "a", arrival_time=t))
    assert released(queue) == ["a0", "a1", "a2"]


def test_a_newly_backlogged_tenant_is_lifted_to_the_smallest_backlogged_counter() -> None:
    queue = IngressFairQueue()
    queue.charge_served("a", 1.0, prompt_tokens=100)
    queue.charge_served("b", 1.0, prompt_tokens=300)
    queue.hold(HeldRequest("a0", "a"))
    queue.hold(HeldRequest("b0", "b"))
    queue.hold(HeldRequest("idle0", "idle"))  # served nothing while the others were
    assert queue.counters.counter("idle") == pytest.approx(100.0)  # no banked credit
    queue.charge_served("idle", 1.0, prompt_tokens=1)
    assert released(queue)[0] == "a0"  # the lifted tenant does not jump the queue


def test_counters_are_shared_between_ingress_queues() -> None:
    shared = VirtualTokenCounters()
    first, second = IngressFairQueue(shared), IngressFairQueue(shared)
    second.hold(HeldRequest("heavy-1", "heavy", arrival_time=0.0))
    second.hold(HeldRequest("light-1", "light", arrival_time=1.0))
    first.charge_served("heavy", 1.0, prompt_tokens=1000)  # served through the first ingress
    assert released(second) == ["light-1", "heavy-1"]


def test_release_from_an_empty_queue_raises() -> None:
    with pytest.raises(IndexError):
        IngressFairQueue().release()
    with pytest.raises(ValueError, match="weight"):
        HeldRequest("r", "a", weight=0.0)


def test_a_replica_has_room_only_under_every_bound() -> None:
    rule = IngressSaturation(max_in_flight=4, max_queued_prompt_tokens=100, kv_usage_limit=0.9)
    assert replica_has_room(ReplicaRoom(3, 99, 0.5), rule)
    assert not replica_has_room(ReplicaRoom(4, 0, 0.5), rule)  # the batch is full
    assert not replica_has_room(ReplicaRoom(0, 100, 0.5), rule)  # a step of prompts queued
    assert not replica_has_room(ReplicaRoom(0, 0, 0.9), rule)  # KV at its limit


def test_held_while_every_replica_is_saturated_released_when_one_is_not() -> None:
    rule = IngressSaturation(max_in_flight=2, max_queued_prompt_tokens=100)
    full = [ReplicaRoom(2, 0, 0.1), ReplicaRoom(1, 500, 0.1)]
    assert not cluster_has_room(full, rule)
    assert cluster_has_room([*full, ReplicaRoom(1, 50, 0.1)], rule)
    assert not cluster_has_room([], rule)  # no replica: held (the lifecycle's queue)


def test_saturation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        IngressSaturation(max_in_flight=0)
    with pytest.raises(ValueError, match="max_queued_prompt_tokens"):
        IngressSaturation(max_queued_prompt_tokens=0)
    with pytest.raises(ValueError, match="kv_usage_limit"):
        IngressSaturation(kv_usage_limit=0.0)
