"""A prefill chunk after a cached prefix on CPU (two flash calls merged by log-sum-exp)
against the masked SDPA it replaces, beside the kernels' torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels import reference
from iterserve.replica.cpu_attention import chunk_after_prefix


@pytest.mark.parametrize(("q_len", "prefix_len", "heads"), [
    (1, 5, (4, 4)), (7, 1, (4, 2)), (16, 48, (9, 3)), (64, 16, (6, 1)), (33, 100, (8, 8)),
])
def test_chunk_after_prefix_matches_the_bottom_right_masked_sdpa(
        q_len: int, prefix_len: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(q_len * 1000 + prefix_len)
    length = prefix_len + q_len
    q = torch.randn((1, num_heads, q_len, 64), generator=gen)  # [1, Hq, q_len, D]
    k = torch.randn((1, num_kv_heads, length, 64), generator=gen)  # [1, Hkv, L, D]
    v = torch.randn((1, num_kv_heads, length, 64), generator=gen)
    mask = torch.ones((q_len, length), dtype=torch.bool).tril(prefix_len)  # query j: keys <= P + j
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(chunk_after_prefix(q, k, v, prefix_len, 0.125), want,
                               atol=2e-6, rtol=1e-5)


def test_chunk_after_prefix_matches_the_reference_paged_attention() -> None:
    """The same chunk through kernels/reference.py's paged attention (a block table over a
    paged cache): the ground truth every attention path is held to."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 16
    prefix_len, q_len = 10, 6
    length = prefix_len + q_len
    num_blocks = -(-length // block_size)
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    v_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    query = torch.randn((q_len, num_heads, head_dim), generator=gen)  # [T, Hq, D]
    want = reference.paged_attention(query, k_cache, v_cache, torch.tensor([0, q_len]),
                                     torch.tensor([length]),
                                     torch.arange(num_blocks, dtype=torch.int32)[None], 0.25)
    keys = k_cache.view(-1, num_kv_heads, head_dim)[:length].transpose(0, 1)[None]
    values = v_cache.view(-1, num_kv_heads, head_dim)[:length].transpose(0, 1)[None]
    got = chunk_after_prefix(query.transpose(0, 1)[None], keys, values, prefix_len, 0.25)
    torch.testing.assert_close(got[0].transpose(0, 1), want, atol=2e-6, rtol=1e-5)
