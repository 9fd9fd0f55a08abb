"""The varlen paged-attention kernel against reference.paged_attention on ragged batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testlib import DEVICE, TOLERANCES, make_paged_batch, poisoned

from iterserve.kernels import ops
from iterserve.kernels import paged_attention as pa
from iterserve.kernels import reference as ref

# A mixed batch: decodes (q_len 1), prefill chunks over cached context, a full prefill
# (q_len == seq_len), an idle sequence (q_len 0), lengths on and off block boundaries.
Q_LENS = [1, 9, 1, 21, 0, 1, 32]
SEQ_LENS = [37, 41, 1, 21, 5, 64, 70]

# (block_size, head_dim, group, dtype): every block size, head dim, GQA ratio and dtype
# appears, without the full cross product the interpreter could not afford.
CASES = [
    (16, 64, 1, torch.float32),
    (32, 128, 4, torch.float32),
    (16, 128, 8, torch.float16),
    (32, 64, 4, torch.float16),
    (16, 64, 8, torch.float32),
    (16, 80, 3, torch.float32),  # non-power-of-2 head dim and group: masked lanes and rows
]


def _run(batch: object, dtype: torch.dtype, **hints: int) -> tuple[torch.Tensor, torch.Tensor]:
    args = (
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    got = ops.paged_attention(*args, **hints, out=poisoned(tuple(batch.query.shape), dtype))
    return got, ref.paged_attention(*args)


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype"), CASES)
def test_mixed_batch_matches_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    batch = make_paged_batch(
        Q_LENS,
        SEQ_LENS,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + head_dim + group,
    )
    got, want = _run(batch, dtype)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("builder", "config"),
    [
        ("decode_config", {"BLOCK_M": 16, "BLOCK_Q": 1, "TILE_N": 16, "num_warps": 4, "num_stages": 1}),
        ("prefill_config", {"BLOCK_M": 16, "BLOCK_Q": 4, "TILE_N": 16, "num_warps": 4, "num_stages": 1}),
        ("prefill_config", {"BLOCK_M": 64, "BLOCK_Q": 16, "TILE_N": 64, "num_warps": 4, "num_stages": 2}),
        ("prefill_config", {"BLOCK_M": 128, "BLOCK_Q": 32, "TILE_N": 32, "num_warps": 8, "num_stages": 2}),
    ],
    ids=["decode-small-tiles", "chunk-small-tiles", "chunk-mid-tiles", "chunk-large-tiles"],
)
def test_every_tile_config_is_correct(
    monkeypatch: pytest.MonkeyPatch, builder: str, config: dict[str, int]
) -> None:
    # The launchers pick tiles from the head layout; force others so the kernel is checked on
    # query blocks straddling chunk ends and tiles straddling cache blocks at every size.
    monkeypatch.setattr(pa, builder, lambda *args: config)
    batch = make_paged_batch(
        Q_LENS,
        SEQ_LENS,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=3,
    )
    got, want = _run(batch, torch.float32, num_decodes=1)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_pure_decode_and_single_long_prefill() -> None:
    decode = make_paged_batch(
        [1] * 5,
        [1, 16, 17, 48, 100],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )
    got, want = _run(decode, torch.float32, num_decodes=5)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    # One 130-token prompt on the 128-row chunk tiles: two query blocks, heaviest first.
    prefill = make_paged_batch(
        [130],
        [130],
        num_kv_heads=1,
        group=2,
        head_dim=64,
        block_size=32,
        dtype=torch.float16,
        seed=6,
    )
    assert pa.prefill_config(2, 64)["BLOCK_M"] == 128
    got, want = _run(prefill, torch.float16)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float16])


def test_int64_metadata_and_strided_query() -> None:
    batch = make_paged_batch(
        [3, 1],
        [10, 20],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=7,
    )
    # The query as a view into a fused qkv buffer: token stride larger than Hq * D.
    fused = torch.randn(4, 6, 64, device=DEVICE)
    fused[:, :4] = batch.query
    query = fused[:, :4]
    args = (
        query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc.long(),
        batch.seq_lens.long(),
        batch.block_tables.long(),
        batch.scale,
    )
    got = ops.paged_attention(*args, out=poisoned((4, 4, 64), torch.float32))
    torch.testing.assert_close(got, ref.paged_attention(*args), **TOLERANCES[torch.float32])


def test_grid_covers_any_batch_for_any_block_q() -> None:
    # The chunk grid T // BLOCK_Q + S must give every sequence cdiv(q_len, BLOCK_Q) programs.
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        q_lens = torch.randint(0, 40, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen)
        block_q = int(torch.randint(1, 33, (1,), generator=gen))
        starts = [0, *q_lens.cumsum(0).tolist()]
        for i, q_len in enumerate(q_lens.tolist()):
            first, next_first = starts[i] // block_q + i, starts[i + 1] // block_q + i + 1
            assert next_first - first >= -(-q_len // block_q)


def test_paged_attention_validation() -> None:
    batch = make_paged_batch(
        [1], [5], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    q, kc, vc = batch.query, batch.k_cache, batch.v_cache
    qsl, sl, bt = batch.query_start_loc, batch.seq_lens, batch.block_tables
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ops.paged_attention(q[:, :3], kc, vc, qsl, sl, bt, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        ops.paged_attention(q, kc, vc, qsl[:1], sl, bt, 1.0)
    with pytest.raises(ValueError, match="share dtype"):
        ops.paged_attention(q, kc, vc.half(), qsl, sl, bt, 1.0)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        ops.paged_attention(q, kc[..., :32], vc[..., :32], qsl, sl, bt, 1.0)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        ops.paged_attention(q, kc, vc, qsl, sl, bt.float(), 1.0)
    with pytest.raises(ValueError, match="scale"):
        ops.paged_attention(q, kc, vc, qsl, sl, bt, 0.0)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        ops.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, qsl, sl, bt, 1.0)


@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    num_seqs = draw(st.integers(1, 5))
    q_lens = draw(st.lists(st.integers(0, 24), min_size=num_seqs, max_size=num_seqs))
    # seq_len >= q_len (the chunk is the tail of the context), >= 1 so no sequence is empty.
    seq_lens = [q + draw(st.integers(0 if q else 1, 70)) for q in q_lens]
    return q_lens, seq_lens


@settings(max_examples=25, deadline=None, derandomize=True)
@given(batch_shape=ragged_batches(), group=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([16, 32]))
def test_random_ragged_batches(batch_shape: tuple[list[int], list[int]], group: int, block_size: int) -> None:
    q_lens, seq_lens = batch_shape
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_kv_heads=2,
        group=group,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float32,
        seed=sum(seq_lens),
    )
    got, want = _run(batch, torch.float32)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
