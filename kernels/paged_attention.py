"""One varlen paged-attention kernel for prefill chunks and decodes in the same launch.

Each program owns BLOCK_Q query tokens of one sequence times the GROUP query heads that share
one KV head. Those BLOCK_M = BLOCK_Q * GROUP (padded) rows form the M dimension of both dots,
so each K/V tile is loaded once for the whole head group and tl.dot runs on tensor cores even
for a single decode token (the vLLM unified-attention layout). The KV loop walks the sequence
in TILE_N-token tiles, independent of the cache block size: each token's physical block is
looked up in the block table.

Programs are mapped to (sequence, query block) without a host sync: sequence i owns program
ids [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), which holds at least
cdiv(q_len_i, BLOCK_Q) ids, so T // BLOCK_Q + S programs cover any batch; a program finds its
sequence by binary search over query_start_loc and surplus programs exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_out,
    check_shape,
    check_tensor,
    dot_dtype,
    next_power_of_2,
)

LOG2E = 1.4426950408889634


@triton.jit
def find_seq_idx(
    query_start_loc_ptr: tl.tensor,  # [S + 1]
    num_seqs: tl.tensor,
    pid: tl.tensor,
    BLOCK_Q: tl.constexpr,
) -> tl.tensor:
    """The last sequence i whose first program id, qsl[i] // BLOCK_Q + i, is <= pid."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


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
    head_dim: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Online softmax over cache positions [kv_start, kv_end) with causal masking per row."""
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    for tile in range(kv_start, kv_end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        # int64 before multiplying by strides: block * stride overflows int32 on large caches.
        offset = (
            block.to(tl.int64) * stride_cache_n
            + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_b
            + kv_head * stride_cache_h
        )
        k = tl.load(  # K^T tile: [BLOCK_D, TILE_N]
            k_cache_ptr + offset[None, :] + dims[:, None],
            mask=dim_mask[:, None] & pos_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        # "ieee" keeps fp32 operands (test caches) exact instead of tf32; 16-bit operands run
        # on tensor cores either way.
        scores = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee")  # [BLOCK_M, TILE_N]
        scores = scores * scale_log2
        visible = (pos[None, :] <= query_pos[:, None]) & pos_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees position kv_start in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [TILE_N, BLOCK_D]
            v_cache_ptr + offset[:, None] + dims[None, :],
            mask=pos_valid[:, None] & dim_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def paged_attention_kernel(
    out_ptr: tl.tensor,  # [T, Hq, D]
    query_ptr: tl.tensor,  # [T, Hq, D]
    k_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    v_cache_ptr: tl.tensor,  # [N, B, Hkv, D]
    query_start_loc_ptr: tl.tensor,  # [S + 1]
    seq_lens_ptr: tl.tensor,  # [S]
    block_tables_ptr: tl.tensor,  # [S, M]
    scale_log2: tl.tensor,  # softmax scale * log2(e): the kernel works in exp2
    num_seqs: tl.tensor,
    head_dim: tl.tensor,
    stride_q_t: tl.tensor,
    stride_q_h: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_h: tl.tensor,
    stride_cache_n: tl.tensor,
    stride_cache_b: tl.tensor,
    stride_cache_h: tl.tensor,
    stride_bt_s: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq_idx(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # surplus program id (see the module docstring)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # token index inside the chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    query_pos = context_len + q_idx
    # Keys after this block's last query are invisible to all of its rows: skip those tiles.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)

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
        block_tables_ptr + seq.to(tl.int64) * stride_bt_s,
        kv_head,
        0,
        kv_end,
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
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
        acc,
        mask=row_valid[:, None] & dim_mask[None, :],
    )


def attention_config(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch options for a batch, from host-known sizes only (no sync).

    Decode-heavy batches (about one query token per sequence) get the smallest M tile tl.dot
    allows; prefill-heavy batches get large M tiles so each K/V tile is reused across many
    query rows (the kernel is compute-bound there). Any choice is correct: the program grid
    covers every batch for any BLOCK_Q.
    """
    tokens_per_seq = num_tokens / max(num_seqs, 1)
    if tokens_per_seq <= 1.0:
        block_m, num_warps, num_stages = 16, 4, 3
    elif tokens_per_seq < 64 or head_dim > 128:
        block_m, num_warps, num_stages = 64, 4, 2
    else:
        block_m, num_warps, num_stages = 128, 8, 2
    block_m = max(block_m, next_power_of_2(group))
    return {
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE_N": 64 if head_dim <= 128 else 32,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


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
    if head_dim < 16:
        raise ValueError(f"head_dim must be >= 16 (tl.dot's minimum), got {head_dim}")
    check_shape("block_tables", block_tables, (seq_lens.shape[0], block_tables.shape[1]))
    if not scale > 0.0:
        raise ValueError(f"scale must be positive, got {scale}")
    return check_device(
        query=query, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables
    )


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    query_start_loc: torch.Tensor,  # [S + 1] int, query tokens of seq i are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor,  # [S] int, context length including this step's tokens
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, D], optional preallocated output
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a ragged batch over the paged cache (see reference.paged_attention).

    The cache must already hold this step's keys and values. Query j of a chunk of length
    q_len sees context positions 0 .. seq_len - q_len + j. Tokens past query_start_loc[-1]
    are left unwritten. Index values (block ids, lengths) are trusted, not synced to check.
    """
    device = check_paged_args(query, k_cache, v_cache, seq_lens, block_tables, scale)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    check_device(query=query, query_start_loc=query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    out = check_out(out, tuple(query.shape), query.dtype, device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    cfg = attention_config(num_tokens, num_seqs, group, head_dim)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale) * LOG2E,
        num_seqs,
        head_dim,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=next_power_of_2(head_dim),
        TILE_N=cfg["TILE_N"],
        BLOCK_SIZE=block_size,
        DOT_DTYPE=dot_dtype(k_cache.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
