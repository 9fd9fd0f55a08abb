"""Planned disruption loses nothing (issue 14 part 3): under steady streaming load through the
Serve ingress, a scale-down (2 -> 1 replicas) and then a rolling redeploy (a changed engine
setting, so Serve replaces every replica) drop 0 streams: every request sent ends 200 with
[DONE] and all its tokens. The stopping replicas drain: Serve's graceful_shutdown_timeout_s is
derived from max_model_len (`drain_timeout_for`), long enough for the longest generation.

Simulated runner (20 ms per step). The redeploy goes through `serve.run` of the changed
application, the same controller path as `serve deploy` of a changed config file (which would
need Ray's dashboard, too heavy for this box). The timeline is printed for RELIABILITY.md.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from reliability_support import APP_NAME, SIM_ENGINE

from iterserve.loadtests.disruption import StreamingLoad, Timeline

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

LOAD_CLIENTS = 8
MAX_TOKENS = 120  # >= 2.4 s per stream at 20 ms per step: always some stream in flight
SETTLE_S = 4.0


def _replica_configs(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/debug/replicas", timeout=30)
    return [info["config"] for info in response.json()["data"]]


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_scale_down_and_rolling_redeploy_drop_nothing(serve_session: Any) -> None:
    from ray import serve

    from iterserve.deploy.app import build_app

    app_args: dict[str, Any] = {"engine_kwargs": dict(SIM_ENGINE), "num_replicas": 2,
                                "router": "kv"}
    timeline = Timeline()
    with serve_session.deploy(app_args) as url:
        _wait_for(lambda: len(_replica_configs(url)) == 2, 60, "2 replicas")
        timeline = Timeline()
        with StreamingLoad(url, LOAD_CLIENTS, MAX_TOKENS) as load:
            timeline.mark("load started (8 streaming clients, 120 tokens each)")
            time.sleep(SETTLE_S)
            timeline.mark(f"scale-down 2 -> 1 issued ({load.completed()} streams done)")
            serve.run(build_app({**app_args, "num_replicas": 1}), name=APP_NAME,
                      route_prefix="/", blocking=False)
            timeline.mark("scale-down: serve.run returned")
            _wait_for(lambda: len(_replica_configs(url)) == 1, 120, "1 replica")
            timeline.mark("scale-down: 1 replica answers /debug/replicas")
            time.sleep(SETTLE_S)
            changed = {**app_args, "num_replicas": 1,
                       "engine_kwargs": {**SIM_ENGINE, "max_num_seqs": 12}}
            timeline.mark(f"rolling redeploy issued ({load.completed()} streams done)")
            serve.run(build_app(changed), name=APP_NAME, route_prefix="/", blocking=False)
            timeline.mark("redeploy: serve.run returned")
            _wait_for(lambda: [c["max_num_seqs"] for c in _replica_configs(url)] == [12], 180,
                      "the redeployed replica")
            timeline.mark("redeploy: only the new replica answers")
            time.sleep(SETTLE_S)
            timeline.mark("load stopping")
        timeline.mark(f"load stopped: {len(load.outcomes)} sent, {load.completed()} complete")
    print("timeline:", timeline.dump())
    failures = load.failures()
    print("failures:", failures[:10])
    assert len(load.outcomes) >= 2 * LOAD_CLIENTS
    assert not failures, f"{len(failures)} of {len(load.outcomes)} streams dropped: {failures[:5]}"
