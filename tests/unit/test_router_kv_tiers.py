"""The router charges a prompt's prefix by the KV tier it lives in (kv_tier_costs.py):
device ~0, host ~copy time, disk ~read time, nowhere: prefill. The tier-blind arm
(score_kv_tiers off) counts what lives below the device as uncached."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from block_hash_oracle import prompt_block_hashes
from test_router_cache_reports import BLOCK, PROMPT, _FakeReplica, _pending, load
from test_router_cache_reports import _router as _any_router

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.kv_tier_costs import charged_hit, tier_fractions
from iterserve.autoscale.replica_cache_reports import cached_prefix_tiers, cached_prefix_tokens

CHAIN = prompt_block_hashes(PROMPT, BLOCK)  # 40 blocks


def _router(**kwargs: object):  # noqa: ANN202 - a KVAwareRouter
    """Stats never stale: the first Ray import on a busy machine can outlast the 5 s, and
    staleness is not what these tests are about."""
    return _any_router(stats_stale_after_s=3600.0, **kwargs)


def busier(tiers: dict[str, list[int]] | None, num_waiting: int = 0) -> dict:
    """A replica's routing stats: its tiers' hashes, num_waiting waiting requests."""
    base = load(None)
    return replace(base, num_waiting=num_waiting).with_cached_blocks(tiers, BLOCK).to_dict()


def firsts(router, replicas: list[_FakeReplica], n: int = 12) -> set[str]:  # noqa: ANN001
    return {asyncio.run(router.choose_replicas(replicas, _pending(PROMPT, f"q{i}")))[0][0]
            .replica_id.unique_id for i in range(n)}


def test_default_fractions_are_the_stated_bandwidths_over_the_prefill_speed() -> None:
    host, disk = tier_fractions(None, RouterConfig())[1:]
    assert host == pytest.approx(131072 * 34000 / 25e9)  # 0.178
    assert disk == pytest.approx(131072 * 34000 / 6e9)  # 0.743
    slow = tier_fractions(load(), RouterConfig(prefill_tokens_per_s=10**6))
    assert slow[1:] == (1.0, 1.0)  # a tier slower than prefilling costs as much, no more
    assert charged_hit([32, 64, 0], (0.0, 0.25, 1.0)) == 32 + 48


def test_the_prefix_runs_through_every_tier_and_stops_at_the_first_missing_block() -> None:
    tiers = {"device": CHAIN[:2] + CHAIN[3:5], "host": [CHAIN[2]], "disk": CHAIN[5:8]}
    holder = load(None).with_cached_blocks(tiers, BLOCK)
    assert cached_prefix_tiers(PROMPT, ["r"], [holder]) == {"r": [4 * BLOCK, BLOCK, 3 * BLOCK]}
    blind = cached_prefix_tokens(PROMPT, ["r"], [holder])  # device only: stops at block 2
    assert blind == {"r": 2 * BLOCK}
    aware = cached_prefix_tokens(PROMPT, ["r"], [holder], tier_costs=RouterConfig())
    host, disk = tier_fractions(holder, RouterConfig())[1:]
    assert aware == {"r": round(4 * BLOCK + BLOCK * (1 - host) + 3 * BLOCK * (1 - disk))}


def test_a_replica_with_the_prefix_in_host_beats_one_without_it() -> None:
    """The one with it is a waiting request busier: it still wins with the tiers scored
    (40 blocks of prefill saved, 0.18 of it paid back in copies), and loses without."""
    replicas = [_FakeReplica("host", busier({"device": [], "host": CHAIN}, num_waiting=1)),
                _FakeReplica("none", busier({"device": []}))]
    assert firsts(_router(), replicas) == {"host"}
    assert firsts(_router(score_kv_tiers=False), replicas) == {"none"}


def test_the_blind_arm_scores_host_as_uncached() -> None:
    replicas = [_FakeReplica("host", busier({"device": [], "host": CHAIN})),
                _FakeReplica("none", busier({"device": []}))]
    assert firsts(_router(score_kv_tiers=False), replicas, n=40) == {"host", "none"}
    assert firsts(_router(), replicas) == {"host"}


def test_device_beats_host_when_loads_are_equal() -> None:
    replicas = [_FakeReplica("device", busier({"device": CHAIN})),
                _FakeReplica("host", busier({"device": [], "host": CHAIN}))]
    assert firsts(_router(), replicas) == {"device"}
    disk = [_FakeReplica("host", busier({"device": [], "host": CHAIN})),
            _FakeReplica("disk", busier({"device": [], "disk": CHAIN}))]
    assert firsts(_router(), disk) == {"host"}


def test_a_replica_that_leaves_has_its_report_dropped_at_once() -> None:
    router = _router()
    replicas = [_FakeReplica("host", busier({"device": [], "host": CHAIN})),
                _FakeReplica("none", busier({"device": []}))]
    parsed = router._parsed._parsed  # the parsed reports, per replica

    async def run() -> None:  # Serve calls these on its event loop
        await router.choose_replicas(replicas, _pending(PROMPT, "a"))
        assert set(parsed) == {r.replica_id for r in replicas}
        router.on_replica_actor_died(replicas[0].replica_id)  # died: forgotten at once
        assert set(parsed) == {replicas[1].replica_id}
        await router.choose_replicas(replicas, _pending(PROMPT, "b"))
        router.update_replicas([replicas[1]])  # scaled down: gone with the update
        assert set(parsed) == {replicas[1].replica_id}

    asyncio.run(run())


def test_a_replica_is_charged_by_the_kv_bytes_its_own_cache_reports() -> None:
    """SmolLM2 in fp32 keeps 46,080 bytes a token, not the assumed Llama-3-8B's 131,072: its
    host tier reads cost 0.35x what the assumption would charge."""
    reporting = replace(load(), kv_bytes_per_token=46080)
    assert tier_fractions(reporting, RouterConfig())[1] == pytest.approx(46080 * 34000 / 25e9)
    assert tier_fractions(load(), RouterConfig())[1] == pytest.approx(131072 * 34000 / 25e9)
