"""The readable oracle of the router's ranking: router_policy's score, spelled out one replica
at a time. tests/unit/test_router_table.py holds production (KVRouterCore's ScoreTable) to
it on random loads; test_router_scoring.py and test_router_cache_affinity.py pin its
behaviour on hand-built cases. Pure: reads no clock (`now` is passed in)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_inflight import Correction
from iterserve.autoscale.router_policy import (
    TIER_DRAINING,
    TIER_HOT,
    TIER_OK,
    R,
    _as_correction,
    effective_load,
    prefill_queue,
)
from iterserve.autoscale.signals import ReplicaLoad


@dataclass(frozen=True)
class ReplicaScore:
    replica_id: Hashable
    tier: int
    score: float
    eff_waiting: int
    eff_kv: float
    stale: bool
    balance: float = 0.0  # the routed-work part of score (long-run balance, not queue)


def queued_prefill(correction: Correction, load: ReplicaLoad | None, now: float | None,
                   config: RouterConfig) -> float:
    """U at now: `prefill_queue`'s tokens less what the replica's prefill_token_rate
    computed since their time (never below 0); all of them where not drained."""
    tokens, as_of = prefill_queue(correction, load, config)
    if as_of is None or now is None or load is None:
        return tokens
    elapsed = max(0.0, now - as_of)
    return max(0.0, tokens - load.prefill_token_rate * elapsed)


def request_kv_share(request_tokens: int, load: ReplicaLoad | None, config: RouterConfig
                     ) -> float:
    """The KV fraction of `load`'s replica that a request of request_tokens would take
    (`_kv_of` of a one-request correction, without building one: it runs per replica per
    request)."""
    kv_tokens = 0 if load is None else load.num_total_blocks * config.prefix_block_size
    if request_tokens > 0 and kv_tokens > 0:
        return request_tokens / kv_tokens
    return config.inflight_kv_per_request * 1


def score_replicas(
    candidates: Sequence[R],
    loads: Mapping[R, ReplicaLoad | None],
    in_flight_corrections: Mapping[R, int | Correction],
    config: RouterConfig,
    now: float | None = None,
    request_tokens: int = 0,
    prompt_tokens: int = 0,
    cached_tokens: Mapping[R, int] | None = None,
    routed_work: Mapping[R, float] | None = None,
) -> list[ReplicaScore]:
    """Score every candidate (same order as candidates); see the module docstring."""
    scores = []
    per_waiting = config.prefill_tokens_per_waiting
    work = routed_work or {}
    least_work = min((work.get(r, 0.0) for r in candidates), default=0.0)
    # Where some replica caches most of this prompt, where it goes is the cache's call
    # (within the load terms); the meter weighs in by the share that is not cached anywhere.
    best_hit = max(cached_tokens.values(), default=0) if cached_tokens else 0
    work_weight = config.routed_work_weight * (1.0 - min(1.0, best_hit / max(1, prompt_tokens)))
    for rid in candidates:
        load = loads.get(rid)
        correction = _as_correction(in_flight_corrections.get(rid))
        eff_waiting, eff_kv, hot, stale = effective_load(load, correction, now, config)
        if not hot:
            share = request_kv_share(request_tokens, load, config)
            hot = eff_kv + share >= config.kv_high_watermark
        draining = load is not None and load.draining
        tier = TIER_DRAINING if draining else TIER_HOT if hot else TIER_OK
        score = config.waiting_weight * eff_waiting + config.kv_weight * eff_kv
        if config.score_prefill_work:
            hit = 0 if cached_tokens is None else cached_tokens.get(rid, 0)
            own = max(0, prompt_tokens - hit)
            score += (queued_prefill(correction, load, now, config) + own) / per_waiting
        balance = 0.0
        if work:
            balance = work_weight * (work.get(rid, 0.0) - least_work) / per_waiting
        scores.append(ReplicaScore(rid, tier, score + balance, eff_waiting, eff_kv, stale,
                                   balance))
    return scores


def rank_replicas(
    candidates: Sequence[R],
    loads: Mapping[R, ReplicaLoad | None],
    in_flight_corrections: Mapping[R, int | Correction],
    config: RouterConfig,
    prompt_prefix_hash: int | None = None,
    affinity: Mapping[int, R] | None = None,
    now: float | None = None,
    request_tokens: int = 0,
    prompt_tokens: int = 0,
    cached_tokens: Mapping[R, int] | None = None,
    routed_work: Mapping[R, float] | None = None,
) -> list[R]:
    """Candidates best first. Pure: reads no clock (`now` is the caller's time.time()).

    loads: the last stats per replica (missing or None: none yet). in_flight_corrections:
    requests (a count, or a `Correction` with their prompt tokens) this router routed to the
    replica that its stats do not reflect yet (see `InFlightTracker.corrections`).
    affinity: prefix hash -> the replica that served it last. request_tokens: the KV
    footprint (prompt + max_tokens) of the request being routed (0: unknown).
    prompt_tokens: its prompt length; cached_tokens: per replica, how many leading prompt
    tokens it holds in its prefix cache (None: unknown; then the affinity table decides).
    """
    scores = score_replicas(candidates, loads, in_flight_corrections, config, now,
                            request_tokens, prompt_tokens, cached_tokens, routed_work)
    order = sorted(range(len(scores)), key=lambda i: (scores[i].tier, scores[i].score, i))
    ranked: list[R] = [candidates[i] for i in order]
    if cached_tokens is not None and config.score_prefill_work:
        pending = None if not affinity or prompt_prefix_hash is None else affinity.get(
            prompt_prefix_hash)
        return cache_affinity_first(ranked, scores, cached_tokens, prompt_tokens, config,
                                    pending)
    if not (config.prefix_affinity and prompt_prefix_hash is not None and affinity):
        return ranked
    preferred = affinity.get(prompt_prefix_hash)
    if preferred is None or preferred not in candidates:
        return ranked
    by_id = {s.replica_id: s for s in scores}
    pref = by_id[preferred]
    best = scores[order[0]]
    if pref.tier == TIER_OK and pref.score <= best.score + config.prefix_affinity_slack:
        ranked.remove(preferred)
        ranked.insert(0, preferred)
    return ranked


def cache_affinity_first(ranked: list[R], scores: Sequence[ReplicaScore],
                         cached_tokens: Mapping[R, int], prompt_tokens: int,
                         config: RouterConfig, recent: R | None = None) -> list[R]:
    """Move the replica caching the longest share of the prompt to the front when that
    share is at least cache_affinity_threshold, it is in tier 0, and its score is within
    cache_affinity_slack of the best: Ray's and SGLang's "route by cache match above a
    threshold", under our load guard. Sticking keeps a session's or tenant's growing
    prefix on one replica; the score alone lets the routed-work balance pull it away."""
    if not ranked or prompt_tokens <= 0 or config.cache_affinity_threshold > 1.0:
        return ranked
    best_hit = max(cached_tokens.get(r, 0) for r in ranked)
    if best_hit > 0 and best_hit / prompt_tokens >= config.cache_affinity_threshold:
        preferred = next(r for r in ranked if cached_tokens.get(r, 0) == best_hit)
    elif recent is not None and recent in cached_tokens:
        preferred = recent  # no replica holds it yet, but one was just sent this prefix
    else:
        return ranked
    by_id = {s.replica_id: s for s in scores}
    pref, lead = by_id[preferred], by_id[ranked[0]]
    # queue against queue: the routed-work balance must not pull a prefix off its replica
    if pref.tier == TIER_OK and (pref.score - pref.balance
                                 <= lead.score - lead.balance + config.cache_affinity_slack):
        return [preferred] + [r for r in ranked if r != preferred]
    return ranked
