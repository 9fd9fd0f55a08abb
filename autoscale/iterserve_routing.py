"""iterserve's router as a `RoutingPolicy`: the simulator's and the tournament's entry point.

It calls `KVRouterCore` (affinity table, in-flight tracker, `rank_replicas`) exactly as the
Ray adapter `KVAwareRouter` does: shuffle the candidates (independent routers must not break
ties towards the same replica), rank on the replicas' last reported loads corrected by this
router's own in-flight requests, take the first; record the route; forget it on completion.
The only difference is where the replica ids, loads and clock come from.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.routing_context import RouteRequest, RoutingContext


class IterserveRouter:
    """use_replica_cache: read the replicas' own prefix-cache answers
    (`ReplicaView.cached_prefix_tokens`) where the caller gives them; False runs the router
    as the Ray adapter does today (replicas do not report their block hashes to it yet)."""

    def __init__(self, config: RouterConfig | None = None, name: str = "iterserve",
                 use_replica_cache: bool = True) -> None:
        self.config = config or RouterConfig()
        self.core: KVRouterCore[Hashable] = KVRouterCore(self.config)
        self.name = name
        self.use_replica_cache = use_replica_cache
        self._pending: tuple[str, int | None, int] | None = None
        self._cached: dict[Hashable, int] | None = None

    def _key(self, request: RouteRequest) -> tuple[int | None, int]:
        pending = self._pending
        if pending is not None and pending[0] == request.request_id:
            return pending[1], pending[2]
        key, tokens = self.core.request_key(request.prompt_token_ids, request.max_tokens)
        self._pending = (request.request_id, key, tokens)
        return key, tokens

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        shuffled = list(ctx.replicas)
        rng.shuffle(shuffled)
        loads = {v.replica_id: v.load for v in shuffled}
        key, tokens = self._key(ctx.request)
        prompt = ctx.request.prompt_token_ids
        self._cached = None
        if self.use_replica_cache and all(v.cached_prefix_tokens is not None for v in shuffled):
            self._cached = {v.replica_id: v.cached_prefix_tokens(prompt) for v in shuffled}
        ranked = self.core.rank(list(loads), loads, key, tokens, ctx.now,
                                prompt_tokens=len(prompt), cached_tokens=self._cached)
        return ranked[0]

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        key, tokens = self._key(request)
        hit = 0 if self._cached is None else self._cached.get(replica_id, 0)
        self.core.routed(request.request_id, replica_id, now, key, tokens,
                         prefill_tokens=max(0, len(request.prompt_token_ids) - hit))

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        self.core.completed(request_id)

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None:
        self.core.keep_only(replica_ids)
