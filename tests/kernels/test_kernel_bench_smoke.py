"""The GPU benchmark's code paths, run once on CPU through the interpreter with tiny shapes.

The benchmark cannot be timed here, but its tensor plumbing (paged layouts, the dense copies
handed to SDPA, the launches the engine picks, the bf16 correctness rows) and its floors can
be checked, so a GPU session does not die on a shape bug.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import INTERPRET

from iterserve.loadtests.studies.gpu_first_light import kernel_bench as bench


@pytest.fixture
def cpu_bench(monkeypatch: pytest.MonkeyPatch) -> torch.Generator:
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "_bench_graph", lambda fn: (fn(), 0.5)[1])
    return torch.Generator().manual_seed(0)


@pytest.mark.skipif(not INTERPRET, reason="the real benchmark covers this on a GPU")
def test_bench_rows_on_cpu(cpu_bench: torch.Generator) -> None:
    row = bench._decode_row(2, 40, cpu_bench, copy_bw=1e12, sms=132)
    assert len(row) == len(bench.HEADER) and row[0] == "decode attention"
    assert row[1] == "batch 2 x ctx 40, splits 1" and row[4] == "-"
    prefill = bench._prefill_row(48, cpu_bench)
    assert prefill[1] == "one causal chunk of 48" and "TFLOPS" in prefill[2]
    table = bench._table(bench.HEADER, [row, prefill])
    assert table.count("\n") == 3


def test_floors_are_the_issue_floors() -> None:
    assert bench.decode_floor(16, 4096) == 85.0 and bench.decode_floor(256, 16384) == 85.0
    assert bench.decode_floor(1, 4096) == 60.0
    assert bench.decode_floor(1, 512) is None and bench.decode_floor(64, 512) is None
    assert bench.verdict(84.9, 85.0) == "BELOW FLOOR" and bench.verdict(85.0, 85.0) == "ok"
    assert bench.verdict(1.3, 1.2, higher_is_better=False) == "BELOW FLOOR"
    from iterserve.loadtests.studies.gpu_first_light.engine_decode_bench import STEP_FLOOR_RATIO

    assert STEP_FLOOR_RATIO == 1.2


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="the real benchmark covers this on a GPU")
def test_bench_correctness_table_on_cpu(cpu_bench: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    # fp16, not bf16: the interpreter truncates fp32 -> bf16 on store where the GPU rounds to
    # nearest, which costs up to two bf16 ulps after a fused add + norm.
    monkeypatch.setattr(bench, "DTYPE", torch.float16)
    monkeypatch.setattr(bench, "CHECK_Q_LENS", (1, 1, 1, 40, 9))
    monkeypatch.setattr(bench, "CHECK_SEQ_LENS", (17, 100, 153, 40, 60))
    monkeypatch.setattr(bench, "CHECK_ROWS", 5)
    rows = bench.check_correctness(cpu_bench)
    assert len(rows) == 10
    assert [r for r in rows if r[2] != "ok"] == []


def test_bench_exits_cleanly_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
