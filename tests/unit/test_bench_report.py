"""`iterserve bench`: level summaries, SLOs, floors, and a tiny run against stand-in servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import serve_fake_openai

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests import bench
from iterserve.loadtests.bench_client import LevelRun, RequestResult, ServerSample
from iterserve.loadtests.bench_stats import (
    Slo,
    _ms,
    compare,
    parse_slo,
    summarise_level,
)
from iterserve.loadtests.streaming import StreamTiming


def _result(index: int, ttft: float, gap: float, tokens: int) -> RequestResult:
    timing = StreamTiming(start=0.0)
    for position in range(tokens):
        timing.feed_line('data: {"choices": [{"text": "x"}]}', ttft + position * gap)
    timing.feed_line(f'data: {{"choices": [], "usage": {{"completion_tokens": {tokens}}}}}', 9.0)
    timing.feed_line("data: [DONE]", 9.0)
    return RequestResult(index, prompt_tokens=10, max_tokens=tokens, timing=timing, status=200)


def test_stream_timing_follows_vllm_definitions() -> None:
    timing = _result(0, ttft=0.5, gap=0.1, tokens=11).timing
    assert timing.ttft_s == 0.5
    assert timing.e2e_s == pytest.approx(1.5)  # the usage chunk at 9.0 does not count
    assert timing.tpot_s == pytest.approx(0.1)
    assert timing.chunk_gaps == pytest.approx([0.1] * 10)
    partial = StreamTiming(start=0.0)
    partial.feed_bytes(b'data: {"choices": [{"text": "a"}]}\n\nda', 0.2)
    partial.feed_bytes(b'ta: {"choices": [{"text": "b"}]}\n\n', 0.3)
    assert partial.text_chunks == 2 and partial.ttft_s == 0.2


def test_summary_throughput_percentiles_kv_and_goodput() -> None:
    results = [_result(0, 0.2, 0.05, 21), _result(1, 3.0, 0.05, 21), _result(2, 0.2, 0.05, 5)]
    results[2].timing.usage_output_tokens = 4  # fewer tokens than asked: a failure
    run = LevelRun(concurrency=2, started_at=0.0, finished_at=4.0, results=results,
                   last_dispatch_at=2.0)
    samples = [ServerSample(t, kv, 2, 0, oob, 0) for t, kv, oob in
               ((-0.5, 0.0, 1.0), (1.0, 0.4, 1.0), (3.0, 0.6, 3.0), (4.5, 0.1, 3.0))]
    summary = summarise_level(run, samples, Slo(ttft_ms=2000, tpot_ms=100))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["output_tokens_per_s"] == pytest.approx(42 / 4)
    assert summary["ttft_ms_p50"] == pytest.approx(1600)
    assert summary["tpot_ms_mean"] == pytest.approx(50)
    assert summary["kv_usage_peak"] == 0.6 and summary["kv_usage_mean"] == pytest.approx(0.5)
    assert summary["out_of_blocks"] == 2.0
    assert summary["goodput_rps"] == pytest.approx(1 / 4)  # only request 0 meets both SLOs
    # Steady state: only tokens streamed before the last dispatch (t=2): request 0's 21.
    assert summary["steady_output_tokens_per_s"] == pytest.approx(21 / 2)


def test_slo_percentile_and_floor_helpers() -> None:
    assert parse_slo(["ttft:500", "e2e:9000"]) == Slo(ttft_ms=500, e2e_ms=9000)
    with pytest.raises(ValueError):
        parse_slo(["latency:5"])
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and _ms([], 99) is None
    static = [{"concurrency": 64, "output_tokens_per_s": 100.0, "ttft_ms_p95": 1000.0,
               "steady_output_tokens_per_s": 100.0}]
    good = [{"concurrency": 64, "output_tokens_per_s": 250.0, "ttft_ms_p95": 500.0,
             "steady_output_tokens_per_s": 300.0}]
    weak = [{"concurrency": 64, "output_tokens_per_s": 150.0, "ttft_ms_p95": 500.0}]
    assert compare(static, good, 64).passed
    assert compare(static, good, 64).steady_throughput_ratio == pytest.approx(3.0)
    assert not compare(static, weak, 64).passed
    assert compare(static, good, 128).throughput_ratio is None


@pytest.mark.slow  # about 3 s: two stand-in servers, real HTTP, three PNGs
def test_bench_runs_end_to_end_against_stand_in_servers(tmp_path: Path) -> None:
    with serve_fake_openai(ttft_s=0.15, itl_s=0.004) as (slow_url, _), \
            serve_fake_openai(ttft_s=0.01, itl_s=0.002) as (fast_url, _):
        code = bench.main([
            "--static-url", slow_url, "--continuous-url", fast_url, "--concurrency", "1,2",
            "--min-requests", "4", "--max-requests", "4", "--output-lengths", "uniform:4-8",
            "--prompt-buckets", "short:4-8:1", "--sample-interval", "0.05", "--no-progress",
            "--out", str(tmp_path), "--report", str(tmp_path / "BENCH.md")])
    assert code == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    for mode in ("static", "continuous"):
        levels = results["modes"][mode]["levels"]
        assert [level["concurrency"] for level in levels] == [1, 2]
        assert all(level["completed"] == 4 and level["failed"] == 0 for level in levels)
        assert results["modes"][mode]["samples"], "the /metrics sampler ran"
    fast, slow = results["modes"]["continuous"]["levels"], results["modes"]["static"]["levels"]
    assert fast[0]["ttft_ms_p50"] < slow[0]["ttft_ms_p50"]
    report = (tmp_path / "BENCH.md").read_text()
    assert "| static | 2 | 4/4 |" in report and "| continuous | 1 | 4/4 |" in report
    for name in ("throughput_vs_concurrency.png", "ttft_p95_vs_concurrency.png",
                 "kv_usage_over_time.png"):
        assert (tmp_path / name).stat().st_size > 1000
