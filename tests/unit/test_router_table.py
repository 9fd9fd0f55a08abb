"""KVRouterCore's ScoreTable ranks exactly as the pure reference `rank_replicas` does."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from router_oracle import rank_replicas

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_policy import Correction, prefix_hash
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.signals import ReplicaLoad

NOW = 1000.0
PROMPT = list(range(100, 180))  # 5 blocks of 16


def _load(rng: random.Random, plain: bool = False) -> ReplicaLoad | None:
    """plain: stats with a KV size, not draining (the ScoreTable's fast path)."""
    if not plain and rng.random() < 0.15:
        return None
    total = rng.choice([100, 1000] if plain else [0, 100, 1000])
    kv = rng.choice([0.0, 0.1, 0.5, 0.8, 0.85, 0.95, 1.0])  # few values: many exact ties
    return ReplicaLoad(
        kv_usage=kv, num_waiting=rng.choice([0, 0, 1, 3, 8]), num_running=rng.randrange(4),
        num_free_blocks=int(total * (1 - kv)), num_total_blocks=total, step_token_rate=0.0,
        timestamp=NOW - rng.choice([0.1, 0.1, 0.5, 5.0, 7.5]),
        max_waiting_requests=rng.choice([None, None, 4, 8]),
        draining=not plain and rng.random() < 0.1,
        prefill_token_rate=rng.choice([0.0, 0.0, 2000.0, 35_000.5]),
        queued_prefill_tokens=rng.choice([0, 0, 700, 9000]))


def _correction(rng: random.Random) -> Correction | None:
    if rng.random() < 0.3:
        return None
    # prefill_as_of: a drained correction (as a draining tracker gives), some in the future;
    # waiting: how many are still queued (drain_inflight_waiting), None: all
    requests = rng.randrange(3)
    return Correction(requests, rng.choice([0, 500, 5000]), rng.choice([0, 800, 9000]),
                      rng.choice([0, 0, 300, 2000, 1234.5]),
                      rng.choice([None, None, NOW - 0.05, NOW - 0.3, NOW + 0.01]),
                      rng.choice([None, None, rng.randint(0, requests)]))


def _config(rng: random.Random) -> RouterConfig:
    return RouterConfig(
        score_prefill_work=rng.random() < 0.8, prefix_affinity=rng.random() < 0.8,
        use_committed_kv=rng.random() < 0.8,
        routed_work_weight=rng.choice([0.0, 32.0, 32.0, 5.0]),
        cache_affinity_threshold=rng.choice([0.1, 0.1, 0.6, 1.5]),
        max_waiting_per_replica=rng.choice([None, None, 3]),
        stats_stale_after_s=rng.choice([5.0, 1.0]),
        drain_inflight_prefill=rng.random() < 0.5)


def _situation(rng: random.Random, core: KVRouterCore[str], n: int) -> dict:
    """One request's situation; the core's routed-work meter and affinity table are fed."""
    ids = [f"r{i}" for i in range(n)]
    rng.shuffle(ids)
    candidates = ids[: rng.randint(1, n)]
    key = prefix_hash(PROMPT, 16, 4) if rng.random() < 0.7 else None
    if rng.random() < 0.5:
        core.affinity.record(prefix_hash(PROMPT, 16, 4), rng.choice(ids))
    for _ in range(rng.randrange(3)):
        core.routed_work.add(rng.choice(ids), rng.choice([0, 100, 2000]),
                             NOW - rng.choice([0.0, 1.0, 3.0, 9.0]))
    cached = None
    if rng.random() < 0.7:
        cached = {r: rng.choice([0, 0, 0, 16, 48, 64]) for r in candidates}
    return {"candidates": candidates, "key": key, "cached": cached,
            "prompt_tokens": rng.choice([0, len(PROMPT), len(PROMPT)]),
            "num_tokens": rng.choice([0, len(PROMPT) + 200, 2000, 5000])}


def _reference(core: KVRouterCore[str], s: dict, loads: dict, corrections: dict) -> list[str]:
    config = core.config
    return rank_replicas(
        s["candidates"], loads, corrections, config, prompt_prefix_hash=s["key"],
        affinity=core.affinity.as_mapping(), now=NOW, request_tokens=s["num_tokens"],
        prompt_tokens=s["prompt_tokens"], cached_tokens=s["cached"],
        routed_work=core.routed_work.snapshot(NOW) if config.routed_work_weight else None)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.booleans())
def test_rank_and_best_equal_the_reference_with_given_corrections(seed: int, n: int,
                                                                   plain: bool) -> None:
    """plain: every replica has sized stats and none drains, the ScoreTable's fast path
    (one division for every KV share, tiers from the watermark alone)."""
    rng = random.Random(seed)
    core: KVRouterCore[str] = KVRouterCore(_config(rng))
    loads: dict[str, ReplicaLoad | None] = {f"r{i}": _load(rng, plain) for i in range(n)}
    corrections = {f"r{i}": _correction(rng) for i in range(n)}
    for _ in range(6):  # the same core again and again: rows kept, some replicas changed
        s = _situation(rng, core, n)
        cands = s["candidates"]
        want = _reference(core, s, loads, {r: c for r, c in corrections.items()
                                           if c is not None})
        args = (cands, [loads[r] for r in cands], s["key"], s["num_tokens"], NOW,
                s["prompt_tokens"], s["cached"], [corrections[r] for r in cands])
        assert core.rank(*args) == want
        assert core.best(*args) == want[0]
        for rid in rng.sample(sorted(loads), rng.randrange(n + 1)):
            if rng.random() < 0.5:
                loads[rid] = _load(rng, plain)
            else:
                corrections[rid] = _correction(rng)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 10))
def test_rank_equals_the_reference_with_the_cores_own_tracker(seed: int, n: int) -> None:
    """Corrections from the core's InFlightTracker: rows follow its changes."""
    rng = random.Random(seed)
    core: KVRouterCore[str] = KVRouterCore(_config(rng))
    loads: dict[str, ReplicaLoad | None] = {f"r{i}": _load(rng) for i in range(n)}
    live: list[str] = []
    for step in range(12):
        s = _situation(rng, core, n)
        cands = s["candidates"]
        want = _reference(core, s, loads, core.in_flight.corrections(loads))
        args = (cands, [loads[r] for r in cands], s["key"], s["num_tokens"], NOW,
                s["prompt_tokens"], s["cached"])
        assert core.rank(*args) == want
        assert core.best(*args) == want[0]
        if step % 3 == 1:  # the same core with the corrections given: its rows follow both
            given = core.in_flight.corrections(loads)
            assert core.rank(*args, [given.get(r) for r in cands]) == want
        chosen = core.best(*args)
        core.routed(f"q{step}", chosen, NOW - rng.choice([0.0, 0.3, 2.0]), s["key"],
                    s["num_tokens"], prefill_tokens=rng.choice([0, 80]))
        live.append(f"q{step}")
        if live and rng.random() < 0.4:
            core.completed(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.3:
            loads[rng.choice(sorted(loads))] = _load(rng)
        if rng.random() < 0.1:
            core.replica_died(rng.choice(sorted(loads)))


def test_ties_keep_candidate_order_and_empty_candidates_rank_empty() -> None:
    core: KVRouterCore[str] = KVRouterCore(RouterConfig())
    idle = ReplicaLoad(0.0, 0, 0, 100, 100, 0.0, timestamp=NOW)
    assert core.rank(["b", "a", "c"], [idle, idle, idle], None, 0, NOW) == ["b", "a", "c"]
    assert core.best(["c", "a"], [idle, idle], None, 0, NOW) == "c"
    assert core.rank([], [], None, 0, NOW) == []
