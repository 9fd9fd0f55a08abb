"""LoRA shrink and expand over segments of rows, one adapter per segment (Punica's SGMV).

A step's rows are grouped by adapter slot into segments (replica/lora_layers.LoRABatch):
segment s covers `rows[seg_start[s] : seg_start[s] + seg_len[s]]` (flat row indices, so the
rows need not be contiguous in the batch) and uses slot `seg_slot[s]`. Each program takes a
tile of one segment's rows and one tile of output columns, so every adapter's weights are read
once per tile of its rows, and rows of different adapters share one launch.

shrink: hidden[row, :] = x[row, :] @ shrink[slot].T       shrink: [slots, N, K]
expand: out[row, off_i:off_i+size_i] += hidden[row, i*R:(i+1)*R] @ expand[slot, off_i:.., :R].T
for each output slice i (q, k, v of a fused qkv; gate, up), expand: [slots, out, R] (any
strides: LoRALinear keeps it as a view of [slots, R, out], the CPU bmm's layout). Each
(row, column) of `out` is written by exactly one program, so the add needs no atomics.
Accumulation is fp32 whatever the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import next_power_of_2

BLOCK_M = 16  # rows of a segment per program (tl.dot's smallest tile)


@triton.jit
def lora_shrink_kernel(
    x_ptr: tl.tensor,  # [T, K]
    w_ptr: tl.tensor,  # [slots, N, K]
    out_ptr: tl.tensor,  # [T, N] fp32
    rows_ptr: tl.tensor,  # [M] int64 flat rows, grouped by segment
    seg_start_ptr: tl.tensor, seg_len_ptr: tl.tensor, seg_slot_ptr: tl.tensor,  # [S] each
    num_k: tl.tensor, num_n: tl.tensor,
    stride_x: tl.tensor, stride_ws: tl.tensor, stride_wn: tl.tensor, stride_out: tl.tensor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    first = tl.program_id(2) * BLOCK_M
    if first >= length:  # the grid covers the longest segment
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, num_k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < num_k
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def lora_expand_kernel(
    h_ptr: tl.tensor,  # [T, n_slices * R] fp32
    w_ptr: tl.tensor,  # [slots, out, R]
    out_ptr: tl.tensor,  # [T, out], added to
    rows_ptr: tl.tensor,
    seg_start_ptr: tl.tensor, seg_len_ptr: tl.tensor, seg_slot_ptr: tl.tensor,
    slice_offsets_ptr: tl.tensor,  # [n_slices + 1] int64: each slice's first output column
    rank: tl.tensor, blocks_per_slice: tl.tensor,
    stride_h: tl.tensor, stride_ws: tl.tensor, stride_wo: tl.tensor, stride_wr: tl.tensor,
    stride_out: tl.tensor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    first = tl.program_id(2) * BLOCK_M
    if first >= length:
        return
    piece = tl.program_id(1)
    part = piece // blocks_per_slice
    col_begin = tl.load(slice_offsets_ptr + part)
    col_end = tl.load(slice_offsets_ptr + part + 1)
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0)
    offs_n = col_begin + (piece % blocks_per_slice) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = tl.load(h_ptr + rows[:, None] * stride_h + part * rank + offs_r[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[None, :] * stride_wo
                    + offs_r[:, None] * stride_wr,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc += tl.dot(h, w.to(tl.float32))
    mask = m_mask[:, None] & n_mask[None, :]
    where = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    total = tl.load(where, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(where, total.to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, shrink: torch.Tensor, rows: torch.Tensor,
                segments: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """hidden [T, N] fp32 (rows outside every segment left zero) for x [T, K] and
    shrink [slots, N, K]; `segments` [3, S] int64: start, length, slot."""
    num_tokens, num_k = x.shape
    num_n = shrink.shape[1]
    hidden = torch.zeros((num_tokens, num_n), dtype=torch.float32, device=x.device)
    num_segments = segments.shape[1]
    if num_segments == 0 or max_seg_len == 0:
        return hidden
    block_n = min(next_power_of_2(num_n), 64)
    block_k = min(max(next_power_of_2(num_k), 16), 64)
    grid = (num_segments, triton.cdiv(num_n, block_n), triton.cdiv(max_seg_len, BLOCK_M))
    lora_shrink_kernel[grid](
        x, shrink, hidden, rows, segments[0], segments[1], segments[2], num_k, num_n,
        x.stride(0), shrink.stride(0), shrink.stride(1), hidden.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return hidden


def lora_expand(hidden: torch.Tensor, expand: torch.Tensor, out: torch.Tensor,
                rows: torch.Tensor, segments: torch.Tensor, max_seg_len: int,
                slice_offsets: list[int]) -> torch.Tensor:
    """out[row, slice i] += hidden[row, i*R:(i+1)*R] @ expand[slot, slice i, :].T in place;
    `slice_offsets`: each slice's first column, then the end of the last."""
    num_segments = segments.shape[1]
    rank = expand.shape[2]
    if num_segments == 0 or max_seg_len == 0:
        return out
    widest = max(b - a for a, b in zip(slice_offsets, slice_offsets[1:], strict=False))
    block_n = min(max(next_power_of_2(widest), 16), 64)
    block_r = min(max(next_power_of_2(rank), 16), 64)
    blocks_per_slice = triton.cdiv(widest, block_n)
    offsets = torch.tensor(slice_offsets, dtype=torch.int64, device=out.device)
    grid = (num_segments, blocks_per_slice * (len(slice_offsets) - 1),
            triton.cdiv(max_seg_len, BLOCK_M))
    lora_expand_kernel[grid](
        hidden, expand, out, rows, segments[0], segments[1], segments[2], offsets, rank,
        blocks_per_slice, hidden.stride(0), expand.stride(0), expand.stride(1), expand.stride(2),
        out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r)
    return out
