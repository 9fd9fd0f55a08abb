"""Flatten one SchedulerOutput into the arrays a forward pass needs.

Pure numpy and Python: no torch, no device. The layout is the scheduler's order (decodes
first, then prefill chunks); request i's new tokens occupy [query_start_loc[i],
query_start_loc[i+1]) of the flat batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    # Async scheduling: decode inputs whose token the previous step is still sampling. The
    # runner fills input_ids[token_index] with that request's sampled token before running.
    pending_token_indices: list[int] = field(default_factory=list)  # flat indices into [T]
    pending_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def prepare_inputs(output: SchedulerOutput, block_size: int) -> PreparedInputs:
    scheduled = output.scheduled
    num_seqs = len(scheduled)
    # Plain lists first (numpy item access costs more than it saves at these sizes), each
    # field in one comprehension; per-token arithmetic is vectorised afterwards.
    starts = [s.num_computed_tokens for s in scheduled]  # [S]
    query_lens = [s.num_new_tokens for s in scheduled]  # [S]
    tables = [s.block_table for s in scheduled]  # [S] of [blocks]
    input_ids: list[int] = []
    pending_indices: list[int] = []
    pending_ids: list[str] = []
    for s in scheduled:
        start, request = s.num_computed_tokens, s.request
        if s.num_new_tokens == 1:  # the common decode case
            offset = start - len(request.prompt_token_ids)
            outputs = request.output_token_ids
            if offset < 0:
                input_ids.append(request.prompt_token_ids[start])
            elif offset < len(outputs):
                input_ids.append(outputs[offset])
            else:  # still being sampled by the step in flight
                pending_indices.append(len(input_ids))
                pending_ids.append(request.request_id)
                input_ids.append(0)
        else:
            input_ids.extend(_token_slice(request, start, start + s.num_new_tokens))
    sample_rows = [i for i, s in enumerate(scheduled) if s.samples and not s.is_padding]
    lens = np.array(query_lens, dtype=np.int64)  # [S]
    max_query_len = int(lens.max(initial=0))
    seq_lens = np.array(starts, dtype=np.int64) + lens  # [S]
    if max_query_len == 1:  # decodes only: token i is request i's last
        query_start = np.arange(num_seqs + 1, dtype=np.int32)
        token_rows = np.arange(num_seqs)  # [T] the request row of each token
        positions = seq_lens - 1
    else:
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(lens, out=query_start[1:])
        token_rows = np.repeat(np.arange(num_seqs), lens)
        # position of flat token t = its request's start + (t - its request's first index)
        positions = (np.arange(len(input_ids), dtype=np.int64)
                     + (seq_lens - lens - query_start[:-1])[token_rows])
    block_tables = _padded_block_tables(tables)
    slot_mapping = (block_tables[token_rows, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    padding_rows = [i for i, s in enumerate(scheduled) if s.is_padding]
    if padding_rows:  # padding rows write no key or value
        slot_mapping[np.isin(token_rows, padding_rows)] = -1
    last_indices = query_start[1:].astype(np.int64) - 1  # [S] flat index of each last token
    return PreparedInputs(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        sample_rows=sample_rows,
        logits_indices=last_indices if len(sample_rows) == num_seqs else last_indices[sample_rows],
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max(initial=0)),
        pending_token_indices=pending_indices,
        pending_request_ids=pending_ids,
    )


def _padded_block_tables(tables: list[Sequence[int]]) -> np.ndarray:
    """[S, M] int32: each block table, zero padded to the longest."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(int(lengths.max(initial=0)), 1)
    padded = np.zeros((len(tables), width), dtype=np.int32)
    try:  # the block manager's int32 arrays: their bytes, joined, are the flat entries
        flat = np.frombuffer(b"".join(tables), dtype=np.int32)
    except TypeError:  # plain lists (tests, hand-built plans): convert each int
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32,
                           count=int(lengths.sum()))
    padded[np.arange(width) < lengths[:, None]] = flat
    return padded


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    return (prompt + request.output_token_ids)[start:end]
