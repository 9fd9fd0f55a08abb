"""Each adapter's share of the requests a router routed (decayed), and the rule that spreads
an adapter to another replica only when its share needs more replicas than hold it."""

from __future__ import annotations

import pytest

from iterserve.autoscale.lora_traffic import PRUNE_EVERY, AdapterTraffic, needs_another_holder


def test_an_adapters_share_counts_every_request_the_base_models_included() -> None:
    traffic = AdapterTraffic(half_life_s=5.0)
    for i in range(100):
        traffic.record("hot" if i % 4 == 0 else None if i % 4 == 1 else f"cold-{i}", 0.0)
    assert traffic.share("hot", 0.0, replicas=0) == pytest.approx(0.25)
    assert traffic.share("cold-2", 0.0, replicas=0) == pytest.approx(0.01)
    assert traffic.share("never", 0.0, replicas=0) == 0.0


def test_the_share_follows_a_shift_within_a_few_half_lives() -> None:
    traffic = AdapterTraffic(half_life_s=1.0)
    for t in range(100):  # "a" alone for 10 s, then "b" alone
        traffic.record("a" if t < 50 else "b", t / 5)
    assert traffic.share("b", 99 / 5, replicas=0) > 0.99
    assert traffic.share("a", 99 / 5, replicas=0) < 0.01


def test_the_first_requests_of_a_run_do_not_read_as_a_huge_share() -> None:
    """3 of the first 8 requests: 3/8 alone, 12 of 32 replicas' worth; counted with one
    request per replica added, 3/40 (2.4 replicas' worth), and the prior fades."""
    traffic = AdapterTraffic(half_life_s=5.0)
    for i in range(8):
        traffic.record("hot" if i < 3 else None, 0.0)
    assert traffic.share("hot", 0.0, replicas=32) == pytest.approx(3 / 40)
    for i in range(3200):
        traffic.record("hot" if i % 8 < 3 else None, 0.0)
    assert traffic.share("hot", 0.0, replicas=32) == pytest.approx(3 / 8, rel=0.02)


def test_an_adapter_gets_another_holder_only_above_its_share_of_the_replicas() -> None:
    # a fifth of the requests over 32 replicas: 6.4 replicas' worth
    assert needs_another_holder(0.2, holders=6, replicas=32)
    assert not needs_another_holder(0.2, holders=7, replicas=32)
    # a cold adapter (a tenth of one replica's share) keeps to its one holder
    assert not needs_another_holder(0.1 / 32, holders=1, replicas=32)
    assert needs_another_holder(0.1 / 32, holders=0, replicas=32)  # nobody holds it
    assert not needs_another_holder(0.0, holders=0, replicas=32)
    assert not needs_another_holder(0.5, holders=0, replicas=0)


def test_adapters_without_requests_for_many_half_lives_are_forgotten() -> None:
    traffic = AdapterTraffic(half_life_s=1.0)
    traffic.record("old", 0.0)
    for _ in range(PRUNE_EVERY):
        traffic.record("new", 60.0)
    assert len(traffic) == 1 and traffic.share("old", 60.0, replicas=0) == 0.0


def test_a_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        AdapterTraffic(half_life_s=0.0)
