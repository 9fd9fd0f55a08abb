"""The disk KV tier: blocks the host tier evicts, kept in files under a byte bound.

Below the host tier (replica/host_kv_tier.py): when the host tier's index evicts a block, the
runner takes its bytes out of the host slot and hands them to `write_async`; a writer thread
of this tier writes the file (replica/disk_kv_store.py), so the engine's step never waits for
the disk. A write that would push the queue past `max_pending_bytes` is dropped and counted
(the block is computed if it is wanted again): a slow disk costs hits, never step time.

A prompt whose hash chain continues here, past the device's and the host's misses, reads the
block back (`read`, on the engine's thread, during scheduling: the block then re-enters the host
tier and is copied to the device like a host hit). A file that fails its checksum is counted,
deleted and reported as a miss; a file that cannot be read, likewise. A full disk (ENOSPC) or a
block that does not fit the byte bound is counted and not written.

Which blocks are here is this object's in-memory index (stable chain hash -> file size, `
FileIndex`), filled at start from the files a previous engine on the same folder left (so a
restarted replica hits them). Eviction weighs recency and frequency as the host tier's does
(a segmented LRU): a file enters *probation*; a file read back moves to *protected* (at most
PROTECTED_FRACTION of the bytes); the writer deletes probation's least recent files first,
then protected's, until a new one fits the bound, so a stream of blocks written once and never
read cannot flush the ones that came back. The index is shared by the engine's thread and
the writer, under one lock.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path

from iterserve.replica.disk_kv_store import CorruptKVFile, DiskKVStore, kv_layout_identity

logger = logging.getLogger(__name__)

HOST_TO_DISK = "CPU_to_DISK"  # transfer_type labels, in vLLM's "<from>_to_<to>" form
DISK_TO_HOST = "DISK_to_CPU"
DISK_TRANSFER_TYPES = (HOST_TO_DISK, DISK_TO_HOST)
# Why a block was not written or not read back: each means computing it (counted).
DISK_ERRORS = ("corrupt", "read_failed", "disk_full", "write_failed", "dropped")
GIB = 2**30
MAX_PENDING_BYTES = 256 * 2**20  # queued writes, at most (more: dropped, counted)
WRITER_NICENESS = 19  # the writer thread's nice value: the engine's step comes first
PROTECTED_FRACTION = 0.8  # of the byte bound, at most, holds files read back at least once


class FileIndex:
    """The files on disk by stable hash: two segments in order of last use (least recent
    first), probation (never read back) and protected (read back at least once)."""

    def __init__(self, max_protected_bytes: int) -> None:
        self.probation: OrderedDict[int, int] = OrderedDict()  # stable hash -> bytes
        self.protected: OrderedDict[int, int] = OrderedDict()
        self.used_bytes = 0
        self._protected_bytes = 0
        self._max_protected_bytes = max_protected_bytes

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, stable_hash: int) -> bool:
        return stable_hash in self.probation or stable_hash in self.protected

    def add(self, stable_hash: int, nbytes: int) -> None:
        self.probation[stable_hash] = nbytes
        self.used_bytes += nbytes

    def touch(self, stable_hash: int) -> None:
        """Recently used again (written again): the recent end of its segment."""
        for segment in (self.probation, self.protected):
            if stable_hash in segment:
                segment.move_to_end(stable_hash)

    def hit(self, stable_hash: int) -> None:
        """Read back: protected, whose least recent overflow falls back to probation."""
        nbytes = self.probation.pop(stable_hash, None)
        if nbytes is None:
            self.protected.move_to_end(stable_hash)
            return
        self.protected[stable_hash] = nbytes
        self._protected_bytes += nbytes
        while self._protected_bytes > self._max_protected_bytes and len(self.protected) > 1:
            demoted, size = self.protected.popitem(last=False)
            self._protected_bytes -= size
            self.probation[demoted] = size

    def pop(self, stable_hash: int) -> int | None:
        """Forget the file: its size, or None if it was not here."""
        nbytes = self.probation.pop(stable_hash, None)
        if nbytes is None:
            nbytes = self.protected.pop(stable_hash, None)
            if nbytes is not None:
                self._protected_bytes -= nbytes
        if nbytes is not None:
            self.used_bytes -= nbytes
        return nbytes

    def victim(self) -> int | None:
        """The file to delete next: probation's least recent, then protected's."""
        for segment in (self.probation, self.protected):
            if segment:
                return next(iter(segment))
        return None


class DiskKVTier:
    def __init__(self, store: DiskKVStore, capacity_bytes: int, block_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        """block_bytes: one block's payload (the host tier's bytes_per_block)."""
        if store.file_bytes(block_bytes) > capacity_bytes:
            raise ValueError(f"kv_offloading_disk_size ({capacity_bytes / GIB:.6f} GiB) holds "
                             f"no KV block of this model ({block_bytes} bytes each)")
        self.store = store
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._files = FileIndex(int(capacity_bytes * PROTECTED_FRACTION))
        self._pending_bytes = 0
        self.bytes_copied = dict.fromkeys(DISK_TRANSFER_TYPES, 0)
        self.copy_seconds = dict.fromkeys(DISK_TRANSFER_TYPES, 0.0)
        self.errors = dict.fromkeys(DISK_ERRORS, 0)
        self.num_evicted = 0
        for block in store.scan():  # oldest first: the least recent end of the LRU
            self._files.add(block.stable_hash, block.nbytes)
        self._evict_to_fit(0)  # a smaller bound than last time: the oldest files go
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="disk-kv-writer",
                                        daemon=True)
        self._writer.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def __contains__(self, stable_hash: int) -> bool:
        with self._lock:
            return stable_hash in self._files

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._files.used_bytes

    def counters(self) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
        """(bytes copied, seconds, errors), copied under the lock the writer updates them in."""
        with self._lock:
            return dict(self.bytes_copied), dict(self.copy_seconds), dict(self.errors)

    def recent_hashes(self, limit: int) -> list[int]:
        """The stable hashes of at most `limit` files, the ones read back first, then the
        others, most recent first within each (what a replica reports to routers: files
        found at start-up included, written by this replica before a restart)."""
        with self._lock:
            held = itertools.chain(reversed(self._files.protected),
                                   reversed(self._files.probation))
            return list(itertools.islice(held, max(0, limit)))

    def touch(self, stable_hash: int) -> None:
        """The block is wanted again (its host copy was evicted while this one stayed)."""
        with self._lock:
            self._files.touch(stable_hash)

    # ------------------------------------------------------------------------------ writes
    def write_async(self, stable_hash: int, payload: bytes) -> None:
        """Queue the block's file; dropped (counted) when the queue holds too many bytes."""
        with self._lock:
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.errors["dropped"] += 1
                return
            self._pending_bytes += len(payload)
        self._queue.put((stable_hash, payload))

    def flush(self) -> None:
        """Wait until every queued write is done (tests, benchmarks, a clean shutdown)."""
        self._queue.join()

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the queued writes (waiting at most timeout_s) and stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout_s)

    def _write_loop(self) -> None:
        try:  # the lowest CPU priority (Linux: per thread): writes take only idle CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError) as error:
            logger.info("disk KV tier: writer priority left as it is (%s)", error)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, stable_hash: int, payload: bytes) -> None:
        try:
            self._write_file(stable_hash, payload)
        finally:  # pending: queued or being written
            with self._lock:
                self._pending_bytes -= len(payload)

    def _write_file(self, stable_hash: int, payload: bytes) -> None:
        with self._lock:
            if stable_hash in self._files:  # written meanwhile (spilled twice)
                self._files.touch(stable_hash)
                return
        nbytes = self.store.file_bytes(len(payload))
        self._evict_to_fit(nbytes)
        start = time.perf_counter()
        try:
            written = self.store.write(stable_hash, payload)
        except OSError as error:
            reason = "disk_full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "write_failed"
            with self._lock:
                self.errors[reason] += 1
            logger.warning("disk KV tier: block not written (%s): %s", reason, error)
            return
        with self._lock:
            self.bytes_copied[HOST_TO_DISK] += len(payload)
            self.copy_seconds[HOST_TO_DISK] += time.perf_counter() - start
            self._files.add(stable_hash, written)

    def _evict_to_fit(self, nbytes: int) -> None:
        """Delete the least recent files until nbytes more fit the bound."""
        while True:
            with self._lock:
                victim = self._files.victim()
                if self._files.used_bytes + nbytes <= self.capacity_bytes or victim is None:
                    return
                self._files.pop(victim)
                self.num_evicted += 1
            self.store.delete(victim)

    # ------------------------------------------------------------------------------- reads
    def read(self, stable_hash: int) -> bytes | None:
        """The block's verified payload, or None (not here, corrupt, unreadable: counted, and
        the file forgotten). On the engine's thread: a hit waits for its read."""
        with self._lock:
            if stable_hash not in self._files:
                return None
        start = time.perf_counter()
        try:
            payload = self.store.read(stable_hash, self.block_bytes)
        except CorruptKVFile as error:
            self._forget(stable_hash, "corrupt")
            logger.warning("disk KV tier: %s; deleted, the block is computed", error)
            return None
        except OSError as error:
            self._forget(stable_hash, "read_failed")
            logger.warning("disk KV tier: block %016x unreadable (%s); computed",
                           stable_hash, error)
            return None
        with self._lock:
            self.bytes_copied[DISK_TO_HOST] += len(payload)
            self.copy_seconds[DISK_TO_HOST] += time.perf_counter() - start
            if stable_hash in self._files:
                self._files.hit(stable_hash)
        return payload

    def _forget(self, stable_hash: int, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1
            self._files.pop(stable_hash)
        self.store.delete(stable_hash)


def block_layout_identity(model_config: str, weight_files: list[Path] | None, dtype: str,
                          block_size: int, layout: str) -> bytes:
    """The layout identity of an engine's KV blocks (disk_kv_store.kv_layout_identity): its
    model's config, its weight files' paths, sizes and modification times (a fine-tune of the
    same shapes has other paths; one copied over the old files, other times), or for dummy
    weights the fixed seed they are drawn from; its dtype, block size and the host tier's row
    layout. A false miss (the same weights copied anew) costs recomputing; a false hit would
    cost wrong tokens, so every doubt is a different identity."""
    if weight_files is None:
        weights = "dummy-seed-0"
    else:
        stats = [(file.resolve(), file.stat()) for file in weight_files]
        weights = ";".join(f"{path}:{stat.st_size}:{stat.st_mtime_ns}" for path, stat in stats)
    return kv_layout_identity(model_config, weights, dtype, str(block_size), layout)


def open_disk_tier(path: str | Path, size_gib: float, identity: bytes,
                   block_bytes: int) -> DiskKVTier:
    """The disk tier over `path` for blocks of this layout identity."""
    return DiskKVTier(DiskKVStore(Path(path), identity), int(size_gib * GIB), block_bytes)
