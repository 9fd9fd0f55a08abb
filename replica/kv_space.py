"""Where one engine's KV lives and how much of it: the device blocks and the tiers below them.

The device KV is sized from `num_gpu_blocks_override`, else on CPU from the memory free on
the node (`cpu_memory.cpu_kv_cache_bytes`), else on a GPU by profiling a worst-case forward
and giving the KV what `gpu_memory_utilization` leaves. Below it, off by default, the host
tier (`kv_offloading_size`, GiB or "auto") and the disk tier (`kv_offloading_disk_path`),
whose files are found again by the layout identity of the blocks they hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.config import EngineConfig
from iterserve.replica.cpu_memory import available_memory_bytes, cpu_kv_cache_bytes
from iterserve.replica.disk_kv_tier import DiskKVTier, open_disk_tier
from iterserve.replica.host_kv_tier import HostKVTier, auto_kv_offloading_gib, host_kv_slots

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k_cache, v_cache [N, B, Hkv, D]


def kv_bytes_per_block(model_config: Any, block_size: int, dtype: torch.dtype) -> int:  # noqa: ANN401
    """K and V of every layer for one block of tokens."""
    element = torch.tensor([], dtype=dtype).element_size()
    return (2 * model_config.num_hidden_layers * block_size * model_config.num_key_value_heads
            * model_config.head_dim * element)


def decide_num_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int,
                      profile_gpu: Callable[[], int]) -> int:
    """The device KV's blocks: the override, the CPU's memory budget, or a GPU profile."""
    cache = config.cache
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type != "cuda":
        sched = config.scheduler
        budget = cpu_kv_cache_bytes(cache, bytes_per_block, sched.max_num_seqs,
                                    sched.max_model_len)
        return max(1, budget // bytes_per_block)
    return profile_gpu()


def profile_gpu_blocks(model: torch.nn.Module, model_config: Any, config: EngineConfig,  # noqa: ANN401
                       device: torch.device, dtype: torch.dtype, bytes_per_block: int) -> int:
    """Blocks that fit in gpu_memory_utilization of the GPU after a worst-case forward."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    block_size = config.cache.block_size
    num_tokens = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_model_len)
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    scratch = [(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
               for _ in range(model_config.num_hidden_layers)]
    attn = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens, is_decode_only=False,
    )
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = model(ids, torch.arange(num_tokens, device=device), scratch, attn)
        model.compute_logits(hidden[-config.scheduler.max_num_seqs:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del scratch, hidden
    _, total = torch.cuda.mem_get_info(device)
    budget = total * config.cache.gpu_memory_utilization - peak
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache: peak {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization="
            f"{config.cache.gpu_memory_utilization}; raise it or use a smaller model"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.1f GiB)", blocks, block_size,
                blocks * bytes_per_block / 2**30)
    return blocks


def kv_offloading_gib(config: EngineConfig, device: torch.device, device_kv_bytes: int) -> float:
    """The host tier's size: the setting's, or for "auto" a share of the memory free now
    (on CPU less the device KV cache, allocated but not yet touched, so not yet counted)."""
    cache = config.cache
    if cache.kv_offloading_size != "auto":
        return float(cache.kv_offloading_size)
    free = available_memory_bytes()
    if device.type == "cpu":
        free = max(0, free - device_kv_bytes)
    return auto_kv_offloading_gib(free, cache.cpu_replicas_per_node)


def open_host_tier(config: EngineConfig, device: torch.device, kv_caches: KVCaches,
                   bytes_per_block: int) -> HostKVTier | None:
    """The host KV tier below the device KV (None: off, the default): allocated, not written."""
    if config.cache.kv_offloading_size is None:
        return None
    device_kv_bytes = kv_caches[0][0].shape[0] * bytes_per_block
    slots = host_kv_slots(kv_offloading_gib(config, device, device_kv_bytes), bytes_per_block)
    tier = HostKVTier(slots, kv_caches)
    logger.info("host KV tier: %d blocks (%.2f GiB)", slots, tier.nbytes / 2**30)
    return tier


def open_disk_kv_tier(config: EngineConfig, layout_identity: str,
                      host_tier: HostKVTier | None) -> DiskKVTier | None:
    """The disk tier below the host tier (None: off, the default), its files found again
    under `layout_identity` (the runner's: model, weights, dtype, block size, K/V layout;
    host slots share the device caches' layout)."""
    cache = config.cache
    if cache.kv_offloading_disk_path is None:
        return None
    if host_tier is None:
        raise ValueError("kv_offloading_disk_path needs kv_offloading_size (the host tier)")
    tier = open_disk_tier(cache.kv_offloading_disk_path, cache.kv_offloading_disk_size,
                          layout_identity, host_tier.bytes_per_block)
    logger.info("disk KV tier: %s, %d blocks (%.2f GiB) found from earlier runs",
                tier.store.directory, len(tier), tier.used_bytes / 2**30)
    return tier
