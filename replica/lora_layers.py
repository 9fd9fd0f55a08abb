"""LoRA beside the base linears: one step applies each row's own adapter (Punica's idea).

The base `Linear` is left as it is (on CPU its weight stays prepacked for oneDNN): a
`LoRALinear` wraps it and adds `(x A_s^T) B_s^T` to the rows whose request uses the adapter
in slot s. Each wrapped linear holds `max_loras` slots, zero-padded to `max_lora_rank`:
`shrink` [slots, n_slices * R, in] (the A of every slice of a fused projection stacked, so
the shrink of q/k/v or gate/up is one matmul) and `expand` [slots, out, R] (each slice's B,
scaled, in its own rows), the layout the GPU's SGMV kernels read too (kernels/lora_sgmv.py).

The step's row -> slot assignment is one `LoRABatch`, shared by every wrapped linear and set
once per step by the runner before the forward (as vLLM's punica wrapper is): the adapter
rows sorted by slot, and the runs of equal slot in that order. Each run costs two small
matmuls per slice, whatever the batch size; rows without an adapter cost nothing, and a
step with none skips LoRA altogether.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from iterserve.replica.models.layers import Linear


@dataclass
class LoRABatch:
    """This step's adapter rows. `order`: the flat rows using an adapter, sorted by slot
    (None when those rows already sit in runs of one slot each, so no gather is needed);
    `runs`: (slot, start, end) over the sorted rows (or over the flat rows when `order` is
    None). No runs: the step has no adapter row."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    order: torch.Tensor | None = None  # [N] int64 flat row indices
    # For the SGMV kernels (with_segments): the adapter rows grouped by slot, and per
    # segment [3, S] its start in `rows`, its length and its slot; `longest` segment's length.
    with_segments: bool = False
    # The CPU's batched path for many adapters (`padded`): every slot's rows in a [slots, M]
    # grid (M: the most rows one slot has), so one bmm per slice serves every adapter.
    num_slots: int = 0
    padded: PaddedRows | None = None
    rows: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    longest: int = 0

    def assign(self, token_slots: list[int], device: torch.device) -> None:
        """Set the step from each flat row's slot (-1: the base model alone)."""
        self._group(token_slots, device)
        if self.with_segments:
            self._segments(device)
            return
        self.padded = None
        if self.runs and should_pad(self.runs, self.num_slots):
            self.padded = PaddedRows.of(token_slots, device)

    def _segments(self, device: torch.device) -> None:
        if self.order is not None:
            rows = self.order
            bounds = [(slot, start, end) for slot, start, end in self.runs]
        else:
            rows = torch.cat([torch.arange(start, end) for _, start, end in self.runs]
                             or [torch.zeros(0, dtype=torch.int64)]).to(device)
            offsets = [0]
            for _, start, end in self.runs:
                offsets.append(offsets[-1] + end - start)
            bounds = [(slot, offsets[i], offsets[i + 1])
                      for i, (slot, _, _) in enumerate(self.runs)]
        self.rows = rows
        self.segments = torch.tensor([[start for _, start, _ in bounds],
                                      [end - start for _, start, end in bounds],
                                      [slot for slot, _, _ in bounds]],
                                     dtype=torch.int64).reshape(3, len(bounds)).to(device)
        self.longest = max((end - start for _, start, end in bounds), default=0)

    def _group(self, token_slots: list[int], device: torch.device) -> None:
        self.runs, self.order = [], None
        contiguous: list[tuple[int, int, int]] = []
        start = 0
        for row in range(1, len(token_slots) + 1):
            if row == len(token_slots) or token_slots[row] != token_slots[start]:
                if token_slots[start] >= 0:
                    contiguous.append((token_slots[start], start, row))
                start = row
        if len({slot for slot, _, _ in contiguous}) == len(contiguous):
            self.runs = contiguous
            return
        rows = sorted((slot, row) for row, slot in enumerate(token_slots) if slot >= 0)
        self.order = torch.tensor([row for _, row in rows], dtype=torch.int64, device=device)
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][0] != rows[start][0]:
                self.runs.append((rows[start][0], start, i))
                start = i


def should_pad(runs: list[tuple[int, int, int]], num_slots: int) -> bool:
    """Whether one bmm over the slots' padded rows beats a loop over the runs: a run costs
    1 + n_slices small matmuls, each ~10-30 us of dispatch on CPU whatever its size, while the
    grid computes (highest slot used + 1) * M rows and reads those slots' weights whatever
    their use. Measured (loadtests/studies/multi_lora): 16 adapters x 2 rows favour the grid;
    1 adapter x 32 rows the loop."""
    if len(runs) < 3 or num_slots == 0:  # 0: a batch built without slots (the loop only)
        return False
    rows = sum(end - start for _, start, end in runs)
    longest = max(end - start for _, start, end in runs)
    width = max(slot for slot, _, _ in runs) + 1
    return width * longest <= 4 * rows


@dataclass
class PaddedRows:
    """The adapter rows in a [width, M] grid over slots 0..width-1 (the slot manager fills the
    lowest free slots first, so the used ones sit low): `index` [width * M] the flat row of
    each cell (padding cells read row 0, their results dropped), `cells` [N] the grid cell of
    each adapter row and `rows` [N] its flat row."""

    index: torch.Tensor
    cells: torch.Tensor
    rows: torch.Tensor
    depth: int  # M
    width: int  # highest slot used + 1

    @staticmethod
    def of(token_slots: list[int], device: torch.device) -> PaddedRows:
        width = max(token_slots) + 1
        per_slot: list[list[int]] = [[] for _ in range(width)]
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                per_slot[slot].append(row)
        depth = max(map(len, per_slot))
        index = [0] * (width * depth)
        cells, rows = [], []
        for slot, slot_rows in enumerate(per_slot):
            for i, row in enumerate(slot_rows):
                index[slot * depth + i] = row
                cells.append(slot * depth + i)
                rows.append(row)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return PaddedRows(tensor(index), tensor(cells), tensor(rows), depth, width)


class LoRALinear(nn.Module):
    """A base linear plus the adapters in its slots. `slices`: (offset, size) of each output
    slice (q, k, v of a fused qkv; gate, up; or the whole output)."""

    def __init__(self, base: Linear, slices: list[tuple[int, int]], max_loras: int,
                 max_rank: int, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.slice_bounds = [offset for offset, _ in slices] + [sum(size for _, size in slices)]
        self.max_rank = max_rank
        self.batch = batch
        weight = base.weight
        out_features, in_features = weight.shape
        self.shrink = torch.zeros(max_loras, len(slices) * max_rank, in_features,
                                  dtype=weight.dtype, device=weight.device)
        # [slots, out, R] as a view of [slots, R, out]: the CPU's bmm then reads each slice's
        # B^T with unit stride, no copy (measured 1.5x faster than [slots, out, R] storage).
        self.expand = torch.zeros(max_loras, max_rank, out_features, dtype=weight.dtype,
                                  device=weight.device).transpose(1, 2)

    def set_slot(self, slot: int, per_slice: list[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Write an adapter into `slot`: per slice (A [r, in], B [out_slice, r]) or None for a
        slice it does not adapt (left zero)."""
        rank = self.max_rank
        self.shrink[slot].zero_()
        self.expand[slot].zero_()
        for i, ((offset, size), pair) in enumerate(zip(self.slices, per_slice, strict=True)):
            if pair is None:
                continue
            a, b = pair
            self.shrink[slot, i * rank:i * rank + a.shape[0]].copy_(a)
            self.expand[slot, offset:offset + size, :b.shape[1]].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        out = self.base(x)
        batch = self.batch
        if not batch.runs:
            return out
        if batch.with_segments:  # the GPU: one shrink and one expand launch for every adapter
            from iterserve.kernels.lora_sgmv import lora_expand, lora_shrink

            hidden = lora_shrink(x, self.shrink, batch.rows, batch.segments, batch.longest)
            return lora_expand(hidden, self.expand, out, batch.rows, batch.segments,
                               batch.longest, self.slice_bounds)
        if batch.padded is not None:
            return self._add_lora_padded(out, x, batch.padded)
        if batch.order is None:
            for slot, start, end in batch.runs:
                self._add_lora(out[start:end], x[start:end], slot)
            return out
        rows = x.index_select(0, batch.order)  # [N, in], sorted by slot
        delta = torch.zeros((rows.shape[0], out.shape[1]), dtype=out.dtype, device=out.device)
        for slot, start, end in batch.runs:
            self._add_lora(delta[start:end], rows[start:end], slot)
        return out.index_add_(0, batch.order, delta)

    def _add_lora_padded(self, out: torch.Tensor, x: torch.Tensor, grid: PaddedRows
                         ) -> torch.Tensor:
        """out += each row's adapter, every slot at once: one bmm for the shrink, one per
        slice for the expand, over the [slots, M] grid of rows."""
        rank, slots = self.max_rank, grid.width
        cells = x.index_select(0, grid.index).view(slots, grid.depth, x.shape[1])
        hidden = torch.bmm(cells, self.shrink[:slots].transpose(1, 2))  # [slots, M, n*R]
        parts = [torch.bmm(hidden[:, :, i * rank:(i + 1) * rank],
                           self.expand[:slots, offset:offset + size].transpose(1, 2))
                 for i, (offset, size) in enumerate(self.slices)]  # [slots, M, size] each
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        delta = delta.view(slots * grid.depth, -1).index_select(0, grid.cells)
        return out.index_add_(0, grid.rows, delta)

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor, slot: int) -> None:
        """out += x A^T B^T for the adapter in `slot`, slice by slice (in place on views)."""
        rank = self.max_rank
        hidden = x @ self.shrink[slot].T  # [rows, n_slices * R]
        expand = self.expand[slot]
        for i, (offset, size) in enumerate(self.slices):
            out[:, offset:offset + size].addmm_(hidden[:, i * rank:(i + 1) * rank],
                                                expand[offset:offset + size].T)
