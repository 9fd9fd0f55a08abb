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

Tiers (`KV_TIERS`, best first): a block lives in the device KV, and below it in a host tier
(replica/host_kv_index.py, which calls `host_stored` / `host_evicted`) or a disk tier (its
owner calls `tier_stored` / `tier_evicted`). The index keeps a block while any tier holds
it, so a block the device evicts into the host tier keeps its stable hash (hashed once) and
is reported under "host" until the host tier lets it go too; a block in several tiers is
reported in the best of them (the one a lookup would read).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from iterserve.replica.block_keys import ROOT_HASH, BlockHash, BlockTokens

if TYPE_CHECKING:
    from iterserve.replica.host_kv_index import HostEntry

ROOT = 0  # the chain's parent before the first block
# A report holds at most this many hashes (8 bytes each on the wire, every routing-stats
# period); beyond it the shallowest blocks are kept: a prefix's head serves the most prompts.
MAX_REPORTED_BLOCK_HASHES = 32768
_TUPLE_FORM = b"tuple:"
# Where a cached block can live, best (cheapest to read) first: the names a replica's
# report and the router's tier costs use.
DEVICE, HOST, DISK = "device", "host", "disk"
KV_TIERS = (DEVICE, HOST, DISK)
_BIT = {tier: 1 << i for i, tier in enumerate(KV_TIERS)}
_BEST_TIER = [None] + [next(t for t in KV_TIERS if mask & _BIT[t]) for mask in range(1, 8)]


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
        self._tiers: dict[BlockHash, int] = {}  # block hash -> the tiers holding it (bits)
        self.num_hashed = 0  # blocks hashed so far (tests check each is hashed once)

    def __len__(self) -> int:
        return len(self._entries)

    # --------------------------------------------------------------------- the device
    def stored(self, block: BlockHash, parent: BlockHash, tokens: BlockTokens) -> None:
        self.tier_stored(DEVICE, block, parent, tokens)

    def evicted(self, block: BlockHash) -> None:
        self.tier_evicted(DEVICE, block)

    # ------------------------------------------------------------ the host tier's hook
    def host_stored(self, entry: HostEntry) -> None:
        self.tier_stored(HOST, entry.key, entry.parent, entry.tokens)

    def host_evicted(self, entry: HostEntry) -> None:
        self.tier_evicted(HOST, entry.key)

    # ------------------------------------------------------------------ any tier
    def tier_stored(self, tier: str, block: BlockHash, parent: BlockHash,
                    tokens: BlockTokens) -> None:
        """`tier` now holds the block: indexed (hashed) unless some tier already held it."""
        held = self._tiers.get(block)
        if held is not None:
            self._tiers[block] = held | _BIT[tier]
            return
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
        self._tiers[block] = _BIT[tier]
        if depth == len(self._levels):
            self._levels.append({})
        self._levels[depth][block] = stable

    def tier_evicted(self, tier: str, block: BlockHash) -> None:
        """`tier` let the block go: it leaves the index once no tier holds it."""
        held = self._tiers.get(block)
        if held is None:
            return
        held &= ~_BIT[tier]
        if held:
            self._tiers[block] = held
            return
        del self._tiers[block]
        entry = self._entries.pop(block)
        del self._levels[entry[1]][block]

    def report(self) -> dict[str, list[int]]:
        """Per tier (always "device", the others where they hold something), the stable
        hashes of the blocks whose best tier it is; over `limit` hashes in all, the
        shallowest whole levels that fit (a prefix's head serves more prompts than its
        tail)."""
        reported: dict[str, list[int]] = {DEVICE: []}
        tiers, best = self._tiers, _BEST_TIER
        if len(self._entries) <= self.limit:
            levels: list[dict[BlockHash, int]] = [
                {block: stable for block, (stable, _) in self._entries.items()}]
        else:
            levels, total = [], 0
            for level in self._levels:
                total += len(level)
                if total > self.limit:
                    break
                levels.append(level)
        for level in levels:
            for block, stable in level.items():
                tier = best[tiers[block]]
                hashes = reported.get(tier)
                if hashes is None:
                    hashes = reported[tier] = []
                hashes.append(stable)
        return reported
