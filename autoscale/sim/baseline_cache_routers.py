"""Stateful `RoutingPolicy` wrappers of the cache-aware baselines in `baseline_routers`.

Each keeps what its original keeps, fed only by the `on_*` hooks: a prefix history of the
prompts it routed (llm-d approximate prefix, Ray's prefix tree, SGLang's approximate tree,
Dynamo without KV events) and its own in-flight requests (SGLang's load, Dynamo's active
prefill tokens and blocks). Where the caller supplies the replicas' own prefix-cache
answer (`ReplicaView.cached_prefix_tokens`, from their KV block hashes), the policies
documented as using KV events (Dynamo, llm-d precise) read it instead of their history.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from iterserve.autoscale.sim.baseline_routers import (
    LlmdWeights,
    SglangThresholds,
    argbest,
    dynamo_costs,
    llmd_scores,
    ray_prefix_affinity_choice,
    sglang_cache_aware_choice,
)
from iterserve.autoscale.sim.prefix_history import PrefixHistory, block_chain
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext


@dataclass
class _Flight:
    replica_id: Hashable
    prompt_tokens: int
    total_tokens: int  # prompt + max_tokens
    routed_at: float


class _HistoryRouter:
    """Shared plumbing: a prefix history, in-flight requests, one cached block chain."""

    name = "history"

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.history = PrefixHistory(capacity_blocks)
        self.in_flight: dict[str, _Flight] = {}
        self._chain_for: tuple[str, int, list[int]] | None = None

    def chain(self, request: RouteRequest, block_size: int) -> list[int]:
        cached = self._chain_for
        if cached is not None and cached[0] == request.request_id and cached[1] == block_size:
            return cached[2]
        chain = block_chain(request.prompt_token_ids, block_size)
        self._chain_for = (request.request_id, block_size, chain)
        return chain

    def matched(self, ctx: RoutingContext) -> list[int]:
        chain = self.chain(ctx.request, ctx.block_size)
        return [self.history.matched_blocks(v.replica_id, chain) for v in ctx.replicas]

    def in_flight_counts(self, replicas: Sequence[ReplicaView]) -> list[int]:
        counts: dict[Hashable, int] = {}
        for f in self.in_flight.values():
            counts[f.replica_id] = counts.get(f.replica_id, 0) + 1
        return [counts.get(v.replica_id, 0) for v in replicas]

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        n = len(request.prompt_token_ids)
        self.in_flight[request.request_id] = _Flight(replica_id, n, n + request.max_tokens, now)
        cached = self._chain_for
        if cached is not None and cached[0] == request.request_id:
            self.history.record(replica_id, cached[2])
        elif self._chain_for is not None:
            # Chosen for another request since (Ray routes concurrent requests
            # concurrently): record this one's own chain, at the block size last used.
            self.history.record(replica_id, self.chain(request, self._chain_for[1]))

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        self.in_flight.pop(request_id, None)

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None:
        self.history.keep_only(replica_ids)
        live = set(replica_ids)
        for rid in [r for r, f in self.in_flight.items() if f.replica_id not in live]:
            del self.in_flight[rid]


def _precise_or_history(ctx: RoutingContext, history_blocks: Sequence[int]) -> list[int]:
    """Cached prompt tokens per replica: the replica's own answer where given, else the
    router's history (whole blocks)."""
    prompt = ctx.request.prompt_token_ids
    return [v.cached_prefix_tokens(prompt) if v.cached_prefix_tokens is not None
            else m * ctx.block_size for v, m in zip(ctx.replicas, history_blocks, strict=True)]


class LlmdRouter(_HistoryRouter):
    """llm-d EPP with the inference-scheduling guide's scorers (see `llmd_scores`).
    precise=False: prefix match approximated from routing history (the guide's default
    prefix-cache-scorer; LRU of 31,250 blocks per pod as in its lruCapacityPerServer);
    precise=True: from the replicas' KV block hashes (llm-d's precise-prefix-cache scorer)."""

    def __init__(self, weights: LlmdWeights | None = None, precise: bool = False,
                 capacity_blocks: int = 31_250) -> None:
        super().__init__(capacity_blocks)
        self.weights = weights or LlmdWeights()
        self.precise = precise
        self.name = "llm-d-precise" if precise else "llm-d"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        n_blocks = len(ctx.request.prompt_token_ids) // ctx.block_size
        matched = self.matched(ctx)
        if self.precise:
            matched = [t // ctx.block_size for t in _precise_or_history(ctx, matched)]
        fractions = [0.0 if n_blocks == 0 else min(1.0, m / n_blocks) for m in matched]
        scores = llmd_scores(ctx.replicas, fractions, self.weights)
        return ctx.replicas[argbest(scores, rng)].replica_id


class DynamoRouter(_HistoryRouter):
    """Dynamo's KV router cost (see `dynamo_costs`) with router-tracked active sequences:
    decode blocks are the in-flight requests' prompt + max_tokens blocks (Ray passes
    max_tokens as the expected output). Dynamo drops a request's prefill tokens when its
    first token streams back; the contract has no first-token hook, so a request counts as
    prefilling until the replica's published stats are newer than its routing time.
    Overlap from the replicas' block hashes (KV events) where given, else from routing
    history (Dynamo's ApproxKvIndexer)."""

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        super().__init__(None)
        self.overlap_score_weight = overlap_score_weight
        self.name = "dynamo"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        overlap = _precise_or_history(ctx, self.matched(ctx))
        prefill: dict[Hashable, int] = {}
        decode: dict[Hashable, int] = {}
        bs = ctx.block_size
        stats_time = {v.replica_id: (-1.0 if v.load is None else v.load.timestamp)
                      for v in ctx.replicas}
        for f in self.in_flight.values():
            if f.routed_at >= stats_time.get(f.replica_id, -1.0):
                prefill[f.replica_id] = prefill.get(f.replica_id, 0) + f.prompt_tokens
            decode[f.replica_id] = decode.get(f.replica_id, 0) + -(-f.total_tokens // bs)
        ids = [v.replica_id for v in ctx.replicas]
        costs = dynamo_costs(len(ctx.request.prompt_token_ids), overlap,
                             [prefill.get(i, 0) for i in ids], [decode.get(i, 0) for i in ids],
                             bs, self.overlap_score_weight)
        return ctx.replicas[argbest(costs, rng, lowest=True)].replica_id


class RayPrefixAffinityRouter(_HistoryRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter (see `ray_prefix_affinity_choice`), with its
    defaults: imbalanced_threshold inf, match_rate_threshold 0.1, no eviction."""

    def __init__(self, imbalanced_threshold: float = float("inf"),
                 match_rate_threshold: float = 0.1) -> None:
        super().__init__(None)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.name = "ray-prefix"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        trees = [self.history.size_blocks(v.replica_id) for v in ctx.replicas]
        return ray_prefix_affinity_choice(
            ctx.replicas, self.matched(ctx), trees, len(ctx.request.prompt_token_ids),
            ctx.block_size, rng, self.imbalanced_threshold, self.match_rate_threshold)


class SglangRouter(_HistoryRouter):
    """SGLang router `cache_aware` (see `sglang_cache_aware_choice`): load is the router's
    in-flight count per worker; its tree evicts at max_tree_size (2**26 characters: never
    reached in these runs, so no eviction here)."""

    def __init__(self, thresholds: SglangThresholds | None = None) -> None:
        super().__init__(None)
        self.thresholds = thresholds or SglangThresholds()
        self.name = "sglang"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        trees = [self.history.size_blocks(v.replica_id) for v in ctx.replicas]
        return sglang_cache_aware_choice(
            ctx.replicas, self.in_flight_counts(ctx.replicas), self.matched(ctx), trees,
            len(ctx.request.prompt_token_ids), ctx.block_size, self.thresholds, rng)
