"""write_kv_cache: exact scatter into the paged cache, padding slots skipped."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE

from iterserve.kernels import ops
from iterserve.kernels import reference as ref


@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_kv_heads", "src_dtype", "cache_dtype"),
    [
        (16, 64, 2, torch.float32, torch.float32),
        (32, 128, 4, torch.float16, torch.float16),
        (16, 80, 3, torch.float32, torch.float16),  # odd sizes, cast on store
    ],
)
def test_write_kv_cache_matches_reference(
    block_size: int, head_dim: int, num_kv_heads: int, src_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 11
    # key and value are strided views of a fused kv buffer, as the projection produces them.
    kv = torch.randn((num_tokens, 2, num_kv_heads, head_dim), generator=gen).to(src_dtype)
    key, value = kv[:, 0].to(DEVICE), kv[:, 1].to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN sentinel: slots nobody writes must stay NaN, written ones must be exact.
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(key, value, k_want, v_want, slot_mapping)
    ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_want, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, atol=0, rtol=0, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~k_cache.isnan()).all(-1).all(-1).sum()) == written


def test_write_kv_cache_int32_slots_and_empty() -> None:
    k_cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(2, 1, 64, device=DEVICE)
    ops.write_kv_cache(
        key, key * 2, k_cache, v_cache, torch.tensor([31, -1], dtype=torch.int32, device=DEVICE)
    )
    assert torch.equal(k_cache[1, 15, 0], torch.ones(64, device=DEVICE)) and k_cache.sum() == 64
    assert v_cache.sum() == 128
    ops.write_kv_cache(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.long, device=DEVICE))


def test_write_kv_cache_validation() -> None:
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        ops.write_kv_cache(
            key,
            key,
            torch.zeros(2, 16, 4, 64, device=DEVICE),
            torch.zeros(2, 16, 4, 64, device=DEVICE),
            slots,
        )
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        ops.write_kv_cache(key, key, k_cache, k_cache.clone(), slots.float())
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        ops.write_kv_cache(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="share dtype"):
        ops.write_kv_cache(key, key, k_cache, k_cache.half(), slots)
