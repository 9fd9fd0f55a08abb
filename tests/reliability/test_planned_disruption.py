"""Planned disruption loses nothing (issue 14 part 3): under steady streaming load through the
Serve ingress, a scale-down (2 -> 1 replicas) and then a rolling redeploy (a changed engine
setting, so Serve replaces every replica) drop 0 streams: every request sent ends 200 with
[DONE] and all its tokens. The stopping replicas drain: Serve's graceful_shutdown_timeout_s is
derived from max_model_len (`drain_timeout_for`), long enough for the longest generation.

Simulated runner (20 ms per step). Two paths:

* `serve.run` of the changed application in this process (the shared Ray session);
* `serve deploy` of changed YAML configs with Ray's CLI against a Ray dashboard
  (`loadtests/studies/reliability/serve_deploy_disruption.py`, in a subprocess: it starts its own Ray with the
  dashboard). A changed `args:` replaces the ingress too, and a stream longer than Serve's
  default 20 s drain runs through the redeploy. The timelines are printed for RELIABILITY.md.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_support import APP_NAME, SIM_ENGINE

from iterserve.loadtests.studies.reliability.disruption import StreamingLoad, Timeline

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

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


def test_serve_deploy_scale_down_and_redeploy_drop_nothing(tmp_path: Path) -> None:
    out = tmp_path / "serve_deploy.json"
    # Ray's socket paths must stay under 107 bytes: a short folder, not pytest's tmp_path.
    ray_dir = tempfile.mkdtemp(prefix="iterserve-sd-", dir="/tmp")
    command = [sys.executable, "-m", "iterserve.loadtests.studies.reliability.serve_deploy_disruption",
               "--temp-dir", ray_dir, "--json", str(out)]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=420)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    print("serve deploy:", json.dumps({k: v for k, v in result.items() if k != "configs"}))
    assert result["requests"] >= 2 * LOAD_CLIENTS
    assert not result["failures"], result["failures"]
    assert result["long_streams"] == result["long_complete"] >= 1, result["long_failures"]
    # the long stream outlived Serve's default drain after the redeploy began
    assert max(result["long_stream_after_redeploy_s"]) > \
        result["serve_default_graceful_shutdown_s"]
    actors = result["actors"]
    assert len(actors["v1"]["LLMReplica"]) == 2 and len(actors["v2"]["LLMReplica"]) == 1
    # the redeploy replaced the ingress and the replica (not an in-place config update)
    assert actors["end"]["OpenAIIngress"] and actors["end"]["LLMReplica"]
    assert not set(actors["end"]["OpenAIIngress"]) & set(actors["v2"]["OpenAIIngress"])
    assert not set(actors["end"]["LLMReplica"]) & set(actors["v2"]["LLMReplica"])
