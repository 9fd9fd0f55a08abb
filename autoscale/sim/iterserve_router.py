"""iterserve's router as a `RoutingPolicy`: the simulator's and the tournament's entry point.

It calls `KVRouterCore` (affinity table, in-flight tracker, routed-work meter,
`ScoreTable`) exactly as the Ray adapter `KVAwareRouter` does: shuffle the candidates
(independent routers must not break ties towards the same replica), rank on the replicas'
last reported loads corrected by the requests in flight, take the first (`best`: the first
of `rank` without ordering the rest); record the route;
forget it on completion. The only differences are where the replica ids, loads and clock
come from, and where the in-flight corrections come from (`InFlightSource`):

- `OWN_TRACKER`: this router's `InFlightTracker`, fed by `on_routed` / `on_completed`, as
  the Ray adapter keeps it (the default);
- `CALLER_VIEWS`: the caller's `ReplicaView.correction`, which the cluster simulator keeps
  incrementally as `InFlightTracker.corrections` would (tests/unit/test_cluster_sim.py
  checks the two agree).

Where the caller says what changed since this router's previous request
(`RoutingContext.offer`, as the simulator does), the own-tracker router keeps that list's
rows and redoes per-replica work only for the changed views (`KVRouterCore.best_offered`):
the same decision and the same random draws (tests/unit/test_router_offer.py).

A request naming a LoRA adapter (`RouteRequest.adapter`) is ranked in full (`rank`) and the
ranking goes through `prefer_adapter_holders` (with each replica's waiting requests as the
score counts them, and the adapter's share of the requests this router routed lately,
`AdapterTraffic`), as the Ray adapter's `choose_replicas` does;
lora_affinity=False leaves the adapter out (the score alone decides).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.kv_pull_cost import credit_pulls
from iterserve.autoscale.kv_tier_costs import charged_hit, tier_fractions
from iterserve.autoscale.lora_affinity import prefer_adapter_holders, waiting_counts
from iterserve.autoscale.lora_in_flight import AdaptersInFlight, with_adapters_in_flight
from iterserve.autoscale.lora_traffic import AdapterTraffic
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.router_table import OfferedRows
from iterserve.autoscale.shuffle import shuffle
from iterserve.autoscale.sim.kv_pull import SimKVPulls, pull_fraction
from iterserve.autoscale.sim.prefix import prompt_namespace
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext

InFlightSource = Literal["own-tracker", "caller-views"]
OWN_TRACKER: InFlightSource = "own-tracker"
CALLER_VIEWS: InFlightSource = "caller-views"


class IterserveRouter:
    """The production KV-aware router (one instance per ingress router).

    use_replica_cache: read the replicas' own prefix-cache answers
    (`ReplicaView.cached_prefix_tokens`) where the caller gives them; False runs the router
    as the Ray adapter does with `RouterConfig.use_replica_cache_reports` off (the affinity
    table stands in; the adapter's default reads the replicas' reported block hashes).
    in_flight: where the in-flight corrections come from (module docstring). kv_pulls: the
    replicas pull prefixes from each other at this (simulated) cost: a replica is credited
    the best other holder's extra tokens at what pulling them saves (`kv_pull.credit_pulls`),
    so that an overloaded holder loses to a light replica plus a pull (None: blind to them)."""

    def __init__(self, config: RouterConfig | None = None, name: str = "iterserve",
                 use_replica_cache: bool = True, in_flight: InFlightSource = OWN_TRACKER,
                 lora_affinity: bool = True, kv_pulls: SimKVPulls | None = None) -> None:
        if in_flight not in (OWN_TRACKER, CALLER_VIEWS):
            raise ValueError(f"in_flight must be {OWN_TRACKER!r} or {CALLER_VIEWS!r}, "
                             f"got {in_flight!r}")
        self.config = config or RouterConfig()
        self.core: KVRouterCore[Hashable] = KVRouterCore(self.config)
        self.name = name
        self.use_replica_cache = use_replica_cache
        self.in_flight = in_flight
        self.lora_affinity = lora_affinity
        self.kv_pulls = kv_pulls
        self.adapters_in_flight: AdaptersInFlight[Hashable] = AdaptersInFlight()
        self.adapter_traffic = AdapterTraffic(self.config.lora_traffic_half_life_s)
        self._pending: tuple[str, int | None, int] | None = None
        self._cached: Mapping[Hashable, int] | None = None
        self._offer_token: object = None  # the caller's token of the offer below
        self._offered: OfferedRows[Hashable] | None = None

    def _key(self, request: RouteRequest) -> tuple[int | None, int]:
        pending = self._pending
        if pending is not None and pending[0] == request.request_id:
            return pending[1], pending[2]
        prompt = request.prompt_token_ids
        key, tokens = self.core.request_key(prompt, request.max_tokens, prompt_namespace(prompt))
        self._pending = (request.request_id, key, tokens)
        return key, tokens

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        if ctx.request.adapter is not None and self.lora_affinity:
            return self._choose_for_adapter(ctx, rng, ctx.request.adapter)
        if ctx.offer is not None and self.in_flight == OWN_TRACKER:
            return self._choose_offered(ctx, rng)
        shuffled = list(ctx.replicas)
        shuffle(rng, shuffled)
        ids = [v.replica_id for v in shuffled]
        key, tokens = self._key(ctx.request)
        prompt = ctx.request.prompt_token_ids
        self._cached = self._cache_answers(ctx, shuffled, ids)
        corrections = [v.correction for v in shuffled] if self.in_flight == CALLER_VIEWS \
            else None
        return self.core.best(ids, [v.load for v in shuffled], key, tokens, ctx.now,
                              prompt_tokens=len(prompt), cached_tokens=self._cached,
                              corrections=corrections)

    def _choose_for_adapter(self, ctx: RoutingContext, rng: random.Random, adapter: str
                            ) -> Hashable:
        """The Ray adapter's decision for a request naming `adapter`: the full ranking,
        then `prefer_adapter_holders` on the waiting counts the score uses."""
        self._offered = None  # its rows miss this request's changes: rebuilt when next used
        shuffled = list(ctx.replicas)
        shuffle(rng, shuffled)
        ids = [v.replica_id for v in shuffled]
        loads = [v.load for v in shuffled]
        key, tokens = self._key(ctx.request)
        self._cached = self._cache_answers(ctx, shuffled, ids)
        corrections = [v.correction for v in shuffled] if self.in_flight == CALLER_VIEWS \
            else None
        ranked = self.core.rank(ids, loads, key, tokens, ctx.now,
                                prompt_tokens=len(ctx.request.prompt_token_ids),
                                cached_tokens=self._cached, corrections=corrections)
        if corrections is None:
            corrections = [self.core.in_flight.correction(rid, load)
                           for rid, load in zip(ids, loads, strict=True)]
        waiting = waiting_counts(ids, loads, corrections, ctx.now, self.config)
        held = {rid: with_adapters_in_flight(load, self.adapters_in_flight.adapters(rid))
                for rid, load in zip(ids, loads, strict=True)}
        return prefer_adapter_holders(ranked, held, waiting, adapter,
                                      self.config.lora_affinity_slack,
                                      self.adapter_traffic.share(adapter, ctx.now, len(ids)))[0]

    def _choose_offered(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        """choose() where the caller says what changed since the previous request
        (`OfferDelta`): the same decision, with per-replica work only for what changed.
        The replicas are not shuffled, their positions are (the same draws as shuffling
        the views), and the shuffled order breaks ties."""
        views, offer = ctx.replicas, ctx.offer
        order = list(range(len(views)))
        shuffle(rng, order)
        offered = self._offered
        changed: Sequence[int] = offer.changed
        if offered is None or offer.token is not self._offer_token \
                or len(offered.ids) != len(views):  # a new list (or a caller that lied)
            offered = self._offered = self.core.offer([v.replica_id for v in views])
            self._offer_token = offer.token
            changed = range(len(views))
        key, tokens = self._key(ctx.request)
        prompt = ctx.request.prompt_token_ids
        self._cached = self._cache_answers(ctx, views, offered.ids)
        return self.core.best_offered(offered, order, changed, lambda i: views[i].load, key,
                                      tokens, ctx.now, prompt_tokens=len(prompt),
                                      cached_tokens=self._cached)

    def _cache_answers(self, ctx: RoutingContext, views: Sequence[ReplicaView],
                       ids: Sequence[Hashable]) -> Mapping[Hashable, int] | None:
        """The replicas' own prefix-cache answers for this prompt, if used and known: with
        KV tiers and RouterConfig.score_kv_tiers, each tier's tokens charged their copy
        time (kv_tier_costs, as the Ray adapter reads the per-tier reports); else the
        device's alone. With kv_pulls, each credited what a pull would bring it."""
        if not self.use_replica_cache:
            return None
        prompt = ctx.request.prompt_token_ids
        if ctx.prefix_tiers is not None and self.config.score_kv_tiers:
            tiers = ctx.prefix_tiers(prompt, ids)
            if not tiers:
                return tiers
            loads = {v.replica_id: v.load for v in views}
            charged = {rid: counts[0] if not any(counts[1:]) else
                       charged_hit(counts, tier_fractions(loads[rid], self.config))
                       for rid, counts in tiers.items()}
            return self._with_pulls(views, ids, charged, tiers)
        if ctx.prefix_cache is not None:  # the caller answers for every replica at once
            device = ctx.prefix_cache(prompt, ids)
        elif all(v.cached_prefix_tokens is not None for v in views):
            device = {v.replica_id: v.cached_prefix_tokens(prompt) for v in views}
        else:
            return None
        return self._with_pulls(views, ids, device, {rid: [n] for rid, n in device.items()})

    def _with_pulls(self, views: Sequence[ReplicaView], ids: Sequence[Hashable],
                    charged: Mapping[Hashable, int], tiers: Mapping[Hashable, Sequence[int]]
                    ) -> Mapping[Hashable, int]:
        """charged, or with kv_pulls each replica credited a pull from the best holder
        offered (its device and host tokens: what it can send)."""
        pulls = self.kv_pulls
        if pulls is None or not tiers:
            return charged
        rates = {v.replica_id: v.load.prefill_token_rate
                 if v.load is not None and v.load.prefill_token_rate > 0
                 else self.config.prefill_tokens_per_s for v in views}
        kv_bytes = self.config.kv_bytes_per_token
        return credit_pulls(charged, {rid: sum(c[:2]) for rid, c in tiers.items()},
                            {rid: sum(c) for rid, c in tiers.items()}, ids,
                            lambda rid, n: pull_fraction(pulls, n, kv_bytes, rates[rid]))

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        key, tokens = self._key(request)
        hit = 0 if self._cached is None else self._cached.get(replica_id, 0)
        self.core.routed(request.request_id, replica_id, now, key, tokens,
                         prefill_tokens=max(0, len(request.prompt_token_ids) - hit))
        if self.lora_affinity:
            self.adapters_in_flight.routed(request.request_id, replica_id, request.adapter)
            self.adapter_traffic.record(request.adapter, now)

    def on_peer_routed(self, request: RouteRequest, replica_id: Hashable, sent_at: float,
                       prefill_tokens: int, now: float) -> None:
        """`PeerSyncedPolicy`: a peer router's send counts in this router's load view."""
        _, tokens = self.core.request_key(request.prompt_token_ids, request.max_tokens)
        self.core.peer_routed(request.request_id, replica_id, sent_at, tokens, prefill_tokens)

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        self.core.completed(request_id)
        self.adapters_in_flight.completed(request_id)

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None:
        self.core.keep_only(replica_ids)
        self.adapters_in_flight.keep_only(replica_ids)
