"""The CPU paths benchmark's plumbing on small cases (its timings are not checked here)."""

from __future__ import annotations

import pytest

from iterserve.loadtests.studies.engine_speed import cpu_paths_bench


def test_attention_parts_print_a_row_per_case_and_thread_count(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cpu_paths_bench, "DECODE_GRID", ((2, 64), (3, 40)))
    monkeypatch.setattr(cpu_paths_bench, "PREFILL_CASES", ((32, 0), (8, 20)))
    monkeypatch.setattr(cpu_paths_bench, "AFTER_PREFIX_CASES", ((16, 48),))
    cpu_paths_bench.main(["--part", "decode", "--threads", "1", "--rounds", "2", "--repeats",
                          "1"])
    cpu_paths_bench.main(["--part", "prefill", "--threads", "1", "--rounds", "2", "--repeats",
                          "1"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| case")]
    assert [row[0] for row in rows] == ["| batch 2, context ~64", "| batch 3, context ~40",
                                        "| 32 tokens after 0 cached", "| 8 tokens after 20 cached",
                                        "| 16 tokens after 48 cached"]  # masked vs two calls
    assert all(row[1] == "1" and row[4].endswith("x") for row in rows)  # threads, speed-up
    assert "path after the grid: blocks" in out  # the compiled decode ran throughout
    assert out.startswith("CPU: ")  # the CPU model heads the figures
