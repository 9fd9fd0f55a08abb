"""A prompt's prefix-cache keys, computed once for all the replicas a router asks.

A cache-aware router asks every replica "how many leading tokens of this prompt do you
cache?" (`ReplicaView.cached_prefix_tokens`) for every request: at 64-256 replicas, building
the prompt's block keys once per replica was most of the simulator's time. The keys are the
ones `BlockManager.find_cached_prefix` builds, (hash of the previous key, the block's
tokens), so the answer is the same; they are built only as deep as some replica's cache
reaches (most answers stop at the first block).
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.replica.block_manager import BlockKey


class PromptBlockKeys:
    """The keys of the last prompt asked about (one per cluster: the replicas share it)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prompt: Sequence[int] | None = None  # held, so that its id is not reused
        self._keys: list[BlockKey] = []
        self._max_blocks = 0

    def num_cached_blocks(self, token_ids: Sequence[int], cached: dict[BlockKey, int]) -> int:
        """How many leading full blocks of the prompt are in `cached` (a block manager's
        cached_blocks); at least one token is left over, as find_cached_prefix leaves it.
        The prompt is recognised by identity: a router passes one object to every replica."""
        if token_ids is not self._prompt:
            self._prompt = token_ids
            self._keys = []
            self._max_blocks = (len(token_ids) - 1) // self.block_size
        keys, size = self._keys, self.block_size
        n = 0
        while n < self._max_blocks:
            if n == len(keys):
                parent = hash(keys[-1]) if keys else 0
                keys.append((parent, tuple(token_ids[n * size : (n + 1) * size])))
            if keys[n] not in cached:
                break
            n += 1
        return n
