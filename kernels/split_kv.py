"""Split-KV (flash-decoding) paged attention for small decode batches, plus its reduce kernel.

A decode batch of S sequences gives the varlen kernel only about S * Hkv programs; with few
sequences that leaves most SMs idle while one program walks a long context. Here stage 1
splits each sequence's context into NUM_SPLITS ranges (grid S x Hkv x NUM_SPLITS), each
writing a normalised partial output and its log-sum-exp to fp32 scratch; stage 2 merges the
partials with the LSE rule. The split length depends on each sequence's own length, so the
grid is fixed per launch (CUDA-graph friendly) and short sequences simply leave trailing
splits empty: stage 1 returns early for them and stage 2 never reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    cdiv,
    check_out,
    check_shape,
    dot_dtype,
    next_power_of_2,
    num_sms,
)
from iterserve.kernels.paged_attention import LOG2E, attend_tiles, check_paged_args

MAX_SPLITS = 32
# Below this many tokens per split, the merge costs more than the extra parallelism buys.
MIN_TOKENS_PER_SPLIT = 256
DECODE_TILE_N = 64


@triton.jit
def split_range(
    seq_len: tl.tensor, split: tl.tensor, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Token range [start, end) of one split; both kernels must agree on it."""
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    per_split = tl.maximum(per_split, TILE_N)  # never 0, even for an empty sequence
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    return start, end, per_split


@triton.jit
def split_kv_decode_kernel(
    partial_out_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS, D] fp32
    partial_lse_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS] fp32, log2 domain
    query_ptr: tl.tensor,  # [S, Hq, D]
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    seq_lens_ptr: tl.tensor,  # [S]
    block_tables_ptr: tl.tensor,  # [S, M]
    scale_log2: tl.tensor,
    head_dim: tl.tensor,
    stride_q_s: tl.tensor,
    stride_q_h: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    stride_bt_s: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end, per_split = split_range(seq_len, split, NUM_SPLITS, TILE_N)
    if start >= end:
        return  # empty split: the reduce kernel skips it

    # Rows are the GROUP query heads of this KV head (padded to BLOCK_M for tl.dot).
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(
        query_ptr + seq * stride_q_s + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    # A decode query is the last token: it sees every cached position.
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q.to(DOT_DTYPE),
        query_pos,
        m_i,
        l_i,
        acc,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt_s,
        kv_head,
        start,
        end,
        scale_log2,
        head_dim,
        stride_cache_n,
        stride_cache_b,
        stride_cache_h,
        BLOCK_D,
        TILE_N,
        BLOCK_SIZE,
        DOT_DTYPE,
    )
    num_heads = tl.num_programs(1) * GROUP
    row = (seq * num_heads + head.to(tl.int64)) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(
        partial_out_ptr + row[:, None] * BLOCK_D + dims[None, :],
        acc / l_i[:, None],
        mask=row_valid[:, None] & dim_mask[None, :],
    )
    tl.store(partial_lse_ptr + row, m_i + tl.log2(l_i), mask=row_valid)


@triton.jit
def split_kv_reduce_kernel(
    out_ptr: tl.tensor,  # [S, Hq, D]
    partial_out_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS, D] fp32
    partial_lse_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS] fp32
    seq_lens_ptr: tl.tensor,  # [S]
    head_dim: tl.tensor,
    stride_o_s: tl.tensor,
    stride_o_h: tl.tensor,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, _, per_split = split_range(seq_len, 0, NUM_SPLITS, TILE_N)
    splits = tl.arange(0, SPLITS_PAD)
    # Exactly the splits stage 1 wrote: start = split * per_split < seq_len.
    active = (splits < NUM_SPLITS) & (splits * per_split < seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + row, mask=active, other=float("-inf")).to(tl.float32)
    partial = tl.load(
        partial_out_ptr + row[:, None] * BLOCK_D + dims[None, :],
        mask=active[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    # Inactive splits are never loaded, so their weight is exactly 0; an empty sequence (an
    # invalid input) leaves max_lse = -inf, hence the guards: it yields zeros, not NaN.
    max_lse = tl.max(lse, axis=0)
    max_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    weight = tl.exp2(lse - max_lse)  # [SPLITS_PAD]
    total = tl.sum(weight, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    merged = tl.sum(partial * weight[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + dims, merged, mask=dim_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many KV splits fill the GPU for a decode batch; 1 means don't split.

    Aims at about two programs per SM, but never splits below MIN_TOKENS_PER_SPLIT tokens and
    never past MAX_SPLITS (the reduce kernel loads all splits of a head at once).
    """
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    wanted = cdiv(2 * num_sms, programs)
    by_length = cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def use_split_kv(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    max_query_len: int,
    num_sms: int = 132,
) -> bool:
    """Whether the engine should run a batch through paged_decode_attention_split_kv.

    Only pure-decode batches (every sequence has one query token) qualify, and only when the
    varlen kernel's grid would leave SMs idle on long contexts.
    """
    if max_query_len != 1:
        return False
    return choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) > 1


def alloc_scratch(
    num_seqs: int, num_heads: int, num_splits: int, block_d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # partial out [S, Hq, splits, BLOCK_D], lse [S, Hq, splits]
    # torch.empty: the caching allocator makes this free, and stage 2 only reads what
    # stage 1 wrote (tests poison these buffers to prove it).
    partial_out = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=device)
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


def paged_decode_attention_split_kv(
    query: torch.Tensor,  # [S, Hq, D], one decode token per sequence
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    seq_lens: torch.Tensor,  # [S] int, context length including this step's token
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,  # [S, Hq, D], optional preallocated output
) -> torch.Tensor:  # [S, Hq, D]
    """Decode attention with the context split across programs (flash-decoding).

    Same result as paged_attention with query_start_loc = arange(S + 1). With num_splits=None
    the split count comes from choose_num_splits, bounding the context length by the block
    table's capacity (M * B) since the true maximum would need a device sync.
    """
    device = check_paged_args(query, k_cache, v_cache, seq_lens, block_tables, scale)
    num_seqs, num_heads, head_dim = query.shape
    check_shape("query", query, (seq_lens.shape[0], num_heads, head_dim))
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, num_sms(device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    out = check_out(out, tuple(query.shape), query.dtype, device)
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    partial_out, partial_lse = alloc_scratch(num_seqs, num_heads, num_splits, block_d, device)
    split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out,
        partial_lse,
        query,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        float(scale) * LOG2E,
        head_dim,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_M=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        TILE_N=DECODE_TILE_N,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype(k_cache.dtype),
        num_warps=4,
        num_stages=3,
    )
    split_kv_reduce_kernel[(num_seqs, num_heads)](
        out,
        partial_out,
        partial_lse,
        seq_lens,
        head_dim,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
        BLOCK_D=block_d,
        TILE_N=DECODE_TILE_N,
        num_warps=4,
    )
    return out
