"""What the replicas' own prefix-cache reports say about one prompt (the Ray adapter's side).

Each replica's routing stats carry the stable hashes of the blocks its prefix cache can hit,
per KV tier (`ReplicaLoad.tier_hashes()`, block_size tokens each; replica/block_hashes.py).
For a prompt, a replica caches as many leading tokens as the leading run of the prompt's
block hash chain found in its tiers: `cached_prefix_tokens` gives that per reporting
replica, each tier's tokens charged their copy time (kv_tier_costs.py), the
`cached_tokens` that `KVRouterCore.rank` takes (what the cluster simulator gets from its
replicas directly). The chain leaves the prompt's last token out, as the block manager's
lookup does, so a hit always leaves at least one token to compute.

`ParsedLoads` parses each replica's routing stats once per update, not once per request:
Serve hands the router a new dict object with every poll, so the dict's identity (held by
the cache, so its id cannot be reused while cached) and its timestamp name the update.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.kv_tier_costs import charged_hit, tier_fractions
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_hashes import DEVICE, KV_TIERS, ROOT, stable_block_hash
from iterserve.replica.block_keys import (
    CacheNamespace,
    block_tokens,
    namespaced,
    num_cacheable_blocks,
)


class ParsedLoads:
    """`ReplicaLoad.try_from_dict(stats)` per replica, kept until its stats dict changes."""

    def __init__(self) -> None:
        self._parsed: dict[Hashable, tuple[Mapping[str, Any] | None, Any, ReplicaLoad | None]
                           ] = {}

    def load(self, replica_id: Hashable, stats: Mapping[str, Any] | None) -> ReplicaLoad | None:
        stamp = stats.get("timestamp") if stats else None
        cached = self._parsed.get(replica_id)
        if cached is not None and cached[0] is stats and cached[1] == stamp:
            return cached[2]
        load = ReplicaLoad.try_from_dict(stats)
        self._parsed[replica_id] = (stats, stamp, load)
        return load

    def keep_only(self, live: Iterable[Hashable]) -> None:
        live_ids = set(live)
        for rid in [r for r in self._parsed if r not in live_ids]:
            del self._parsed[rid]

    def forget(self, replica_id: Hashable) -> None:
        self._parsed.pop(replica_id, None)


def cached_prefix_tokens(token_ids: Sequence[int], candidates: Sequence[Hashable],
                         loads: Sequence[ReplicaLoad | None],
                         namespace: CacheNamespace = b"",
                         tier_costs: RouterConfig | None = None) -> dict[Hashable, int] | None:
    """Per candidate that reported its prefix cache: how many leading prompt tokens it
    holds, in prefill tokens saved. Candidates without a report are left out (missing
    means 0); None when none reported. `namespace`: the request's cache namespace
    (block_keys.cache_namespace), which its first block's key carries as the replicas' do.

    tier_costs None: the device tier alone (a block found only below it ends the prefix,
    as for a router blind to the tiers). Else the prefix runs on through every reported
    tier, each block in the best tier holding it, and is charged by where it lives
    (kv_tier_costs: `charged_hit` with the replica's `tier_fractions`)."""
    tiers = cached_prefix_tiers(token_ids, candidates, loads, namespace,
                                device_only=tier_costs is None)
    if tiers is None:
        return None
    return charge_tiers(tiers, dict(zip(candidates, loads, strict=True)), tier_costs)


def charge_tiers(tiers: Mapping[Hashable, Sequence[int]],
                 loads: Mapping[Hashable, ReplicaLoad | None],
                 tier_costs: RouterConfig | None) -> dict[Hashable, int]:
    """Each replica's cached tokens per tier (cached_prefix_tiers) as prefill tokens saved:
    the device tier's alone with tier_costs None, else every tier charged its copy time."""
    if tier_costs is None:
        return {rid: counts[0] for rid, counts in tiers.items()}
    return {rid: counts[0] if not any(counts[1:]) else
            charged_hit(counts, tier_fractions(loads[rid], tier_costs))
            for rid, counts in tiers.items()}


def cached_prefix_tiers(token_ids: Sequence[int], candidates: Sequence[Hashable],
                        loads: Sequence[ReplicaLoad | None], namespace: CacheNamespace = b"",
                        device_only: bool = False) -> dict[Hashable, list[int]] | None:
    """Per candidate that reported: the prompt's leading cached tokens per tier (KV_TIERS
    order), the prefix running on while some tier holds its next block (as the block
    manager's lookup continues in the host tier where the device misses). The chain is
    hashed once per block size the replicas report, and only as deep as some replica
    holds it: a long prompt whose head nobody caches costs one block hash."""
    reporters: dict[int, list[tuple[Hashable, list[tuple[int, frozenset[int]]]]]] = {}
    for replica_id, load in zip(candidates, loads, strict=True):
        if load is not None and load.cached_block_hashes is not None:
            held = [(KV_TIERS.index(tier), hashes) for tier, hashes in load.tier_hashes()
                    if not device_only or tier == DEVICE]  # best tier first
            reporters.setdefault(load.block_size, []).append((replica_id, held))
    if not reporters:
        return None
    hits: dict[Hashable, list[int]] = {}
    for size, holders in reporters.items():
        for replica_id, _ in holders:
            hits[replica_id] = [0] * len(KV_TIERS)
        parent = ROOT
        for i in range(num_cacheable_blocks(len(token_ids), size)):
            chunk = block_tokens(token_ids[i * size:(i + 1) * size])
            parent = stable_block_hash(parent, namespaced(namespace, chunk) if i == 0 else chunk)
            still = []
            for holder in holders:
                for rank, hashes in holder[1]:  # the best tier holding the block
                    if parent in hashes:
                        hits[holder[0]][rank] += size
                        still.append(holder)
                        break
            holders = still
            if not holders:
                break
    return hits
