"""Ray Serve request routers for the routing experiment's comparison arms.

`TokenTextPrefixCacheAffinityRouter`: Ray 2.60's own `PrefixCacheAffinityRouter` (from
ray.llm's internal module: the public `ray.serve.llm.request_router` re-export imports
ray.serve.llm, which requires vLLM or SGLang). Ray's router looks for a `prompt` or
`messages` attribute on the handle call's positional args and matches characters in its
prefix tree; deploy's `LLMReplica.generate(prompt_token_ids, params, request_id)` gets token
ids, which have neither, so Ray's router would raise. The adapter overrides that one method,
`_extract_text_from_request`: a token-id prompt becomes a string of one character per token
(`token_ids_as_text`, code point 0x10000 + id), so Ray's character-level match length is
the token-level match length and its tenant sizes are in tokens. Everything else (prefix
tree actor, imbalance check, match-rate threshold, smallest-tenant fallback, power-of-two
fallback, queue-length probing, exact-match hand-off) is Ray's code, with its defaults.

`RoutingPolicyRouter`: any `RoutingPolicy` of `autoscale.sim.baseline_*routers` (the policies
the cluster simulator and the tournament run) inside Ray's handle, so a reimplementation
runs on the real path beside the original. It fills each `ReplicaView` as the simulator
does: load from the replica's routing stats, ongoing = this router's own requests in
flight there; correction and cached_prefix_tokens stay empty (replicas report no block
hashes to Ray). Like Ray's PrefixCacheAffinityRouter, it hands a chosen replica to exactly
the request it was chosen for (no FIFOMixin).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from iterserve.autoscale.router import extract_max_tokens, extract_prompt_token_ids
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.baseline_cache_routers import RayPrefixAffinityRouter
from iterserve.autoscale.sim.routing_context import (
    ReplicaView,
    RouteRequest,
    RoutingContext,
    RoutingPolicy,
)

TOKEN_CODE_POINT_OFFSET = 0x10000  # above the BMP: no surrogates, one code point per token
MAX_TOKEN_ID = 0x10FFFF - TOKEN_CODE_POINT_OFFSET


def token_ids_as_text(token_ids: Sequence[int]) -> str:
    """One character per token id, so that a shared token prefix is a shared text prefix of
    the same length (Ray's match rate = matched characters / prompt characters)."""
    for token in token_ids:
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"token id {token} cannot be rendered as one code point")
    return "".join(map(chr, (t + TOKEN_CODE_POINT_OFFSET for t in token_ids)))


class TokenTextPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray 2.60's PrefixCacheAffinityRouter, reading token-id prompts (see module doc)."""

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        token_ids = extract_prompt_token_ids(pending_request.args, pending_request.kwargs)
        if token_ids is None:  # a text prompt / messages request: Ray's own reading
            return super()._extract_text_from_request(pending_request)
        return token_ids_as_text(token_ids)


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "ray-prefix": RayPrefixAffinityRouter,
}


class RoutingPolicyRouter(RequestRouter):
    """A `RoutingPolicy` from `POLICIES` as a Ray Serve request router (see module doc)."""

    def initialize_state(self, policy: str = "ray-prefix", block_size: int = 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        self._policy = POLICIES[policy]()
        self._block_size = block_size
        self._rng = random.Random()
        self._in_flight: dict[str, ReplicaID] = {}  # internal request id -> replica
        self._ongoing: dict[ReplicaID, int] = {}

    def _route_request(self, pending_request: PendingRequest) -> RouteRequest:
        token_ids = extract_prompt_token_ids(pending_request.args, pending_request.kwargs)
        return RouteRequest(pending_request.metadata.internal_request_id, token_ids or [],
                            extract_max_tokens(pending_request.args, pending_request.kwargs),
                            time.time())

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:  # Serve asks without a request only to probe: any order
            return [list(candidate_replicas)]
        views = [ReplicaView(r.replica_id, ReplicaLoad.try_from_dict(r.routing_stats),
                             ongoing=self._ongoing.get(r.replica_id, 0))
                 for r in candidate_replicas]
        ctx = RoutingContext(self._route_request(pending_request), views, time.time(),
                             self._block_size)
        chosen = self._policy.choose(ctx, self._rng)
        first = [r for r in candidate_replicas if r.replica_id == chosen]
        rest = [r for r in candidate_replicas if r.replica_id != chosen]
        # The chosen replica first; the rest only if it cannot take the request (full).
        pending_request.routing_context.should_backoff = True
        return [first, rest] if rest else [first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._in_flight[request_id] = replica_id
        self._ongoing[replica_id] = self._ongoing.get(replica_id, 0) + 1
        self._policy.on_routed(self._route_request(pending_request), replica_id, time.time())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed_to = self._in_flight.pop(internal_request_id, None)
        if routed_to is not None:
            self._ongoing[routed_to] -= 1
            self._policy.on_completed(internal_request_id, routed_to, time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._policy.on_replicas_changed([r.replica_id for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.on_replicas_changed(list(self.curr_replicas))


def ray_prefix_cache_affinity_config(period_s: float) -> RequestRouterConfig:
    """Ray's own PrefixCacheAffinityRouter (token-text adapter), Ray's default kwargs."""
    return RequestRouterConfig(
        request_router_class=f"{__name__}:TokenTextPrefixCacheAffinityRouter",
        request_routing_stats_period_s=period_s)


def routing_policy_config(policy: str, period_s: float, block_size: int) -> RequestRouterConfig:
    """One of `POLICIES` run by `RoutingPolicyRouter`."""
    return RequestRouterConfig(
        request_router_class=f"{__name__}:RoutingPolicyRouter",
        request_router_kwargs={"policy": policy, "block_size": block_size},
        request_routing_stats_period_s=period_s)


def router_config_for(name: str, period_s: float, block_size: int) -> Any:  # noqa: ANN401
    """The RequestRouterConfig of a comparison arm by its routing_experiment name."""
    if name == "PrefixCacheAffinityRouter (Ray 2.60)":
        return ray_prefix_cache_affinity_config(period_s)
    if name == "ray-prefix (ours)":
        return routing_policy_config("ray-prefix", period_s, block_size)
    raise ValueError(f"no comparison router named {name!r}")
