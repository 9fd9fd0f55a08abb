"""Published routing policies, reimplemented over the `RoutingContext` contract.

Each rule is a small pure function (`*_choice`) over the candidates' views plus whatever
state the original keeps; the classes below are thin `RoutingPolicy` wrappers that own that
state (a cursor, a prefix history, in-flight counts) and update it only through the
`on_*` hooks. Sources are named in each docstring; deviations from the original are said
there. The tournament (`loadtests/studies/router_tournament/tournament.py`) runs them beside
iterserve's router.

Load-only:  random, round-robin, power-of-two (Ray Serve default), least KV usage (AIBrix
            least-kv-cache).
Cache-aware: llm-d EPP weighted scorers, Dynamo KV router cost, Ray Serve LLM's
            PrefixCacheAffinityRouter, SGLang router cache_aware.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from iterserve.autoscale.sim.routing_context import (
    ReplicaView,
    RouteRequest,
    RoutingContext,
)


# ----------------------------------------------------------------------------- load-only
def random_choice(replicas: Sequence[ReplicaView], rng: random.Random) -> Hashable:
    """Uniform at random (Dynamo `--router-mode random`, llm-d's 'random' arm)."""
    return rng.choice(replicas).replica_id


def round_robin_choice(replicas: Sequence[ReplicaView], cursor: int) -> Hashable:
    """The cursor-th replica modulo the count (Dynamo / SGLang `round_robin`)."""
    return replicas[cursor % len(replicas)].replica_id


def power_of_two_choice(replicas: Sequence[ReplicaView], rng: random.Random) -> Hashable:
    """Ray Serve's default `PowerOfTwoChoicesRequestRouter`: sample two distinct replicas,
    take the one with the shorter queue (ongoing requests); ties go to the first sampled.
    Ray probes the replica's queue length across all routers; here `ongoing` is this
    router's own count (what Ray's queue-length cache holds between probes)."""
    if len(replicas) == 1:
        return replicas[0].replica_id
    a, b = rng.sample(list(replicas), 2)
    return (b if b.ongoing < a.ongoing else a).replica_id


def least_kv_choice(replicas: Sequence[ReplicaView], rng: random.Random) -> Hashable:
    """AIBrix gateway `least-kv-cache`: the lowest reported KV usage; ties at random.
    A replica with no stats yet counts as empty."""
    def kv(v: ReplicaView) -> float:
        return 0.0 if v.load is None else v.load.kv_usage
    best = min(kv(v) for v in replicas)
    return rng.choice([v for v in replicas if kv(v) == best]).replica_id


# ----------------------------------------------------------------------------- llm-d
@dataclass(frozen=True)
class LlmdWeights:
    """llm-d inference-scheduling guide defaults (guides/inference-scheduling values:
    queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3)."""

    queue: float = 2.0
    kv_utilization: float = 2.0
    prefix: float = 3.0


def llmd_scores(replicas: Sequence[ReplicaView], prefix_match_fraction: Sequence[float],
                weights: LlmdWeights) -> list[float]:
    """llm-d EPP scoring (gateway-api-inference-extension scorers, weighted sum, max wins):
    queue-scorer: (max_q - q) / (max_q - min_q) over candidates, 1 when all equal, on the
    pods' reported waiting queue; kv-cache-utilization-scorer: 1 - KV usage;
    prefix-cache-scorer: matched prompt blocks / prompt blocks."""
    queues = [0 if v.load is None else v.load.num_waiting for v in replicas]
    lo, hi = min(queues), max(queues)
    scores = []
    for view, q, match in zip(replicas, queues, prefix_match_fraction, strict=True):
        queue_score = 1.0 if hi == lo else (hi - q) / (hi - lo)
        kv_score = 1.0 - (0.0 if view.load is None else view.load.kv_usage)
        scores.append(weights.queue * queue_score + weights.kv_utilization * kv_score
                      + weights.prefix * match)
    return scores


def argbest(values: Sequence[float], rng: random.Random, lowest: bool = False) -> int:
    """Index of the max (or min) value; ties broken at random (as the EPP's max-score
    picker and Dynamo's selector do)."""
    target = min(values) if lowest else max(values)
    return rng.choice([i for i, v in enumerate(values) if v == target])


# ----------------------------------------------------------------------------- Dynamo
def dynamo_costs(prompt_tokens: int, overlap_tokens: Sequence[int],
                 active_prefill_tokens: Sequence[int], active_decode_blocks: Sequence[int],
                 block_size: int, overlap_score_weight: float = 1.0) -> list[float]:
    """NVIDIA Dynamo KV router (docs/architecture/kv_cache_routing.md; the selection Ray
    2.60's alpha `KVAwareRouter` delegates to), per worker:

        prefill_blocks = (prompt tokens not cached on the worker + its active prefill
                          tokens) / block_size
        decode_blocks  = the worker's active blocks + this request's blocks
        cost           = overlap_score_weight * prefill_blocks + decode_blocks

    The lowest cost wins (temperature 0, the default: deterministic argmin)."""
    request_blocks = -(-prompt_tokens // block_size)
    costs = []
    for overlap, prefill, decode in zip(overlap_tokens, active_prefill_tokens,
                                        active_decode_blocks, strict=True):
        new_prefill = max(0, prompt_tokens - overlap) + prefill
        costs.append(overlap_score_weight * new_prefill / block_size + decode + request_blocks)
    return costs


# ----------------------------------------------------------------------------- Ray / SGLang
def ray_prefix_affinity_choice(replicas: Sequence[ReplicaView], matched_blocks: Sequence[int],
                               tree_blocks: Sequence[int], prompt_tokens: int, block_size: int,
                               rng: random.Random, imbalanced_threshold: float = float("inf"),
                               match_rate_threshold: float = 0.1) -> Hashable:
    """Ray Serve LLM `PrefixCacheAffinityRouter` (ray/llm/_internal/serve/routing_policies/
    prefix_aware/prefix_aware_router.py, Ray 2.60): if max - min queue length <=
    imbalanced_threshold (default inf: always), match the prompt against the prefix tree:
    match rate >= match_rate_threshold -> the replicas owning the longest match, else the
    replicas with the smallest tree; Serve then takes the shortest queue in that group.
    Imbalanced: power of two. Match rate here: matched whole blocks x block_size / prompt
    tokens (Ray's is characters)."""
    queues = [v.ongoing for v in replicas]
    if max(queues) - min(queues) > imbalanced_threshold:
        return power_of_two_choice(replicas, rng)
    best = max(matched_blocks)
    rate = best * block_size / max(1, prompt_tokens)
    if best > 0 and rate >= match_rate_threshold:
        group = [i for i, m in enumerate(matched_blocks) if m == best]
    else:
        smallest = min(tree_blocks)
        group = [i for i, t in enumerate(tree_blocks) if t == smallest]
    shortest = min(queues[i] for i in group)
    return replicas[rng.choice([i for i in group if queues[i] == shortest])].replica_id


@dataclass(frozen=True)
class SglangThresholds:
    """sglang-router / model gateway defaults (RouterArgs: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


def sglang_cache_aware_choice(replicas: Sequence[ReplicaView], in_flight: Sequence[int],
                              matched_blocks: Sequence[int], tree_blocks: Sequence[int],
                              prompt_tokens: int, block_size: int,
                              thresholds: SglangThresholds, rng: random.Random) -> Hashable:
    """SGLang router `cache_aware` (sgl-router src/policies/cache_aware.rs): imbalanced when
    max - min in-flight > balance_abs_threshold AND max > min * balance_rel_threshold ->
    the least-loaded worker. Otherwise the worker with the longest prefix match if the match
    ratio > cache_threshold, else the worker with the smallest approximate tree."""
    lo, hi = min(in_flight), max(in_flight)
    if hi - lo > thresholds.balance_abs_threshold and hi > lo * thresholds.balance_rel_threshold:
        return replicas[argbest(in_flight, rng, lowest=True)].replica_id
    best = max(matched_blocks)
    if best * block_size / max(1, prompt_tokens) > thresholds.cache_threshold:
        return replicas[argbest(matched_blocks, rng)].replica_id
    return replicas[argbest(tree_blocks, rng, lowest=True)].replica_id


# ----------------------------------------------------------------------------- wrappers
class _Stateless:
    name = "stateless"

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        pass

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        pass

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None:
        pass


class RandomRouter(_Stateless):
    name = "random"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return random_choice(ctx.replicas, rng)


class RoundRobinRouter(_Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return round_robin_choice(ctx.replicas, self._cursor)

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        self._cursor += 1


class PowerOfTwoRouter(_Stateless):
    name = "pow2"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return power_of_two_choice(ctx.replicas, rng)


class LeastKVRouter(_Stateless):
    name = "least-kv"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return least_kv_choice(ctx.replicas, rng)
