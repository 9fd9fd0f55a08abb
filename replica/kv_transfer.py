"""Moving a cached prefix's KV blocks from one engine to another: `export_blocks` on the
engine that holds them, `import_blocks` on the engine that wants them, a `KVBlockPayload`
between the two.

A payload is a run of consecutive full blocks of one prompt's hash chain: where the run
starts in the chain (`first_block`), each block's stable chain hash (replica/block_hashes.py,
the same in every process, the cache namespace folded into the first block's), and the blocks'
bytes on the host, one row per block in the host tier's slot order (every layer's K then V,
as `HostKVTier.read_slot` lays them out), under the `KVLayoutKey` of the engine that made them.

The receiver checks everything it can before a byte is used: the layout key must equal its
own (the same model config and weight files, dtype, block size, heads, head dim, row layout),
the namespace must be the request's, and each block's stable hash must be the one the
receiver computes from its own copy of the prompt's tokens; the first block that differs ends
the import. Accepted blocks go into the receiver's host KV tier under its own chain keys
(`BlockManager.receive_block`; the payload's rows stay views until the next step writes
them all into their slots at once, `HostKVTier.write_slots`), and the EXISTING onboarding
path brings them to the device:
the prompt's lookup continues its chain in the host tier and the step copies the blocks back
before its forward, counting them as cached tokens. An import therefore needs a host tier.

Both sides run on the engine thread, between steps (`AsyncLLMEngine.call`): the holder copies
at most `max_bytes` per call, so a long prefix is exported as several chunks and the holder's
batch waits for one chunk's copy at a time, never for the whole transfer. A block whose
planned copy has not landed yet (a step that was empty) ends the export there. Where the
engine runs on CPU without async scheduling, the holder may also copy from any thread,
mid-step (`export_blocks_unlocked`): cached blocks' bytes change only after the engine
thread has counted a write into them (replica/kv_write_generations.py), so a block whose
count is unchanged across the copy was copied whole, and one written meanwhile is left out.

The same two calls are what a prefill/decode split would use: a prefill replica exports a
finished prompt's blocks (`export_blocks` over the prompt), a decode replica imports them
(`import_blocks`) before admitting the request, which then finds its whole prompt cached. How
the payload travels (Ray's object store between replicas: deploy/kv_pull.py) is not this
file's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from iterserve.replica.block_hashes import ROOT, stable_block_hash
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    BlockTokens,
    CacheNamespace,
    block_hash,
    block_tokens,
    namespaced,
    num_cacheable_blocks,
)
from iterserve.replica.block_manager import host_hit, host_slot
from iterserve.replica.host_kv_index import HostEntry
from iterserve.replica.host_kv_tier import block_major

if TYPE_CHECKING:
    from iterserve.replica.block_manager import BlockManager
    from iterserve.replica.kv_write_generations import WriteGenerations
    from iterserve.replica.llm_engine import LLMEngine


class KVTransferRefused(ValueError):
    """A payload this engine must not use (another layout, another namespace) or cannot
    take (no host tier to receive into): the request computes its prefix instead."""


@dataclass(frozen=True, slots=True)
class KVLayoutKey:
    """What makes a block's bytes mean the same KV in two engines, besides its tokens.
    identity: the digest of the model's config, weight files, dtype, block size and row layout
    (disk_kv_tier.block_layout_identity, the disk tier's folder name); the rest, spelled out,
    say what differs when two keys do."""

    identity: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class ChainBlock:
    """One full block of a prompt's chain: the engine's own key (per process), its parent's,
    its tokens as the key reads them, and its stable hash (every process)."""

    key: BlockHash
    parent: BlockHash
    tokens: BlockTokens
    stable: int


@dataclass(frozen=True)
class KVBlockPayload:
    """Blocks first_block .. first_block + len(stable_hashes) - 1 of one prompt's chain.
    kv: [num_blocks, layout.bytes_per_block] uint8 on the host, one block per row."""

    layout: KVLayoutKey
    namespace: CacheNamespace
    first_block: int
    stable_hashes: tuple[int, ...]
    kv: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.stable_hashes)

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes)


def layout_key(engine: LLMEngine) -> KVLayoutKey | None:
    """The engine's layout key; None for a runner without real KV (the simulated one)."""
    runner = engine.runner
    identity = getattr(runner, "kv_layout_identity", None)
    if identity is None:
        return None
    mc = runner.model_config
    return KVLayoutKey(identity, str(runner.dtype), runner.block_size, mc.num_hidden_layers,
                       mc.num_key_value_heads, mc.head_dim, runner.kv_bytes_per_block)


def prompt_chain(token_ids: Sequence[int], namespace: CacheNamespace,
                 block_size: int) -> list[ChainBlock]:
    """The prompt's blocks a prefix lookup may hit (every full block but one holding its last
    token: block_keys.num_cacheable_blocks), keyed as the block manager keys them."""
    chain: list[ChainBlock] = []
    key, stable = ROOT_HASH, ROOT
    for i in range(num_cacheable_blocks(len(token_ids), block_size)):
        tokens = block_tokens(token_ids[i * block_size : (i + 1) * block_size])
        if i == 0:
            tokens = namespaced(namespace, tokens)
        parent = key
        key, stable = block_hash(parent, tokens), stable_block_hash(stable, tokens)
        chain.append(ChainBlock(key, parent, tokens, stable))
    return chain


def _held(engine: LLMEngine, block: ChainBlock) -> int | None:
    """Where the engine holds the block: a device block id, a host hit (negative), or None."""
    manager = engine.block_manager
    hit = manager.cached_blocks.get(block.key)
    if hit is None and manager.host is not None:
        slot = manager.host.lookup(block.key)
        hit = None if slot is None else host_hit(slot)
    return hit


def _where(engine: LLMEngine, block: ChainBlock) -> int | None:
    """Where the block's bytes can be read now: as _held, but None while a planned copy
    into it has not landed (it waits for a step that has not run)."""
    hit = _held(engine, block)
    if hit is None or not engine.block_manager.has_landed(hit):
        return None
    return hit


def num_held_blocks(engine: LLMEngine, chain: Sequence[ChainBlock]) -> int:
    """How many leading blocks of the chain the engine holds on its device or host tier."""
    for held, block in enumerate(chain):
        if _where(engine, block) is None:
            return held
    return len(chain)


def export_blocks(engine: LLMEngine, token_ids: Sequence[int], namespace: CacheNamespace,
                  first_block: int, max_bytes: int) -> KVBlockPayload | None:
    """The holder's side, on its engine thread: the prompt's blocks from `first_block` on,
    as many consecutive ones as it holds and `max_bytes` allows, copied to the host. None
    when it has no real KV; a payload of no blocks when it holds none of them there."""
    layout = layout_key(engine)
    if layout is None:
        return None
    chain = prompt_chain(token_ids, namespace, layout.block_size)
    limit = min(len(chain), first_block + max(0, max_bytes) // layout.bytes_per_block)
    hits: list[int] = []
    for block in chain[first_block:limit]:
        hit = _where(engine, block)
        if hit is None:
            break
        hits.append(hit)
    kv = _copy_hits(engine, hits, layout.bytes_per_block)
    stable = tuple(block.stable for block in chain[first_block : first_block + len(hits)])
    return KVBlockPayload(layout, namespace, first_block, stable, kv)


def can_export_unlocked(engine: LLMEngine) -> bool:
    """Whether `export_blocks_unlocked` may run off the engine thread: on CPU without async
    scheduling, where a step's copies and forward have run when the step finishes (on CUDA
    they may still be queued then, so exports wait for the step boundary there)."""
    runner = engine.runner
    kv_caches = getattr(runner, "kv_caches", None)
    return (layout_key(engine) is not None and not engine.config.async_scheduling
            and bool(kv_caches) and kv_caches[0][0].device.type == "cpu")


def export_blocks_unlocked(engine: LLMEngine, token_ids: Sequence[int],
                           namespace: CacheNamespace, first_block: int,
                           max_bytes: int) -> KVBlockPayload:
    """export_blocks from any thread, without waiting for the engine's step boundary (only
    where can_export_unlocked): each block's write count (replica/kv_write_generations.py)
    is read before and after the copy, and the payload ends at the first block that was
    being written, had left its tier, or was written while copied: a block evicted
    meanwhile is left out, never sent with another block's bytes."""
    layout = layout_key(engine)
    manager = engine.block_manager
    chain = prompt_chain(token_ids, namespace, layout.block_size)
    limit = min(len(chain), first_block + max(0, max_bytes) // layout.bytes_per_block)
    hits: list[int] = []
    counts: list[int] = []
    for block in chain[first_block:limit]:
        seen = _stable_hit(manager, block)
        if seen is None:
            break
        hits.append(seen[0])
        counts.append(seen[1])
    kv = _copy_hits(engine, hits, layout.bytes_per_block)
    kept = 0
    for hit, count in zip(hits, counts, strict=True):
        if not _writes(manager, hit).unchanged(_index(hit), count):
            break  # written while copied: this block and the rest are computed
        kept += 1
    stable = tuple(block.stable for block in chain[first_block : first_block + kept])
    return KVBlockPayload(layout, namespace, first_block, stable, kv[:kept])


def _stable_hit(manager: BlockManager, block: ChainBlock) -> tuple[int, int] | None:
    """(where the block is, its write count) when it sits in a tier with no write open
    into it, else None. The count is read between two lookups that agree: a block that
    left its place before the count was read is not taken for the one now there."""
    hit = _lookup(manager, block)
    if hit is None:
        return None
    count = _writes(manager, hit).stable(_index(hit))
    if count is None or _lookup(manager, block) != hit:
        return None
    return hit, count


def _lookup(manager: BlockManager, block: ChainBlock) -> int | None:
    """_held without touching anything (dict reads only): safe beside the engine thread."""
    hit = manager.cached_blocks.get(block.key)
    if hit is None and manager.host is not None:
        slot = manager.host.lookup(block.key)
        hit = None if slot is None else host_hit(slot)
    return hit


def _writes(manager: BlockManager, hit: int) -> WriteGenerations:
    return manager.device_writes if hit >= 0 else manager.host_writes


def _index(hit: int) -> int:
    return hit if hit >= 0 else host_slot(hit)


def _copy_hits(engine: LLMEngine, hits: list[int], bytes_per_block: int) -> np.ndarray:
    """The hits' bytes, one row each, device blocks and host slots alike."""
    kv = np.empty((len(hits), bytes_per_block), dtype=np.uint8)
    runner = engine.runner
    rows = torch.from_numpy(kv)  # the same memory
    on_device = [row for row, hit in enumerate(hits) if hit >= 0]
    in_host = [row for row, hit in enumerate(hits) if hit < 0]
    if on_device:
        _gather(runner.kv_caches, [hits[row] for row in on_device], rows, on_device)
    if in_host:
        tier = runner.host_tier
        tier.wait_for_copies()  # on CUDA (the engine thread's exports only)
        _gather(list(zip(tier.keys, tier.values, strict=True)),
                [host_slot(hits[row]) for row in in_host], rows, in_host)
    return kv


def _gather(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: list[int],
            out: torch.Tensor, rows: list[int]) -> None:
    """Blocks `blocks` of per-layer (K, V) tensors into rows `rows` of out ([n, bytes] uint8
    on the host), each row in read_slot's order: every layer's K block, then its V block.
    One gather per layer and tensor for all the blocks, written straight into out's columns
    for that tensor: no staging buffer the size of the payload (allocating and filling one
    made the copy ~5x slower than the bytes it moves, measured on the holder)."""
    index = torch.tensor(blocks, dtype=torch.long, device=layers[0][0].device)
    row_index = torch.tensor(rows, dtype=torch.long)
    every_row = rows == list(range(out.shape[0]))
    offset = 0  # bytes into a row
    for keys, values in layers:
        for cache in (keys, values):
            picked = block_major(cache).index_select(0, index).reshape(len(blocks), -1)
            size = picked.element_size()
            columns = out.view(picked.dtype)[:, offset // size : offset // size + picked.shape[1]]
            if every_row:
                columns.copy_(picked)
            else:
                columns.index_copy_(0, row_index, picked.to(out.device))
            offset += picked.shape[1] * size


def import_blocks(engine: LLMEngine, token_ids: Sequence[int], namespace: CacheNamespace,
                  payload: KVBlockPayload) -> int:
    """The receiver's side, on its engine thread: the payload's blocks that match the prompt
    and that it does not hold yet go into its host tier; returns how many it took. Raises
    KVTransferRefused for another layout or namespace, or without a host tier."""
    manager = engine.block_manager
    if manager.host is None:
        raise KVTransferRefused("this engine has no host KV tier to receive blocks into "
                                "(kv_offloading_size)")
    own = layout_key(engine)
    if own != payload.layout:
        raise KVTransferRefused(f"the blocks' layout {payload.layout} is not this engine's "
                                f"{own}")
    if payload.namespace != namespace:
        raise KVTransferRefused("the blocks belong to another cache namespace")
    if payload.kv.shape != (payload.num_blocks, own.bytes_per_block):
        raise KVTransferRefused(f"a payload of shape {payload.kv.shape} for "
                                f"{payload.num_blocks} blocks of {own.bytes_per_block} bytes")
    chain = prompt_chain(token_ids, namespace, own.block_size)
    wanted = chain[payload.first_block : payload.first_block + payload.num_blocks]
    taken = 0
    for row, (block, stable) in enumerate(zip(wanted, payload.stable_hashes, strict=False)):
        if block.stable != stable:
            break  # another prompt's block from here on: computed, never read
        if _held(engine, block) is not None:
            continue  # held already (a hit moves it up the tier's LRU anyway)
        entry = HostEntry(block.key, block.parent, block.tokens, block.stable)
        if not manager.receive_block(entry, payload.kv[row]):
            break  # no host slot free this step: the rest is computed
        taken += 1
    manager.kv_blocks_received += taken
    return taken
