"""iterserve's production router and autoscaler as contract policies (`routing_context`).

`IterserveRouter` calls `rank_replicas` with exactly the arguments `KVAwareRouter.
choose_replicas` passes (shuffled candidates, their loads, in-flight corrections, the prompt's
prefix hash and the affinity table, now, prompt + max_tokens) and keeps its
`PrefixAffinityTable` as `on_request_routed` / `update_replicas` do. Its corrections are
the caller's `ReplicaView.correction`, which the simulator computes as
`InFlightTracker.corrections` would (tests/unit/test_cluster_sim.py checks the two agree).
Serve tries the ranks in order and skips a replica at max_ongoing_requests; the caller
offers only replicas below it, so rank 0 is the choice.

`IterserveAutoscaler` calls `policy.desired_replicas` and threads its policy state from
one call to the next, as Serve does with the state the class-form policy returns.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence
from typing import Any

from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
from iterserve.autoscale.policy import ScalingContext, desired_replicas
from iterserve.autoscale.router_policy import PrefixAffinityTable, prefix_hash, rank_replicas
from iterserve.autoscale.routing_context import RouteRequest, RoutingContext


class IterserveRouter:
    """The production KV-aware router (one instance per ingress router)."""

    name = "iterserve"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._affinity: PrefixAffinityTable[Hashable] = PrefixAffinityTable(
            self.config.prefix_max_entries)

    def _key(self, request: RouteRequest) -> int | None:
        if not self.config.prefix_affinity:
            return None
        return prefix_hash(request.prompt_token_ids, self.config.prefix_block_size,
                           self.config.prefix_num_blocks)

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        views = list(ctx.replicas)
        rng.shuffle(views)  # as choose_replicas does: ties must not favour one replica
        request = ctx.request
        ranked = rank_replicas(
            candidates=[v.replica_id for v in views],
            loads={v.replica_id: v.load for v in views},
            in_flight_corrections={v.replica_id: v.correction for v in views},
            config=self.config,
            prompt_prefix_hash=self._key(request),
            affinity=self._affinity.as_mapping(),
            now=ctx.now,
            request_tokens=len(request.prompt_token_ids) + request.max_tokens,
        )
        return ranked[0]

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None:
        self._affinity.record(self._key(request), replica_id)

    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None:
        return None  # the in-flight count lives with the caller (ReplicaView.correction)

    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None:
        live = set(replica_ids)
        for rid in {rid for rid in self._affinity.as_mapping().values() if rid not in live}:
            self._affinity.forget_replica(rid)


class IterserveAutoscaler:
    """The production autoscaling policy, its state carried between calls."""

    name = "iterserve"

    def __init__(self, config: AutoscaleConfig | None = None) -> None:
        self.config = config or AutoscaleConfig()
        self._state: dict[str, Any] = {}

    def desired_replicas(self, ctx: ScalingContext) -> int:
        ctx = dataclasses.replace(ctx, policy_state=self._state)
        desired, self._state = desired_replicas(ctx, self.config)
        return desired


class FixedReplicas:
    """No autoscaling: always n replicas."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one replica, got {n}")
        self.n = n
        self.name = f"fixed-{n}"

    def desired_replicas(self, ctx: ScalingContext) -> int:
        return self.n
