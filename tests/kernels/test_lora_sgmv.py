"""The LoRA SGMV shrink/expand kernels against a per-row torch oracle, under the Triton
interpreter on CPU (on a GPU when one is present): ranks 8-64, fused slices of unequal
widths, segments of mixed slots (rows interleaved in the batch), rows with no adapter."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE

from iterserve.kernels.lora_sgmv import lora_expand, lora_shrink


def oracle(x: torch.Tensor, shrink: torch.Tensor, expand: torch.Tensor,
           slots: list[int], slices: list[tuple[int, int]], rank: int) -> torch.Tensor:
    """Each row alone: x A_slot^T, then each slice's B_slot; rows with slot -1 get zero."""
    out = torch.zeros(x.shape[0], expand.shape[1], dtype=torch.float64)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        hidden = shrink[slot].double() @ x[row].double()
        for i, (offset, size) in enumerate(slices):
            out[row, offset:offset + size] = (expand[slot, offset:offset + size].double()
                                              @ hidden[i * rank:(i + 1) * rank])
    return out


def segments_of(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """rows grouped by slot and [3, S] (start, length, slot), as LoRABatch builds them."""
    order = sorted((slot, row) for row, slot in enumerate(slots) if slot >= 0)
    rows = [row for _, row in order]
    starts, lengths, seg_slots = [], [], []
    for i, (slot, _) in enumerate(order):
        if i == 0 or order[i - 1][0] != slot:
            starts.append(i)
            lengths.append(0)
            seg_slots.append(slot)
        lengths[-1] += 1
    segments = torch.tensor([starts, lengths, seg_slots], dtype=torch.int64, device=DEVICE)
    return (torch.tensor(rows, dtype=torch.int64, device=DEVICE), segments,
            max(lengths, default=0))


@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("slots", [
    [0, 2, -1, 1, 2, 0, 0, 3, -1, 1, 2, 2, 0],  # interleaved, with base rows
    [1] * 19,  # one adapter, a segment longer than a tile
    [3, -1, -1],  # one row of one adapter
])
def test_shrink_then_expand_matches_the_oracle(rank: int, slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(rank)
    num_slots, hidden_size = 4, 48
    slices = [(0, 48), (48, 16), (64, 16)]  # a small fused qkv: q wider than k and v
    width = 80
    x = torch.randn(len(slots), hidden_size, generator=gen)
    shrink = torch.randn(num_slots, len(slices) * rank, hidden_size, generator=gen)
    expand = torch.randn(num_slots, width, rank, generator=gen)
    rows, segments, longest = segments_of(slots)
    base = torch.randn(len(slots), width, generator=gen)
    hidden = lora_shrink(x.to(DEVICE), shrink.to(DEVICE), rows, segments, longest)
    out = lora_expand(hidden, expand.to(DEVICE), base.clone().to(DEVICE), rows, segments,
                      longest, [0, 48, 64, 80])
    want = base.double() + oracle(x, shrink, expand, slots, slices, rank)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-4, atol=1e-3)


def test_single_slice_projection_and_no_segments() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 40, generator=gen)
    shrink = torch.randn(2, 8, 40, generator=gen)
    expand = torch.randn(2, 8, 24, generator=gen).transpose(1, 2)  # LoRALinear's layout
    slots = [1, 0, 1, -1, 0]
    rows, segments, longest = segments_of(slots)
    out = lora_expand(lora_shrink(x, shrink, rows, segments, longest), expand,
                      torch.zeros(5, 24), rows, segments, longest, [0, 24])
    torch.testing.assert_close(out.double(), oracle(x, shrink, expand, slots, [(0, 24)], 8),
                               rtol=1e-4, atol=1e-3)
    rows, segments, longest = segments_of([-1, -1])
    assert lora_shrink(x[:2], shrink, rows, segments, longest).abs().sum() == 0


@pytest.mark.parametrize("slots", [[0, 2, -1, 1, 2, 0], [1, 1, -1, 0, 0]])  # sorted, grouped
def test_lora_linear_runs_the_kernels_as_the_torch_path(slots: list[int]) -> None:
    """LoRALinear with segments (the GPU's path, here interpreted) equals its grouped torch
    path (the CPU's), both through the same slots."""
    from iterserve.replica.lora_layers import LoRABatch, LoRALinear
    from iterserve.replica.models.layers import Linear

    gen = torch.Generator().manual_seed(9)
    base = Linear(32, 80, False, torch.float32, DEVICE)
    base.weight.data.copy_(torch.randn(80, 32, generator=gen))
    results = []
    for with_segments in (False, True):
        batch = LoRABatch(with_segments=with_segments)
        lora = LoRALinear(base, [(0, 48), (48, 16), (64, 16)], 3, 16, batch)
        gen.manual_seed(10)
        for slot in range(3):
            per_slice = [(torch.randn(8, 32, generator=gen), torch.randn(size, 8, generator=gen))
                         for size in (48, 16, 16)]
            per_slice[1] = None  # an adapter without k_proj
            lora.set_slot(slot, per_slice)
        batch.assign(slots, torch.device(DEVICE))
        results.append(lora(torch.randn(len(slots), 32, generator=gen.manual_seed(11))))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-3)
