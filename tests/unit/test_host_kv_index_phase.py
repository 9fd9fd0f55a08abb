"""A workload phase change on the host tier, measured over HTTP (loadtests/studies/kv_tiers/
README.md, "Over HTTP"): a plain segmented LRU keeps one phase's hit blocks in its protected
segment (80 % of the slots) and the next phase's blocks, cycling through probation alone, are
evicted before they return: its returning turns were never served from the tier again (0 %).
The index now remembers what probation evicted (ghosts, as ARC's B1 list): a block stored again
while remembered shrinks the protected share and demotes its oldest block.

Replayed on the real HostKVIndex under a device LRU of 234 blocks and 936 host slots (the HTTP
study's sizes): six 128-block chats, three returning turns each, new chats each phase. In a
later phase the first return of each chat still misses (probation evicted it before the tier
knew the phase had changed); the next two are served: ~50 % of returning-turn blocks.
"""

from __future__ import annotations

from iterserve.loadtests.studies.kv_tiers.host_index_shapes import (
    chat_hit_rates,
    device_in_front_of,
)
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex

DEVICE_BLOCKS, HOST_SLOTS = 234, 936


def returning_turn_hit_rates(phases: int) -> list[float]:
    """The study's replay (loadtests/studies/kv_tiers/host_index_shapes.py) of this shape."""
    cached = device_in_front_of(HostKVIndex(HOST_SLOTS), DEVICE_BLOCKS)
    return chat_hit_rates(cached, chats=6, blocks=128, turns=3, phases=phases)


def test_the_first_phase_is_served_from_the_host_tier() -> None:
    assert returning_turn_hit_rates(1) == [1.0]


def test_a_later_phase_is_served_from_the_host_tier_after_its_first_return() -> None:
    later = returning_turn_hit_rates(3)[1:]
    assert all(rate > 0.45 for rate in later), later  # 0.0 without the ghosts


def test_a_block_stored_again_after_probation_evicted_it_shrinks_the_protected_share() -> None:
    index = HostKVIndex(10)
    for key in range(10):
        index.store(HostEntry(key, key, ()))  # type: ignore[arg-type]
    for key in range(8):  # hit: protected holds 8, its share
        index.record_hit(index.lookup(key))  # type: ignore[arg-type]
    index.unpin_all()
    index.store(HostEntry(10, 10, ()))  # type: ignore[arg-type]  # evicts probation's 8
    index.store(HostEntry(8, 8, ()))  # type: ignore[arg-type]  # 8 again: a ghost
    for key in (11, 12):  # two new blocks: 10, then the protected block demoted for 8, leave
        index.store(HostEntry(key, key, ()))  # type: ignore[arg-type]
    assert 0 not in index and 8 in index  # a plain SLRU evicts 8 and keeps 0
    assert all(key in index for key in range(1, 8))


def test_the_protected_share_is_a_parameter_and_bounded() -> None:
    """At a fifth of the slots, two of ten blocks hit stay protected and the rest fall back
    to probation, whose least recent leaves first (loadtests/studies/kv_tiers/
    host_index_shapes.py replays the shares over several workloads)."""
    import pytest

    index = HostKVIndex(10, protected_fraction=0.2)
    for key in range(10):
        index.store(HostEntry(key, key, ()))  # type: ignore[arg-type]
    for key in range(5):
        index.record_hit(index.lookup(key))  # type: ignore[arg-type]
    index.unpin_all()
    for key in range(10, 18):  # eight new blocks: 5-9 leave, then the demoted hits 0-2
        index.store(HostEntry(key, key, ()))  # type: ignore[arg-type]
    assert 3 in index and 4 in index  # protected: the last two hits
    assert not any(key in index for key in (0, 1, 2, 5, 6, 7, 8, 9))  # at 0.8, 0-2 stay
    with pytest.raises(ValueError, match="protected_fraction"):
        HostKVIndex(10, protected_fraction=1.5)
