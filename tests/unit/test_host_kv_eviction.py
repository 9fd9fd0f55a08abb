"""The host tier's eviction policies on their own (replica/host_kv_eviction.py), through the
real HostKVIndex: LRU's order, ARC's two lists and its adapting target (as vLLM's
`vllm/v1/kv_offload/cpu/policies/arc.py` behaves), and the setting that picks one."""

from __future__ import annotations

import pytest

from iterserve.replica.host_kv_eviction import (
    ARCEviction,
    LRUEviction,
    SegmentedLRUEviction,
    make_eviction_policy,
)
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex


def store(index: HostKVIndex, *keys: int) -> None:
    for key in keys:
        index.store(HostEntry(key, 0, bytes(8)))  # type: ignore[arg-type]


def hit(index: HostKVIndex, *keys: int) -> None:
    for key in keys:
        index.record_hit(index.lookup(key))  # type: ignore[arg-type]
    index.unpin_all()


def test_lru_lets_the_least_recently_used_go_whether_or_not_it_was_ever_copied_back() -> None:
    index = HostKVIndex(3, LRUEviction())
    store(index, 1, 2, 3)
    hit(index, 1)  # 1 is now the most recent
    store(index, 4)  # 2 goes
    assert 2 not in index and all(k in index for k in (1, 3, 4))
    store(index, 5, 6, 7)  # a scan flushes everything, 1 included: LRU's known weakness
    assert not any(k in index for k in (1, 3, 4))


def test_arc_keeps_reused_blocks_while_its_recency_target_is_zero() -> None:
    policy = ARCEviction(4)
    index = HostKVIndex(4, policy)
    store(index, 1, 2, 3, 4)
    hit(index, 1, 2)  # T2 = {1, 2}, T1 = {3, 4}
    store(index, 10, 11, 12)  # target 0: T1 leaves first, each new block in turn
    assert all(k in index for k in (1, 2)) and policy.target_t1 == 0


def test_arc_grows_its_recency_target_when_a_block_t1_let_go_comes_back() -> None:
    policy = ARCEviction(4)
    index = HostKVIndex(4, policy)
    store(index, 1, 2, 3, 4)
    hit(index, 1, 2)
    store(index, 5, 6)  # 3 and 4 go to B1
    store(index, 3)  # back while remembered: target 0 -> 1 (|B2| / |B1| < 1)
    assert policy.target_t1 == 1.0 and 5 not in index
    store(index, 4)  # target 2; T1 = {6, 3} holds 2 >= 2: T1's least recent (6) goes
    assert policy.target_t1 == 2.0 and 6 not in index
    store(index, 7)  # T1 = {3, 4} at its target of 2: T1's 3 goes, T2 kept
    assert 3 not in index and all(k in index for k in (1, 2, 4, 7))
    policy.target_t1 = 3.0  # T1 = {4, 7} under its target: now T2's least recent goes
    store(index, 8)
    assert 1 not in index and all(k in index for k in (2, 4, 7, 8))


def test_arc_shrinks_its_target_when_a_block_t2_let_go_comes_back() -> None:
    policy = ARCEviction(2)
    index = HostKVIndex(2, policy)
    store(index, 1, 2)
    hit(index, 1, 2)  # both in T2
    policy.target_t1 = 2.0
    store(index, 3)  # T1 empty, under target: T2's 1 goes to B2
    assert 1 not in index
    store(index, 1)  # back from B2: target 2 -> 1
    assert policy.target_t1 == 1.0


def test_a_store_of_a_held_block_is_recency_not_reuse_under_arc() -> None:
    policy = ARCEviction(3)
    index = HostKVIndex(3, policy)
    store(index, 1, 2, 3)
    store(index, 1)  # touched, not promoted: still in T1, now its most recent
    store(index, 4)
    assert 2 not in index and 1 in index


@pytest.mark.parametrize("name, kind", [("lru", LRUEviction), ("arc", ARCEviction),
                                        ("slru", SegmentedLRUEviction)])
def test_the_setting_names_the_policy(name: str, kind: type) -> None:
    assert isinstance(make_eviction_policy(name, 8), kind)
    with pytest.raises(ValueError, match="unknown host KV eviction policy 'lfu'"):
        make_eviction_policy("lfu", 8)


@pytest.mark.parametrize("name", ["lru", "arc", "slru"])
def test_every_policy_skips_pinned_slots_and_frees_each_slot_once(name: str) -> None:
    index = HostKVIndex(3, make_eviction_policy(name, 3))
    store(index, 1, 2, 3)
    index.pin(index.lookup(1))  # type: ignore[arg-type]
    index.pin(index.lookup(2))  # type: ignore[arg-type]
    store(index, 4)  # only 3 is unpinned
    assert 3 not in index and all(k in index for k in (1, 2, 4))
    index.unpin_all()
    for key in range(10, 40):
        store(index, key)
    assert len(index) == 3 and index.num_evicted == 31
