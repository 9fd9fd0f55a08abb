"""The contract between routing / autoscaling policies and their callers.

Callers: the cluster simulator (`cluster.py`) and the studies that drive it. Implemented by
iterserve's router (`iterserve_router.py`, which calls `KVRouterCore` as the Ray adapter
`autoscale/router.py` does) and autoscaler (`policies.py`, over `decide`), and by the
published baselines (`baseline_*.py`; `loadtests/studies/ray_routing/ray_routers.py` runs
Ray's prefix router on Ray through it). A routing policy sees one `RoutingContext` per
request and names the replica it chooses; its state (round-robin cursor, prefix tree,
affinity table) lives on the policy object and changes only through the `on_*` hooks.
Nothing here reads a clock, touches Ray or sleeps.

Invariant: `choose` returns the `replica_id` of one of `ctx.replicas` (never empty).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from iterserve.autoscale.autoscaling_policy import ScalingContext
from iterserve.autoscale.router_policy import Correction
from iterserve.autoscale.signals import ReplicaLoad


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows of one request before it is sent."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    arrival_time: float
    session_id: str | None = None  # tenant / conversation, when the workload has one
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)


@dataclass(frozen=True)
class ReplicaView:
    """One candidate replica as this router sees it now.

    load: the replica's last reported stats (stale by up to routing_stats_period_s; None
    before the first report). correction: what this router sent it that `load` cannot
    reflect yet. ongoing: requests this router has in flight at the replica (Serve's queue
    length, what power-of-two compares). cached_prefix_tokens: the replica's own answer to
    "how many leading tokens of this prompt do you hold in your prefix cache", from the
    block hashes it reports with its stats (None when the caller has no such report).
    """

    replica_id: Hashable
    load: ReplicaLoad | None
    correction: Correction = field(default_factory=lambda: Correction(requests=0))
    ongoing: int = 0
    cached_prefix_tokens: Callable[[Sequence[int]], int] | None = None


# (prompt, replica ids) -> {replica id: cached leading prompt tokens}, replicas holding none
# of it left out: every replica's `cached_prefix_tokens` answered at once.
PrefixCacheAnswers = Callable[[Sequence[int], Sequence[Hashable]], Mapping[Hashable, int]]


# (prompt, replica ids) -> {replica id: the prompt's leading cached tokens per KV tier
# (replica/block_hashes.KV_TIERS order)}, replicas holding none of it in any tier left out.
PrefixTierAnswers = Callable[[Sequence[int], Sequence[Hashable]], Mapping[Hashable, list[int]]]


@dataclass(frozen=True)
class OfferDelta:
    """What changed in the replicas offered since this policy's previous request, where the
    caller knows (the cluster simulator offers one router the same replicas for thousands
    of requests in a row, a few views changing between two).

    token: an object that stands for one list of replica ids in one order; a context with
    the same token as the previous context this policy was given lists the same replica
    ids in the same order, and its views differ from that context's only at the positions
    in `changed` (every other view is the same object). A token new to the policy promises
    nothing (changed is then ignored)."""

    token: object
    changed: Sequence[int]


@dataclass(frozen=True)
class RoutingContext:
    """prefix_cache: where the caller can answer `ReplicaView.cached_prefix_tokens` for all
    the replicas in one call (the cluster simulator: one lookup per replica cache rather
    than a call per replica), that call; the answers are the views' own. offer: what
    changed since this policy's previous request, where the caller knows (a policy may
    skip the per-replica work for the rest; the decision is the same without it).
    prefix_tiers: where the replicas have KV tiers below the device, every replica's
    answer per tier (what their per-tier block-hash reports say); prefix_cache answers for
    the device alone, as a router reading device-only KV events sees it."""

    request: RouteRequest
    replicas: Sequence[ReplicaView]
    now: float
    block_size: int  # the engines' KV block size (the router's prefix granularity)
    prefix_cache: PrefixCacheAnswers | None = None
    offer: OfferDelta | None = None
    prefix_tiers: PrefixTierAnswers | None = None


class RoutingPolicy(Protocol):
    name: str

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable: ...

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None: ...

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None: ...

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None: ...


@runtime_checkable
class PeerSyncedPolicy(RoutingPolicy, Protocol):
    """A router that counts its peers' sends as its own once it hears of them, as Dynamo's
    KV router does with `router_replica_sync` (router replicas share their active
    sequences). The cluster simulator tells it of each peer's send and completion
    `ClusterSimConfig.router_sync_delay_s` after it (completions through `on_completed`)."""

    def on_peer_routed(self, request: RouteRequest, replica_id: Hashable, sent_at: float,
                       prefill_tokens: int, now: float) -> None:
        """A peer sent `request` to `replica_id` at `sent_at`; the replica had to compute
        `prefill_tokens` of its prompt (the rest was in its prefix cache)."""
        ...


class AutoscalingPolicy(Protocol):
    name: str

    def desired_replicas(self, ctx: ScalingContext) -> int: ...
