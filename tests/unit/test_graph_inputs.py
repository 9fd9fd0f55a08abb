"""Host-side halves of the engine step: the packed CUDA-graph inputs and the launch hints.

The device half (one pinned host-to-device copy into the graph's static buffers) needs a
GPU: loadtests/studies/gpu_first_light/gpu_first_light.py runs it. Here the packing is checked on numpy.
"""

from __future__ import annotations

import numpy as np

from iterserve.replica.attention_metadata import count_leading_decodes
from iterserve.replica.cuda_graphs import FIELDS, field, pack_graph_inputs, tables
from iterserve.replica.input_batch import PreparedInputs


def _prepared(n: int, width: int) -> PreparedInputs:
    return PreparedInputs(
        input_ids=np.arange(100, 100 + n, dtype=np.int64),
        positions=np.arange(10, 10 + n, dtype=np.int64),
        slot_mapping=np.arange(200, 200 + n, dtype=np.int64),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=np.arange(11, 11 + n, dtype=np.int32),
        block_tables=np.arange(n * width, dtype=np.int32).reshape(n, width) + 1,
        sample_rows=list(range(n)),
        logits_indices=np.arange(n, dtype=np.int64),
        max_query_len=1,
        max_seq_len=10 + n,
    )


def test_pack_graph_inputs_pads_and_returns_the_used_prefix() -> None:
    capacity, max_blocks = 8, 6
    buffer = np.full(len(FIELDS) * capacity + capacity * max_blocks, 777, dtype=np.int32)
    used = pack_graph_inputs(buffer, capacity, max_blocks, _prepared(3, 2), size=4)
    assert used == len(FIELDS) * capacity + 4 * max_blocks
    assert field(buffer, capacity, "input_ids")[:3].tolist() == [100, 101, 102]
    assert field(buffer, capacity, "positions")[:3].tolist() == [10, 11, 12]
    assert field(buffer, capacity, "slot_mapping")[:4].tolist() == [200, 201, 202, -1]
    assert field(buffer, capacity, "seq_lens")[:4].tolist() == [11, 12, 13, 1]
    block_tables = tables(buffer, capacity, max_blocks)
    assert block_tables[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert block_tables[3, 0] == 0  # the padding row attends to one token of block 0
    # A second, smaller step reuses the buffer: what it needs is rewritten.
    pack_graph_inputs(buffer, capacity, max_blocks, _prepared(1, 1), size=1)
    assert field(buffer, capacity, "slot_mapping")[0] == 200 and block_tables[0, 0] == 1


def test_count_leading_decodes() -> None:
    assert count_leading_decodes(np.array([0, 1, 2, 3])) == 3  # decode only
    assert count_leading_decodes(np.array([0, 1, 2, 9, 10])) == 2  # decodes, a chunk, then q_len 1
    assert count_leading_decodes(np.array([0, 7, 8])) == 0
    assert count_leading_decodes(np.array([0])) == 0
