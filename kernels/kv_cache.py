"""Write this step's keys and values into the paged KV cache, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def write_kv_cache_kernel(
    key_ptr: tl.tensor,  # [T, Hkv, D]
    value_ptr: tl.tensor,  # [T, Hkv, D]
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    slot_mapping_ptr: tl.tensor,  # [T]
    stride_key_t: tl.tensor,
    stride_key_h: tl.tensor,
    stride_value_t: tl.tensor,
    stride_value_h: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    num_kv_heads: tl.tensor,
    head_dim: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: the scheduler gave it no slot
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    src_k = key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :]
    src_v = value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
    # The cache strides are the same for K and V (checked by the launcher).
    dst = block * stride_cache_n + offset * stride_cache_b + heads[:, None] * stride_cache_h
    dst = dst + dims[None, :]
    # Upcasting to fp32 is exact for every cache dtype; the store rounds once, like the reference.
    k = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(src_v, mask=mask, other=0.0).to(tl.float32)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * B + offset; -1 is padding
) -> None:
    """Store each token's key and value at its slot; slots of -1 are skipped.

    Slot values are not range-checked (that would need a device sync): a slot past the cache
    is out-of-bounds memory, exactly as in vLLM's reshape_and_cache.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    check_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, tuple(key.shape))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    check_shape("k_cache", k_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must share dtype and strides, got "
            f"{k_cache.dtype}/{v_cache.dtype} and {k_cache.stride()}/{v_cache.stride()}"
        )
    if num_tokens == 0:
        return

    block_d = next_power_of_2(head_dim)
    # Up to ~4K elements per program: all KV heads of a token for typical models (8 x 128).
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
