"""The disk KV tier's files and policy, without a model: real files in a temporary folder."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from iterserve.replica.config import CacheConfig
from iterserve.replica.disk_kv_store import (
    HEADER_BYTES,
    CorruptKVFile,
    DiskKVStore,
    kv_layout_identity,
)
from iterserve.replica.disk_kv_tier import (
    DISK_TO_HOST,
    HOST_TO_DISK,
    DiskKVTier,
    block_layout_identity,
)

BLOCK_BYTES = 256
IDENTITY = kv_layout_identity("tiny-llama", "float32", "16", "rows")


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 256 for i in range(BLOCK_BYTES))


def tier_at(root: Path, num_files: int = 100, identity: bytes = IDENTITY,
            **kwargs: int) -> DiskKVTier:
    capacity = num_files * (HEADER_BYTES + BLOCK_BYTES)
    return DiskKVTier(DiskKVStore(root, identity), capacity, BLOCK_BYTES, **kwargs)


def test_a_block_written_asynchronously_reads_back_the_same_bytes(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    tier.write_async(11, payload(1))
    tier.flush()
    assert 11 in tier and tier.read(11) == payload(1)
    assert tier.read(12) is None  # never written: a miss, not an error
    copied, seconds, errors = tier.counters()
    assert copied == {HOST_TO_DISK: BLOCK_BYTES, DISK_TO_HOST: BLOCK_BYTES}
    assert seconds[HOST_TO_DISK] > 0 and seconds[DISK_TO_HOST] > 0
    assert set(errors.values()) == {0}
    assert [p.name for p in tier.store.directory.iterdir()] == [f"{11:016x}.kv"]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_file_is_counted_deleted_and_missed(tmp_path: Path, damage: str) -> None:
    tier = tier_at(tmp_path)
    tier.write_async(5, payload(5))
    tier.flush()
    path = tier.store.path_of(5)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 17] ^= 0x40  # one bit of the payload
    else:
        data = data[: len(data) // 2]  # a torn write
    path.write_bytes(bytes(data))
    assert tier.read(5) is None
    assert tier.counters()[2]["corrupt"] == 1
    assert 5 not in tier and not path.exists() and tier.used_bytes == 0


def test_a_file_of_another_layout_is_never_read(tmp_path: Path) -> None:
    """Another model, dtype, block size or layout has another identity: another folder, and
    a file moved into this one by hand fails its header check."""
    tier = tier_at(tmp_path)
    tier.write_async(9, payload(9))
    tier.flush()
    other_identity = kv_layout_identity("tiny-llama", "float16", "16", "rows")
    assert other_identity != IDENTITY
    other = tier_at(tmp_path, identity=other_identity)
    assert len(other) == 0 and 9 not in other and other.read(9) is None
    moved = other.store.path_of(9)
    moved.write_bytes(tier.store.path_of(9).read_bytes())
    with pytest.raises(CorruptKVFile, match="header"):
        other.store.read(9, BLOCK_BYTES)


def test_a_restart_on_the_same_folder_finds_the_blocks_and_drops_half_written_ones(
        tmp_path: Path) -> None:
    first = tier_at(tmp_path)
    for key in (1, 2, 3):
        first.write_async(key, payload(key))
    first.close()
    half_written = first.store.path_of(4).with_name(f"{4:016x}.kv.tmp.999")
    half_written.write_bytes(b"ISKV partial")
    second = tier_at(tmp_path)
    assert len(second) == 3 and second.read(2) == payload(2)
    assert not half_written.exists()
    assert second.used_bytes == 3 * (HEADER_BYTES + BLOCK_BYTES)


def test_the_byte_bound_evicts_the_least_recently_used_files(tmp_path: Path) -> None:
    tier = tier_at(tmp_path, num_files=3)
    for key in (1, 2, 3):
        tier.write_async(key, payload(key))
    tier.flush()
    assert tier.read(1) == payload(1)  # 1 is now the most recent
    tier.write_async(4, payload(4))
    tier.write_async(5, payload(5))
    tier.flush()
    assert [key for key in (1, 2, 3, 4, 5) if key in tier] == [1, 4, 5]
    assert sorted(p.name for p in tier.store.directory.iterdir()) == [
        f"{key:016x}.kv" for key in (1, 4, 5)]
    assert tier.num_evicted == 2 and tier.used_bytes <= tier.capacity_bytes
    smaller = tier_at(tmp_path, num_files=1)  # restarted with a smaller bound: oldest go
    assert len(smaller) == 1


def test_blocks_read_back_outlive_a_stream_of_blocks_never_read(tmp_path: Path) -> None:
    """The segmented LRU: files written once and never read (a no-reuse stream) are deleted
    before files that came back, however recent the stream."""
    tier = tier_at(tmp_path, num_files=4)
    for key in (1, 2):
        tier.write_async(key, payload(key))
    tier.flush()
    assert tier.read(1) == payload(1) and tier.read(2) == payload(2)  # both protected
    for key in range(10, 20):  # a stream of ten, never read
        tier.write_async(key, payload(key))
    tier.flush()
    assert 1 in tier and 2 in tier and len(tier) == 4
    assert [key for key in range(10, 20) if key in tier] == [18, 19]


def test_a_full_disk_is_counted_and_nothing_is_announced(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC cannot be produced on this machine's shared disk without filling it: the
    store's write raises it, as the kernel would, after its temporary file was opened."""
    tier = tier_at(tmp_path)

    def no_space(stable_hash: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier.store, "write", no_space)
    tier.write_async(3, payload(3))
    tier.flush()
    assert tier.counters()[2]["disk_full"] == 1
    assert 3 not in tier and tier.read(3) is None


def test_writes_beyond_the_pending_bound_are_dropped_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tier_at(tmp_path, max_pending_bytes=2 * BLOCK_BYTES)
    release = threading.Event()
    real_write = tier.store.write

    def slow_write(stable_hash: int, data: bytes) -> int:
        release.wait(timeout=10)
        return real_write(stable_hash, data)

    monkeypatch.setattr(tier.store, "write", slow_write)
    for key in range(1, 6):  # the writer holds at most 2 blocks' bytes queued or in flight
        tier.write_async(key, payload(key))
    release.set()
    tier.flush()
    assert tier.counters()[2]["dropped"] == 3 and len(tier) == 2


def test_the_disk_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        CacheConfig(kv_offloading_disk_path="/tmp/kv")
    with pytest.raises(ValueError, match="kv_offloading_disk_size must be > 0"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/kv",
                    kv_offloading_disk_size=0)
    assert CacheConfig().kv_offloading_disk_path is None  # off by default


def test_the_identity_changes_with_the_weights_dtype_block_size_and_layout(
        tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 64)
    base = ("LlamaConfig(...)", [weights], "torch.float32", 16, "rows")
    identity = block_layout_identity(*base)
    assert identity == block_layout_identity(*base)  # stable: a restart finds its folder
    other_path = tmp_path / "finetune.safetensors"  # the same shapes, another checkpoint
    other_path.write_bytes(b"y" * 64)
    variants = [("LlamaConfig(other)", [weights], "torch.float32", 16, "rows"),
                ("LlamaConfig(...)", [other_path], "torch.float32", 16, "rows"),
                ("LlamaConfig(...)", None, "torch.float32", 16, "rows"),
                ("LlamaConfig(...)", [weights], "torch.bfloat16", 16, "rows"),
                ("LlamaConfig(...)", [weights], "torch.float32", 32, "rows"),
                ("LlamaConfig(...)", [weights], "torch.float32", 16, "transposed rows")]
    assert len({identity, *(block_layout_identity(*v) for v in variants)}) == 1 + len(variants)
    weights.write_bytes(b"z" * 64)  # new weights copied over the old file: a new mtime
    os.utime(weights, ns=(1, 1))
    assert block_layout_identity(*base) != identity
