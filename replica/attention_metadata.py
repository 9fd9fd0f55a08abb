"""The flat batch's layout, as the attention ops need it.

The runner lays out every scheduled request's new tokens back to back (decodes first, then
prefill chunks). Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and,
after this step's keys are written, a context of seq_lens[i] tokens in the paged cache whose
blocks are block_tables[i, :ceil(seq_lens[i] / block_size)].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [S, M] int32, padded with 0 past each sequence's blocks
    slot_mapping: torch.Tensor  # [T] int32 (int64 also taken), block * B + offset; -1 pads
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every query length is 1
    # Launch hints for the Triton attention, known on the host (no device sync): the first
    # num_decodes sequences have one query token each (the decode launch), and that part runs
    # split num_kv_splits ways across the context (flash-decoding) when > 1.
    num_decodes: int = 0
    num_kv_splits: int = 1
    # Eager steps only: [P, 2] int32, the decode part's non-empty (sequence, split) pairs
    # (kernels/work_lists.split_work), so split-KV launches no idle program. None under CUDA
    # graphs, whose grid must stay the same between replays. On CPU (replica/cpu_attention.py)
    # [P + 1, 3] int32: every decode's (sequence, KV block, tokens) pairs, one split per block.
    split_work: torch.Tensor | None = None
    # [P, 2] int32, the chunk part's (chunk, query block) pairs heaviest first across chunks
    # (kernels/work_lists.prefill_work). Chunks never run under CUDA graphs.
    prefill_work: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def count_leading_decodes(query_start_loc: np.ndarray) -> int:  # [S + 1] host array
    """How many sequences at the front of the batch have exactly one query token."""
    not_one = np.flatnonzero(np.diff(query_start_loc) != 1)
    return int(not_one[0]) if not_one.size else int(query_start_loc.shape[0] - 1)
