"""Router-side prefix history: which replica was sent which prompt blocks (no clock, no Ray).

The "approximate" prefix state of llm-d's EPP, SGLang's router, Ray's PrefixCacheAffinityRouter
and Dynamo's `--no-kv-events` mode: a router remembers the prompts it routed and guesses
that a replica still caches them. A prompt is a chain of block hashes (block i's hash covers
blocks 0..i, as vLLM's and the engine's prefix cache key blocks), so "longest cached prefix
on replica r" is the number of leading chain hashes r's history holds. Block granularity
stands in for the character-level trees of Ray and SGLang (their match length is in
characters; ours in tokens rounded down to whole blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


def block_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of each full block of the prompt, each chained to all blocks before it."""
    chain: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        chain.append(parent)
    return chain


class PrefixHistory:
    """Per replica, an LRU set of the chain hashes this router sent it."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self._capacity = capacity_blocks  # None: never evict (Ray's default do_eviction=False)
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def record(self, replica_id: Hashable, chain: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for h in chain:
            blocks[h] = None
            blocks.move_to_end(h)
        if self._capacity is not None:
            while len(blocks) > self._capacity:
                blocks.popitem(last=False)

    def matched_blocks(self, replica_id: Hashable, chain: Sequence[int]) -> int:
        """Leading blocks of `chain` this replica was sent (its approximate cache hit)."""
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        n = 0
        for h in chain:
            if h not in blocks:
                break
            n += 1
        return n

    def size_blocks(self, replica_id: Hashable) -> int:
        """The replica's tree size (Ray's and SGLang's 'smallest tenant' measure)."""
        blocks = self._blocks.get(replica_id)
        return 0 if blocks is None else len(blocks)

    def keep_only(self, replica_ids: Iterable[Hashable]) -> None:
        """Forget replicas that left; new ones start with an empty history."""
        live = set(replica_ids)
        for rid in [r for r in self._blocks if r not in live]:
            del self._blocks[rid]
        for rid in live:
            self._blocks.setdefault(rid, OrderedDict())
