"""kernels/reference.py against independent textbook math: it is the engine's CPU path as well
as the Triton kernels' ground truth, and its loop bodies are written for few torch calls, so
each is checked here against a plain formulation of the same math."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import make_paged_batch

from iterserve.kernels import reference as ref


def dense_attention(batch: object) -> torch.Tensor:
    """Per sequence: its context read back token by token through the block table, then
    softmax(q k^T * scale) v with the causal mask, every query head on its KV head."""
    b = batch
    block_size, num_kv_heads = b.k_cache.shape[1], b.k_cache.shape[2]
    group = b.query.shape[1] // num_kv_heads
    out = torch.zeros(b.query.shape, dtype=torch.float32)
    starts = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = b.block_tables[i].long()[positions // block_size]
        keys = b.k_cache[blocks, positions % block_size].float()  # [L, Hkv, D]
        values = b.v_cache[blocks, positions % block_size].float()
        for head in range(b.query.shape[1]):
            q = b.query[q_start:q_end, head].float()  # [q_len, D]
            scores = q @ keys[:, head // group].T * b.scale  # [q_len, L]
            visible = positions[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[q_start:q_end, head] = torch.softmax(scores, dim=-1) @ values[:, head // group]
    return out


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 80])  # 64: scale 1/8, exact either way; 80: not
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([1, 1, 1, 1, 1], [1, 16, 17, 40, 100]),  # decodes only: the in-place fp32 path
    ([9, 1, 0, 1, 24], [9, 33, 5, 2, 60]),  # a full prefill, decodes, an idle row, a chunk
])
def test_reference_paged_attention_matches_dense_attention(
        dtype: torch.dtype, atol: float, head_dim: int, q_lens: list[int],
        seq_lens: list[int]) -> None:
    batch = make_paged_batch(q_lens, seq_lens, num_kv_heads=3, group=3, head_dim=head_dim,
                             block_size=16, dtype=dtype)
    # The model hands attention a strided view of its fused qkv projection.
    tokens, heads = batch.query.shape[:2]
    fused = torch.full((tokens, heads + 6, head_dim), float("nan"), dtype=dtype)
    fused[:, :heads] = batch.query
    batch.query = fused[:, :heads]
    got = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc,
                              batch.seq_lens, batch.block_tables, batch.scale)
    assert got.dtype == dtype and got.is_contiguous()
    want = dense_attention(batch)
    rows = sum(q_lens)  # the idle row has no query rows
    torch.testing.assert_close(got[:rows].float(), want[:rows], atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rotary_rounds_as_the_rotate_half_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, head_dim = 6, 64
    qkv = torch.randn((tokens, 15 * head_dim), generator=gen).to(dtype)
    query, key = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(512).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    wants = []
    for x in (query, key):
        x1, x2 = x[..., :32].float(), x[..., 32:].float()
        cos, sin = cache[positions, None, :32], cache[positions, None, 32:]
        wants.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype))
    untouched = qkv[:, 768:].clone()
    ref.rotary_embedding(positions, query, key, cache)
    assert torch.equal(query, wants[0]) and torch.equal(key, wants[1])  # bit for bit
    assert torch.equal(qkv[:, 768:], untouched)


def test_reference_write_kv_cache_without_padding_is_an_exact_scatter() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((5, 2, 3, 64), generator=gen)
    slots = torch.tensor([17, 3, 40, 0, 31], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(3, 16, 3, 64), torch.zeros(3, 16, 3, 64)
    ref.write_kv_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(48, 3, 64), v_cache.view(48, 3, 64)
    assert torch.equal(flat_k[slots.long()], kv[:, 0]) and torch.equal(flat_v[slots.long()], kv[:, 1])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 5  # nothing else written
