"""The CPU KV cache's size when the user gives none: from the node's free memory.

vLLM's CPU backend sizes its KV space from the node's memory (`gpu_memory_utilization` of it,
less what the process already holds) instead of a fixed amount. Here the budget is
`gpu_memory_utilization` of the memory free when the engine starts (after its weights are
loaded, so they are not counted twice), divided among the engines that share the node
(`cpu_replicas_per_node`, which the Serve app sets), and capped at what `max_num_seqs`
requests of `max_model_len` tokens can use: more blocks than that are never touched, and a
small test model must not get millions of blocks.

A fixed 512 MiB held ~11.6k tokens of SmolLM2 in fp32, fewer than 64 concurrent chats need:
they preempted each other, and continuous batching measured only 1.27x static over HTTP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from iterserve.replica.config import CacheConfig

logger = logging.getLogger(__name__)


def available_memory_bytes() -> int:
    """Memory the kernel can hand out now without swapping (MemAvailable on Linux; elsewhere
    the free pages, a lower estimate)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_cache_bytes(cache: CacheConfig, bytes_per_block: int, max_num_seqs: int,
                       max_model_len: int) -> int:
    """The CPU KV budget in bytes: the user's, else this engine's share of the free memory,
    at most what max_num_seqs full-length requests can occupy."""
    if cache.cpu_kv_cache_bytes is not None:
        return cache.cpu_kv_cache_bytes
    free = available_memory_bytes()
    share = int(free * cache.gpu_memory_utilization / cache.cpu_replicas_per_node)
    blocks_per_request = -(-max_model_len // cache.block_size)
    useful = max_num_seqs * blocks_per_request * bytes_per_block
    budget = min(share, useful)
    logger.info("CPU KV cache: %.2f GiB (%.2f GiB free x %.2f / %d engine(s) on this node, at "
                "most %.2f GiB for %d requests of %d tokens)", budget / 2**30, free / 2**30,
                cache.gpu_memory_utilization, cache.cpu_replicas_per_node, useful / 2**30,
                max_num_seqs, max_model_len)
    return budget
