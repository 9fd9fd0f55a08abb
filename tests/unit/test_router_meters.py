"""RoutedWorkMeter.values: the same floats from its array path as from its list path and
as the snapshot, bit for bit, with replicas never sent to, forgotten and re-added."""

from __future__ import annotations

import random

from iterserve.autoscale.router_meters import RoutedWorkMeter


class ListOnly(RoutedWorkMeter):
    ARRAYS_FROM = 1 << 30


class ArraysAlways(RoutedWorkMeter):
    ARRAYS_FROM = 0


def test_array_and_list_paths_give_the_snapshots_floats() -> None:
    rng = random.Random(7)
    replicas = [f"r{i}" for i in range(40)]
    meters = [ListOnly(12.5), ArraysAlways(12.5)]
    now = 0.0
    for step in range(3000):
        now += rng.choice([0.0, rng.random() * 0.01, rng.random() * 5.0])
        rid = rng.choice(replicas)
        if step % 97 == 0:
            for meter in meters:
                meter.forget_replica(rid)
        else:
            tokens = rng.randrange(0, 5000)
            for meter in meters:
                meter.add(rid, tokens, now)
        asked = rng.sample(replicas, rng.randrange(1, len(replicas))) + ["never-sent"]
        at = now - rng.choice([0.0, 1.0, -2.0])  # times can run backwards: decay floors at 0
        expected = [meters[0].snapshot(at).get(r, 0.0) for r in asked]
        listed, arrayed = (list(meter.values(asked, at)) for meter in meters)
        assert listed == arrayed == expected  # bit for bit (numpy's power fails this here)
