"""A workload phase change on the host tier, measured over HTTP (loadtests/studies/kv_tiers/
README.md, "Over HTTP"): a segmented LRU kept one phase's hit blocks in its protected segment
(80 % of the slots) and the next phase's blocks, cycling through probation alone, were evicted
before they returned. Remembering what probation evicted (ghosts, ARC's B1 list) served half of
a later phase; LRU, now the default as in vLLM, serves all of it; ARC most of it.

Replayed on the real HostKVIndex under a device LRU of 234 blocks and 936 host slots (the HTTP
study's sizes): six 128-block chats, three returning turns each, new chats each phase
(loadtests/studies/kv_tiers/host_index_shapes.py replays six more shapes and other sizes).
"""

from __future__ import annotations

import pytest

from iterserve.loadtests.studies.kv_tiers.host_index_shapes import (
    chat_hit_rates,
    device_in_front_of,
)
from iterserve.replica.host_kv_eviction import SegmentedLRUEviction, make_eviction_policy
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex

DEVICE_BLOCKS, HOST_SLOTS = 234, 936


def returning_turn_hit_rates(policy: str, phases: int) -> list[float]:
    """The study's replay of this shape under the named eviction policy."""
    index = HostKVIndex(HOST_SLOTS, make_eviction_policy(policy, HOST_SLOTS))
    cached = device_in_front_of(index, DEVICE_BLOCKS)
    return chat_hit_rates(cached, chats=6, blocks=128, turns=3, phases=phases)


@pytest.mark.parametrize("policy", ["lru", "arc", "slru"])
def test_the_first_phase_is_served_from_the_host_tier(policy: str) -> None:
    assert returning_turn_hit_rates(policy, 1) == [1.0]


@pytest.mark.parametrize("policy, floor", [("lru", 0.99), ("arc", 0.6), ("slru", 0.45)])
def test_a_later_phase_is_served_from_the_host_tier(policy: str, floor: float) -> None:
    """lru 1.00 / 1.00, arc 0.68 / 0.98 (its first return misses until the ghosts grow T1),
    slru 0.50 / 0.50 (0.0 without its ghosts)."""
    later = returning_turn_hit_rates(policy, 3)[1:]
    assert all(rate > floor for rate in later), later


def test_slru_shrinks_its_protected_share_when_a_block_probation_evicted_comes_back() -> None:
    index = HostKVIndex(10, SegmentedLRUEviction(10))
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
    to probation, whose least recent leaves first."""
    index = HostKVIndex(10, SegmentedLRUEviction(10, protected_fraction=0.2))
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
        SegmentedLRUEviction(10, protected_fraction=1.5)
