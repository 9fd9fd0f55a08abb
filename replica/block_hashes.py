"""Prefix-cache block hashes that mean the same in every process.

The block manager keys its prefix cache by (Python `hash` of the previous block's key,
the block's tokens): Python salts the hash of bytes per process (PYTHONHASHSEED), so a
router in another process cannot recompute those keys. A replica therefore reports its
cached blocks as *stable* hashes, and the router hashes a prompt the same way:

    stable(block 0) = H(ROOT, tokens of block 0)
    stable(block i) = H(stable(block i - 1), tokens of block i)
    H(parent, tokens) = blake2b(parent as 8 little-endian bytes + tokens, digest_size=8),
                        read as an unsigned little-endian 64-bit int

where `tokens` is the block's `block_tokens` form (int64 bytes; a token id beyond int64
falls back to the bytes of its tuple's repr, prefixed so the two forms cannot collide).
A chain hash names the whole prefix up to that block, as the block manager's key does.

`CachedBlockHashes` produces a block manager's report: the stable hashes of the blocks a
lookup can reach (their whole parent chain cached), memoised per key so that a steady-state
report hashes only the blocks cached since the last one; the block manager's hot paths
(registering blocks, lookups) pay nothing for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from iterserve.replica.block_manager import BlockKey, BlockTokens, block_tokens

ROOT = 0  # the chain's parent before the first block (the block manager's root is 0 too)
# A report holds at most this many hashes (8 bytes each on the wire, every routing-stats
# period); beyond it the shallowest blocks are kept: a prefix's head serves the most prompts.
MAX_REPORTED_BLOCK_HASHES = 32768
_TUPLE_FORM = b"tuple:"


def stable_block_hash(parent: int, tokens: BlockTokens) -> int:
    """The chain hash of a block whose previous block's chain hash is `parent`."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(tokens if isinstance(tokens, bytes) else _TUPLE_FORM + repr(tokens).encode())
    return int.from_bytes(digest.digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the prompt's blocks a prefix cache could hit: its full blocks
    but the one holding its last token (a hit always leaves one token to compute, as
    `BlockManager.find_cached_prefix` does)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = ROOT
    for i in range((len(token_ids) - 1) // block_size):
        parent = stable_block_hash(parent, block_tokens(
            token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def leading_run(chain: Sequence[int], cached: frozenset[int] | set[int]) -> int:
    """How many leading hashes of `chain` are in `cached`: the blocks a lookup would hit."""
    for n, block_hash in enumerate(chain):
        if block_hash not in cached:
            return n
    return len(chain)


class CachedBlockHashes:
    """The stable hashes of a prefix cache's reachable blocks, memoised between reports.

    `report(cached_blocks)` reads the block manager's `cached_blocks` (key -> block id) and
    must run where that dict is not being changed (the engine thread). Blocks whose parent
    chain is no longer cached are left out: a lookup walks from the first block and can
    never reach them. The memo keeps only keys still cached.
    """

    def __init__(self, limit: int = MAX_REPORTED_BLOCK_HASHES) -> None:
        self.limit = limit
        self._entries: dict[BlockKey, tuple[int, int]] = {}  # key -> (hash(key), stable)
        self.num_hashed = 0  # blocks hashed so far (tests check the memo saves work)

    def __len__(self) -> int:
        return len(self._entries)

    def report(self, cached_blocks: Mapping[BlockKey, int]) -> list[int]:
        old = self._entries
        entries: dict[BlockKey, tuple[int, int]] = {}
        by_parent_id: dict[int, BlockKey] = {}  # hash(key), as children name it -> key
        new_keys: list[BlockKey] = []
        for key in cached_blocks:
            entry = old.get(key)
            if entry is None:
                new_keys.append(key)
                by_parent_id[hash(key)] = key
            else:
                entries[key] = entry
                by_parent_id[entry[0]] = key
        broken: set[BlockKey] = set()  # new keys whose chain misses a block
        for key in new_keys:
            if key not in entries and key not in broken:
                self._resolve(key, entries, by_parent_id, broken)
        self._entries = entries
        depths = self._depths(entries, by_parent_id)
        if len(depths) > self.limit:
            kept = sorted(depths, key=depths.__getitem__)[: self.limit]
            return [entries[key][1] for key in kept]
        return [entries[key][1] for key in depths]

    def _resolve(self, key: BlockKey, entries: dict[BlockKey, tuple[int, int]],
                 by_parent_id: Mapping[int, BlockKey], broken: set[BlockKey]) -> None:
        """Memoise the stable hash of `key` and of its unhashed ancestors, if its chain
        reaches the root or a hashed block; else (an ancestor evicted) leave them out."""
        chain = [key]
        parent_stable = ROOT
        while (parent := chain[-1][0]) != ROOT:
            parent_key = by_parent_id.get(parent)
            if (parent_key is None or parent_key in broken
                    or len(chain) > len(by_parent_id)):  # evicted, or a hash cycle
                broken.update(chain)
                return
            entry = entries.get(parent_key)
            if entry is not None:
                parent_stable = entry[1]
                break
            chain.append(parent_key)
        for block_key in reversed(chain):
            parent_stable = stable_block_hash(parent_stable, block_key[1])
            entries[block_key] = (hash(block_key), parent_stable)
            self.num_hashed += 1

    @staticmethod
    def _depths(entries: Mapping[BlockKey, tuple[int, int]],
                by_parent_id: Mapping[int, BlockKey]) -> dict[BlockKey, int]:
        """The reachable keys (every ancestor cached and hashed), each with its block index
        in the chain."""
        depths: dict[BlockKey, int] = {}
        broken: set[BlockKey] = set()
        for key in entries:
            path: list[BlockKey] = []
            node = key
            while True:
                known = depths.get(node)
                if known is not None:
                    base: int | None = known
                    break
                if node in broken or node not in entries or len(path) > len(entries):
                    base = None  # an ancestor is gone (or a hash cycle): unreachable
                    break
                path.append(node)
                if node[0] == ROOT:
                    base = -1
                    break
                parent_key = by_parent_id.get(node[0])
                if parent_key is None:
                    base = None
                    break
                node = parent_key
            if base is None:
                broken.update(path)
                continue
            for block_key in reversed(path):
                base += 1
                depths[block_key] = base
        return depths
