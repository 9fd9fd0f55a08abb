"""A replica's start-up, stage by stage: seconds, bytes read from storage, bytes copied.

    startup = StartupRecorder()
    with startup.stage("weights_place") as stage:
        ...; stage.copied(tensor.nbytes)
    startup.as_dict()   # {stage: {"seconds", "bytes_read", "bytes_copied"}}, in STAGES order

The stages, in the order a replica goes through them (a stage a start does not have is left
out: weights_pack on a GPU):

    imports        the engine's modules (torch, the model code) imported in the replica
    model_config   the settings resolved and the model's config read (a GGUF's header parsed)
    tokenizer      the tokenizer built from the model's files
    weights_read   the weight files read into the page cache (no copy: a populating mmap)
    weights_place  the model built and its parameters filled from the mapped files: every
                   dequantisation, dtype conversion and copy after the map, counted in bytes
    weights_pack   on CPU, every linear's weight reordered once into oneDNN's layout (a copy)
    kv_cache       the KV cache sized (profiled on a GPU) and allocated
    graphs         CUDA graphs captured for the decode batch sizes; on CPU, the compiled
                   decode attention built and warmed (replica/cpu_attention.py)
    engine_start   the rest of the engine and the replica (threads, stat logger)

`bytes_read` is what the process read from storage meanwhile (/proc/self/io read_bytes: 0 for
a file already in the page cache), `bytes_copied` what the stage's code wrote into new
memory. Two stages a replica cannot time itself are measured by whoever started it
(loadtests/studies/replica_startup): actor_start (scale decision to the replica's first
line) and first_token (replica ready to the first request's first token).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STAGES = ("actor_start", "imports", "model_config", "tokenizer", "weights_read",
          "weights_place", "weights_pack", "kv_cache", "graphs", "engine_start", "first_token")
# Linux 5.14+: fault a mapping's pages in (reading them from storage) without copying them.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def storage_read_bytes() -> int:
    """Bytes this process has read from storage so far (0 where /proc/self/io is missing)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


@dataclass
class StageRecord:
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_copied: int = 0

    def copied(self, nbytes: int) -> None:
        self.bytes_copied += int(nbytes)


class StartupRecorder:
    """Seconds and bytes per stage; a stage entered twice adds up."""

    def __init__(self) -> None:
        self.records: dict[str, StageRecord] = {}

    def record(self, name: str) -> StageRecord:
        if name not in STAGES:
            raise ValueError(f"unknown start-up stage {name!r}; stages: {', '.join(STAGES)}")
        return self.records.setdefault(name, StageRecord())

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        record = self.record(name)
        read_before = storage_read_bytes()
        started = time.perf_counter()
        try:
            yield record
        finally:
            record.seconds += time.perf_counter() - started
            record.bytes_read += storage_read_bytes() - read_before

    def merge(self, other: StartupRecorder) -> None:
        for name, theirs in other.records.items():
            mine = self.record(name)
            mine.seconds += theirs.seconds
            mine.bytes_read += theirs.bytes_read
            mine.bytes_copied += theirs.bytes_copied

    def seconds(self) -> dict[str, float]:
        return {name: self.records[name].seconds for name in STAGES if name in self.records}

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{stage: {"seconds", "bytes_read", "bytes_copied"}} in STAGES order (plain JSON)."""
        return {name: {"seconds": r.seconds, "bytes_read": float(r.bytes_read),
                       "bytes_copied": float(r.bytes_copied)}
                for name in STAGES if (r := self.records.get(name)) is not None}


def populate_page_cache(files: list[Path]) -> int:
    """Read `files` into the page cache through a mapping (MADV_POPULATE_READ: the kernel
    reads them in large sequential requests and copies nothing to this process); returns
    their total size. Where the advice is refused (an older kernel), the pages are left to
    fault in when the weights are placed."""
    total = 0
    for file in files:
        size = file.stat().st_size
        total += size
        if size == 0:
            continue
        with open(file, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
            try:
                mapped.madvise(MADV_POPULATE_READ)
            except OSError:  # EINVAL before Linux 5.14
                os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_WILLNEED)
    return total
