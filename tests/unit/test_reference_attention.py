"""The CPU attention path: decodes batched by length group equal the per-sequence loop."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels import reference


def _one_by_one(query, k_cache, v_cache, qsl, lens, tables, scale):
    """Each sequence through paged_attention alone (its per-sequence loop)."""
    parts = []
    for i, seq_len in enumerate(lens):
        q = query[qsl[i]:qsl[i + 1]]
        parts.append(reference.paged_attention(
            q, k_cache, v_cache, torch.tensor([0, q.shape[0]]), torch.tensor([seq_len]),
            tables[i:i + 1], scale))
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_per_sequence(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, block_size, kv_heads, head_dim, heads = 300, 16, 3, 64, 9
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [1, 5, 17, 100, 300, 1000, 16, 33, 700, 64]
    q_lens = [1, 1, 1, 1, 7, 1, 1, 1, 3, 0]  # decodes, two prefill chunks, one idle
    tables = torch.zeros(len(lens), 64, dtype=torch.int32)  # zero padded, as the engine's
    order = torch.randperm(blocks, generator=gen)
    used = 0
    for i, seq_len in enumerate(lens):
        n = -(-seq_len // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    query = torch.randn(qsl[-1], heads, head_dim, generator=gen).to(dtype)
    got = reference.paged_attention(query, k_cache, v_cache, torch.tensor(qsl),
                                    torch.tensor(lens), tables, 0.125)
    want = _one_by_one(query, k_cache, v_cache, qsl, lens, tables, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_length_groups_bound_the_padding() -> None:
    lens = [1000, 3, 5, 16, 17, 40, 900, 300]
    groups = reference._length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for group in groups:
        assert max(lens[i] for i in group) <= 2 * min(lens[i] for i in group)
