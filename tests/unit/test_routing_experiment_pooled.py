"""routing_experiment.pooled: repeats of one arm pool every run's requests, keep every
run's (sent, TTFT) pairs and the box load each run ended at (so a results file with two
repeats can be pooled again with another, and its report shows the load, not nan)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iterserve.loadtests.studies.ray_harness import ClientRecord
from iterserve.loadtests.studies.ray_routing.routing_experiment import pooled, summarize
from iterserve.loadtests.studies.sim_validation.sim_validation import load_ray_results


def a_run(arm: str, ttfts: list[float], load: float) -> dict[str, Any]:
    records = [ClientRecord(request_id=f"{arm}-{i}", sent=float(i), kind="short",
                             first_token=i + t, finished=i + t + 1.0, num_tokens=4,
                             finish_reason="length")
               for i, t in enumerate(ttfts)]
    summary = summarize(records, preemptions=2)
    summary["arm"] = arm
    summary["loadavg_1m_at_end"] = load
    return {"summary": summary, "kv": [{"t": 0.0, "replica": "r", "kv_usage": load}],
            "ttfts": [(r.sent, r.ttft) for r in records], "records": records, "preemptions": 2}


def test_two_runs_pool_their_requests_pairs_and_loads() -> None:
    first, second = a_run("pow2", [0.1, 0.2, 0.3], 2.5), a_run("pow2", [1.0, 2.0], 3.1)
    (arm,) = pooled([first, second], ["pow2"])
    assert arm["summary"]["runs"] == 2
    assert arm["summary"]["failed"] == 0
    assert arm["summary"]["preemptions"] == 2.0
    assert sorted(t for _, t in arm["ttfts"]) == pytest.approx([0.1, 0.2, 0.3, 1.0, 2.0])
    assert arm["summary"]["loadavg_1m_at_end"] == 3.1
    assert arm["summary"]["loadavg_1m_at_end_per_run"] == [2.5, 3.1]
    assert arm["kv"] == first["kv"]


def test_one_run_keeps_its_own_summary() -> None:
    run = a_run("iterserve", [0.5, 0.7], 1.5)
    (arm,) = pooled([run], ["iterserve"])
    assert arm["summary"]["ttft_p99_s"] == run["summary"]["ttft_p99_s"]
    assert arm["summary"]["loadavg_1m_at_end"] == 1.5
    assert arm["ttfts"] == run["ttfts"]


def test_sim_validation_reads_the_load_of_a_file_written_before_pooling_kept_it(
        tmp_path: Path) -> None:
    first, second = a_run("pow2", [0.1, 0.2], 2.7), a_run("pow2", [0.3], 3.1)
    (arm,) = pooled([first, second], ["pow2"])
    del arm["summary"]["loadavg_1m_at_end"]  # as in results files of 2026-12-03
    meta = {"workload": {}, "engine_kwargs": {}, "time_scale": 1.0, "when": "then",
            "per_run": [first["summary"], second["summary"]]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"meta": meta, "results": [arm]}))
    (result,) = load_ray_results([path])["results"]
    assert result["summary"]["loadavg_1m_at_end"] == 3.1
