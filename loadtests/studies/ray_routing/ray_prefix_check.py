"""Decision-level check of our PrefixCacheAffinityRouter reimplementation against Ray's tree.

    python -m iterserve.loadtests.studies.ray_routing.ray_prefix_check [--duration 840] [--replicas 4]

Replays the routing experiment's workload through both prefix states side by side: Ray
2.60's own `PrefixTree` (characters; a prompt rendered one character per token, as the
Ray arm's adapter renders it) with Ray's rule from `_prefix_match_best_replicas` (match
rate >= 0.1: the tenants owning the longest match, else the smallest tenants), and our
`RayPrefixAffinityRouter` (whole 16-token blocks of routing history). Every request goes
where ours sends it, and both states record it there; each decision counts as agreeing
when ours picked a replica of Ray's candidate group. Queue lengths are all equal here
(the load part is Serve's, not the prefix state's), so this isolates the prefix state:
block granularity vs characters, block counts vs character counts for tenant size.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from iterserve.autoscale.sim.baseline_cache_routers import RayPrefixAffinityRouter
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext
from iterserve.loadtests.studies.ray_routing.ray_routers import token_ids_as_text
from iterserve.loadtests.studies.ray_routing.routing_experiment import WorkloadConfig, make_workload

MATCH_RATE_THRESHOLD = 0.1  # Ray's default


@dataclass(frozen=True)
class Agreement:
    decisions: int
    agreed: int
    by_prefix_match: int  # decisions where Ray's rule took the longest-match tenants
    agreed_by_prefix_match: int

    @property
    def rate(self) -> float:
        return self.agreed / self.decisions if self.decisions else float("nan")


def rays_group(tree: PrefixTree, text: str, tenants: list[str]) -> tuple[list[str], bool]:
    """Ray's candidate group for this prompt, and whether the prefix match chose it."""
    matched, owners = tree.prefix_match(text, tenants)
    if owners and len(matched) / len(text) >= MATCH_RATE_THRESHOLD:
        return owners, True
    return tree.get_smallest_tenants() or tenants, False


def compare(prompts: Sequence[Sequence[int]], num_replicas: int = 4, block_size: int = 16,
            seed: int = 0) -> Agreement:
    tenants = [f"replica-{i}" for i in range(num_replicas)]
    tree = PrefixTree()
    tree.add_tenants(tenants, 0.0)
    ours = RayPrefixAffinityRouter()
    views = [ReplicaView(t, None) for t in tenants]
    rng = random.Random(seed)
    agreed = by_match = agreed_by_match = 0
    for i, prompt in enumerate(prompts):
        text = token_ids_as_text(prompt)
        group, matched = rays_group(tree, text, tenants)
        request = RouteRequest(f"check-{i}", list(prompt), 1, float(i))
        chosen = ours.choose(RoutingContext(request, views, float(i), block_size), rng)
        ok = chosen in group
        agreed += ok
        by_match += matched
        agreed_by_match += ok and matched
        ours.on_routed(request, chosen, float(i))
        tree.insert(text, str(chosen), float(i))
    return Agreement(len(prompts), agreed, by_match, agreed_by_match)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=840.0,
                        help="seconds of the routing experiment's workload to replay")
    parser.add_argument("--replicas", type=int, default=4, help="replicas both routers choose among")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds")
    args = parser.parse_args(argv)
    for seed in range(args.seeds):
        specs = make_workload(WorkloadConfig(seed=seed, duration_s=args.duration))
        result = compare([s.prompt_token_ids for s in specs], args.replicas, seed=seed)
        print(f"workload seed {seed}: {result.agreed}/{result.decisions} decisions agree "
              f"({result.rate:.3f}); by prefix match {result.agreed_by_prefix_match}/"
              f"{result.by_prefix_match}, by smallest tenant "
              f"{result.agreed - result.agreed_by_prefix_match}/"
              f"{result.decisions - result.by_prefix_match}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
