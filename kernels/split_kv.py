"""Split-KV (flash-decoding) paged attention for small decode batches, plus its reduce kernel.

A decode batch of S sequences gives the decode kernel only S * Hkv programs; with few
sequences that leaves SMs idle while one program walks a long context. Here stage 1 splits
each sequence's context into up to NUM_SPLITS ranges, each program writing a normalised
partial output and its log-sum-exp to fp32 scratch; stage 2 merges the partials with the
LSE rule. The split length is each sequence's own cdiv(seq_len, NUM_SPLITS) rounded up to
whole tiles, so a short sequence fills only its first few splits (work_lists.active_splits).

Two grids for stage 1, one compiled variant each (HAS_WORK_LIST):
- eager steps pass a host-built work list (work_lists.split_work): one program per
  non-empty (sequence, split) x KV head, longest sequences first; no program is idle.
- CUDA graphs need a grid that does not change between replays, so without a work list the
  grid is the static S x Hkv x NUM_SPLITS: a short sequence's trailing splits are empty and
  their programs return at once. Stage 2 never reads an empty split in either case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    cdiv,
    check_out,
    check_shape,
    check_work_list,
    dot_dtype,
    next_power_of_2,
    num_sms,
)
from iterserve.kernels.attention_core import LOG2E, attend_range, check_paged_args
from iterserve.kernels.launch import Launch
from iterserve.kernels.work_lists import kv_tile

MAX_SPLITS = 64
# The split counts choose_num_splits can return: what aot.py compiles.
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Shorter splits cost more in the merge and the per-program prologue than they buy.
MIN_TOKENS_PER_SPLIT = 64
# Resident decode programs per SM the split count aims at (decode runs >= 3 CTAs per SM).
TARGET_PROGRAMS_PER_SM = 3
DECODE_NUM_STAGES = 5


@triton.jit
def split_range(
    seq_len: tl.tensor, split: tl.tensor, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Token range [start, end) of one split; both kernels and work_lists.split_lengths agree."""
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    per_split = tl.maximum(per_split, TILE_N)  # never 0, even for an empty sequence
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    return start, end, per_split


@triton.jit(do_not_specialize=["stride_bt_s"])
def split_kv_decode_kernel(
    partial_out_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS, BLOCK_D] fp32
    partial_lse_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS] fp32, log2 domain
    query_ptr: tl.tensor,  # [S, Hq, D]
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    seq_lens_ptr: tl.tensor,  # [S]
    block_tables_ptr: tl.tensor,  # [S, M]
    work_ptr: tl.tensor,  # [P, 2] (sequence, split) per program, read only with HAS_WORK_LIST
    scale_log2: tl.tensor,
    stride_q_s: tl.tensor,
    stride_q_h: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    stride_bt_s: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WORK_LIST: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> None:
    if HAS_WORK_LIST:  # grid (P, Hkv): program i runs the i-th non-empty split
        item = work_ptr + tl.program_id(0).to(tl.int64) * 2
        seq = tl.load(item).to(tl.int64)
        split = tl.load(item + 1)
    else:  # static grid (S, Hkv, NUM_SPLITS), for CUDA graphs
        seq = tl.program_id(0).to(tl.int64)
        split = tl.program_id(2)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end, per_split = split_range(seq_len, split, NUM_SPLITS, TILE_N)
    if start >= end:
        return  # empty split (static grid only): the reduce kernel skips it

    # Rows are the GROUP query heads of this KV head (padded to BLOCK_M for tl.dot).
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_s + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    # A decode query is the last token: it sees every cached position.
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    m_i, l_i, acc = attend_range(
        q.to(DOT_DTYPE),
        query_pos,
        seq_len - 1,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt_s,
        kv_head,
        start,
        end,
        scale_log2,
        stride_cache_n,
        stride_cache_b,
        stride_cache_h,
        BLOCK_M,
        HEAD_DIM,
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
    partial_out_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS, BLOCK_D] fp32
    partial_lse_ptr: tl.tensor,  # [S, Hq, NUM_SPLITS] fp32
    seq_lens_ptr: tl.tensor,  # [S]
    stride_o_s: tl.tensor,
    stride_o_h: tl.tensor,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
) -> None:
    """Merge the splits stage 1 wrote, one at a time with a running max (any NUM_SPLITS)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, _, per_split = split_range(seq_len, 0, NUM_SPLITS, TILE_N)
    # Exactly the splits stage 1 wrote: start = split * per_split < seq_len.
    num_active = tl.minimum(tl.cdiv(seq_len, per_split), NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    first_row = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    max_lse = float("-inf")
    total = 0.0
    merged = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_active):
        lse = tl.load(partial_lse_ptr + first_row + split)
        partial = tl.load(partial_out_ptr + (first_row + split) * BLOCK_D + dims, mask=dim_mask, other=0.0)
        new_max = tl.maximum(max_lse, lse)
        rescale = tl.exp2(max_lse - new_max)
        weight = tl.exp2(lse - new_max)
        merged = merged * rescale + partial * weight
        total = total * rescale + weight
        max_lse = new_max
    # An empty sequence (an invalid input) writes no split: zeros, not NaN.
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + dims, merged / total, mask=dim_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many KV splits keep every SM busy for a decode batch; 1 means don't split.

    Splits while the programs, S x Hkv, are fewer than TARGET_PROGRAMS_PER_SM per SM, into
    about enough splits to reach that (rounded down to a power of two), never shorter than
    MIN_TOKENS_PER_SPLIT tokens (judged on the longest sequence), never more than MAX_SPLITS.
    """
    programs = num_seqs * num_kv_heads
    target = TARGET_PROGRAMS_PER_SM * num_sms
    if programs == 0 or programs >= target:
        return 1
    wanted = cdiv(target, programs)
    by_length = max(max_seq_len, 1) // MIN_TOKENS_PER_SPLIT
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    # Powers of two only: NUM_SPLITS is a constexpr, so each value is a compiled variant.
    return 1 << (splits.bit_length() - 1)


def use_split_kv(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    max_query_len: int,
    num_sms: int = 132,
) -> bool:
    """Whether a pure-decode batch of this shape runs split-KV (choose_num_splits > 1)."""
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


def split_kv_launches(
    out: torch.Tensor,  # [S, Hq, D]
    query: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, M]
    scale: float,
    num_splits: int,
    work: torch.Tensor | None = None,  # [P, 2] int32 from work_lists.split_work, or None
) -> list[Launch]:
    """Stage 1 and the reduce, as launches (the launcher runs them, aot.py compiles them).

    With a work list stage 1 launches its P items (none when P = 0); without, the static grid.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    tile_n = kv_tile(head_dim)
    partial_out, partial_lse = alloc_scratch(num_seqs, num_heads, num_splits, block_d, query.device)
    stage1 = Launch(
        name="split_kv_decode",
        kernel=split_kv_decode_kernel,
        grid=(num_seqs, num_kv_heads, num_splits) if work is None else (work.shape[0], num_kv_heads, 1),
        args=(
            partial_out, partial_lse, query, k_cache, v_cache, seq_lens, block_tables,
            seq_lens if work is None else work,  # never read without a work list
            float(scale) * LOG2E, query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        ),  # fmt: skip
        constexprs={
            "GROUP": group,
            "BLOCK_M": max(16, next_power_of_2(group)),
            "HEAD_DIM": head_dim,
            "BLOCK_D": block_d,
            "TILE_N": tile_n,
            "BLOCK_SIZE": k_cache.shape[1],
            "NUM_SPLITS": num_splits,
            "HAS_WORK_LIST": work is not None,
            "DOT_DTYPE": dot_dtype(k_cache.dtype),
        },
        num_warps=4,
        num_stages=DECODE_NUM_STAGES,
    )
    reduce = Launch(
        name="split_kv_reduce",
        kernel=split_kv_reduce_kernel,
        grid=(num_seqs, num_heads),
        args=(out, partial_out, partial_lse, seq_lens, out.stride(0), out.stride(1)),
        constexprs={"NUM_SPLITS": num_splits, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "TILE_N": tile_n},
        num_warps=4,
        num_stages=2,
    )
    return [reduce] if work is not None and work.shape[0] == 0 else [stage1, reduce]


def paged_decode_attention_split_kv(
    query: torch.Tensor,  # [S, Hq, D], one decode token per sequence
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    seq_lens: torch.Tensor,  # [S] int, context length including this step's token
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
    num_splits: int | None = None,
    *,
    work: torch.Tensor | None = None,  # [P, 2] from work_lists.split_work(seq_lens, num_splits)
    out: torch.Tensor | None = None,  # [S, Hq, D], optional preallocated output
) -> torch.Tensor:  # [S, Hq, D]
    """Decode attention with the context split across programs (flash-decoding).

    Same result as paged_attention with query_start_loc = arange(S + 1). With num_splits=None
    the split count comes from choose_num_splits, bounding the context length by the block
    table's capacity (M * B) since the true maximum would need a device sync. `work`, built
    on the host for these seq_lens and this split count, launches only the non-empty splits.
    """
    device = check_paged_args(query, k_cache, v_cache, seq_lens, block_tables, scale)
    num_seqs, num_heads, head_dim = query.shape
    check_shape("query", query, (seq_lens.shape[0], num_heads, head_dim))
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, num_sms(device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if work is not None:
        check_work_list("work", work, device)
    out = check_out(out, tuple(query.shape), query.dtype, device)
    if num_seqs == 0:
        return out
    for launch in split_kv_launches(
        out, query, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, work
    ):
        launch.run()
    return out
