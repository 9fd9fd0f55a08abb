"""Varlen paged attention for a flat batch: one launch for its decodes, one for its chunks.

The engine lays a batch out decodes first (one query token each), then prefill chunks.
`paged_attention` runs the two parts as separate launches of one kernel, specialised by the
IS_DECODE constexpr:

- decodes: one program per (sequence, KV head), BLOCK_Q = 1, the smallest M tile tl.dot
  allows, deep K/V pipelining; or, when those programs cannot fill the GPU, split-KV
  (flash-decoding, split_kv.py) with a split count chosen from the decode part alone.
- chunks: BLOCK_Q query tokens x the GROUP query heads of one KV head per program (the vLLM
  unified-attention layout), 128-row tiles so each K/V tile feeds many rows.

Each program owns BLOCK_M = BLOCK_Q * GROUP (padded) rows, the M dimension of both dots, so
each K/V tile is loaded once per head group and tl.dot runs on tensor cores even for one
decode token. The KV loop walks TILE_N-token tiles independent of the cache block size.

Chunk programs are mapped to (sequence, query block) one of two ways (HAS_WORK_LIST):
- the eager step's host-built work list (work_lists.prefill_work): one program per query
  block, heaviest first across every chunk of the batch (a block costs the keys it sees),
  so the long programs start first and the short ones fill the tail; no spare programs.
- without one (direct callers; no host lengths needed): chunk i owns program ids
  [(qsl[i] - qsl[0]) // BLOCK_Q + i, ...), at least cdiv(q_len, BLOCK_Q) of them, so
  (T - num_decodes) // BLOCK_Q + S - num_decodes programs cover the chunks; a program finds
  its chunk by binary search, and within a chunk the last (heaviest) block runs first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    INDEX_DTYPES,
    check_device,
    check_out,
    check_shape,
    check_tensor,
    check_work_list,
    dot_dtype,
    next_power_of_2,
)
from iterserve.kernels.attention_core import LOG2E, attend_range, check_paged_args
from iterserve.kernels.launch import Launch
from iterserve.kernels.split_kv import MAX_SPLITS, split_kv_launches
from iterserve.kernels.work_lists import kv_tile, prefill_block_m, prefill_block_q


@triton.jit
def find_seq_idx(
    query_start_loc_ptr: tl.tensor,  # [S + 1]
    num_seqs: tl.tensor,
    pid: tl.tensor,
    BLOCK_Q: tl.constexpr,
) -> tl.tensor:
    """The last sequence i whose first program id, (qsl[i] - qsl[0]) // BLOCK_Q + i, is <= pid."""
    base = tl.load(query_start_loc_ptr)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Batch-shaped ints stay unspecialised: one compiled variant serves every batch.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_s"])
def paged_attention_kernel(
    out_ptr: tl.tensor,  # [T, Hq, D]
    query_ptr: tl.tensor,  # [T, Hq, D]
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    query_start_loc_ptr: tl.tensor,  # [S + 1] of this launch's sequences
    seq_lens_ptr: tl.tensor,  # [S]
    block_tables_ptr: tl.tensor,  # [S, M]
    work_ptr: tl.tensor,  # [P, 2] (chunk, query block) per program, read only with HAS_WORK_LIST
    scale_log2: tl.tensor,  # softmax scale * log2(e): the kernel works in exp2
    num_seqs: tl.tensor,
    stride_q_t: tl.tensor,
    stride_q_h: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_h: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    stride_bt_s: tl.tensor,
    IS_DECODE: tl.constexpr,
    HAS_WORK_LIST: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if IS_DECODE:
        seq = pid  # one program per decode: no search, no spare programs
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = 1
        q_block = 0
    elif HAS_WORK_LIST:  # program pid runs the pid-th heaviest query block of the batch
        item = work_ptr + pid.to(tl.int64) * 2
        seq = tl.load(item)
        q_block = tl.load(item + 1)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    else:
        seq = find_seq_idx(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        base = tl.load(query_start_loc_ptr)
        local = pid - ((q_start - base) // BLOCK_Q + seq)
        num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
        if local >= num_q_blocks:
            return  # surplus program id (see the module docstring)
        q_block = num_q_blocks - 1 - local  # heaviest query block first
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # token index inside the chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    query_pos = context_len + q_idx
    # Keys after this block's last query are invisible to all of its rows: skip those tiles.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    m_i, l_i, acc = attend_range(
        q.to(DOT_DTYPE),
        query_pos,
        context_len + q_block * BLOCK_Q,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_s,
        kv_head,
        0,
        kv_end,
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
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
        acc,
        mask=row_valid[:, None] & dim_mask[None, :],
    )


def decode_config(group: int, head_dim: int) -> dict[str, int]:
    """Decode programs: the smallest M tile, 5 stages (K/V two tiles ahead, ids three)."""
    return {
        "BLOCK_M": max(16, next_power_of_2(group)),
        "BLOCK_Q": 1,
        "TILE_N": kv_tile(head_dim),
        "num_warps": 4,
        "num_stages": 5,
    }


def prefill_config(group: int, head_dim: int) -> dict[str, int]:
    """Chunk programs: 128 rows (compute-bound), K/V two tiles ahead as for decode."""
    return {
        "BLOCK_M": prefill_block_m(group),
        "BLOCK_Q": prefill_block_q(group),  # what work_lists.prefill_work cuts chunks by
        "TILE_N": kv_tile(head_dim),
        "num_warps": 8,
        "num_stages": 5,
    }


def paged_launch(
    name: str,
    out: torch.Tensor,  # [T, Hq, D]
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [S' + 1] of the launched sequences
    seq_lens: torch.Tensor,  # [S']
    block_tables: torch.Tensor,  # [S', M]
    scale: float,
    num_tokens: int,  # query tokens of the launched sequences
    is_decode: bool,
    work: torch.Tensor | None = None,  # [P, 2] chunk launch only, from work_lists.prefill_work
) -> Launch:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = (decode_config if is_decode else prefill_config)(group, head_dim)
    if is_decode:
        programs = num_seqs
    elif work is None:
        programs = num_tokens // cfg["BLOCK_Q"] + num_seqs
    else:
        programs = work.shape[0]
    return Launch(
        name=name,
        kernel=paged_attention_kernel,
        grid=(programs, num_kv_heads),
        args=(
            out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
            seq_lens if work is None else work,  # never read without a work list
            float(scale) * LOG2E, num_seqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        ),  # fmt: skip
        constexprs={
            "IS_DECODE": is_decode,
            "HAS_WORK_LIST": work is not None,
            "GROUP": group,
            "BLOCK_Q": cfg["BLOCK_Q"],
            "BLOCK_M": cfg["BLOCK_M"],
            "HEAD_DIM": head_dim,
            "BLOCK_D": next_power_of_2(head_dim),
            "TILE_N": cfg["TILE_N"],
            "BLOCK_SIZE": k_cache.shape[1],
            "DOT_DTYPE": dot_dtype(k_cache.dtype),
        },
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def batch_launches(
    out: torch.Tensor,  # [T, Hq, D]
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, M]
    scale: float,
    num_decodes: int,
    num_kv_splits: int,
    split_work: torch.Tensor | None = None,  # [P, 2] (decode, split), work_lists.split_work
    prefill_work: torch.Tensor | None = None,  # [P, 2] (chunk, q block), work_lists.prefill_work
) -> list[Launch]:
    """The launches of one flat batch: its decode part, then its chunk part (each if any)."""
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    launches = []
    if num_decodes > 0 and num_kv_splits > 1:
        launches += split_kv_launches(
            out[:num_decodes], query[:num_decodes], k_cache, v_cache,
            seq_lens[:num_decodes], block_tables[:num_decodes], scale, num_kv_splits, split_work,
        )  # fmt: skip
    elif num_decodes > 0:
        launches.append(paged_launch(
            "paged_attention.decode", out, query, k_cache, v_cache,
            query_start_loc[: num_decodes + 1], seq_lens[:num_decodes],
            block_tables[:num_decodes], scale, num_decodes, True,
        ))  # fmt: skip
    if num_decodes < num_seqs and (prefill_work is None or prefill_work.shape[0] > 0):
        launches.append(paged_launch(
            "paged_attention.prefill", out, query, k_cache, v_cache,
            query_start_loc[num_decodes:], seq_lens[num_decodes:], block_tables[num_decodes:],
            scale, num_tokens - num_decodes, False, prefill_work,
        ))  # fmt: skip
    return launches


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    query_start_loc: torch.Tensor,  # [S + 1] int, query tokens of seq i are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor,  # [S] int, context length including this step's tokens
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
    *,
    num_decodes: int = 0,
    num_kv_splits: int = 1,
    split_work: torch.Tensor | None = None,  # [P, 2] int32, see below
    prefill_work: torch.Tensor | None = None,  # [P, 2] int32, see below
    out: torch.Tensor | None = None,  # [T, Hq, D], optional preallocated output
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a ragged batch over the paged cache (see reference.paged_attention).

    The cache must already hold this step's keys and values. Query j of a chunk of length
    q_len sees context positions 0 .. seq_len - q_len + j. Tokens past query_start_loc[-1]
    are left unwritten. Index values (block ids, lengths) are trusted, not synced to check.

    num_decodes: the caller's word (from host metadata) that sequences 0 .. num_decodes - 1
    hold exactly one query token each, tokens 0 .. num_decodes - 1; they run as the decode
    launch, split num_kv_splits ways across their context when num_kv_splits > 1
    (choose_num_splits). With the defaults every sequence runs as a chunk: correct for any
    batch. split_work: the eager step's host-built list of the decode part's non-empty splits
    (work_lists.split_work of seq_lens[:num_decodes], num_kv_splits and head_dim): split-KV
    then launches exactly those; None (CUDA graphs) keeps the static grid. prefill_work: the
    same for the chunk part (work_lists.prefill_work of query_start_loc[num_decodes:],
    seq_lens[num_decodes:] and the group): one program per query block, heaviest first.
    """
    device = check_paged_args(query, k_cache, v_cache, seq_lens, block_tables, scale)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    check_device(query=query, query_start_loc=query_start_loc)
    num_tokens = query.shape[0]
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if not 0 <= num_decodes <= min(num_seqs, num_tokens):
        raise ValueError(f"num_decodes must be in [0, {min(num_seqs, num_tokens)}], got {num_decodes}")
    if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_SPLITS:
        raise ValueError(f"num_kv_splits must be an int in [1, {MAX_SPLITS}], got {num_kv_splits!r}")
    for name, work in (("split_work", split_work), ("prefill_work", prefill_work)):
        if work is not None:
            check_work_list(name, work, device)
    out = check_out(out, tuple(query.shape), query.dtype, device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    for launch in batch_launches(
        out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
        num_decodes, num_kv_splits, split_work, prefill_work,
    ):  # fmt: skip
        launch.run()
    return out

