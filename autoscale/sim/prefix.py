"""A prompt's prefix-cache keys, computed once for all the replicas a router asks.

A cache-aware router asks every replica "how many leading tokens of this prompt do you
cache?" (`ReplicaView.cached_prefix_tokens`) for every request: at 64-256 replicas, building
the prompt's block keys once per replica was most of the simulator's time. The keys are the
chain hashes `BlockManager.find_cached_prefix` builds (`block_hash`), so the answer is the
same; they are built only as deep as some replica's cache reaches (most answers stop at the
first block).
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence

from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.replica.block_hashes import KV_TIERS
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    CacheNamespace,
    block_hash,
    block_tokens,
    namespaced,
    num_cacheable_blocks,
)


def prompt_namespace(token_ids: Sequence[int]) -> CacheNamespace:
    """The cache namespace a prompt's blocks live in: a SyntheticPrompt's own (its tenant's
    salt), else the shared one."""
    return token_ids.cache_namespace if isinstance(token_ids, SyntheticPrompt) else b""


class PromptBlockKeys:
    """The keys of the last prompt asked about (one per cluster: the replicas share it)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prompt: Sequence[int] | None = None  # held, so that its id is not reused
        self._keys: list[BlockHash] = []
        self._max_blocks = 0

    def first_key(self, token_ids: Sequence[int]) -> BlockHash | None:
        """The key of the prompt's first block, None if no block of it can be a hit."""
        self._start(token_ids)
        if self._max_blocks == 0:
            return None
        keys = self._keys
        if not keys:
            first = block_tokens(token_ids[: self.block_size])
            keys.append(block_hash(ROOT_HASH, namespaced(prompt_namespace(token_ids), first)))
        return keys[0]

    def _start(self, token_ids: Sequence[int]) -> None:
        if token_ids is not self._prompt:
            self._prompt = token_ids
            self._keys = []
            self._max_blocks = num_cacheable_blocks(len(token_ids), self.block_size)

    def num_cached_blocks(self, token_ids: Sequence[int], cached: dict[BlockHash, int]) -> int:
        """How many leading full blocks of the prompt are in `cached` (a block manager's
        cached_blocks); at least one token is left over, as find_cached_prefix leaves it.
        The prompt is recognised by identity: a router passes one object to every replica."""
        self._start(token_ids)
        keys, size = self._keys, self.block_size
        n = 0
        while n < self._max_blocks:
            if n == len(keys):
                chunk = block_tokens(token_ids[n * size : (n + 1) * size])
                if keys:
                    keys.append(block_hash(keys[-1], chunk))
                else:  # the first block's key is in the prompt's namespace
                    keys.append(block_hash(ROOT_HASH,
                                           namespaced(prompt_namespace(token_ids), chunk)))
            if keys[n] not in cached:
                break
            n += 1
        return n


    def tier_counts(self, token_ids: Sequence[int], tiers: Sequence[Container[BlockHash]]
                    ) -> list[int]:
        """Per tier (KV_TIERS order: device, host, disk), how many of the prompt's leading
        tokens are found there, the chain running on while some tier holds its next block
        (each block counted in the first tier holding it), as the block manager's lookup
        runs on through its tiers."""
        self._start(token_ids)
        keys, size = self._keys, self.block_size
        counts = [0] * len(KV_TIERS)
        n = 0
        while n < self._max_blocks:
            if n == len(keys):
                parent = keys[-1] if keys else ROOT_HASH
                keys.append(block_hash(parent, block_tokens(token_ids[n * size : (n + 1) * size])))
            key = keys[n]
            rank = next((i for i, tier in enumerate(tiers) if key in tier), None)
            if rank is None:
                break
            counts[rank] += size
            n += 1
        return counts


class ClusterPrefixCache:
    """Every replica's answer to "how many leading tokens of this prompt do you cache" in
    one call (`RoutingContext.prefix_cache`), from a cluster-wide index of who could.

    A replica can hold a prompt's first block only if it was sent a request whose first
    block of tokens (prompt, then generated tokens) is that block: `routed` records, per
    first-block key, the replicas sent one. A query looks its first key up
    there once, asks only those replicas' caches (one dict probe each), and the ones
    holding it further. Same answers as
    `SimulatedReplica.cached_prefix_tokens`; replicas holding none of the prompt are left out.
    The index keeps one entry per distinct first block ever routed (ints and replica ids).
    """

    def __init__(self, keys: PromptBlockKeys) -> None:
        self.keys = keys
        self._caches: dict[Hashable, dict[BlockHash, int]] = {}
        self._sent: dict[BlockHash, list[Hashable]] = {}  # first block's key -> replicas sent one
        self._tiers: dict[Hashable, list[Container[BlockHash]]] = {}  # device, host, disk

    def add_replica(self, replica_id: Hashable, cached_blocks: dict[BlockHash, int],
                    lower_tiers: Sequence[Container[BlockHash]] = ()) -> None:
        """cached_blocks: the replica's BlockManager.cached_blocks (prefix caching on);
        lower_tiers: the indexes of its KV tiers below the device, best first."""
        self._caches[replica_id] = cached_blocks
        if lower_tiers:
            self._tiers[replica_id] = [cached_blocks, *lower_tiers]

    def remove_replica(self, replica_id: Hashable) -> None:
        self._caches.pop(replica_id, None)
        self._tiers.pop(replica_id, None)

    def tiers(self, token_ids: Sequence[int], replica_ids: Sequence[Hashable]
              ) -> dict[Hashable, list[int]]:
        """`RoutingContext.prefix_tiers`: per replica holding some of the prompt in some
        tier, its leading tokens per tier (`PromptBlockKeys.tier_counts`). A block reaches a
        lower tier only by leaving the device of the replica sent it, so the replicas sent
        the prompt's first block are still the only ones to ask."""
        first = self.keys.first_key(token_ids)
        sent = None if first is None else self._sent.get(first)
        if sent is None:
            return {}
        asked, answers = set(replica_ids), {}
        for rid in sent:
            tiers = self._tiers.get(rid)
            if tiers is None:
                tiers = [self._caches.get(rid, _NONE)]
            if rid in asked:
                counts = self.keys.tier_counts(token_ids, tiers)
                if any(counts):
                    answers[rid] = counts
        return answers

    def routed(self, replica_id: Hashable, token_ids: Sequence[int], max_tokens: int,
               output_token_id: int) -> None:
        """A request went to replica_id: its first block may join that replica's cache
        (its tokens are the prompt's, then output_token_id, the simulated model's)."""
        size = self.keys.block_size
        if isinstance(token_ids, SyntheticPrompt) and token_ids.first_private_block(size) == 0:
            return  # no other prompt starts with its first block: nobody will ask for it
        if len(token_ids) > size:  # the router asked first_key of this prompt: memoised
            h = self.keys.first_key(token_ids)
        elif len(token_ids) + max_tokens >= size:  # the first block ends in generated tokens
            first = tuple(token_ids) + (output_token_id,) * (size - len(token_ids))
            h = block_hash(ROOT_HASH, namespaced(prompt_namespace(token_ids),
                                                 block_tokens(first)))
        else:
            return
        sent = self._sent.get(h)
        if sent is None:
            self._sent[h] = [replica_id]
        elif replica_id not in sent:
            sent.append(replica_id)

    def __call__(self, token_ids: Sequence[int], replica_ids: Sequence[Hashable]
                 ) -> dict[Hashable, int]:
        first = self.keys.first_key(token_ids)
        if first is None:
            return {}
        sent = self._sent.get(first)
        if sent is None:
            return {}
        caches = self._caches
        holders = [rid for rid in sent if first in caches.get(rid, _NONE)]
        if not holders:
            return {}
        asked = set(replica_ids)
        size = self.keys.block_size
        return {rid: self.keys.num_cached_blocks(token_ids, caches[rid]) * size
                for rid in holders if rid in asked}


_NONE: dict[BlockHash, int] = {}
