"""CUDA graphs for decode-only steps: a ladder of captured batch sizes, padded up.

A decode step of a small model is dominated by kernel launch overhead; replaying a captured
graph removes it. Each graph reads its inputs from static buffers, so a step copies its
inputs in, pads the batch up to the next captured size (padding slots are -1 and padding
rows attend to a single token of block 0, whose output is discarded) and replays.
Only used on CUDA; the CPU path never constructs this class.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.input_batch import PreparedInputs

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_batch_size: int,
        max_blocks_per_seq: int,
        split_kv_for: Callable[[int, int], bool],
    ) -> None:
        self.split_kv_for = split_kv_for  # (batch size, max context) -> use split-KV decode
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch_size] or [max_batch_size]
        if self.sizes[-1] < max_batch_size and max_batch_size <= CAPTURE_SIZES[-1]:
            self.sizes.append(max_batch_size)
        self.max_blocks = max_blocks_per_seq
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [n]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [n]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        max_seq_len = self.max_blocks * self.kv_caches[0][0].shape[1]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            # Kernels size their grids from this, so capture for the longest context.
            max_seq_len=max_seq_len,
            is_decode_only=True,
            use_split_kv=self.split_kv_for(size, max_seq_len),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))
            self.model(*args)  # warm up: triton autotuning and lazy init outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, prepared: PreparedInputs) -> bool:
        return (prepared.num_tokens <= self.sizes[-1]
                and prepared.block_tables.shape[1] <= self.max_blocks)

    def run(self, prepared: PreparedInputs,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:  # -> [num_tokens, hidden]
        """input_ids: [T] already on the device (async scheduling fills pending decode
        inputs there); None copies prepared.input_ids."""
        n = prepared.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = prepared.block_tables.shape[1]
        source = torch.from_numpy(prepared.input_ids) if input_ids is None else input_ids
        self.input_ids[:n].copy_(source, non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(prepared.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(prepared.slot_mapping), non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(torch.from_numpy(prepared.seq_lens), non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :width].copy_(torch.from_numpy(prepared.block_tables),
                                            non_blocking=True)
        self.block_tables[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
