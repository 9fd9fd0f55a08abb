"""An eager step's index inputs in one host-to-device copy.

An eager step (prefill chunks, or a decode batch no CUDA graph covers) needs about ten small
index arrays on the device: input ids, positions, slots, the attention layout, the logits
rows, the kernels' work lists. Copying each from pageable memory costs a staging copy and a
transfer apiece. Here they are packed, as int32, into one pinned host buffer and shipped
with one non-blocking copy into one device buffer whose views they become (as the CUDA
graphs' inputs are, cuda_graphs.PackedGraphInputs). Two host twins alternate, each guarded
by an event, so a step never rewrites a twin whose copy may still be in flight; the device
buffer is reused, which is safe because the next step's copy queues on the same stream
behind this step's kernels. Buffers grow to the next power of two and stay.

On CPU the same packing runs into plain memory (no pinning, no events), so the CPU tests
exercise the layout the GPU uses.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _capacity(num_values: int) -> int:
    return 1 << max(num_values - 1, 0).bit_length()


class PackedStepInputs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host_buffers = [torch.empty(0, dtype=torch.int32) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.pinned else []
        self.device_buffer = torch.empty(0, dtype=torch.int32, device=device)
        self.turn = 0

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Every array as an int32 device tensor of its own shape, all from one copy.

        Values must fit in int32 (token ids, positions, slots and block ids all do).
        """
        total = sum(array.size for array in arrays.values())
        host = self._host_twin(total)
        flat = host.numpy()
        layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, array in arrays.items():
            flat[offset : offset + array.size] = array.reshape(-1)
            layout[name] = (offset, array.shape)
            offset += array.size
        if self.device_buffer.numel() < total:
            self.device_buffer = torch.empty(_capacity(total), dtype=torch.int32, device=self.device)
        self.device_buffer[:total].copy_(host[:total], non_blocking=self.pinned)
        if self.pinned:
            self.copied[self.turn].record()
        self.turn ^= 1
        return {name: self.device_buffer[start : start + math.prod(shape)].view(shape)
                for name, (start, shape) in layout.items()}

    def _host_twin(self, total: int) -> torch.Tensor:
        """This turn's host buffer, at least `total` long, its previous copy finished."""
        if self.pinned:
            self.copied[self.turn].synchronize()  # queued two steps ago: long done
        host = self.host_buffers[self.turn]
        if host.numel() < total:
            host = torch.empty(_capacity(total), dtype=torch.int32)
            self.host_buffers[self.turn] = host.pin_memory() if self.pinned else host
        return self.host_buffers[self.turn]
