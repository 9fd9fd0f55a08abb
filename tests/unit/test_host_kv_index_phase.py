"""A known failure of the host tier's segmented LRU, measured over HTTP (loadtests/studies/
kv_tiers/README.md, "Over HTTP"): after one workload phase whose blocks were hit, those blocks
hold the protected segment (80 % of the slots) and nothing demotes them, so the next phase's
blocks cycle through probation alone; with a working set larger than probation, no returning
turn of the new phase is ever served from the tier again.

Replayed here on the real HostKVIndex under a device LRU of 234 blocks and 936 host slots
(the HTTP study's sizes): six 128-block chats, three returning turns each, new chats each
phase. xfail(strict): this fails the day the tier adapts (ARC's ghost entries are one way),
and then the marker must go.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from iterserve.replica.host_kv_index import HostEntry, HostKVIndex

DEVICE_BLOCKS, HOST_SLOTS = 234, 936


def returning_turn_hit_rates(phases: int) -> list[float]:
    index = HostKVIndex(HOST_SLOTS)
    device: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def cached(key: tuple[int, int, int]) -> bool:
        if key in device:
            device.move_to_end(key)
            return True
        slot = index.lookup(key)
        if slot is not None:
            index.record_hit(slot)
            index.unpin_all()
        device[key] = None
        while len(device) > DEVICE_BLOCKS:
            evicted, _ = device.popitem(last=False)
            index.store(HostEntry(evicted, evicted, ()))  # type: ignore[arg-type]
            index.unpin_all()
        return slot is not None

    rates = []
    for phase in range(phases):
        chats = [[(phase, chat, block) for block in range(128)] for chat in range(6)]
        hits = looked_up = 0
        for turn in range(4):
            for chat, blocks in enumerate(chats):
                found = [cached(key) for key in blocks]
                if turn > 0:
                    hits += sum(found[:-9])
                    looked_up += len(blocks) - 9
                blocks += [(phase, chat, len(blocks) + i) for i in range(9)]
        rates.append(hits / looked_up)
    return rates


def test_the_first_phase_is_served_from_the_host_tier() -> None:
    assert returning_turn_hit_rates(1) == [1.0]


@pytest.mark.xfail(strict=True, reason="SLRU: a stale protected segment starves later phases "
                                       "(measured over HTTP, 2026-12-07); not fixed yet")
def test_a_later_phase_is_served_from_the_host_tier_too() -> None:
    assert returning_turn_hit_rates(3)[1:] == [1.0, 1.0]
