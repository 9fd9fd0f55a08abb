"""The live router's price of a prefix pull (KVAwareRouter with RouterConfig.kv_pull_hints):
each replica's cache answer credited what pulling the best other holder's extra tokens would
save, by the same pure rule the simulator's router uses (kv_pull_cost.credit_pulls).

A pull's cost share is the receiver's rule (kv_pull_cost.pull_fraction) at the router's
assumptions: the object store's assumed bandwidth and latency (the receiver measures its own;
the router does not see it), RouterConfig.kv_bytes_per_token, and the receiver's reported
prefill rate (RouterConfig.prefill_tokens_per_s before it reports one). What a holder can
send is its device and host tiers' tokens (the disk tier is not exported).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.kv_pull_cost import (
    ASSUMED_BANDWIDTH_BYTES_PER_S,
    credit_pulls,
    pull_fraction,
)
from iterserve.autoscale.kv_tier_costs import kv_bytes_per_token
from iterserve.autoscale.signals import ReplicaLoad


def pullable_tokens(tiers: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, int]:
    """The leading prompt tokens each replica could send to a puller: device and host."""
    return {rid: sum(counts[:2]) for rid, counts in tiers.items()}


def with_pull_credit(charged: Mapping[Hashable, int], tiers: Mapping[Hashable, Sequence[int]],
                     replica_ids: Sequence[Hashable],
                     loads: Mapping[Hashable, ReplicaLoad | None],
                     config: RouterConfig) -> dict[Hashable, int]:
    """charged (each replica's own cache answer, in prefill tokens saved), each replica
    credited a pull from the best other holder where that beats prefilling the tokens."""

    def fraction(rid: Hashable, num_tokens: int) -> float:
        load = loads.get(rid)
        rate = (load.prefill_token_rate if load is not None and load.prefill_token_rate > 0
                else config.prefill_tokens_per_s)
        return pull_fraction(num_tokens, kv_bytes_per_token(load, config),
                             ASSUMED_BANDWIDTH_BYTES_PER_S, rate)

    return credit_pulls(charged, pullable_tokens(tiers),
                        {rid: sum(counts) for rid, counts in tiers.items()}, replica_ids,
                        fraction)
