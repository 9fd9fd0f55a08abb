"""CUDA graphs for decode-only steps: a ladder of captured batch sizes, padded up.

A decode step of a small model is dominated by kernel launch overhead; replaying a captured
graph removes it. Each graph reads its inputs from static device buffers, all views of one
packed int32 buffer, so a step writes its inputs (padded up to the next captured size:
padding slots are -1, padding rows attend to a single token of block 0, their output is
discarded) into a pinned host twin with numpy and ships them with ONE host-to-device copy,
then replays. Two host twins alternate, each guarded by an event, so a step never rewrites
a buffer whose copy is still in flight; nothing in the step waits for the device otherwise.
Only used on CUDA; the CPU path never constructs this class.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.input_batch import PreparedInputs

TensorOrArray = TypeVar("TensorOrArray", torch.Tensor, np.ndarray)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


# The packed layout (int32): input_ids [n] | positions [n] | slot_mapping [n] | seq_lens [n] |
# block_tables [n, M]. A step of padded size s uses the prefix up to block-table row s.
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")


def field(buffer: TensorOrArray, capacity: int, name: str) -> TensorOrArray:  # [n]
    index = FIELDS.index(name)
    return buffer[index * capacity : (index + 1) * capacity]


def tables(buffer: TensorOrArray, capacity: int, max_blocks: int) -> TensorOrArray:  # [n, M]
    return buffer[len(FIELDS) * capacity :].reshape(capacity, max_blocks)  # a view either way


def pack_graph_inputs(
    arrays: np.ndarray, capacity: int, max_blocks: int, prepared: PreparedInputs, size: int
) -> int:
    """Write one step's inputs, padded to `size`, into a packed host buffer.

    Returns how many leading elements the step uses (what must be copied to the device).
    """
    n, width = prepared.num_tokens, prepared.block_tables.shape[1]
    field(arrays, capacity, "input_ids")[:n] = prepared.input_ids
    field(arrays, capacity, "positions")[:n] = prepared.positions
    slots = field(arrays, capacity, "slot_mapping")
    slots[:n] = prepared.slot_mapping
    slots[n:size] = -1
    seq_lens = field(arrays, capacity, "seq_lens")
    seq_lens[:n] = prepared.seq_lens
    seq_lens[n:size] = 1
    block_tables = tables(arrays, capacity, max_blocks)
    block_tables[:n, :width] = prepared.block_tables  # entries past width are never read
    block_tables[n:size, 0] = 0
    return len(FIELDS) * capacity + size * max_blocks


class PackedGraphInputs:
    """The graph inputs as views of one device buffer, filled from pinned host twins."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        self.capacity, self.max_blocks = capacity, max_blocks
        total = len(FIELDS) * capacity + capacity * max_blocks
        self.device_buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self.host_buffers = [torch.zeros(total, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0
        self.views = {name: field(self.device_buffer, capacity, name) for name in FIELDS}
        self.block_tables = tables(self.device_buffer, capacity, max_blocks)  # [n, M]
        self.views["seq_lens"].fill_(1)
        self.views["slot_mapping"].fill_(-1)

    def upload(self, prepared: PreparedInputs, size: int) -> None:
        """Pack the step's inputs on the host and copy them to the device in one copy."""
        host = self.host_buffers[self.turn]
        self.copied[self.turn].synchronize()  # the copy from this twin two steps ago: long done
        end = pack_graph_inputs(host.numpy(), self.capacity, self.max_blocks, prepared, size)
        self.device_buffer[:end].copy_(host[:end], non_blocking=True)
        self.copied[self.turn].record()
        self.turn ^= 1


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_batch_size: int,
        max_blocks_per_seq: int,
        kv_splits_for: Callable[[int, int], int],
    ) -> None:
        self.kv_splits_for = kv_splits_for  # (decodes, max context) -> split-KV count
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch_size] or [max_batch_size]
        if self.sizes[-1] < max_batch_size and max_batch_size <= CAPTURE_SIZES[-1]:
            self.sizes.append(max_batch_size)
        self.max_blocks = max_blocks_per_seq
        n = self.sizes[-1]
        self.inputs = PackedGraphInputs(n, max_blocks_per_seq, device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        max_seq_len = self.max_blocks * self.kv_caches[0][0].shape[1]
        views = self.inputs.views
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=views["seq_lens"][:size],
            block_tables=self.inputs.block_tables[:size],
            slot_mapping=views["slot_mapping"][:size],
            max_query_len=1,
            # Kernels size their grids from this, so capture for the longest context.
            max_seq_len=max_seq_len,
            is_decode_only=True,
            num_decodes=size,
            num_kv_splits=self.kv_splits_for(size, max_seq_len),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        views = self.inputs.views
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool
            args = (views["input_ids"][:size], views["positions"][:size], self.kv_caches,
                    self._metadata(size))
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
            pending: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:  # -> [num_tokens, hidden]
        """pending: (flat indices, token ids) on the device of decode inputs the previous
        step is still sampling (async scheduling), written over the uploaded input ids."""
        n = prepared.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.inputs.upload(prepared, size)
        if pending is not None:  # async scheduling: inputs the previous step is sampling
            where, token_ids = pending
            self.inputs.views["input_ids"][where] = token_ids.to(torch.int32)
        self.graphs[size].replay()
        return self.outputs[size][:n]
