"""An engine loop that dies (a device fault) under load: the replica must not linger.

Two replicas with simulated GPUs serve closed-loop streaming clients; creating
SIM_FAULT_FILE makes the first GPU to step fault (DeviceFaultError, what a CUDA error or an
out-of-memory would raise), which stops that replica's engine loop while its process lives.

Expected: streams under way on it end with an SSE error event (none hang); requests sent to
it afterwards are retried on the other replica (its routing stats say "admits nothing" at
once, and a request it refuses is sent again); its health check fails within one
health_check_period_s and Serve replaces it. The time from the fault to a healthy replacement
is printed and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_support import SIM_ENGINE, SIM_FAULT_FILE, run_async, serve_actor_pids
from test_replica_crash import llm_replica_states

from iterserve.loadtests.studies.reliability.chaos import Outcome, closed_loop_streams

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_CLIENTS = 12
RUN_S = 40.0
FAULT_AT_S = 8.0
MAX_TOKENS = 100  # ~2 s per request at 20 ms per step
CLIENT_TIMEOUT_S = 60.0


async def load_with_fault(base_url: str) -> dict[str, Any]:
    start = time.monotonic()
    fault: dict[str, Any] = {}

    async def injector() -> None:
        await asyncio.sleep(FAULT_AT_S)
        pids = await asyncio.to_thread(serve_actor_pids, "LLMReplica")
        assert len(pids) == 2, pids
        Path(SIM_FAULT_FILE).touch()
        fault["at"] = time.monotonic() - start
        while Path(SIM_FAULT_FILE).exists() and time.monotonic() - start < fault["at"] + 10:
            await asyncio.sleep(0.01)
        fault["claimed_at"] = time.monotonic() - start
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = await asyncio.to_thread(llm_replica_states)
            new_pids = await asyncio.to_thread(serve_actor_pids, "LLMReplica")
            replaced = len(set(new_pids) - set(pids))
            if replaced and fault.get("replacement_started_at") is None:
                fault["replacement_started_at"] = time.monotonic() - start
            if states.get("RUNNING") == 2 and len(new_pids) == 2 and replaced == 1:
                fault["recovered_at"] = time.monotonic() - start
                return
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        outcomes, _ = await asyncio.gather(
            closed_loop_streams(http, NUM_CLIENTS, RUN_S, MAX_TOKENS, CLIENT_TIMEOUT_S),
            injector())
    return {"outcomes": outcomes, **fault}


def test_engine_loop_death_is_contained_and_replaced(serve_session: Any) -> None:
    Path(SIM_FAULT_FILE).unlink(missing_ok=True)
    app_args = {"engine_kwargs": dict(SIM_ENGINE), "num_replicas": 2}
    with serve_session.deploy(app_args) as base_url:
        run = run_async(load_with_fault(base_url), timeout_s=RUN_S + 200)
    outcomes: list[tuple[float, Outcome]] = run["outcomes"]
    fault_at = run["claimed_at"]
    recovered_at = run.get("recovered_at")
    failed = [(t, o) for t, o in outcomes if not (o.ok and o.finish_reason == "length")]
    hung = [o for _, o in failed if o.error and "client timeout" in o.error]
    in_stream = [o for _, o in failed if o.status == 200 and o.error]
    started_after = [(t, o) for t, o in failed if t > fault_at + 0.5]
    figures = {
        "requests": len(outcomes), "failed": len(failed),
        "failed_in_stream_error_event": len(in_stream), "hung": len(hung),
        "failed_http_status": sorted(str(o.status) for _, o in failed if o.status != 200),
        "failed_requests_started_after_fault": len(started_after),
        "fault_at_s": round(fault_at, 2),
        "replacement_process_after_s": (round(run["replacement_started_at"] - fault_at, 2)
                                        if run.get("replacement_started_at") else None),
        "healthy_replacement_after_s": round(recovered_at - fault_at, 2) if recovered_at else None,
        "failures_ended_within_s_of_fault": (round(max(t + o.latency_s for t, o in failed)
                                                   - fault_at, 2) if failed else None),
    }
    print("engine loop death:", json.dumps(figures))
    print("failed samples:", [(round(t, 2), o.status, (o.error or "")[:100]) for t, o in failed][:8])
    assert not Path(SIM_FAULT_FILE).exists(), "no replica stepped after the fault was armed"
    assert not hung, figures
    assert recovered_at is not None, f"Serve did not replace the replica: {figures}"
    assert all(o.error for o in in_stream), "a broken stream must end with an error event"
    # Only the streams under way on the dead replica fail (at most its max_num_seqs).
    assert len(failed) <= SIM_ENGINE["max_num_seqs"], figures
    assert not started_after, f"requests sent after the fault must be retried: {figures}"
