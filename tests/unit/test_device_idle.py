"""The simulated runner's DeviceIdleMeter: the engine CPU time its simulated GPU waits for.

The meter's line fit and merging are checked on hand-made counts; the runner's recording is
checked against an independent reading of the same engine (wall time minus modelled time
over a stretch of sync steps, as `offline_bench.async_step_time` measures it), and against
async scheduling, under which that CPU time hides behind the modelled step.
"""

from __future__ import annotations

import time

import pytest

from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.device_idle import (
    DeviceIdleMeter,
    WaitDistribution,
    bucket_floor_s,
    fit_idle,
    fit_report,
    merge_reports,
    wait_bucket,
)


def test_fit_recovers_a_line_weighted_by_steps() -> None:
    meter = DeviceIdleMeter()
    for n, count in ((1, 10), (8, 30), (32, 5)):
        for _ in range(count):
            meter.record(n, 0.0003 + 0.00004 * n)
    per_step, per_seq = fit_idle(meter)
    assert per_step == pytest.approx(0.0003, rel=1e-6)
    assert per_seq == pytest.approx(0.00004, rel=1e-6)
    report = fit_report(meter)
    assert report["steps"] == 45
    assert report["mean_batch"] == pytest.approx((10 + 240 + 160) / 45)


def test_reports_merge_across_replicas_and_one_size_gives_the_mean() -> None:
    a, b = DeviceIdleMeter(), DeviceIdleMeter()
    a.record(4, 0.001)
    b.record(4, 0.003)
    merged = merge_reports([a.report(), b.report()])
    assert merged.steps == {4: 2} and merged.idle_s[4] == pytest.approx(0.004)
    assert fit_idle(merged) == (pytest.approx(0.002), 0.0)
    with pytest.raises(ValueError, match="nothing measured"):
        fit_idle(DeviceIdleMeter())


def test_buckets_hold_their_waits_within_twelve_percent() -> None:
    for wait in (1e-6, 3.3e-5, 0.002, 0.0479, 1.7):
        bucket = wait_bucket(wait)
        assert bucket_floor_s(bucket) <= wait * (1 + 1e-12)
        assert wait < bucket_floor_s(bucket + 1) * (1 + 1e-12)
        assert bucket_floor_s(bucket + 1) / bucket_floor_s(bucket) == pytest.approx(10 ** 0.05)
    assert wait_bucket(0.0) == -1 and bucket_floor_s(-1) == 0.0


def test_quantiles_read_the_tail_a_mean_hides() -> None:
    # 990 steps wait 1 ms, 10 wait 80 ms: the mean (1.8 ms) says nothing of the 80 ms ones
    a, b = DeviceIdleMeter(), DeviceIdleMeter()
    for i in range(990):
        (a if i % 2 else b).record(4, 0.001)
    for _ in range(10):
        b.record(4, 0.080)
    merged = merge_reports([a.report(), b.report()])
    assert sum(merged.histogram.values()) == 1000
    report = fit_report(merged)
    assert report["mean_idle_s"] == pytest.approx(0.00179)
    assert 0.00089 < report["p50_idle_s"] <= 0.001
    assert 0.00089 < report["p99_idle_s"] <= 0.001  # the 990th wait is still a 1 ms one
    assert 0.071 < report["p999_idle_s"] <= 0.080
    assert report["max_idle_s"] == report["p999_idle_s"]
    with pytest.raises(ValueError, match="no wait counted"):
        DeviceIdleMeter().quantile_s(0.5)


def test_reports_from_before_the_histogram_still_merge() -> None:
    old = {"steps": {"2": 3.0}, "idle_s": {"2": 0.006}}
    merged = merge_reports([old])
    assert merged.histogram == {} and fit_report(merged)["mean_idle_s"] == pytest.approx(0.002)
    assert "p99_idle_s" not in fit_report(merged)


def _busy_engine(async_scheduling: bool, num_running: int = 8) -> LLMEngine:
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", async_scheduling=async_scheduling, max_num_seqs=num_running,
        max_model_len=2048, enable_prefix_caching=False, simulator='{"a_s": 0.004}'))
    for i in range(num_running):
        prompt = [(i * 131 + j * 7) % 4000 + 1 for j in range(64)]
        engine.add_request(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    while not engine.scheduler.all_running_have_output() or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def _idle_over(engine: LLMEngine, steps: int) -> tuple[float, float, int]:
    """(meter's idle seconds, wall minus modelled seconds, steps the meter counted)."""
    runner = engine.runner
    idle_before = sum(runner.device_idle.idle_s.values())
    counted_before = sum(runner.device_idle.steps.values())
    modelled_before = runner.total_simulated_s
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    return (sum(runner.device_idle.idle_s.values()) - idle_before,
            wall - (runner.total_simulated_s - modelled_before),
            sum(runner.device_idle.steps.values()) - counted_before)


def test_sync_steps_wait_for_the_engine_as_wall_minus_modelled_says() -> None:
    engine = _busy_engine(async_scheduling=False)
    idle, excess, counted = _idle_over(engine, 40)
    assert counted == 40  # every step carried on the batch before it
    assert idle > 0.0  # the engine's CPU work is real
    assert idle == pytest.approx(excess, rel=0.2, abs=0.002)


def test_async_scheduling_hides_the_engine_cpu_behind_the_step() -> None:
    sync_idle, _, _ = _idle_over(_busy_engine(async_scheduling=False), 40)
    async_idle, _, counted = _idle_over(_busy_engine(async_scheduling=True), 40)
    assert counted == 40
    assert async_idle < sync_idle / 2


def test_a_wait_distribution_from_a_histogram_keeps_the_measured_mean() -> None:
    meter = DeviceIdleMeter()
    for i in range(1000):
        meter.record(4, 0.080 if i % 100 == 0 else 0.001 + 0.00001 * (i % 7))
    report = fit_report(meter)
    waits = WaitDistribution.from_histogram(meter.report()["histogram"], report["mean_idle_s"])
    total = sum(waits.weights)
    mean = sum(v * w for v, w in zip(waits.values, waits.weights, strict=True)) / total
    assert mean == pytest.approx(report["mean_idle_s"], rel=1e-9)
    draws = [waits.draw(i / 10_000, 4) for i in range(10_000)]
    assert sum(draws) / len(draws) == pytest.approx(report["mean_idle_s"], rel=0.02)
    assert max(draws) > 0.07 and sorted(draws)[5000] < 0.0012  # tail and body both kept


def test_a_wait_distribution_from_quantiles_keeps_the_tail_and_the_mean() -> None:
    fit = {"mean_idle_s": 0.003, "p50_idle_s": 0.001, "p90_idle_s": 0.002, "p99_idle_s": 0.02,
           "p999_idle_s": 0.06, "max_idle_s": 0.2, "per_seq_s": 0.0001, "mean_batch": 3.0}
    waits = WaitDistribution.from_quantiles(fit)
    mean = sum(v * w for v, w in zip(waits.values, waits.weights, strict=True))
    assert mean == pytest.approx(0.003)
    assert waits.values[2:] == (0.011, 0.04, 0.13)  # band middles above p90, as measured
    assert waits.draw(0.9995, 3) == pytest.approx(0.13)
    assert waits.draw(0.9995, 5) == pytest.approx(0.1302)  # the slope, per request
    assert waits.draw(0.1, 0) >= 0.0
    with pytest.raises(ValueError):
        WaitDistribution((), ())
