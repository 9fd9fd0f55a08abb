"""The host KV tier's memory: full KV blocks kept in host RAM below the device KV cache.

A bounded pool of block slots, preallocated per layer (K and V, [num_slots, B, Hkv, D] each,
laid out with the device cache's strides so that a block copies as the same bytes), that the
runner copies blocks into (`store`: device -> host, when the device prefix cache evicts them)
and back (`load`: host -> device, when a prompt's hash chain continues in the tier).
Which block sits in which slot, and which slot is the next victim, is replica/host_kv_index.py's
business: this file only moves bytes and counts them, under vLLM's transfer_type names
(`GPU_to_CPU`, `CPU_to_GPU`; on a CPU engine the "device" is host memory too).

On CPU a copy is a row gather and a row scatter per layer and tensor, over the block-major
contiguous view both sides share (the block-transposed K cache is a permuted view of one: a
block is one run of bytes, so no copy transposes). On CUDA the slots are pinned and
the copies run on a side stream of their own, one cudaMemcpyAsync per block and layer: the side
stream waits for the compute stream's work queued so far (the blocks being stored are final),
and the compute stream waits for the copies before the step's forward (it reads the loaded
blocks and overwrites the stored ones). Copy seconds on CUDA come from events, read once they
have completed. The CUDA path is written but, on this project's CPU-only machines, exercised by
no test: only the CPU path runs here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [N, B, Hkv, D] each
DEVICE_TO_HOST = "GPU_to_CPU"  # vLLM's kv_offload transfer_type labels
HOST_TO_DEVICE = "CPU_to_GPU"
TRANSFER_TYPES = (DEVICE_TO_HOST, HOST_TO_DEVICE)
# One block's bytes in read_slot's order: bytes from disk, or a row of a peer's payload
# (a read-only view of Ray's object store: copied once, by write_slots).
BlockBytes = bytes | np.ndarray
GIB = 2**30
AUTO_FRACTION = 0.5  # of a replica's share of the free memory: the rest is the page cache's
AUTO_CAP_GIB = 64.0  # more is rarely hit again before it is evicted; ask for it explicitly


def host_kv_slots(size_gib: float, bytes_per_block: int) -> int:
    """How many KV blocks `size_gib` of host memory holds; ValueError when not even one."""
    slots = int(size_gib * GIB // bytes_per_block)
    if slots < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV block of this model "
                         f"({bytes_per_block} bytes each); give at least "
                         f"{bytes_per_block / GIB:.6f} GiB")
    return slots


def auto_kv_offloading_gib(free_host_bytes: int, replicas_per_node: int) -> float:
    """kv_offloading_size 'auto': AUTO_FRACTION of the node's free memory, shared among the
    replicas on the node, at most AUTO_CAP_GIB each."""
    return min(AUTO_CAP_GIB, free_host_bytes * AUTO_FRACTION / replicas_per_node / GIB)


def block_major(cache: torch.Tensor) -> torch.Tensor:
    """The cache's dimensions permuted into memory order, blocks first: a contiguous view
    ([N, Hkv, D, B] for the block-transposed K cache, itself for a contiguous one)."""
    order = sorted(range(cache.dim()), key=lambda d: -cache.stride(d))
    rows = cache.permute(order)
    if order[0] != 0 or not rows.is_contiguous():
        raise ValueError(f"the KV cache (strides {cache.stride()}) is not block-major")
    return rows


def kv_layout_signature(keys: torch.Tensor, values: torch.Tensor) -> str:
    """How a block's bytes are laid out in one layer's K and V tensors (shape past the block
    dimension, strides, dtype): the same for the device caches and the host slots made like
    them, so an engine without a host tier names the layout its blocks travel in too."""
    return ";".join(f"{tuple(t.shape[1:])}/{t.stride()}/{t.dtype}" for t in (keys, values))


class HostKVTier:
    def __init__(self, num_slots: int, like: Sequence[KVCache]) -> None:
        """num_slots blocks per layer, shaped and strided like the device caches `like`."""
        k_cache = like[0][0]
        self.num_slots = num_slots
        self.device = k_cache.device
        self._on_cuda = self.device.type == "cuda"
        self.keys = [self._slots_like(k, num_slots) for k, _ in like]  # [num_slots, B, Hkv, D]
        self.values = [self._slots_like(v, num_slots) for _, v in like]
        self.bytes_per_block = sum(k[0].nbytes + v[0].nbytes
                                   for k, v in zip(self.keys, self.values, strict=True))
        self.bytes_copied = dict.fromkeys(TRANSFER_TYPES, 0)
        # On CUDA the copies not yet completed are not in it (their events are read later).
        self.copy_seconds = dict.fromkeys(TRANSFER_TYPES, 0.0)
        self._stream = torch.cuda.Stream(self.device) if self._on_cuda else None
        # CUDA: (transfer type, start event, end event) of copies not yet known to be done.
        self._unsettled: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def _slots_like(self, cache: torch.Tensor, num_slots: int) -> torch.Tensor:
        """[num_slots, B, Hkv, D] on the host with the cache's strides (block-major in both
        layouts the engine uses: the block-transposed CPU K cache and the contiguous one)."""
        if cache.stride(0) != max(cache.stride()):
            raise ValueError(f"the KV cache's blocks are not its outermost dimension "
                             f"(strides {cache.stride()}); the host tier copies whole blocks")
        return torch.empty_strided((num_slots, *cache.shape[1:]), cache.stride(),
                                   dtype=cache.dtype, pin_memory=self._on_cuda)

    # ------------------------------------------------------------------------------ copies
    def store(self, kv_caches: Sequence[KVCache], copies: Sequence[tuple[int, int]]) -> None:
        """Device blocks into host slots: (block id, slot) pairs in plan order; a slot named
        twice keeps the later block (the earlier one was evicted from the tier meanwhile)."""
        if not copies:
            return
        latest = {slot: block for block, slot in copies}
        self._copy(DEVICE_TO_HOST, kv_caches, list(latest.values()), list(latest))

    def load(self, kv_caches: Sequence[KVCache], copies: Sequence[tuple[int, int]]) -> None:
        """Host slots into device blocks: (slot, block id) pairs, each block named once."""
        if not copies:
            return
        self._copy(HOST_TO_DEVICE, kv_caches, [block for _, block in copies],
                   [slot for slot, _ in copies])

    # ------------------------------------------------------------------ slot bytes (disk)
    def _rows(self, slot: int) -> list[torch.Tensor]:
        """The slot's block in every layer, K then V, as contiguous rows of bytes."""
        rows = []
        for host_k, host_v in zip(self.keys, self.values, strict=True):
            rows += [block_major(host_k)[slot], block_major(host_v)[slot]]
        return [row.reshape(-1).view(torch.uint8) for row in rows]

    def wait_for_copies(self) -> None:
        """On CUDA, until the side stream's copies have landed (slots read directly)."""
        if self._stream is not None:
            self._stream.synchronize()

    def read_slot(self, slot: int) -> bytes:
        """The slot's bytes (every layer's K and V block, in order), for the disk tier. On
        CUDA the side stream's copies are waited for first: a store may still be landing."""
        if self._stream is not None:
            self._stream.synchronize()
        return torch.cat(self._rows(slot)).numpy().tobytes()

    @staticmethod
    def read_device_block(kv_caches: Sequence[KVCache], block: int) -> bytes:
        """A device block's bytes in read_slot's order (the slots share the caches' layout)."""
        rows = []
        for k_cache, v_cache in kv_caches:
            rows += [block_major(k_cache)[block], block_major(v_cache)[block]]
        return torch.cat([row.reshape(-1).view(torch.uint8) for row in rows]).cpu().numpy().tobytes()

    def write_slots(self, writes: Sequence[tuple[int, BlockBytes]]) -> None:
        """Fill slots with blocks' bytes as read_slot makes them (read back from disk, or a
        peer's KVBlockPayload rows): (slot, bytes) pairs, each slot named once. The blocks are
        stacked once, then each layer's K and V written with one indexed copy for all of
        them (a pull's 31 blocks, 22.9 MB, on one core of this project's CPU: 6-13 ms, against
        22-44 ms block by block, 60 row copies a block, side by side at load 8)."""
        if not writes:
            return
        rows = []
        for _, payload in writes:
            row = np.frombuffer(payload, dtype=np.uint8)
            if row.size != self.bytes_per_block:
                raise ValueError(f"a block payload of {row.size} bytes, expected "
                                 f"{self.bytes_per_block}")
            rows.append(row)
        if self._stream is not None:
            self._stream.synchronize()
        source = torch.from_numpy(np.stack(rows))  # [n, bytes_per_block] uint8, writable
        slots = torch.tensor([slot for slot, _ in writes], dtype=torch.long)
        offset = 0
        for host_k, host_v in zip(self.keys, self.values, strict=True):
            for host in (host_k, host_v):
                slot_rows = block_major(host)  # [num_slots, ...] contiguous
                width = slot_rows[0].nbytes
                # Each block's part for this tensor, in the tensor's own dtype: an indexed
                # copy of uint8 rows ran 3.5x slower than of the same bytes as fp32.
                part = source[:, offset : offset + width].view(slot_rows.dtype)
                slot_rows.index_copy_(0, slots, part.view(len(writes), *slot_rows.shape[1:]))
                offset += width

    def _copy(self, direction: str, kv_caches: Sequence[KVCache], blocks: list[int],
              slots: list[int]) -> None:
        self.bytes_copied[direction] += len(blocks) * self.bytes_per_block
        if self._stream is not None:
            self._copy_on_side_stream(direction, kv_caches, blocks, slots)
            return
        start = time.perf_counter()
        block_index = torch.tensor(blocks, dtype=torch.long)  # [n]
        slot_index = torch.tensor(slots, dtype=torch.long)  # [n]
        pairs = zip(kv_caches, self.keys, self.values, strict=True)
        for (k_cache, v_cache), host_k, host_v in pairs:
            for cache, host in ((k_cache, host_k), (v_cache, host_v)):
                cache_rows, host_rows = block_major(cache), block_major(host)  # [N, ...] each
                if direction == DEVICE_TO_HOST:
                    host_rows.index_copy_(0, slot_index, cache_rows.index_select(0, block_index))
                else:
                    cache_rows.index_copy_(0, block_index, host_rows.index_select(0, slot_index))
        self.copy_seconds[direction] += time.perf_counter() - start

    def _copy_on_side_stream(self, direction: str, kv_caches: Sequence[KVCache],
                             blocks: list[int], slots: list[int]) -> None:
        """CUDA: block by block on the side stream, ordered after the compute stream's queued
        work and before its next work (not run on this project's CPU machines)."""
        compute = torch.cuda.current_stream(self.device)
        stream = self._stream
        stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            pairs = zip(kv_caches, self.keys, self.values, strict=True)
            for (k_cache, v_cache), host_k, host_v in pairs:
                for block, slot in zip(blocks, slots, strict=True):
                    if direction == DEVICE_TO_HOST:  # pinned destination: truly asynchronous
                        host_k[slot].copy_(k_cache[block], non_blocking=True)
                        host_v[slot].copy_(v_cache[block], non_blocking=True)
                    else:
                        k_cache[block].copy_(host_k[slot], non_blocking=True)
                        v_cache[block].copy_(host_v[slot], non_blocking=True)
            end.record(stream)
        compute.wait_stream(stream)
        self._unsettled.append((direction, start, end))
        self._settle_copy_times()

    def _settle_copy_times(self) -> None:
        """Add the completed CUDA copies' event times to copy_seconds."""
        waiting = []
        for direction, start, end in self._unsettled:
            if end.query():
                self.copy_seconds[direction] += start.elapsed_time(end) / 1000.0
            else:
                waiting.append((direction, start, end))
        self._unsettled = waiting
