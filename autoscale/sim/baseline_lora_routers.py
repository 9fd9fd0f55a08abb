"""Ray Serve's model multiplexing as a `RoutingPolicy`: the published baseline for LoRA.

Ray Serve LLM serves LoRA adapters through Serve's model multiplexing: each replica keeps
an LRU of loaded models (`@serve.multiplexed(max_num_models_per_replica=...)`, Ray LLM's
`max_num_adapters_per_replica`) and reports the ids it holds; the request router
(`MultiplexMixin.apply_multiplex_routing` / `rank_replicas_via_multiplex` in
ray/serve/_private/request_router/request_router.py, under the default
`PowerOfTwoChoicesRequestRouter`) tries, in order:

1. the replicas holding the request's model id (power of two among them: two sampled, the
   shorter queue);
2. where none holds it (or those tried were full), the replicas holding the fewest models;
3. after the matching timeout (1-2 s), all replicas.

So a held adapter goes to its holders while any of them accepts (first fit), however long
their queues: a hot adapter stays pinned to the replica(s) that loaded it first
(ray#65691). Deviations here: the holders are those the replicas' last stats report names
(`ReplicaLoad.lora_adapters`: the host LRU, standing in for the multiplex LRU of the same
size; Ray pushes model-id changes through its controller, similarly late); "full" is
the simulator's max_ongoing_requests (a replica at it is not offered), which moves a
request to step 2 at once rather than after a rejected probe; step 3 needs no timeout
because the simulator offers only replicas that accept. Base-model requests (no model id)
take plain power of two.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from iterserve.autoscale.sim.baseline_routers import PowerOfTwoRouter, power_of_two_choice
from iterserve.autoscale.sim.routing_context import ReplicaView, RoutingContext


def adapters_held(view: ReplicaView) -> frozenset[str]:
    return view.load.lora_adapters if view.load is not None else frozenset()


def ray_multiplex_choice(replicas: Sequence[ReplicaView], adapter: str | None,
                         rng: random.Random) -> Hashable:
    """Power of two among the adapter's holders, else among the replicas holding the
    fewest adapters (all of them for a base-model request)."""
    if adapter is None:
        return power_of_two_choice(replicas, rng)
    holders = [v for v in replicas if adapter in adapters_held(v)]
    if holders:
        return power_of_two_choice(holders, rng)
    fewest = min(len(adapters_held(v)) for v in replicas)
    return power_of_two_choice([v for v in replicas if len(adapters_held(v)) == fewest], rng)


class RayMultiplexRouter(PowerOfTwoRouter):
    name = "ray-multiplex"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return ray_multiplex_choice(ctx.replicas, ctx.request.adapter, rng)
