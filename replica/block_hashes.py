"""Prefix-cache block hashes that mean the same in every process.

The block manager keys its prefix cache by `block_hash(parent's hash, the block's tokens)`,
Python's `hash`: Python salts the hash of bytes per process (PYTHONHASHSEED), so a
router in another process cannot recompute those keys. A replica therefore reports its
cached blocks as *stable* hashes, and the router hashes a prompt the same way:

    stable(block 0) = H(ROOT, tokens of block 0)
    stable(block i) = H(stable(block i - 1), tokens of block i)
    H(parent, tokens) = blake2b(parent as 8 little-endian bytes + tokens, digest_size=8),
                        read as an unsigned little-endian 64-bit int

where `tokens` is the block's `block_tokens` form (int64 bytes; a token id beyond int64
falls back to the bytes of its tuple's repr, prefixed so the two forms cannot collide).
A chain hash names the whole prefix up to that block, as the block manager's key does.

`BlockHashIndex` keeps a block manager's report up to date as blocks enter and leave its
prefix cache (the manager calls `stored` / `evicted`, as vLLM's engine publishes KV cache
events): each cached block is hashed once, when it is cached, and a report costs
O(reported hashes), however large the cache. Without an index attached the block manager's
hot paths pay one `is None` test per block.
"""

from __future__ import annotations

import hashlib

from iterserve.replica.block_keys import ROOT_HASH, BlockHash, BlockTokens

ROOT = 0  # the chain's parent before the first block
# A report holds at most this many hashes (8 bytes each on the wire, every routing-stats
# period); beyond it the shallowest blocks are kept: a prefix's head serves the most prompts.
MAX_REPORTED_BLOCK_HASHES = 32768
_TUPLE_FORM = b"tuple:"


def stable_block_hash(parent: int, tokens: BlockTokens) -> int:
    """The chain hash of a block whose previous block's chain hash is `parent`."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(tokens if isinstance(tokens, bytes) else _TUPLE_FORM + repr(tokens).encode())
    return int.from_bytes(digest.digest(), "little")


class BlockHashIndex:
    """The stable hashes of the blocks in one block manager's prefix cache, by chain depth.

    Attach with `BlockManager.cache_listener = index` before the manager caches anything;
    it then calls `stored(block, parent, tokens)` when a block joins the cache and
    `evicted(block)` when one leaves (the block manager's hashes), on the thread that
    changes the cache (the engine's), which is also where `report()` must run. Entries are
    kept by the block manager's hash: (stable hash, depth), depth being the block's index
    in its chain.
    A block whose parent is not indexed (it was cached as a private copy whose twin has
    been evicted) is left out, and so are its descendants. A block whose ancestor is
    evicted later stays reported until it is evicted itself: a router walks a prompt's
    chain from its first block, so such a block never counts (it only takes report room).
    """

    def __init__(self, limit: int = MAX_REPORTED_BLOCK_HASHES) -> None:
        self.limit = limit
        # the block manager's hash -> (stable hash, depth)
        self._entries: dict[BlockHash, tuple[int, int]] = {}
        self._levels: list[dict[BlockHash, int]] = []  # per depth: block hash -> stable hash
        self.num_hashed = 0  # blocks hashed so far (tests check each is hashed once)

    def __len__(self) -> int:
        return len(self._entries)

    def stored(self, block: BlockHash, parent: BlockHash, tokens: BlockTokens) -> None:
        if parent == ROOT_HASH:
            parent_stable, depth = ROOT, 0
        else:
            entry = self._entries.get(parent)
            if entry is None:
                return  # its parent is not indexed: no lookup can reach it through us
            parent_stable, depth = entry[0], entry[1] + 1
        stable = stable_block_hash(parent_stable, tokens)
        self.num_hashed += 1
        self._entries[block] = (stable, depth)
        if depth == len(self._levels):
            self._levels.append({})
        self._levels[depth][block] = stable

    def evicted(self, block: BlockHash) -> None:
        entry = self._entries.pop(block, None)
        if entry is not None:
            del self._levels[entry[1]][block]

    def report(self) -> list[int]:
        """The stable hashes of the cached blocks; over `limit`, the shallowest whole levels
        that fit (a prefix's head serves more prompts than its tail)."""
        if len(self._entries) <= self.limit:
            return [stable for stable, _ in self._entries.values()]
        reported: list[int] = []
        for level in self._levels:
            if len(reported) + len(level) > self.limit:
                break
            reported.extend(level.values())
        return reported
