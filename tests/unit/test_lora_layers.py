"""The step's rows -> slots plan (LoRABatch) and LoRALinear's three CPU paths (contiguous
runs, rows sorted by slot, one bmm over padded slots), which must agree with a per-row
oracle."""

from __future__ import annotations

import pytest
import torch

from iterserve.replica.lora_layers import LoRABatch, LoRALinear, should_pad
from iterserve.replica.models.layers import Linear

CPU = torch.device("cpu")


def test_batch_runs_without_gather_when_slots_are_contiguous() -> None:
    batch = LoRABatch()
    batch.assign([-1, 2, 2, 0, 0, 0, -1], torch.device("cpu"))
    assert batch.runs == [(2, 1, 3), (0, 3, 6)] and batch.order is None


def test_batch_sorts_interleaved_rows_by_slot() -> None:
    batch = LoRABatch()
    batch.assign([1, -1, 0, 1, 0], torch.device("cpu"))
    assert batch.order.tolist() == [2, 4, 0, 3]
    assert batch.runs == [(0, 0, 2), (1, 2, 4)]


def test_batch_without_adapters_has_no_runs() -> None:
    batch = LoRABatch()
    batch.assign([-1, -1, -1], torch.device("cpu"))
    assert batch.runs == [] and batch.order is None


def test_padding_only_pays_for_many_adapters_with_few_rows_each() -> None:
    sixteen_by_two = [(s, 2 * s, 2 * s + 2) for s in range(16)]
    assert should_pad(sixteen_by_two, num_slots=16)
    assert not should_pad([(0, 0, 32)], num_slots=16)  # one adapter: a loop of one
    assert not should_pad([(0, 0, 30), (9, 30, 31), (15, 31, 32)], num_slots=16)  # mostly pad
    assert should_pad([(0, 0, 30), (1, 30, 31), (2, 31, 32)], num_slots=16)  # 3 slots x 30


@pytest.mark.parametrize(("slots", "path"), [
    ([-1, 0, 0, 2, 2, 2, -1], "contiguous"),  # runs in place: no gather
    ([1, -1, 0, 1, 0], "sorted"),  # interleaved, two adapters: sorted then looped
    ([0, 1, 2, 3, 0, 1, 2, 3, -1, 2], "padded"),  # four adapters, few rows each
])
def test_every_cpu_path_matches_a_per_row_oracle(slots: list[int], path: str) -> None:
    gen = torch.Generator().manual_seed(4)
    base = Linear(24, 40, False, torch.float32, "cpu")
    base.weight.data.copy_(torch.randn(40, 24, generator=gen))
    batch = LoRABatch(num_slots=4)
    lora = LoRALinear(base, [(0, 24), (24, 16)], 4, 8, batch)
    adapters = []
    for slot in range(4):
        rank = 4 + slot  # ranks below the slot's maximum: zero padded
        pairs = [(torch.randn(rank, 24, generator=gen), torch.randn(24, rank, generator=gen)),
                 (torch.randn(rank, 24, generator=gen), torch.randn(16, rank, generator=gen))]
        lora.set_slot(slot, pairs)
        adapters.append(pairs)
    x = torch.randn(len(slots), 24, generator=gen)
    want = x @ base.weight.T
    for row, slot in enumerate(slots):
        if slot >= 0:
            want[row] += torch.cat([b @ (a @ x[row]) for a, b in adapters[slot]])
    batch.assign(slots, CPU)
    taken = ("padded" if batch.padded is not None else
             "sorted" if batch.order is not None else "contiguous")
    assert taken == path
    torch.testing.assert_close(lora(x), want, rtol=1e-5, atol=1e-4)
