"""The paged KV cache's bookkeeping: which physical blocks each request owns.

Every block is either free (reference count 0, in `free_pool`) or used (reference count
>= 1, held by one or more block tables). Free blocks that still hold a full, hashed block of
tokens stay findable by the prefix cache until they are reused, least recently freed first.
Invariant, checked by `check_invariants` in tests after every step:
    num_free_blocks + num_used_blocks == num_total_blocks

The prefix cache is keyed by a chain hash, as vLLM's is: a block's hash is
`block_hash(parent's hash, its tokens)`, the parent of a prompt's first block being 0, so
one int names the whole prefix up to that block. An int key is hashed in O(1) by every dict
operation and keeps nothing else alive (a (parent, tokens) tuple key was rehashed by every
lookup, insertion and eviction, and held its tokens' bytes for as long as it was cached).

Below the device, a host KV tier and a disk tier under it may keep the blocks evicted here
(replica/kv_tier_plans.py plans their copies). A prompt's lookup walks its chain block by
block: the device, then the host tier, then the disk (a disk block is read into a host slot).
`find_cached_prefix` lists a host hit as a negative number (`host_hit`) beside device ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from iterserve.replica.block_hashes import ROOT, stable_block_hash
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    BlockTokens,
    block_tokens,
    namespaced,
    num_cacheable_blocks,
)
from iterserve.replica.disk_kv_tier import DiskKVTier
from iterserve.replica.free_block_pool import FreeBlockPool
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.kv_tier_plans import KVTierPlans, host_hit, host_slot
from iterserve.replica.request import Request

# A request's physical block ids in order: a C int32 array, so a step's input preparation
# copies every table into its [S, M] array as raw bytes instead of converting Python ints.
BlockTable = array  # array("i")


class PrefixCacheListener(Protocol):
    def stored(self, block: BlockHash, parent: BlockHash, tokens: BlockTokens) -> None: ...
    def evicted(self, block: BlockHash) -> None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["BlockManager", "BlockTable", "host_hit", "host_slot"]


class BlockManager(KVTierPlans):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 host: HostKVIndex | None = None, disk: DiskKVTier | None = None) -> None:
        """host: the host KV tier's index (None: no tier below this cache); disk: the disk
        tier below the host tier (None: none)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per block id: how many block tables hold it, and its prefix-cache hash (set once
        # the block is full and registered in the cache).
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockHash | None] = [None] * num_blocks
        self.free_pool = FreeBlockPool(num_blocks)  # reuse order: uncached first, then LRU
        self.cached_blocks: dict[BlockHash, int] = {}
        self.block_tables: dict[str, BlockTable] = {}
        # Per request: how many leading blocks are registered, and the hash chain so far.
        self.num_registered: dict[str, tuple[int, int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # prompt tokens found there (on the device)
        self.init_tiers(num_blocks, host, disk)  # the tiers below: replica/kv_tier_plans.py
        # Told of every hash that joins or leaves cached_blocks (`stored` / `evicted`): the
        # replica's index of stable block hashes for routers (replica/block_hashes.py).
        self.cache_listener: PrefixCacheListener | None = None

    # ----------------------------------------------------------------------------- sizes
    @property
    def num_total_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return self.free_pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def block_table(self, request_id: str) -> BlockTable:
        table = self.block_tables.get(request_id)
        return table if table is not None else array("i")

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.block_tables.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the request's leading full blocks of tokens.

        At least one token is always left to compute, so that the request samples. A request
        asking for prompt logprobs takes no hits: every prompt position must be computed.
        """
        if (not self.enable_prefix_caching or request.num_computed_tokens > 0
                or request.wants_prompt_logprobs):
            return []
        size = self.block_size
        max_blocks = self._max_hit_blocks(request)
        packed = request.prompt_token_bytes
        if packed is None or max_blocks * size * 8 > len(packed):
            packed, tokens = None, request.all_token_ids
        hits: list[int] = []
        key = ROOT_HASH
        host, disk = self.host, self.disk
        namespace = request.cache_namespace
        for i in range(max_blocks):  # block_hash, inlined: once per block of every admission
            if packed is not None:  # the same bytes block_tokens makes of the slice
                chunk: BlockTokens = packed[i * size * 8 : (i + 1) * size * 8]
            else:
                chunk = block_tokens(tokens[i * size : (i + 1) * size])
            if i == 0:
                chunk = namespaced(namespace, chunk)
            parent, key = key, hash((key, chunk))
            block_id = self.cached_blocks.get(key)
            if block_id is None:
                slot = host.lookup(key) if host is not None else None
                if slot is None and disk is not None:
                    slot = self._promote_from_disk(key, parent, chunk, hits)
                if slot is None:
                    break
                block_id = host_hit(slot)
            hits.append(block_id)
        return hits

    def _max_hit_blocks(self, request: Request) -> int:
        """How many leading blocks of the request a prefix lookup may hit."""
        return num_cacheable_blocks(request.num_tokens, self.block_size)

    def _register_full_blocks(self, request: Request, num_computed_tokens: int,
                              last: int | None = None) -> None:
        """Put the request's newly completed blocks, up to block `last` (not included; None:
        all of them), into the prefix cache."""
        table = self.block_tables[request.request_id]
        start, parent = self.num_registered.get(request.request_id, (0, ROOT_HASH))
        end = min(num_computed_tokens // self.block_size, len(table))
        if last is not None and last < end:
            end = last
        if end <= start:
            return
        block_size = self.block_size
        packed: BlockTokens | None = request.prompt_token_bytes
        if packed is not None and end * block_size * 8 <= len(packed):
            tokens: Sequence[int] = ()
            offset = start * block_size  # token offset into packed
        else:
            tokens = self._token_range(request, start * block_size, end * block_size)
            offset = 0
            try:  # all the blocks' tokens in one conversion, then a slice each
                packed = array("q", tokens).tobytes()
            except (OverflowError, TypeError):
                packed = None  # some block's tokens do not fit: each block converts its own
        cached, keys, listener = self.cached_blocks, self.block_keys, self.cache_listener
        origins, chain_stable = self.block_origins, self.disk is not None
        stable = self.stable_chains.get(request.request_id, ROOT) if chain_stable else ROOT
        width = 8 * block_size
        for i in range(start, end):
            if packed is not None:  # block_hash, inlined: this loop runs once per block
                chunk: BlockTokens = packed[offset * 8 : offset * 8 + width]
            else:
                chunk = block_tokens(tokens[offset : offset + block_size])
            if i == 0:
                chunk = namespaced(request.cache_namespace, chunk)
            key = hash((parent, chunk))
            if chain_stable:  # the disk tier names its files by it
                stable = stable_block_hash(stable, chunk)
            offset += block_size
            block_id = table[i]
            # An identical block may already be cached (two requests computed the same prefix
            # at once); the first one stays the cache entry and this one stays private.
            if keys[block_id] is None and cached.setdefault(key, block_id) == block_id:
                keys[block_id] = key
                if listener is not None:
                    listener.stored(key, parent, chunk)
                if origins is not None:
                    origins[block_id] = (parent, chunk, stable)
            parent = key
        self.num_registered[request.request_id] = (end, parent)
        if chain_stable:
            self.stable_chains[request.request_id] = stable

    @staticmethod
    def _token_range(request: Request, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi) of the request, without building all_token_ids (a copy of the
        whole prompt per call: the cost of every decode that fills a block)."""
        prompt = request.prompt_token_ids
        num_prompt = len(prompt)
        if hi <= num_prompt:
            return prompt[lo:hi]
        outputs = request.output_token_ids
        if lo >= num_prompt:
            return outputs[lo - num_prompt : hi - num_prompt]
        return prompt[lo:] + outputs[: hi - num_prompt]

    def mark_computed(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Called after a step computed tokens for the request: cache its full blocks.

        num_computed_tokens: how many leading tokens the finished step left in the KV cache
        (default: request.num_computed_tokens); under async scheduling the request may
        already be scheduled further than that.
        """
        if self.enable_prefix_caching and request.request_id in self.block_tables:
            if num_computed_tokens is None:
                num_computed_tokens = request.num_computed_tokens
            self._register_full_blocks(request, num_computed_tokens)

    # ------------------------------------------------------------------------- allocation
    def num_new_blocks_needed(self, request: Request, num_new_tokens: int, num_hits: int = 0) -> int:
        have = len(self.block_tables.get(request.request_id, ())) or num_hits
        total_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        return max(0, self.num_blocks_for(total_tokens) - have)

    def can_allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Whether blocks for `num_new_tokens` more tokens (after any prefix hits) are free."""
        if not hits:  # the per-step fast path of every running request
            table = self.block_tables.get(request.request_id, ())
            total = request.num_computed_tokens + num_new_tokens
            return -(-total // self.block_size) - len(table) <= self.free_pool.num_free
        return self.num_blocks_to_admit(request, num_new_tokens, hits) <= self.num_free_blocks

    def num_blocks_to_admit(self, request: Request, num_new_tokens: int, hits: list[int]) -> int:
        """Free blocks that admitting the request would take: new blocks for num_new_tokens
        after its prefix hits, plus the hit blocks that sit in the free pool and a block for
        each host-tier hit."""
        refs = self.ref_counts
        hits_in_free_pool = sum(1 for b in hits if b < 0 or refs[b] == 0)
        return self.num_new_blocks_needed(request, num_new_tokens, len(hits)) + hits_in_free_pool

    def try_allocate(self, request: Request, num_new_tokens: int) -> BlockTable | None:
        """Grow a running request's blocks for num_new_tokens more tokens if enough are free:
        its block table, or None (nothing taken). The scheduler's per-step fast path: most
        decodes need no new block at all."""
        table = self.block_tables.get(request.request_id)
        total = request.num_computed_tokens + num_new_tokens
        if table is not None and total <= len(table) * self.block_size:
            return table
        needed = -(-total // self.block_size) - (len(table) if table is not None else 0)
        if needed > self.free_pool.num_free:
            return None
        if table is None:
            table = self.block_tables[request.request_id] = array("i")
        table.extend(self._take_free(needed))
        return table

    def allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Give the request its prefix hits (first admission) and blocks for new tokens.

        Sets request.num_computed_tokens past the hit blocks. Raises RuntimeError if the
        caller did not check can_allocate first.
        """
        if hits and not self.can_allocate(request, num_new_tokens, hits):
            raise RuntimeError(f"out of KV blocks for request {request.request_id}")
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = self.block_tables[request.request_id] = array("i")
        if hits:
            if table:
                raise RuntimeError("prefix hits are only taken at first admission")
            table.extend(self._take_hits(hits))
            request.num_computed_tokens = len(hits) * self.block_size
            self.num_registered[request.request_id] = (len(hits), self.block_keys[table[-1]])
            if self.disk is not None:
                self.stable_chains[request.request_id] = self.stable_hash_of(table[-1])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > self.free_pool.num_free:
            raise RuntimeError(f"out of KV blocks for request {request.request_id}")
        if needed > 0:
            table.extend(self._take_free(needed))

    def _take_hits(self, hits: Sequence[int]) -> list[int]:
        """The blocks of a request's prefix hits, in order. The device hits are taken first:
        the free block a host hit is copied into may not be one of them. Host hits are
        pinned before any is taken: storing an evicted block may not overwrite one."""
        host_slots = [host_slot(hit) for hit in hits if hit < 0]
        if host_slots and self.host is None:
            raise RuntimeError("a host-tier hit without a host tier")
        for slot in host_slots:
            self.host.pin(slot)
        taken = [self._take_hit(hit) if hit >= 0 else hit for hit in hits]
        return [block if block >= 0 else self._load_from_host(host_slot(block))
                for block in taken]

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; cached ones stay findable until reused."""
        rid = request.request_id
        table = self.block_tables.pop(rid, ())
        self.num_registered.pop(rid, None)
        self.stable_chains.pop(rid, None)
        self.free_pool.release(*self._unreference(table, [], []))

    def _unreference(self, table: Sequence[int], uncached: list[int], cached: list[int]
                     ) -> tuple[list[int], list[int]]:
        """Drop one reference to each block of the table, the tail first (so that a chain's
        later blocks are evicted before its head): (uncached, cached) with the blocks no
        table holds any more appended, each in the order let go."""
        refs, keys = self.ref_counts, self.block_keys
        for block_id in reversed(table):
            left = refs[block_id] - 1
            refs[block_id] = left
            if left == 0:
                (uncached if keys[block_id] is None else cached).append(block_id)
        return uncached, cached

    def _take_free(self, count: int) -> list[int]:
        """The first `count` free blocks in reuse order, taken for new tokens: a block that
        still holds cached tokens leaves the prefix cache (its contents are overwritten)."""
        taken = self.free_pool.take(count)
        refs, keys, cached = self.ref_counts, self.block_keys, self.cached_blocks
        listener = self.cache_listener
        for block_id in taken:
            key = keys[block_id]
            if key is not None:
                self.device_writes.open(block_id)  # before it leaves: see kv_write_generations
                del cached[key]
                if self.host is not None:  # first: the listener keeps a block the tier took
                    self._store_in_host(block_id, key)
                if listener is not None:
                    listener.evicted(key)
                keys[block_id] = None
            refs[block_id] = 1  # it was free: no table held it
        return taken

    def _take_hit(self, block_id: int) -> int:
        """A cached block, shared with the request that found it in the prefix cache."""
        if self.ref_counts[block_id] == 0:
            self.free_pool.remove(block_id)
        self.ref_counts[block_id] += 1
        return block_id

    # ------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise RuntimeError if the accounting is inconsistent."""
        refs = [0] * self.num_total_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        self.free_pool.check()
        for block_id, ref_count in enumerate(self.ref_counts):
            in_free = self.free_pool.is_free(block_id)
            if ref_count != refs[block_id]:
                raise RuntimeError(f"block {block_id}: ref_count {ref_count} "
                                   f"but held by {refs[block_id]} tables")
            if in_free != (ref_count == 0):
                raise RuntimeError(f"block {block_id}: free={in_free}, refs={ref_count}")
        if self.num_free_blocks + self.num_used_blocks != self.num_total_blocks:
            raise RuntimeError("free + used != total")
