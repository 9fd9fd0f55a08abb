"""Host-built work lists: split-KV launching only non-empty splits, chunks heaviest first.

Parity against kernels/reference.py under the interpreter, on batches whose unowned cache
slots, unused table entries, split scratch and output start as NaN (kernel_testlib): a
split the list forgets leaves NaN scratch for the reduce to read, and the test fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testlib import TOLERANCES, make_paged_batch, poisoned

from iterserve.kernels import ops, split_kv
from iterserve.kernels import reference as ref
from iterserve.kernels.paged_attention import batch_launches
from iterserve.kernels.work_lists import kv_tile, prefill_block_q, prefill_work, split_work

F32 = TOLERANCES[torch.float32]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    original = split_kv.alloc_scratch

    def alloc(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        partial_out, partial_lse = original(*args)
        return partial_out.fill_(float("nan")), partial_lse.fill_(float("nan"))

    monkeypatch.setattr(split_kv, "alloc_scratch", alloc)


def non_empty_splits(seq_len: int, num_splits: int, tile: int) -> set[int]:
    """Brute force of split_range: the splits whose [start, end) holds a token."""
    per_token_count = -(-seq_len // num_splits)
    per_split = max(-(-per_token_count // tile) * tile, tile)
    return {s for s in range(num_splits) if s * per_split < min((s + 1) * per_split, seq_len)}


def test_split_work_is_exactly_the_non_empty_splits_longest_first() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq_lens = rng.integers(0, 5000, size=int(rng.integers(1, 12)))
        num_splits, head_dim = int(rng.integers(1, 65)), int(rng.choice([64, 128, 256]))
        work = split_work(seq_lens, num_splits, head_dim)
        assert work.dtype == np.int32 and work.shape[1] == 2
        want = {(i, s) for i, n in enumerate(seq_lens) for s in non_empty_splits(int(n), num_splits,
                                                                                 kv_tile(head_dim))}
        assert [tuple(item) for item in work.tolist()] == sorted(want, key=lambda it: (-seq_lens[it[0]],
                                                                                        it[0], it[1]))


def _decode_batch(seq_lens: list[int], seed: int, head_dim: int = 32):  # noqa: ANN202
    return make_paged_batch([1] * len(seq_lens), seq_lens, num_kv_heads=2, group=2, head_dim=head_dim,
                            block_size=16, dtype=torch.float32, seed=seed)  # fmt: skip


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 4, 8, 13, 32, 64])
def test_work_list_split_kv_matches_reference(num_kv_splits: int) -> None:
    # Short beside long: 1 token (one split), exactly full splits (64 * n), a split boundary
    # plus one, a long context; lengths are on and off block and tile boundaries.
    seq_lens = [1, 64 * num_kv_splits, 65, 1000, 17, 257]
    batch = _decode_batch(seq_lens, seed=num_kv_splits)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale)  # fmt: skip
    work = torch.from_numpy(split_work(np.array(seq_lens), num_kv_splits, 32))
    got = ops.paged_attention(*args, num_decodes=len(seq_lens), num_kv_splits=num_kv_splits,
                              split_work=work, out=poisoned(tuple(batch.query.shape), torch.float32))
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.paged_attention(*args), **F32)


@pytest.mark.slow
def test_every_split_count_1_to_64_with_a_work_list() -> None:
    seq_lens = [3, 70, 640]
    batch = _decode_batch(seq_lens, seed=5, head_dim=16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    want = ref.paged_decode_attention(*args, batch.scale)
    for splits in range(1, 65):
        work = torch.from_numpy(split_work(np.array(seq_lens), splits, 16))
        got = ops.paged_decode_attention_split_kv(*args, batch.scale, splits, work=work,
                                                  out=poisoned(tuple(batch.query.shape), torch.float32))
        torch.testing.assert_close(got, want, **F32, msg=f"num_splits={splits}")


def test_mixed_batch_with_a_work_list() -> None:
    q_lens, seq_lens = [1, 1, 1, 1, 9, 33, 20], [300, 1, 65, 128, 41, 33, 90]
    batch = make_paged_batch(q_lens, seq_lens, num_kv_heads=2, group=3, head_dim=80, block_size=32,
                             dtype=torch.float32, seed=3)  # fmt: skip
    args = (batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale)  # fmt: skip
    work = torch.from_numpy(split_work(np.array(seq_lens[:4]), 8, 80))
    got = ops.paged_attention(*args, num_decodes=4, num_kv_splits=8, split_work=work,
                              out=poisoned(tuple(batch.query.shape), torch.float32))
    torch.testing.assert_close(got, ref.paged_attention(*args), **F32)


def test_work_list_grid_launches_only_work() -> None:
    seq_lens = [1, 65, 512, 20]
    batch = _decode_batch(seq_lens, seed=1)
    args = (torch.empty_like(batch.query), batch.query, batch.k_cache, batch.v_cache,
            batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale)  # fmt: skip
    work = torch.from_numpy(split_work(np.array(seq_lens), 8, 32))
    stage1, reduce = batch_launches(*args, num_decodes=4, num_kv_splits=8, split_work=work)
    # 512 tokens fill 8 splits of 64; 65 tokens need 2; 1 and 20 tokens need 1: 12, not 32.
    assert stage1.grid == (12, 2, 1) and stage1.constexprs["HAS_WORK_LIST"]
    assert reduce.grid == (4, 4)
    static, _ = batch_launches(*args, num_decodes=4, num_kv_splits=8)  # CUDA graphs: fixed grid
    assert static.grid == (4, 2, 8) and not static.constexprs["HAS_WORK_LIST"]


def test_empty_work_list_writes_zeros_and_bad_lists_are_refused() -> None:
    batch = _decode_batch([5, 9], seed=2)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    # Zero-length contexts (not a real decode) have no splits: no stage 1, the reduce writes 0.
    empty = torch.zeros(2, dtype=torch.int32)
    got = ops.paged_decode_attention_split_kv(*args[:3], empty, args[4], batch.scale, 4,
                                              work=torch.zeros((0, 2), dtype=torch.int32))
    assert torch.equal(got, torch.zeros_like(got))
    with pytest.raises(ValueError, match="work must have 2 dims"):
        ops.paged_decode_attention_split_kv(*args, batch.scale, 4, work=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"split_work must have shape \(3, 2\)"):
        ops.paged_attention(batch.query, *args[1:3], batch.query_start_loc, *args[3:], batch.scale,
                            num_decodes=2, num_kv_splits=4, split_work=torch.zeros((3, 3), dtype=torch.int32))


def brute_prefill_items(q_lens: list[int], seq_lens: list[int], block_q: int) -> list[tuple[int, int, int]]:
    """(keys seen, chunk, block) of every query block, by the definition."""
    items = []
    for chunk, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for block in range(-(-q_len // block_q)):
            items.append((min(seq_len, seq_len - q_len + (block + 1) * block_q), chunk, block))
    return items


def test_prefill_work_is_every_query_block_heaviest_first() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        q_lens = rng.integers(0, 600, size=int(rng.integers(1, 9)))
        seq_lens = q_lens + rng.integers(0, 3000, size=q_lens.shape[0])
        group = int(rng.choice([1, 3, 4, 8]))
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        work = prefill_work(starts, seq_lens, group)
        items = brute_prefill_items(q_lens.tolist(), seq_lens.tolist(), prefill_block_q(group))
        assert work.dtype == np.int32
        # Heaviest first; equal costs keep batch order (chunk, then block).
        assert [tuple(item) for item in work.tolist()] == [(c, b) for _, c, b in
                                                           sorted(items, key=lambda it: -it[0])]


def test_heaviest_blocks_run_first_across_chunks() -> None:
    # group 4: 32-token query blocks. A 100-token prompt (blocks see 32..100 keys) and a
    # 40-token chunk over 1000 cached tokens (blocks see 1032 and 1040): the second chunk's
    # blocks start first, its last block before its first, then the prompt's from its end.
    work = prefill_work(np.array([0, 100, 140]), np.array([100, 1040]), group=4)
    assert work.tolist() == [[1, 1], [1, 0], [0, 3], [0, 2], [0, 1], [0, 0]]


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(4, 64, 16), (3, 80, 32), (8, 128, 16)])
def test_prefill_work_list_matches_reference(group: int, head_dim: int, block_size: int) -> None:
    # Decodes, then chunks: a long prompt over several query blocks, a chunk over a long
    # cached context, an idle sequence (no tokens: no program), a 1-token chunk, a short one.
    q_lens = [1, 1, 150, 40, 0, 1, 9]
    seq_lens = [60, 300, 150, 700, 5, 33, 90]
    batch = make_paged_batch(q_lens, seq_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=torch.float32, seed=group)  # fmt: skip
    args = (batch.query, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale)  # fmt: skip
    starts = batch.query_start_loc.cpu().numpy()
    work = torch.from_numpy(prefill_work(starts[2:], np.array(seq_lens[2:]), group))
    got = ops.paged_attention(*args, num_decodes=2, prefill_work=work,
                              out=poisoned(tuple(batch.query.shape), torch.float32))
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.paged_attention(*args), **F32)
    # One program per query block: no spare programs, no binary search.
    *_, chunks = batch_launches(torch.empty_like(batch.query), *args, num_decodes=2, num_kv_splits=1,
                                prefill_work=work)
    assert chunks.grid == (work.shape[0], 2) and chunks.constexprs["HAS_WORK_LIST"]
    assert work.shape[0] == sum(-(-q // prefill_block_q(group)) for q in q_lens[2:])
