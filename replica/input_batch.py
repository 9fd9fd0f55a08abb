"""Flatten one SchedulerOutput into the arrays a forward pass needs.

Pure numpy and Python: no torch, no device. The layout is the scheduler's order (decodes
first, then prefill chunks); request i's new tokens occupy [query_start_loc[i],
query_start_loc[i+1]) of the flat batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from iterserve.replica.outputs import SchedulerOutput
from iterserve.replica.request import Request


@dataclass
class PreparedInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, M] int32, zero padded
    sample_rows: list[int]  # indices into the S requests that sample this step
    logits_indices: np.ndarray  # [len(sample_rows)] int64, flat index of each one's last token
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def prepare_inputs(output: SchedulerOutput, block_size: int) -> PreparedInputs:
    scheduled = output.scheduled
    num_seqs = len(scheduled)
    # Plain lists while looping (numpy item access costs more than it saves at these sizes).
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    sample_rows: list[int] = []
    max_blocks = max((len(s.block_table) for s in scheduled), default=1)
    padded_tables = []
    for i, s in enumerate(scheduled):
        start, n, table, request = s.num_computed_tokens, s.num_new_tokens, s.block_table, s.request
        end = start + n
        padded_tables.append(table + [0] * (max_blocks - len(table)))
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + n)
        if n == 1:  # the common decode case
            input_ids.append(request.token_id_at(start))
            positions.append(start)
            if s.is_padding:
                slot_mapping.append(-1)
            else:
                slot_mapping.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(_token_slice(request, start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size
                                for p in range(start, end))
        if end >= request.num_tokens and not s.is_padding:
            sample_rows.append(i)
    query_start = np.array(query_start_loc, dtype=np.int32)
    return PreparedInputs(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slot_mapping, dtype=np.int64),
        query_start_loc=query_start,
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=np.array(padded_tables, dtype=np.int32).reshape(num_seqs, max_blocks),
        sample_rows=sample_rows,
        logits_indices=query_start[1:][sample_rows].astype(np.int64) - 1,
        max_query_len=max((s.num_new_tokens for s in scheduled), default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    return (prompt + request.output_token_ids)[start:end]
