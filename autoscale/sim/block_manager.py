"""The engine's block manager with what only the cluster simulator needs.

A simulated prompt's own tokens (`SyntheticPrompt.private`) are found by no other request,
so the simulator neither hashes the blocks that hold them as they fill nor keeps them in
the prefix cache's reuse queue one by one; it batches the decode-step block work of a
cohort of requests (`append_blocks`, `register_output_blocks`). Same hits, same blocks
reused, same results: tests/unit/test_block_manager_private.py and
tests/unit/test_cluster_sim_speed.py hold these to the engine's `BlockManager`, and
tests/unit/test_cluster_sim.py runs whole clusters both ways byte for byte.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.kv_tiers import DiskTier, TierCopies
from iterserve.replica.block_hashes import ROOT
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    BlockTokens,
    block_tokens,
    namespaced,
)
from iterserve.replica.block_manager import BlockManager, BlockTable, host_hit, host_slot
from iterserve.replica.free_block_pool import FreeBlockPool
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.request import Request

_ANONYMOUS = -1  # an entry of the cached queue that any anonymous free block fills


class SimFreeBlockPool(FreeBlockPool):
    """The free pool with anonymous blocks: full blocks that no request can ever find (a
    private prompt's own blocks, never hashed). They take a cached block's place in the
    reuse order, but which of them fills that place makes no difference (none holds
    anything findable), so the queue holds a marker and the block comes from a stack of
    them, the most recently freed first: its memory is still warm, where the least recently
    freed one's (the whole pool cycled through in order) is not."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._anonymous: list[int] = []  # free anonymous blocks, a stack

    def release(self, uncached: Sequence[int], cached: Sequence[int], num_anonymous: int = 0
                ) -> None:
        """`FreeBlockPool.release`, the first num_anonymous cached blocks anonymous."""
        self._mark_free(uncached, cached)
        if num_anonymous:
            self._anonymous.extend(cached[:num_anonymous])
            self._cached.extend(itertools.repeat(_ANONYMOUS, num_anonymous))
            cached = cached[num_anonymous:]
        self._queue_cached(cached)

    def _take_cached(self, taken: list[int], count: int) -> None:
        pop, entries, free = self._cached.popleft, self._entries, self._free
        while len(taken) < count:
            block_id = pop()
            if block_id == _ANONYMOUS:
                taken.append(self._anonymous.pop())
            else:
                left = entries[block_id] - 1
                entries[block_id] = left
                if left == 0 and free[block_id]:
                    taken.append(block_id)

    def _compact(self) -> None:
        """`FreeBlockPool._compact`; each marker keeps its place among the live entries."""
        entries, free = self._entries, self._free
        kept: deque[int] = deque()
        for block_id in self._cached:
            if block_id == _ANONYMOUS:
                kept.append(block_id)
                continue
            left = entries[block_id] - 1
            entries[block_id] = left
            if left == 0 and free[block_id]:
                kept.append(block_id)
        for block_id in kept:
            if block_id != _ANONYMOUS:
                entries[block_id] = 1
        self._cached = kept

    def in_reuse_order(self) -> list[int]:
        order = self._uncached[::-1]
        remaining = list(self._entries)
        anonymous = list(self._anonymous)
        for block_id in self._cached:
            if block_id == _ANONYMOUS:
                order.append(anonymous.pop())
                continue
            remaining[block_id] -= 1
            if remaining[block_id] == 0 and self._free[block_id]:
                order.append(block_id)
        return order

    def anonymous_blocks(self) -> frozenset[int]:
        """The free anonymous blocks (whichever of them is reused is the pool's choice)."""
        return frozenset(self._anonymous)


class SimBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 host: HostKVIndex | None = None, disk: DiskTier | None = None) -> None:
        """host, disk: the KV tiers below the device (sim/kv_tiers.py); a disk needs a host."""
        super().__init__(num_blocks, block_size, enable_prefix_caching, host)
        self.free_pool = SimFreeBlockPool(num_blocks)
        # Per request: the first block no other request can look up (`mark_private`).
        self.private_from: dict[str, int] = {}
        self.sim_disk = disk  # not BlockManager.disk: the engine's real disk tier stays None
        if disk is not None:
            if host is None:
                raise ValueError("the disk tier is fed by a host tier's evictions")
            host.listener = disk
        self.disk_reads = 0  # blocks read from disk into the host tier, not yet charged

    def find_cached_prefix(self, request: Request) -> list[int]:
        """`BlockManager.find_cached_prefix`, the chain continued on disk where the device
        and the host tier miss: a block found there is read into the host tier (and listed
        as a host hit, copied on from there), as HiCache and LMCache stage disk reads."""
        hits = super().find_cached_prefix(request)
        max_blocks = self._max_hit_blocks(request)
        if self.sim_disk is None or len(hits) >= max_blocks or request.num_computed_tokens > 0 \
                or request.wants_prompt_logprobs or not self.enable_prefix_caching:
            return hits
        host = self.host
        for hit in hits:  # reading disk blocks in evicts host blocks: not these
            if hit < 0:
                host.pin(host_slot(hit))
        parent = ROOT_HASH if not hits else (
            self.block_keys[hits[-1]] if hits[-1] >= 0 else host.entry(host_slot(hits[-1])).key)
        size, width = self.block_size, 8 * self.block_size
        packed = request.prompt_token_bytes  # the bytes block_tokens makes, as the engine's
        tokens = request.all_token_ids if packed is None or max_blocks * width > len(packed) \
            else None
        for i in range(len(hits), max_blocks):
            chunk = packed[i * width:(i + 1) * width] if tokens is None \
                else block_tokens(tokens[i * size:(i + 1) * size])
            key = hash((parent, namespaced(request.cache_namespace, chunk) if i == 0 else chunk))
            parent = key
            block_id = self.cached_blocks.get(key)
            if block_id is not None:
                hits.append(block_id)
                continue
            slot = host.lookup(key)
            if slot is None:
                slot = self._read_from_disk(key)
                if slot is None:
                    break
            host.pin(slot)
            hits.append(host_hit(slot))
        return hits

    def _read_from_disk(self, key: BlockHash) -> int | None:
        """The host slot a block found on disk is read into, or None (not on disk, or no
        host slot free of this step's pins)."""
        disk = self.sim_disk.index
        disk_slot = disk.lookup(key)
        if disk_slot is None:
            return None
        entry = disk.entry(disk_slot)
        disk.record_hit(disk_slot)  # recency and frequency, as the host tier keeps them
        disk.unpin_all()  # nothing copies out of a disk slot within a step
        slot = self.host.store(entry)
        if slot is not None:
            self.disk_reads += 1
        return slot

    def mark_private(self, request_id: str, first_block: int) -> None:
        """No other request's prompt holds this request's tokens from its block first_block
        on (a simulator's own tokens: `SyntheticPrompt.private`), so only the request itself,
        readmitted after a preemption, can look those blocks up. They are not hashed as they
        fill: when it finishes, the filled ones go back to the free pool where registered
        blocks go (the same reuse order), and only a preemption hashes and registers them
        (its readmission may find them). Same hits, same blocks reused: the cluster
        simulator's results are byte-identical with it (tests/unit/test_cluster_sim.py)."""
        self.private_from[request_id] = first_block

    def _max_hit_blocks(self, request: Request) -> int:
        limit = super()._max_hit_blocks(request)
        private = self.private_from.get(request.request_id)
        if private is not None and private < limit and not request.num_preemptions:
            return private  # nothing past it is cached before it registers its own
        return limit

    def mark_computed(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """`BlockManager.mark_computed`, registering no block from the request's first
        private one on."""
        if self.enable_prefix_caching and request.request_id in self.block_tables:
            if num_computed_tokens is None:
                num_computed_tokens = request.num_computed_tokens
            self._register_full_blocks(request, num_computed_tokens,
                                       self.private_from.get(request.request_id))

    def free(self, request: Request) -> None:
        """`BlockManager.free`; a finished private request's own filled blocks go back
        where registered blocks go, as anonymous blocks."""
        rid = request.request_id
        private = self.private_from.get(rid)
        if private is None:
            super().free(request)
            return
        if not request.is_finished:  # preempted: readmitted, it may look them up
            if rid in self.block_tables:
                self._register_full_blocks(request, request.num_computed_tokens)
            super().free(request)  # it stays marked for its next run
            return
        del self.private_from[rid]
        table = self.block_tables.pop(rid, ())
        self.num_registered.pop(rid, None)
        uncached: list[int] = []
        cached: list[int] = []
        if len(table) > private:
            uncached, cached = self._free_private_tail(table, private,
                                                       request.num_computed_tokens)
            table = table[:private]
        # Its own full blocks never hashed (newest first): nothing can find them, so any of
        # them may stand in for another (SimFreeBlockPool).
        num_anonymous = 0
        for block_id in cached:
            if self.block_keys[block_id] is not None:
                break
            num_anonymous += 1
        self.free_pool.release(*self._unreference(table, uncached, cached), num_anonymous)

    def register_output_blocks(self, requests: Sequence[Request], runs: Sequence[BlockTokens],
                               start: int = 0) -> int:
        """`mark_computed(requests[i])` for i = start, start + 1, ... in order, for decodes
        that each completed exactly one more block in the same step, whose tokens the caller
        knows (runs[i], in `block_tokens` form: a simulator's decode has no token list to
        slice). Stops at the first request for which that is not so (a block behind or
        none): returns its i (len(requests): all done); call mark_computed for it."""
        tables, registered = self.block_tables, self.num_registered
        cached, keys, block_size = self.cached_blocks, self.block_keys, self.block_size
        if not self.enable_prefix_caching:
            return len(requests)
        for i in range(start, len(requests)):
            request = requests[i]
            rid = request.request_id
            table = tables.get(rid)
            if table is None:
                continue
            first, parent = registered.get(rid, (0, ROOT_HASH))
            end = min(request.num_computed_tokens // block_size, len(table))
            if end != first + 1:
                return i
            run = runs[i]
            chunk = run if isinstance(run, bytes) else block_tokens(run)
            if first == 0:  # a chain's first block: keyed in the request's namespace
                chunk = namespaced(request.cache_namespace, chunk)
            key = hash((parent, chunk))
            block_id = table[first]
            if keys[block_id] is None and cached.setdefault(key, block_id) == block_id:
                keys[block_id] = key
                if self.cache_listener is not None:
                    self.cache_listener.stored(key, parent, chunk)
                if self.block_origins is not None:  # what a host tier keeps of it
                    self.block_origins[block_id] = (parent, chunk)
            registered[rid] = (end, key)
        return len(requests)

    def land_blocks(self, chain: Sequence[tuple[BlockHash, BlockHash, BlockTokens]]) -> int:
        """Blocks pulled from another replica (sim/kv_pull.py) join the prefix cache as a
        finished request's computed blocks do: free, findable, the most recently used, the
        chain's tail evicted first. The chain's blocks already cached are kept (held while
        the others are taken, so that taking evicts none of them); the rest take free
        blocks in order while any is free. Returns how many blocks were written."""
        cached, keys = self.cached_blocks, self.block_keys
        held: list[int] = []
        written = 0
        for key, parent, chunk in chain:
            block_id = cached.get(key)
            if block_id is None:
                if not self.free_pool.num_free:
                    break  # every block is in use: the rest is computed
                block_id = self._take_free(1)[0]
                keys[block_id] = key
                cached[key] = block_id
                if self.cache_listener is not None:
                    self.cache_listener.stored(key, parent, chunk)
                if self.block_origins is not None:  # what a host tier keeps of it
                    self.block_origins[block_id] = (parent, chunk, ROOT)
                written += 1
            else:
                self._take_hit(block_id)
            held.append(block_id)
        self.free_pool.release(*self._unreference(held, [], []))
        return written

    def append_blocks(self, request_ids: Sequence[str]) -> None:
        """One more block each for these requests, in order: what `allocate(request, n)`
        does for a running request whose n new tokens pass its last block by exactly one
        (a simulator's decodes crossing a block boundary in the same step). Raises
        RuntimeError, taking nothing, if fewer blocks are free."""
        if len(request_ids) > self.free_pool.num_free:
            raise RuntimeError("out of KV blocks for the requests' next blocks")
        tables = self.block_tables
        for rid, block_id in zip(request_ids, self._take_free(len(request_ids)), strict=True):
            tables[rid].append(block_id)

    def _free_private_tail(self, table: BlockTable, private: int, num_computed_tokens: int
                           ) -> tuple[list[int], list[int]]:
        """(uncached, cached) of free()'s loop over a finished private request's blocks from
        `private` on: it alone held them; the filled ones are (or would have been)
        registered, so they go where cached blocks go, the tail first."""
        tail = table[private:].tolist()
        refs = self.ref_counts
        for block_id in tail:
            refs[block_id] = 0
        tail.reverse()
        filled = min(num_computed_tokens // self.block_size, len(table)) - private
        num_unfilled = len(tail) - max(filled, 0)
        return tail[:num_unfilled], tail[num_unfilled:]


def tiered_block_manager(num_blocks: int, config: ClusterSimConfig
                         ) -> tuple[SimBlockManager, TierCopies | None]:
    """A replica's block manager of num_blocks, with the KV tiers config.kv_tiers asks for
    below it, and the accounting of their copies (None: no tiers)."""
    tiers = config.kv_tiers
    if tiers is None or tiers.host_gib <= 0 or not config.enable_prefix_caching:
        return SimBlockManager(num_blocks, config.block_size,
                               config.enable_prefix_caching), None
    per_block = config.sim.kv_bytes_per_token * config.block_size
    host = tiers.host_index(max(1, tiers.num_blocks(tiers.host_gib, per_block)))
    disk = DiskTier(max(1, tiers.num_blocks(tiers.disk_gib, per_block))) \
        if tiers.disk_gib > 0 else None
    manager = SimBlockManager(num_blocks, config.block_size, True, host, disk)
    return manager, TierCopies(tiers, per_block)
