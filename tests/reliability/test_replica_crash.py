"""Replica crash under load (Ray Serve, simulated runners): SIGKILL one LLMReplica process
while closed-loop streaming clients run.

Expected: Serve starts a replacement; requests that had not started on the dead replica go
to the other one; streams already under way on it end with an SSE error event (never hang);
the failed count and the recovery time are printed and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from reliability_support import SIM_ENGINE, run_async, serve_actor_pids, wait_replicas_idle

from iterserve.loadtests.studies.reliability.chaos import Outcome, closed_loop_streams

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_CLIENTS = int(os.environ.get("CRASH_CLIENTS", "16"))  # 8 per replica: all running
RUN_S = 36.0
KILL_AT_S = 10.0
MAX_TOKENS = 150  # ~3 s per request at 20 ms per step
CLIENT_TIMEOUT_S = 60.0  # a stream that outlives this is a hang


def llm_replica_states() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get("iterserve")
    if app is None or "LLMReplica" not in app.deployments:
        return {}
    return {str(k): int(v) for k, v in app.deployments["LLMReplica"].replica_states.items()}


async def load_with_kill(base_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    start = time.monotonic()
    kill: dict[str, Any] = {}

    async def killer() -> None:
        await asyncio.sleep(KILL_AT_S)
        pids = await asyncio.to_thread(serve_actor_pids, "LLMReplica")
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        kill["at"] = time.monotonic() - start
        kill["pid"] = pids[0]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = await asyncio.to_thread(llm_replica_states)
            new_pids = await asyncio.to_thread(serve_actor_pids, "LLMReplica")
            if states.get("RUNNING") == 2 and len(new_pids) == 2 and pids[0] not in new_pids:
                kill["recovered_at"] = time.monotonic() - start
                return
            await asyncio.sleep(0.25)

    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        outcomes, _ = await asyncio.gather(
            closed_loop_streams(http, NUM_CLIENTS, RUN_S, MAX_TOKENS, CLIENT_TIMEOUT_S),
            killer())
    return {"outcomes": outcomes, **kill}


def test_replica_crash_under_load(serve_session: Any) -> None:
    app_args = {"engine_kwargs": dict(SIM_ENGINE), "num_replicas": 2}
    with serve_session.deploy(app_args) as base_url:
        run = run_async(load_with_kill(base_url), timeout_s=RUN_S + 200)
        stats = wait_replicas_idle(base_url, timeout_s=90)
    outcomes: list[tuple[float, Outcome]] = run["outcomes"]
    kill_at = run["at"]
    recovered_at = run.get("recovered_at")
    failed = [(t, o) for t, o in outcomes if not (o.ok and o.finish_reason == "length")]
    hung = [o for _, o in failed if o.error and "client timeout" in o.error]
    in_stream = [o for _, o in failed if o.status == 200 and o.error]
    http_errors = [o for _, o in failed if o.status not in (200, None)]
    other = [o for _, o in failed if o not in in_stream and o not in http_errors]
    after_recovery = [o for t, o in outcomes if recovered_at and t > recovered_at + 2]
    ends = [t + o.latency_s for t, o in failed]
    figures = {
        "requests": len(outcomes), "succeeded": len(outcomes) - len(failed),
        "failed": len(failed), "failed_in_stream_error_event": len(in_stream),
        "failed_http_status": sorted(str(o.status) for o in http_errors),
        "failed_other": [o.error for o in other][:5], "hung": len(hung),
        "kill_at_s": round(kill_at, 2),
        "replacement_running_after_s": round(recovered_at - kill_at, 2) if recovered_at else None,
        "failures_ended_within_s_of_kill": round(max(ends) - kill_at, 2) if ends else None,
        "failed_requests_started_after_kill": sum(1 for t, _ in failed if t > kill_at),
        "requests_after_recovery": len(after_recovery),
        "replicas_after": [{k: s[k] for k in ("num_running", "num_waiting", "num_free_blocks",
                                              "num_total_blocks")} for s in stats],
    }
    print("replica crash:", json.dumps(figures))
    print("failed samples:", [(round(t, 2), o.status, (o.error or "")[:120]) for t, o in failed][:10])
    assert not hung, f"{len(hung)} requests hung: {figures}"
    assert recovered_at is not None, f"Serve did not replace the replica: {figures}"
    assert all(o.error for o in in_stream), "a broken stream must end with an error event"
    # Only what was on the dead replica may fail: at most its batch and its queue.
    assert len(failed) <= NUM_CLIENTS, figures
    assert all(o.retry_after for o in http_errors), "a 503 must say when to retry"
    assert all(o.ok for o in after_recovery), figures
    assert len(stats) == 2
