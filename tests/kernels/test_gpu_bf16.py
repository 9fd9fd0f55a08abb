"""bf16 on a real GPU: the serving dtype, which the CPU interpreter cannot compute in.

The interpreter has no bf16 arithmetic and truncates fp32 -> bf16 on store where the GPU
rounds to nearest, so these run only compiled, on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import INTERPRET, TOLERANCES, make_paged_batch, poisoned

from iterserve.kernels import ops
from iterserve.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU, compiled kernels"
    ),
]
BF16 = torch.bfloat16


@pytest.mark.parametrize(("block_size", "group"), [(16, 4), (32, 8), (16, 1)])
def test_paged_attention_bf16(block_size: int, group: int) -> None:
    batch = make_paged_batch(
        [1, 17, 1, 300, 0, 1],
        [900, 417, 1, 300, 5, 4096],
        num_kv_heads=8,
        group=group,
        head_dim=128,
        block_size=block_size,
        dtype=BF16,
    )
    args = (
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    got = ops.paged_attention(*args, out=poisoned(tuple(batch.query.shape), BF16))
    torch.testing.assert_close(got, ref.paged_attention(*args), **TOLERANCES[BF16])


@pytest.mark.parametrize("num_splits", [None, 2, 16])
def test_split_kv_bf16(num_splits: int | None) -> None:
    seq_lens = [1, 63, 64, 1000, 4096]
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=BF16
    )
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    got = ops.paged_decode_attention_split_kv(
        *args, batch.scale, num_splits, out=poisoned(tuple(batch.query.shape), BF16)
    )
    torch.testing.assert_close(got, ref.paged_decode_attention(*args, batch.scale), **TOLERANCES[BF16])


def test_small_kernels_bf16() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 4096, device="cuda", dtype=BF16, generator=gen)
    r = torch.randn(33, 4096, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(4096, device="cuda", dtype=BF16, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOLERANCES[BF16])
    normed, summed = ops.fused_add_rms_norm(x, r, w, 1e-6)
    want_normed, want_summed = ref.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(summed, want_summed, atol=0, rtol=0)  # both round to nearest
    torch.testing.assert_close(normed, want_normed, **TOLERANCES[BF16])
    g = torch.randn(33, 2 * 1000, device="cuda", dtype=BF16, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(g), ref.silu_and_mul(g), **TOLERANCES[BF16])

    q = torch.randn(33, 32, 128, device="cuda", dtype=BF16, generator=gen)
    k = torch.randn(33, 8, 128, device="cuda", dtype=BF16, generator=gen)
    positions = torch.randint(0, 100, (33,), device="cuda", generator=gen)
    cos_sin = torch.randn(100, 128, device="cuda", generator=gen)
    q_want, k_want = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_want, k_want, cos_sin)
    ops.rotary_embedding(positions, q, k, cos_sin)
    torch.testing.assert_close(q, q_want, **TOLERANCES[BF16])
    torch.testing.assert_close(k, k_want, **TOLERANCES[BF16])

    k_cache = torch.full((4, 16, 8, 128), float("nan"), device="cuda", dtype=BF16)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 63, 17], device="cuda")
    kv = torch.randn(4, 8, 128, device="cuda", dtype=BF16, generator=gen)
    ops.write_kv_cache(kv, kv * 2, k_cache, v_cache, slots)
    ref.write_kv_cache(kv, kv * 2, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
