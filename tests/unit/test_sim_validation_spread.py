"""sim_validation's run-to-run spread (k-seed pools) and its engine CPU table."""

from __future__ import annotations

import pytest

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.studies.sim_validation.sim_validation import k_run_p99_range
from iterserve.loadtests.studies.sim_validation.sim_validation_report import Row, engine_cpu_table, main_table


def _seeds() -> list[list[float]]:
    # seed i's TTFTs: 100 values, its p99 near i (seeds 1..8)
    return [[0.01 * j for j in range(99)] + [float(i)] for i in range(1, 9)]


def test_one_run_pools_span_the_seeds_and_more_runs_narrow_it() -> None:
    seeds = _seeds()
    low1, high1 = k_run_p99_range(seeds, 1)
    per_seed = sorted(percentile(s, 99) for s in seeds)
    assert per_seed[0] <= low1 <= high1 <= per_seed[-1]
    low8, high8 = k_run_p99_range(seeds, 8)  # every seed, every draw: one pool
    assert low8 == pytest.approx(high8)
    low4, high4 = k_run_p99_range(seeds, 4)
    assert high4 - low4 < high1 - low1
    assert k_run_p99_range(seeds, 4) == (low4, high4)  # a fixed RNG: reproducible
    with pytest.raises(ValueError):
        k_run_p99_range(seeds, 9)


def _row(arm: str, ray_p99: float, engine_cpu: dict[str, float] | None) -> Row:
    ray = {"ttft_p50_s": 0.1, "ttft_p99_s": ray_p99, "throughput_tok_s": 100.0,
           "itl_p99_s": 0.05, "preemptions": 3, "loadavg_1m_at_end": 2.0}
    if engine_cpu is not None:
        ray["engine_cpu"] = engine_cpu
    sim = {"ttft_p50_s": 0.1, "ttft_p99_s": 1.0, "throughput_tok_s": 100.0, "itl_p99_s": 0.05,
           "preemptions": 3, "prefix_hit_rate": 0.1, "ttft_p99_per_seed_s": [0.8, 1.0, 1.3],
           "k_runs": 2, "ttft_p99_k_run_95_s": (0.85, 1.2)}
    return Row(arm, ray, sim, sim, 0.0, (0.002, 0.0001))


def test_the_report_says_whether_ray_falls_in_the_spread_and_shows_the_term() -> None:
    inside, outside = _row("a", 1.1, None), _row("b", 2.0, {
        "per_step_s": 0.002, "per_seq_s": 0.0001, "steps": 5000.0, "mean_idle_s": 0.0035,
        "mean_batch": 15.0})
    table = "\n".join(main_table([inside, outside]))
    assert "k=2: 0.85-1.20 (Ray's inside)" in table
    assert "k=2: 0.85-1.20 (Ray's OUTSIDE)" in table
    cpu = "\n".join(engine_cpu_table([inside, outside]))
    assert "| a | 2.000 + 0.1000 | not recorded | not recorded |" in cpu
    assert "| b | 2.000 + 0.1000 | 3.50 at 15.0 | not recorded | 5000 |" in cpu
    spread = _row("c", 1.0, {"per_step_s": 0.002, "per_seq_s": 0.0001, "steps": 900.0,
                             "mean_idle_s": 0.0035, "mean_batch": 15.0, "p50_idle_s": 0.001,
                             "p99_idle_s": 0.02, "p999_idle_s": 0.05, "max_idle_s": 0.09})
    assert "| c | 2.000 + 0.1000 | 3.50 at 15.0 | 1.00 / 20.00 / 50.00 / 90.00 | 900 |" \
        in "\n".join(engine_cpu_table([spread]))


def test_measured_waits_come_from_the_histogram_else_the_quantiles() -> None:
    from iterserve.loadtests.studies.sim_validation.sim_validation import read_engine_waits

    fit = {"per_step_s": 0.001, "per_seq_s": 0.0001, "steps": 100.0, "mean_idle_s": 0.003,
           "mean_batch": 3.0, "p50_idle_s": 0.001, "p90_idle_s": 0.002, "p99_idle_s": 0.02,
           "p999_idle_s": 0.06, "max_idle_s": 0.2}
    from_quantiles = read_engine_waits({"arm": "a", "engine_cpu": fit})
    assert len(from_quantiles.values) == 5 and from_quantiles.values[-1] == pytest.approx(0.13)
    from_histogram = read_engine_waits({"arm": "a", "engine_cpu": fit,
                                        "engine_cpu_waits": {"60": 90.0, "100": 10.0}})
    mean = sum(v * w for v, w in zip(from_histogram.values, from_histogram.weights,
                                     strict=True)) / 100.0
    assert len(from_histogram.values) == 2 and mean == pytest.approx(0.003)
    with pytest.raises(SystemExit, match="single"):
        read_engine_waits({"arm": "old", "engine_cpu": {"mean_idle_s": 0.002}})
