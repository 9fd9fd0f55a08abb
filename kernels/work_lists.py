"""Host-built work lists: which (sequence, piece) each program of an attention launch runs.

An eager step knows its sequence and chunk lengths on the host, so it can size a launch's
grid from the real work and choose the order programs start in, at no device sync. A work
list is an int32 array [P, 2]: program i runs item i, (sequence, piece), where the piece is
a KV split (split-KV stage 1) or a query block (the chunk launch). The launchers take the
list as a device tensor and launch exactly P programs per KV head.

Pure numpy, no triton: the runner builds lists without importing the kernels, and the
kernels derive their tile sizes from the same functions, so the two always agree.
"""

from __future__ import annotations

import numpy as np

# Tokens per K/V tile in every attention loop: 32 KB of bf16 K+V per pipeline stage.
KV_TILE = 64
# Rows (query tokens x query heads) per chunk program: compute-bound, tensor-core sized.
PREFILL_ROWS = 128


def kv_tile(head_dim: int) -> int:
    """K/V tile length in tokens for this head_dim (half for head_dim 256)."""
    return KV_TILE if head_dim <= 128 else KV_TILE // 2


def prefill_block_m(group: int) -> int:
    """Rows per chunk program: 128, or the group padded to a power of two if larger."""
    return max(PREFILL_ROWS, 1 << max(group - 1, 0).bit_length())


def prefill_block_q(group: int) -> int:
    """Query tokens per chunk program (each brings its `group` query heads)."""
    return prefill_block_m(group) // group


def _cdiv(a: np.ndarray, b: int | np.ndarray) -> np.ndarray:
    return -(-a // b)


def split_lengths(seq_lens: np.ndarray, num_splits: int, tile: int) -> np.ndarray:  # [S] -> [S]
    """Tokens per split of each sequence: cdiv(len, splits) rounded up to whole tiles.

    The split-KV kernels compute the same (split_range): change both together.
    """
    per_split = _cdiv(_cdiv(seq_lens.astype(np.int64), num_splits), tile) * tile
    return np.maximum(per_split, tile)


def active_splits(seq_lens: np.ndarray, num_splits: int, tile: int) -> np.ndarray:  # [S] -> [S]
    """How many of the num_splits splits of each sequence hold at least one token."""
    per_split = split_lengths(seq_lens, num_splits, tile)
    return np.minimum(_cdiv(seq_lens.astype(np.int64), per_split), num_splits)


def split_work(seq_lens: np.ndarray, num_splits: int, head_dim: int) -> np.ndarray:  # [P, 2]
    """(sequence, split) of every non-empty split of a decode batch, longest sequences first.

    seq_lens: [S] context lengths of the decode part. A sequence of L tokens gets
    min(num_splits, cdiv(L, its split length)) programs instead of num_splits, so a short
    context beside a long one launches no program that would find nothing to do. Longest
    sequences first: their splits are the longest, so they do not land in the tail.
    """
    counts = active_splits(np.asarray(seq_lens), num_splits, kv_tile(head_dim))
    order = np.argsort(-np.asarray(seq_lens), kind="stable")
    seqs = np.repeat(order, counts[order])
    splits = np.arange(seqs.shape[0]) - np.repeat(np.cumsum(counts[order]) - counts[order], counts[order])
    return np.stack([seqs, splits], axis=1).astype(np.int32)


def prefill_work(query_start_loc: np.ndarray, seq_lens: np.ndarray, group: int) -> np.ndarray:  # [P, 2]
    """(chunk, query block) of every query block of the chunk launch, heaviest first.

    query_start_loc: [S' + 1], seq_lens: [S'] of the chunks (the batch past its decodes).
    A query block's cost is the keys it attends to, min(seq_len, context + end of block),
    so the order runs the last blocks of the longest contexts first across all chunks, and
    the cheap blocks fill the tail. A chunk with no query tokens gets no program.
    """
    block_q = prefill_block_q(group)
    q_lens = np.diff(np.asarray(query_start_loc).astype(np.int64))
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    blocks = _cdiv(q_lens, block_q)
    chunks = np.repeat(np.arange(q_lens.shape[0]), blocks)
    q_block = np.arange(chunks.shape[0]) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    context = (seq_lens - q_lens)[chunks]
    keys = np.minimum(seq_lens[chunks], context + (q_block + 1) * block_q)
    order = np.argsort(-keys, kind="stable")
    return np.stack([chunks[order], q_block[order]], axis=1).astype(np.int32)
