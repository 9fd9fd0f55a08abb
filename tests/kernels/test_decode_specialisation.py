"""The decode-only launch, split-KV at every split count, and mixed two-launch batches.

Each case checks the Triton launcher (interpreted on CPU) against kernels/reference.py on
batches whose unowned cache slots, unused block-table entries (kernel_testlib) and split
scratch are NaN, and whose output buffer starts as NaN: a read past a sequence, a missed
write, or a reduce reading an empty split shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import TOLERANCES, make_paged_batch, poisoned

from iterserve.kernels import ops, split_kv
from iterserve.kernels import reference as ref
from iterserve.kernels.paged_attention import batch_launches

F32 = TOLERANCES[torch.float32]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    original = split_kv.alloc_scratch

    def alloc(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        partial_out, partial_lse = original(*args)
        return partial_out.fill_(float("nan")), partial_lse.fill_(float("nan"))

    monkeypatch.setattr(split_kv, "alloc_scratch", alloc)


def _check(
    q_lens: list[int], seq_lens: list[int], num_decodes: int, num_kv_splits: int, **shape: object
) -> None:
    dtype = shape.pop("dtype", torch.float32)
    batch = make_paged_batch(q_lens, seq_lens, dtype=dtype, seed=sum(seq_lens) + num_kv_splits, **shape)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale)  # fmt: skip
    got = ops.paged_attention(
        *args, num_decodes=num_decodes, num_kv_splits=num_kv_splits,
        out=poisoned(tuple(batch.query.shape), dtype),
    )  # fmt: skip
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.paged_attention(*args), **TOLERANCES[dtype])


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
def test_decode_only_every_head_dim(head_dim: int) -> None:
    # Lengths on, below and above tile (64) and block boundaries; a 1-token context.
    _check([1] * 4, [1, 64, 65, 130], 4, 1, num_kv_heads=1, group=4, head_dim=head_dim, block_size=16)


@pytest.mark.parametrize(("block_size", "group", "dtype"), [(16, 1, torch.float16), (32, 8, torch.float32)])
def test_decode_only_block_sizes_and_groups(block_size: int, group: int, dtype: torch.dtype) -> None:
    _check([1] * 3, [31, 32, 97], 3, 1, num_kv_heads=2, group=group, head_dim=64, block_size=block_size,
           dtype=dtype)  # fmt: skip


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 4, 7, 8, 16, 31, 64])
def test_split_counts_with_empty_and_full_splits(num_kv_splits: int) -> None:
    # 1 token: one non-empty split; 64 * n: every split exactly full; others leave splits empty.
    seq_lens = [1, 64 * num_kv_splits, 100, 257]
    _check([1] * 4, seq_lens, 4, num_kv_splits, num_kv_heads=1, group=2, head_dim=32, block_size=16)


@pytest.mark.slow
def test_split_counts_1_to_64_on_one_sequence() -> None:
    batch = make_paged_batch([1], [200], num_kv_heads=1, group=2, head_dim=16, block_size=16,
                             dtype=torch.float32, seed=1)  # fmt: skip
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    want = ref.paged_decode_attention(*args, batch.scale)
    for splits in range(1, 65):
        out = poisoned((1, 2, 16), torch.float32)
        got = ops.paged_decode_attention_split_kv(*args, batch.scale, splits, out=out)
        torch.testing.assert_close(got, want, **F32, msg=f"num_splits={splits}")


@pytest.mark.parametrize(
    ("head_dim", "block_size", "num_kv_splits"), [(64, 16, 1), (80, 32, 4), (128, 16, 2), (32, 32, 64)]
)
def test_mixed_batch_two_launches(head_dim: int, block_size: int, num_kv_splits: int) -> None:
    # Decodes first, then chunks: over cached context, a full prefill, an idle sequence.
    q_lens = [1, 1, 1, 9, 33, 0, 20]
    seq_lens = [37, 1, 140, 41, 33, 5, 90]
    _check(q_lens, seq_lens, 3, num_kv_splits, num_kv_heads=2, group=3, head_dim=head_dim,
           block_size=block_size)  # fmt: skip


def test_chunks_only_and_one_token_chunks_as_chunks() -> None:
    # num_decodes=0: one-token sequences run through the chunk launch and agree too.
    _check([1, 1, 70], [10, 90, 200], 0, 1, num_kv_heads=1, group=4, head_dim=64, block_size=16)


def test_launch_plan_of_a_mixed_batch() -> None:
    batch = make_paged_batch([1, 1, 1, 40], [10, 20, 30, 40], num_kv_heads=2, group=4, head_dim=64,
                             block_size=16, dtype=torch.float32)  # fmt: skip
    args = (torch.empty_like(batch.query), batch.query, batch.k_cache, batch.v_cache,
            batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale)  # fmt: skip
    decode, chunk = batch_launches(*args, num_decodes=3, num_kv_splits=1)
    assert decode.constexprs["IS_DECODE"] and decode.grid == (3, 2)  # one program per seq x head
    assert decode.constexprs["BLOCK_M"] == 16 and decode.constexprs["BLOCK_Q"] == 1
    assert not chunk.constexprs["IS_DECODE"] and chunk.constexprs["BLOCK_M"] == 128
    assert chunk.grid == (40 // chunk.constexprs["BLOCK_Q"] + 1, 2)  # the chunk part alone
    names = [launch.name for launch in batch_launches(*args, num_decodes=3, num_kv_splits=4)]
    assert names == ["split_kv_decode", "split_kv_reduce", "paged_attention.prefill"]
    assert [launch.name for launch in batch_launches(*args, num_decodes=0, num_kv_splits=1)] == [
        "paged_attention.prefill"
    ]


def test_unsupported_head_dim_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="head_dim 72 is not supported"):
        ops.check_head_dim(72)
    for head_dim in ops.SUPPORTED_HEAD_DIMS:
        ops.check_head_dim(head_dim)


def test_hint_validation() -> None:
    batch = make_paged_batch([1, 1], [5, 9], num_kv_heads=1, group=2, head_dim=64, block_size=16,
                             dtype=torch.float32)  # fmt: skip
    args = (batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="num_decodes"):
        ops.paged_attention(*args, num_decodes=3)
    with pytest.raises(ValueError, match="num_kv_splits"):
        ops.paged_attention(*args, num_decodes=2, num_kv_splits=65)
