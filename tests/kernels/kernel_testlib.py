"""Shared builders for the kernel tests: devices, tolerances, ragged paged batches."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# conftest.py has set TRITON_INTERPRET by the time any test module imports this.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# The interpreter feeds tl.dot fp32 operands (exact numpy math), so only summation order
# differs from torch. Compiled fp16 runs round P and V to fp16 for the tensor cores: looser.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3} if INTERPRET else {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, B, Hkv, D]
    v_cache: torch.Tensor  # [N, B, Hkv, D]
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, M] int32
    scale: float


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A ragged batch over a paged cache with random, non-contiguous block tables.

    Every cache slot no sequence owns holds NaN, and so does one whole "poison" block that
    every unused block-table entry points to: a kernel that reads past a sequence's length,
    or follows a table entry it should not, produces NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = needed + spare_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen)
    poison_block = int(perm[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    next_block = 0
    for i, seq_len in enumerate(seq_lens):
        for j in range(-(-seq_len // block_size)):
            block = int(perm[next_block])
            next_block += 1
            block_tables[i, j] = block
            filled = min(block_size, seq_len - j * block_size)
            kv_shape = (filled, num_kv_heads, head_dim)
            k_cache[block, :filled] = torch.randn(kv_shape, generator=gen).to(dtype)
            v_cache[block, :filled] = torch.randn(kv_shape, generator=gen).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn((starts[-1], num_kv_heads * group, head_dim), generator=gen).to(dtype)
    return PagedBatch(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        scale=head_dim**-0.5,
    )
