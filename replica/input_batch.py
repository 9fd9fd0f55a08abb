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
    query_lens = [s.num_new_tokens for s in scheduled]
    num_tokens = sum(query_lens)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    max_blocks = max((len(s.block_table) for s in scheduled), default=1)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    sample_rows: list[int] = []
    offset = 0
    for i, s in enumerate(scheduled):
        start, n, table, request = s.num_computed_tokens, s.num_new_tokens, s.block_table, s.request
        end = start + n
        block_tables[i, : len(table)] = table
        seq_lens[i] = end
        if n == 1:  # the common decode case, kept free of numpy call overhead
            input_ids[offset] = request.token_id_at(start)
            positions[offset] = start
            slot_mapping[offset] = table[start // block_size] * block_size + start % block_size
        else:
            pos = np.arange(start, end, dtype=np.int64)
            input_ids[offset : offset + n] = _token_slice(request, start, end)
            positions[offset : offset + n] = pos
            slot_mapping[offset : offset + n] = (
                block_tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
            )
        if s.samples:
            sample_rows.append(i)
        offset += n
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    logits_indices = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    return PreparedInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_rows=sample_rows,
        logits_indices=logits_indices,
        max_query_len=max(query_lens, default=0),
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
    )


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    return (prompt + request.output_token_ids)[start:end]
