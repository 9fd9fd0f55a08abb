"""The KV loop every attention kernel shares, and the checks every attention launcher runs.

`attend_tiles` walks cache positions [kv_start, kv_end) in TILE_N-token tiles, looking each
token's physical block up in the block table, and folds them into an online softmax. Kernels
call it twice: once with MASKED=False over the tiles every row sees whole (no causal mask, no
bounds mask: off-diagonal prefill tiles, all but the last decode tile) and once with
MASKED=True over the rest. Both loops are software-pipelined by the kernel's num_stages: the
block ids of tile i+2 and the K/V of tile i+1 load (cp.async) while tile i computes.

head_dim is a constexpr: HEAD_DIM lanes of a BLOCK_D = next_power_of_2(HEAD_DIM) range are
live, so 80/96/112 run on a masked 128-wide tile and powers of two need no mask at all.
"""

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
)

LOG2E = 1.4426950408889634
# Head dims the Triton attention kernels compile for: powers of two, and the padded ones
# real models use. Anything else is refused at engine start (check_head_dim).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 112, 128, 256)


def check_head_dim(head_dim: int) -> None:
    """ValueError unless the Triton attention kernels support this head_dim."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton attention backend (supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}); use attention_backend='torch'"
        )


@triton.jit
def attend_tiles(
    q: tl.tensor,  # [BLOCK_M, BLOCK_D] in DOT_DTYPE
    query_pos: tl.tensor,  # [BLOCK_M] absolute position of each row's query token
    m_i: tl.tensor,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i: tl.tensor,  # [BLOCK_M] fp32 running sum of exp2
    acc: tl.tensor,  # [BLOCK_M, BLOCK_D] fp32 running output
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    block_table_row: tl.tensor,  # pointer to this sequence's [M] block ids
    kv_head: tl.tensor,
    kv_start: tl.tensor,
    kv_end: tl.tensor,
    scale_log2: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    MASKED: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Online softmax over [kv_start, kv_end); MASKED adds the causal and end-of-range masks.

    With MASKED=False the caller guarantees kv_end - kv_start is a multiple of TILE_N and
    that every row sees every position in the range.
    """
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    for tile in range(kv_start, kv_end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        if MASKED:
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE)
        # int64 before multiplying by strides: block * stride overflows int32 on large caches.
        offset = (
            block.to(tl.int64) * stride_cache_n
            + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_b
            + kv_head * stride_cache_h
        )
        k_ptrs = k_cache_ptr + offset[None, :] + dims[:, None]  # K^T tile: [BLOCK_D, TILE_N]
        v_ptrs = v_cache_ptr + offset[:, None] + dims[None, :]  # [TILE_N, BLOCK_D]
        # Masks only where a lane can be dead: the bounds-free loads of whole tiles vectorise.
        if MASKED:
            k = tl.load(k_ptrs, mask=dim_mask[:, None] & pos_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=pos_valid[:, None] & dim_mask[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=dim_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        # "ieee" keeps fp32 operands (test caches) exact instead of tf32; 16-bit operands run
        # on tensor cores either way.
        scores = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee") * scale_log2  # [BLOCK_M, TILE_N]
        if MASKED:
            visible = (pos[None, :] <= query_pos[:, None]) & pos_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        # Callers order the ranges so every row has seen a position before any tile that
        # hides all of it, so m_new is finite and alpha never computes -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attend_range(
    q: tl.tensor,  # [BLOCK_M, BLOCK_D] in DOT_DTYPE
    query_pos: tl.tensor,  # [BLOCK_M]
    first_query_pos: tl.tensor,  # the smallest query_pos of any live row
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_table_row: tl.tensor,
    kv_head: tl.tensor,
    kv_start: tl.tensor,
    kv_end: tl.tensor,
    scale_log2: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Attention of q over [kv_start, kv_end): whole tiles unmasked first, then the rest masked.

    Whole tiles are those ending at or before first_query_pos + 1 and kv_end: every row sees
    them entirely. Returns (m_i, l_i, acc) in the log2 domain, acc not yet divided by l_i.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seen_by_all = tl.minimum(first_query_pos + 1, kv_end)
    unmasked_end = kv_start + tl.maximum(seen_by_all - kv_start, 0) // TILE_N * TILE_N
    m_i, l_i, acc = attend_tiles(
        q, query_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
        kv_start, unmasked_end, scale_log2, stride_cache_n, stride_cache_b, stride_cache_h,
        HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, DOT_DTYPE, False,
    )  # fmt: skip
    m_i, l_i, acc = attend_tiles(
        q, query_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
        unmasked_end, kv_end, scale_log2, stride_cache_n, stride_cache_b, stride_cache_h,
        HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, DOT_DTYPE, True,
    )  # fmt: skip
    return m_i, l_i, acc


def check_paged_args(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, M]
    scale: float,
) -> torch.device:
    """Validation shared by the varlen and split-KV launchers."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    check_shape("k_cache", k_cache, (*k_cache.shape[:3], head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must share dtype and strides, got "
            f"{k_cache.dtype}/{v_cache.dtype} and {k_cache.stride()}/{v_cache.stride()}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_head_dim(head_dim)
    check_shape("block_tables", block_tables, (seq_lens.shape[0], block_tables.shape[1]))
    if not scale > 0.0:
        raise ValueError(f"scale must be positive, got {scale}")
    return check_device(
        query=query, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables
    )
