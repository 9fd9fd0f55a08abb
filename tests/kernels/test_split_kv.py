"""Split-KV (flash-decoding) decode attention and its split heuristics."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import TOLERANCES, make_paged_batch, poisoned

from iterserve.kernels import ops, split_kv
from iterserve.kernels import reference as ref

# Long and short sequences together: with 8 splits of >= 64 tokens, the short ones leave most
# splits empty, the 300-token one fills 5, lengths fall on and off block boundaries.
SEQ_LENS = [1, 64, 65, 300, 128, 17]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill the split scratch with NaN: the reduce must read only partials stage 1 wrote."""
    original = split_kv.alloc_scratch

    def alloc(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        partial_out, partial_lse = original(*args)
        return partial_out.fill_(float("nan")), partial_lse.fill_(float("nan"))

    monkeypatch.setattr(split_kv, "alloc_scratch", alloc)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "dtype", "num_splits"),
    [
        (16, 64, 4, torch.float32, 8),
        (32, 128, 8, torch.float32, 3),
        (16, 128, 1, torch.float16, 5),
        (32, 64, 4, torch.float16, 1),
    ],
)
def test_split_kv_matches_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype, num_splits: int
) -> None:
    batch = make_paged_batch(
        [1] * len(SEQ_LENS),
        SEQ_LENS,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=num_splits,
    )
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    got = ops.paged_decode_attention_split_kv(
        *args, batch.scale, num_splits, out=poisoned(tuple(batch.query.shape), dtype)
    )
    want = ref.paged_decode_attention(*args, batch.scale)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    # The varlen kernel on the same decode batch agrees too (same math, different grid).
    varlen = ops.paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    torch.testing.assert_close(got, varlen, **TOLERANCES[dtype])


def test_split_kv_default_split_count() -> None:
    batch = make_paged_batch(
        [1, 1],
        [200, 33],
        num_kv_heads=1,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=11,
    )
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    got = ops.paged_decode_attention_split_kv(*args, batch.scale)
    torch.testing.assert_close(
        got, ref.paged_decode_attention(*args, batch.scale), **TOLERANCES[torch.float32]
    )


def test_choose_num_splits() -> None:
    # A big batch already fills 3 programs per SM on 132 SMs: no split.
    assert ops.choose_num_splits(64, 8, 16384, 132) == 1
    assert ops.choose_num_splits(50, 8, 16384, 132) == 1  # 400 programs >= 396
    # One sequence, 8 KV heads: 50 splits wanted for 3 x 132 programs, a power of two below.
    assert ops.choose_num_splits(1, 8, 16384, 132) == 32
    assert ops.choose_num_splits(1, 1, 16384, 132) == split_kv.MAX_SPLITS
    # Splits never go below MIN_TOKENS_PER_SPLIT = 64 tokens: 1 x 512 gets 8 (64 CTAs, not 16).
    assert ops.choose_num_splits(1, 8, 512, 132) == 8
    assert ops.choose_num_splits(1, 8, 100, 132) == 1
    assert ops.choose_num_splits(16, 8, 4096, 132) == 4  # 128 programs -> 512
    assert ops.choose_num_splits(0, 8, 4096, 132) == 1
    for programs in range(1, 400, 7):
        splits = ops.choose_num_splits(programs, 1, 1 << 20, 132)
        assert splits in split_kv.SPLIT_COUNTS
        assert splits == 1 or programs * splits <= 2 * 3 * 132  # no more than the GPU holds


def test_use_split_kv() -> None:
    assert ops.use_split_kv(1, 8, 16384, max_query_len=1)
    assert not ops.use_split_kv(1, 8, 16384, max_query_len=2)  # prefill in the batch
    assert not ops.use_split_kv(256, 8, 16384, max_query_len=1)  # grid already full
    assert not ops.use_split_kv(4, 8, 64, max_query_len=1)  # too short to split


def test_split_kv_validation() -> None:
    batch = make_paged_batch(
        [1, 1], [5, 9], num_kv_heads=1, group=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    with pytest.raises(ValueError, match="num_splits"):
        ops.paged_decode_attention_split_kv(*args, 1.0, 0)
    with pytest.raises(ValueError, match="num_splits"):
        ops.paged_decode_attention_split_kv(*args, 1.0, split_kv.MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="query must have shape"):
        ops.paged_decode_attention_split_kv(batch.query[:1], *args[1:], 1.0)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        ops.paged_decode_attention_split_kv(*args[:3], batch.seq_lens.float(), args[4], 1.0)
