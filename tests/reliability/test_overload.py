"""Overload at 3x capacity: fast 429s with Retry-After, admitted requests on time, memory
bounded, every request accounted for (success or 429, nothing else, nothing dropped).

The engine is the production engine over the simulated runner (20 ms steps), with
max_num_seqs=8 and a waiting queue bounded at 8. Capacity is measured first (8 closed-loop
clients); then requests arrive open-loop at 3x that rate (loadtests/studies/reliability/overload.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from reliability_support import (
    SIM_ENGINE,
    local_server,
    replica_stats,
    rss_mb,
    run_async,
    serve_actor_pids,
    wait_replicas_idle,
)

from iterserve.loadtests.studies.reliability.overload import OverloadResult, overload

MAX_WAITING = 8
ENGINE = {**SIM_ENGINE, "max_waiting_requests": MAX_WAITING}
FACTOR = 3.0
DURATION_S = float(os.environ.get("OVERLOAD_SECONDS", "12"))
MAX_TOKENS = 64


def check(result: OverloadResult, max_429_p90_s: float, rss_growth_mb: float) -> None:
    summary = json.dumps({k: v for k, v in result.to_dict().items() if k != "samples"})
    assert not result.unaccounted, summary
    assert result.succeeded + result.rejected_429 == result.sent, summary
    assert result.rejected_429 > 0, f"no 429 at {FACTOR}x capacity: {summary}"
    assert result.rejected_without_retry_after == 0, summary
    # Rejections are fast: over ~140 of them a p99 is the second largest, decided by one
    # process-wide pause (a CI run saw a 1.2 s one stall every request alike), so the
    # bound is on the p90; the slowest rejection must still beat a typical admission.
    assert result.latency_429_s["p90"] < max_429_p90_s, summary
    assert result.latency_429_s["p100"] < result.latency_ok_s["p50"], summary
    # Admitted requests wait at most a bounded queue: about one service time, plus their own.
    assert result.latency_ok_s["p99"] < 3 * result.service_time_s + 0.5, summary
    # Goodput holds near capacity (the server is not thrashing).
    expected = result.capacity_rps * DURATION_S
    assert result.succeeded >= 0.6 * expected, summary
    assert rss_growth_mb < 64, f"RSS grew {rss_growth_mb:.1f} MB under overload; {summary}"


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[float]]:
    """Durations of the cyclic collector's passes meanwhile: the in-process test shares its
    process (and, late in a suite run, a heap of >1 GB) with the server."""
    pauses: list[float] = []
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def test_overload_in_process() -> None:
    with local_server(ENGINE) as server, gc_pauses() as pauses:
        def sample() -> dict[str, Any]:
            stats = server.engine.stats()
            return {"rss_mb": rss_mb([os.getpid()])[os.getpid()],
                    "waiting": stats.num_waiting, "running": stats.num_running}

        result = run_async(overload(server.base_url, None, FACTOR, DURATION_S, MAX_TOKENS,
                                    concurrency=8, capacity_s=6, sampler=sample), 300)
        state = server.wait_idle(timeout_s=60)
    rss = [s["rss_mb"] for s in result.samples]
    growth = max(rss) - rss[0]
    print("overload (in process):", json.dumps({**result.to_dict(), "samples": len(rss),
                                                "rss_growth_mb": round(growth, 1),
                                                "gc_passes": len(pauses),
                                                "longest_gc_pause_s": round(max(pauses, default=0), 3)}))
    assert max(s["waiting"] for s in result.samples) <= MAX_WAITING
    check(result, max_429_p90_s=0.5, rss_growth_mb=growth)
    assert state["num_free_blocks"] == state["num_total_blocks"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overload_serve(serve_session: Any) -> None:
    with serve_session.deploy({"engine_kwargs": ENGINE}) as base_url:
        pids = (serve_actor_pids("LLMReplica") + serve_actor_pids("OpenAIIngress")
                + serve_actor_pids("ProxyActor"))
        assert pids

        def sample() -> dict[str, Any]:
            stats = replica_stats(base_url)[0]
            return {"rss_mb": sum(rss_mb(pids).values()), "waiting": stats["num_waiting"],
                    "running": stats["num_running"]}

        result = run_async(overload(base_url, None, FACTOR, DURATION_S, MAX_TOKENS,
                                    concurrency=8, capacity_s=8, sampler=sample), 300)
        stats = wait_replicas_idle(base_url, timeout_s=60)
    rss = [s["rss_mb"] for s in result.samples]
    growth = max(rss) - rss[0]
    print("overload (Serve):", json.dumps({**result.to_dict(), "samples": len(rss),
                                           "rss_growth_mb": round(growth, 1), "replicas": stats}))
    assert max(s["waiting"] for s in result.samples) <= MAX_WAITING
    check(result, max_429_p90_s=1.0, rss_growth_mb=growth)
