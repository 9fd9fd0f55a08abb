"""Neox-style (rotate-half) rotary embedding, applied in place to q and k in one launch."""

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
def _rotate_heads(
    base_ptr: tl.tensor,  # this token's row of q or k: [H, D]
    stride_h: tl.tensor,
    num_heads: tl.tensor,
    cos: tl.tensor,  # [1, BLOCK_HALF] fp32
    sin: tl.tensor,  # [1, BLOCK_HALF] fp32
    half: tl.tensor,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    # Loop over head tiles so registers stay bounded for models with many heads.
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
        ptr1 = base_ptr + heads[:, None] * stride_h + cols[None, :]
        ptr2 = ptr1 + half
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr1, x1 * cos - x2 * sin, mask=mask)
        tl.store(ptr2, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def rotary_embedding_kernel(
    positions_ptr: tl.tensor,  # [T]
    query_ptr: tl.tensor,  # [T, Hq, D], rotated in place
    key_ptr: tl.tensor,  # [T, Hkv, D], rotated in place
    cos_sin_ptr: tl.tensor,  # [max_position, D]: cos in [:, :D/2], sin in [:, D/2:]
    stride_query_t: tl.tensor,
    stride_query_h: tl.tensor,
    stride_key_t: tl.tensor,
    stride_key_h: tl.tensor,
    stride_cos_sin: tl.tensor,
    num_heads: tl.tensor,
    num_kv_heads: tl.tensor,
    half: tl.tensor,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    q_row = query_ptr + token * stride_query_t
    k_row = key_ptr + token * stride_key_t
    _rotate_heads(q_row, stride_query_h, num_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_row, stride_key_h, num_kv_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, D]: cos in [:, :D/2], sin in [:, D/2:]
) -> None:
    """Rotate q and k in place (HF Llama / Qwen2 / Mistral layout).

    query and key may be strided views of a fused qkv projection; only their last dim must be
    contiguous. Positions are not range-checked against max_position (no device sync).
    """
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    check_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    check_shape("positions", positions, (num_tokens,))
    check_shape("key", key, (num_tokens, key.shape[1], head_dim))
    check_shape("cos_sin_cache", cos_sin_cache, (cos_sin_cache.shape[0], head_dim))
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(max(num_heads, key.shape[1])), max(1, 2048 // block_half))
    rotary_embedding_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
