"""The offline benchmark's plumbing on the tiny model (its timings are not checked here)."""

from __future__ import annotations

import pytest

from iterserve.loadtests import offline_bench


@pytest.mark.slow  # ~40 s on the shared 2-core box: 4 requests of up to 1024 + 512 tokens
def test_throughput_table_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    offline_bench.main(["--part", "throughput", "--model", "iterserve-tiny", "--num-requests",
                        "4", "--concurrency", "2", "--rounds", "2", "--skip-hf", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| iterserve")]
    assert [row.split(" | ")[0] for row in rows] == ["| iterserve continuous",
                                                     "| iterserve static"]
    assert all(row.split(" | ")[1:3] == ["1", "2"] for row in rows)  # threads, rounds
    assert "1.00x" in rows[0]
