"""replica/cpu_attention.py (the engine's CPU attention) against kernels/reference.py.

The batches come from make_paged_batch: random non-contiguous block tables, every slot no
sequence owns full of NaN, so reading past a sequence's tokens or a wrong block shows. The
block-transposed K layout the engine allocates is checked next to the contiguous one.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kernel_testlib import PagedBatch, make_paged_batch

from iterserve.kernels import reference as ref
from iterserve.replica import cpu_attention
from iterserve.replica.cpu_attention import CpuAttention, decode_work, write_kv_cache

TOLERANCES = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def cpu_batch(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, head_dim: int,
              transposed: bool) -> PagedBatch:
    """make_paged_batch on the CPU, the query a strided view of a fused qkv (as the model
    hands it over), K optionally in the engine's block-transposed storage."""
    b = make_paged_batch(q_lens, seq_lens, num_kv_heads=3, group=3, head_dim=head_dim,
                         block_size=16, dtype=dtype)
    for name in ("query", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables"):
        setattr(b, name, getattr(b, name).cpu())
    tokens, heads = b.query.shape[:2]
    fused = torch.full((tokens, heads + 6, head_dim), float("nan"), dtype=dtype)
    fused[:, :heads] = b.query
    b.query = fused[:, :heads]
    if transposed:  # [N, Hkv, D, B] storage, the [N, B, Hkv, D] view
        b.k_cache = b.k_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return b


def run(attention: CpuAttention, b: PagedBatch, num_decodes: int,
        with_work: bool) -> torch.Tensor:
    work = None
    if with_work:  # as the runner builds it, from its host arrays
        work = torch.from_numpy(decode_work(b.seq_lens[:num_decodes].numpy(),
                                            b.block_tables.numpy(), b.k_cache.shape[1]))
    return attention.paged_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc,
                                     b.seq_lens, b.block_tables, b.scale,
                                     num_decodes=num_decodes, split_work=work)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("seq_lens", [[1, 16, 17, 40, 100], [300], [5, 1, 33, 250, 16, 2]])
def test_block_decode_matches_the_reference_loop(dtype: torch.dtype, head_dim: int,
                                                 transposed: bool, seq_lens: list[int]) -> None:
    b = cpu_batch([1] * len(seq_lens), seq_lens, dtype, head_dim, transposed)
    want = ref.paged_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                               b.block_tables, b.scale)
    attention = CpuAttention("loop", "blocks")
    for with_work in (True, False):
        got = run(attention, b, len(seq_lens), with_work)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCES[dtype],
                                   rtol=TOLERANCES[dtype])
    assert attention.paths["decode_attention"] == "blocks"  # no fallback


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", ["blocks", "loop"])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([1, 1, 9, 0, 24], [33, 2, 9, 5, 60]),  # decodes, a full prefill, an idle row, a chunk
    ([1, 200], [40, 500]),  # a decode, then a 200-token chunk after 300 cached tokens
    ([48], [48]),  # one whole prompt, no decodes
])
def test_sdpa_prefill_matches_the_reference_loop(dtype: torch.dtype, decode: str,
                                                 q_lens: list[int], seq_lens: list[int]) -> None:
    b = cpu_batch(q_lens, seq_lens, dtype, 64, transposed=decode == "blocks")
    num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    want = ref.paged_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                               b.block_tables, b.scale)
    got = run(CpuAttention("sdpa", decode), b, num_decodes, with_work=decode == "blocks")
    rows = sum(q_lens)
    torch.testing.assert_close(got[:rows].float(), want[:rows].float(),
                               atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


def test_decode_work_names_every_block_once_then_an_empty_pair() -> None:
    tables = np.array([[7, 3, 9], [4, 0, 0], [5, 6, 0]], dtype=np.int32)
    work = decode_work(np.array([33, 16, 17], dtype=np.int32), tables, 16)
    assert work.tolist() == [[0, 7, 16], [0, 3, 16], [0, 9, 1], [1, 4, 16], [2, 5, 16],
                             [2, 6, 1], [0, 0, 0]]


def test_cache_writes_land_where_the_reference_writes_them() -> None:
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn((5, 3, 64), generator=gen), torch.randn((5, 3, 64), generator=gen)
    slots = torch.tensor([0, 17, -1, 63, 40], dtype=torch.int32)  # -1: a padding token
    want_k, want_v = torch.zeros((4, 16, 3, 64)), torch.zeros((4, 16, 3, 64))
    ref.write_kv_cache(key, value, want_k, want_v, slots)
    got_k = torch.zeros((4, 3, 64, 16)).permute(0, 3, 1, 2)  # the block-transposed view
    got_v = torch.zeros((4, 16, 3, 64))
    write_kv_cache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_failing_compile_falls_back_to_the_loop_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("C++ compile failed")

    monkeypatch.setattr(cpu_attention, "compiled_decode_blocks", lambda: broken)
    attention = CpuAttention("sdpa", "blocks")
    b = cpu_batch([1, 1], [20, 40], torch.float32, 64, transposed=True)
    want = ref.paged_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                               b.block_tables, b.scale)
    with caplog.at_level(logging.WARNING, logger="iterserve.replica.cpu_attention"):
        for _ in range(2):
            torch.testing.assert_close(run(attention, b, 2, with_work=True), want,
                                       atol=2e-6, rtol=2e-6)
    assert attention.paths["decode_attention"] == "loop (fallback: RuntimeError: C++ compile " \
        "failed)"
    assert len(caplog.records) == 1
