"""The flat batch's layout, as the attention ops need it.

The runner lays out every scheduled request's new tokens back to back (decodes first, then
prefill chunks). Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and,
after this step's keys are written, a context of seq_lens[i] tokens in the paged cache whose
blocks are block_tables[i, :ceil(seq_lens[i] / block_size)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [S, M] int32, padded with 0 past each sequence's blocks
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset; -1 for padding
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every query length is 1: the split-KV decode kernel applies
    # Run decode attention split across the context (flash-decoding): set by the runner for
    # decode-only batches too small to fill the GPU.
    use_split_kv: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
